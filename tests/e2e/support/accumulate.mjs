// The `openai` SDK's stream helper and its accumulator over Responses streams chatd encoded
// (the property test in src/http/clients/openai/tests.rs). Reads one SSE body per line (a
// JSON string); for each writes one JSON line: the response the helper finished with, the
// output the SDK's accumulator rebuilt from the events before the terminal one, and where a
// text's `.done` says other than what the accumulator made of its deltas; or the error
// either raised.
import OpenAI from "openai";
import { accumulateResponse } from "openai/lib/responses/ResponseAccumulator";
import { createInterface } from "node:readline";

const terminal = new Set(["response.completed", "response.failed", "response.incomplete"]);

/** What the accumulator made of a text's deltas, before its `.done` event says what it is. */
function accumulated(snapshot, event) {
  const item = snapshot.output[event.output_index];
  switch (event.type) {
    case "response.output_text.done":
      return [item.content[event.content_index].text, event.text];
    case "response.reasoning_summary_text.done":
      return [item.summary[event.summary_index].text, event.text];
    case "response.function_call_arguments.done":
      return [item.arguments, event.arguments];
    default:
      return null;
  }
}

for await (const line of createInterface({ input: process.stdin })) {
  const body = JSON.parse(line);
  const openai = new OpenAI({
    apiKey: "unused",
    baseURL: "http://chatd.invalid/v1",
    maxRetries: 0,
    fetch: async () => new Response(body, { headers: { "content-type": "text/event-stream" } }),
  });
  try {
    let snapshot;
    let rebuilt;
    const mismatches = [];
    const stream = openai.responses.stream({ model: "p", input: "x" });
    stream.on("event", (event) => {
      if (terminal.has(event.type)) {
        rebuilt ??= structuredClone(snapshot.output);
        return;
      }
      const [made, done] = (snapshot && accumulated(snapshot, event)) ?? [];
      if (made !== done) mismatches.push({ type: event.type, made, done });
      snapshot = accumulateResponse(event, snapshot);
    });
    const final = await stream.finalResponse();
    const { status, output, output_text } = final;
    // The helper's own addition (a parse of structured outputs), not an event's.
    for (const item of output) for (const part of item.content ?? []) delete part.parsed;
    console.log(JSON.stringify({ final: { status, output, output_text }, rebuilt, mismatches }));
  } catch (error) {
    console.log(JSON.stringify({ error: String(error) }));
  }
}
