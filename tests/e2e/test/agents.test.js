// The OpenAI Agents SDK (`@openai/agents`, pinned in package.json) against chatd's Responses
// API (CONTRACT.md §20): an agent whose model is a chatd profile and whose function tool the
// SDK runs itself. The tool's call ends a response; the SDK sends its output back, and the
// same chatd run goes on: one run, one stored answer, whichever way the SDK keeps the
// conversation (its own history, a chatd conversation, or previous_response_id).

import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";
import { Agent, run, setDefaultOpenAIClient, setTracingDisabled, tool } from "@openai/agents";
import { z } from "zod";
import { startChatd } from "../support/harness.js";

let chatd;
before(async () => {
  chatd = await startChatd();
  // The SDK keeps the models it made from its default client: one client (one user) for all.
  setDefaultOpenAIClient(client(USER));
  setTracingDisabled(true);
});
after(async () => {
  await chatd?.stop();
});

const USER = "agents";

const client = (user) =>
  new OpenAI({ baseURL: `${chatd.base}/v1`, apiKey: "unused", defaultHeaders: { "x-client-id": user }, maxRetries: 0 });

/** The UUID behind a `resp_…`/`conv_…` id. */
const uuid = (id) =>
  id.replace(/^[a-z]+_/, "").replace(/_.*$/, "").replace(/^(.{8})(.{4})(.{4})(.{4})(.{12})$/, "$1-$2-$3-$4-$5");

/** An agent on profile `default` with a clock the SDK runs, and the calls it got. */
function timekeeper() {
  const calls = [];
  const clock = tool({
    name: "clock",
    description: "The time now in a zone",
    parameters: z.object({ zone: z.string() }),
    execute: async ({ zone }) => {
      calls.push(zone);
      return `10:04 ${zone}`;
    },
  });
  return { agent: new Agent({ name: "Timekeeper", model: "default", tools: [clock] }), calls };
}

/** The conversation a response's run answered in, as the native API has it. */
async function storedFor(user, responseId) {
  const trace = await chatd.api(`/api/trace/${uuid(responseId)}`, user);
  assert.equal(trace.status, 200);
  const conversation = await chatd.api(`/api/conversations/${trace.body.conversation_id}`, user);
  assert.equal(conversation.status, 200);
  return { trace: trace.body, conversation: conversation.body };
}

const withoutMarkers = (content) => content.replace(/(\n\n)?\[\[tool:\d+\]\]/g, "");

test("the SDK runs the agent's function tool, and the same chatd run answers with its output", async () => {
  const { agent, calls } = timekeeper();
  const result = await run(agent, 'What time is it? [mock:tool=clock {"zone": "UTC"}]');
  assert.deepEqual(calls, ["UTC"], "the SDK ran the tool once");
  assert.match(result.finalOutput, /clock said 10:04 UTC/);
  const { trace, conversation } = await storedFor(USER, result.lastResponseId);
  assert.equal(trace.status, "completed");
  assert.equal(conversation.messages.length, 2, "one question, one answer: one run");
  const answer = conversation.messages[1];
  assert.equal(answer.tool_history[0].tool_name, "clock");
  assert.equal(answer.tool_history[0].output, "10:04 UTC");
  assert.ok(withoutMarkers(answer.content).endsWith(result.finalOutput));
});

test("streamed, in a chatd conversation, and on from the last response", async () => {
  const openai = client(USER);
  const { agent, calls } = timekeeper();
  const { id } = await openai.conversations.create({});
  const streamed = await run(agent, 'Time in Paris? [mock:tool=clock {"zone": "CET"}]', {
    stream: true,
    conversationId: id,
  });
  let text = "";
  for await (const chunk of streamed.toTextStream()) text += chunk;
  await streamed.completed;
  assert.deepEqual(calls, ["CET"]);
  assert.match(streamed.finalOutput, /clock said 10:04 CET/);
  assert.ok(text.endsWith(streamed.finalOutput), "the streamed text ends with the final output");

  // A next turn from the last response: the same conversation, after that answer.
  const next = await run(agent, "Thanks!", { previousResponseId: streamed.lastResponseId });
  assert.equal(next.finalOutput, "Mock reply: Thanks!");
  const { conversation } = await storedFor(USER, next.lastResponseId);
  assert.equal(conversation.id, uuid(id));
  assert.deepEqual(
    conversation.messages.map((m) => m.role),
    ["user", "assistant", "user", "assistant"],
  );
  assert.equal(conversation.messages[1].tool_history[0].output, "10:04 CET");
});
