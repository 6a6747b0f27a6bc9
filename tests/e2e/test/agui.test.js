// AG-UI's own client, `@ag-ui/client`'s `HttpAgent` (pinned in package.json), against chatd's
// /api/agui (CONTRACT.md §13.2). Its event verifier is always on in `runAgent`: an event out
// of order, a START without its END, anything after the run's end fails the run, and so
// these tests. What the agent rebuilds is compared with what chatd stored.

import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { HttpAgent } from "@ag-ui/client";
import { startChatd } from "../support/harness.js";

let chatd;
before(async () => {
  chatd = await startChatd();
});
after(async () => {
  await chatd?.stop();
});

let threads = 0;
const newThread = () => `thread-${process.pid}-${(threads += 1)}`;

function agent(user, threadId, text) {
  const agent = new HttpAgent({ url: `${chatd.base}/api/agui`, headers: { "x-client-id": user }, threadId });
  agent.messages = [{ id: `u-${threads}`, role: "user", content: text }];
  return agent;
}

/** Runs the agent; every event it verified, and how the run ended. */
async function run(agent, input = {}, onEvent = () => {}) {
  const events = [];
  try {
    const outcome = await agent.runAgent(
      { runId: `run-${threads}`, ...input },
      {
        onEvent: ({ event }) => {
          events.push(event);
          onEvent(event);
        },
      },
    );
    return { events, ...outcome };
  } catch (error) {
    return { events, error };
  }
}

async function conversationOf(user, threadId) {
  const { body } = await chatd.api("/api/conversations?limit=100", user);
  const found = body.conversations.find((c) => c.external_id === threadId);
  assert.ok(found, `a conversation for ${threadId}`);
  return (await chatd.api(`/api/conversations/${found.id}`, user)).body;
}

const fixtures = join(import.meta.dirname, "../../fixtures/files");
const base64Of = (name) => readFileSync(join(fixtures, name)).toString("base64");

const withoutMarkers = (content) => content.replace(/(\n\n)?\[\[tool:\d+\]\]/g, "");

test("a tool call with thinking: the agent's messages and result are chatd's stored answer", async () => {
  const user = "agui-tool";
  const threadId = newThread();
  const a = agent(user, threadId, 'Add [mock:tool=calculator {"expression": "2+3"}]');
  const { events, result, error } = await run(a, { forwardedProps: { profile: "other" } });
  assert.equal(error, undefined, error?.stack);
  const types = events.map((e) => e.type);
  assert.equal(types[0], "RUN_STARTED");
  assert.equal(types.at(-1), "RUN_FINISHED");
  assert.equal(events[0].threadId, threadId);
  assert.equal(events[0].runId, `run-${threads}`, "the client's run id is echoed");
  assert.equal(types.filter((t) => t === "STEP_STARTED").length, 2, "a step per model call");

  const conversation = await conversationOf(user, threadId);
  const answer = conversation.messages[1];
  assert.equal(answer.model, "mock-2", "forwardedProps.profile picked the profile");
  assert.equal(result.message_id, answer.id);
  assert.equal(result.trace_id, answer.trace_id);
  assert.equal(result.message, answer.content);

  const assistant = a.messages.filter((m) => m.role === "assistant");
  assert.equal(assistant[0].id, answer.id, "the first text is the answer's own id");
  assert.equal(assistant.map((m) => m.content ?? "").join(""), withoutMarkers(answer.content));
  const calls = assistant.flatMap((m) => m.toolCalls ?? []);
  assert.equal(calls.length, 1);
  assert.equal(calls[0].function.name, "calculator");
  assert.deepEqual(JSON.parse(calls[0].function.arguments), answer.tool_history[0].input);
  const [toolMessage] = a.messages.filter((m) => m.role === "tool");
  assert.equal(toolMessage.toolCallId, calls[0].id);
  assert.equal(toolMessage.content, answer.tool_history[0].output);
  // A reasoning message per model call, each from its first line; the stored answer joins
  // them by a blank line.
  const reasonings = new Map();
  for (const e of events.filter((e) => e.type === "REASONING_MESSAGE_CONTENT")) {
    reasonings.set(e.messageId, (reasonings.get(e.messageId) ?? "") + e.delta);
  }
  assert.equal(reasonings.size, 2);
  for (const text of reasonings.values()) assert.ok(!text.startsWith("\n"), JSON.stringify(text));
  assert.equal([...reasonings.values()].join("\n\n"), answer.thinking);
  const usage = events.filter((e) => e.type === "CUSTOM" && e.name === "usage");
  assert.ok(usage.length >= 1, "usage as a CUSTOM event");
});

test("a model call that fails mid-answer and is made again: CUSTOM step_reset, then the answer that survived", async () => {
  const user = "agui-retry";
  const threadId = newThread();
  const a = agent(user, threadId, "Retry me [mock:words=30] [mock:fail_once_after=3] [mock:think=off]");
  const { events, result, error } = await run(a);
  assert.equal(error, undefined, error?.stack);
  const types = events.map((e) => e.type);
  assert.equal(types.at(-1), "RUN_FINISHED");
  const reset = events.findIndex((e) => e.type === "CUSTOM" && e.name === "step_reset");
  assert.ok(reset > 0, `a step_reset: ${types.join(" ")}`);
  assert.equal(events[reset].value.step, 0);
  assert.equal(types.slice(reset + 1).find((t) => t === "STEP_STARTED"), "STEP_STARTED", "the step again");
  const answer = (await conversationOf(user, threadId)).messages[1];
  assert.equal(result.message, answer.content);
  assert.equal(answer.content.split(" ").length, 30);
  // What came after the reset is the answer: a client drops the voided message.
  const after = events.slice(reset).filter((e) => e.type === "TEXT_MESSAGE_CONTENT").map((e) => e.delta).join("");
  assert.equal(after, answer.content);
});

test("the same thread is the same conversation", async () => {
  const user = "agui-thread";
  const threadId = newThread();
  const first = agent(user, threadId, "One");
  assert.equal((await run(first)).error, undefined);
  const second = agent(user, threadId, "Two");
  second.messages = [...first.messages, { id: "u-two", role: "user", content: "Two" }];
  assert.equal((await run(second)).error, undefined);
  const conversation = await conversationOf(user, threadId);
  assert.deepEqual(
    conversation.messages.map((m) => m.content.replace(/\n/g, " ")),
    ["One", "Mock reply: One", "Two", "Mock reply: Two"],
  );
  assert.equal(conversation.messages[2].client_id, "u-two");
});

test("an error run ends with RUN_ERROR and its code, and no result", async () => {
  const user = "agui-error";
  const { events, error, result } = await run(agent(user, newThread(), "fail [mock:error=rate_limited]"));
  assert.equal(error, undefined, error?.stack);
  assert.equal(result, undefined);
  assert.ok(!events.some((e) => e.type === "RUN_FINISHED"));
  const last = events.at(-1);
  assert.equal(last.type, "RUN_ERROR");
  assert.equal(last.code, "RATE_LIMITED");
});

test("cancel by conversation: RUN_ERROR with code CANCELLED, every START ended, the partial stored", async () => {
  const user = "agui-cancel";
  const threadId = newThread();
  let contents = 0;
  let cancelled;
  const { events, error, result } = await run(
    agent(user, threadId, "Long [mock:words=400] [mock:delay=20]"),
    {},
    (event) => {
      if (event.type === "TEXT_MESSAGE_CONTENT" && (contents += 1) === 3) {
        cancelled = conversationOf(user, threadId).then((c) =>
          chatd.api("/api/cancel_stream", user, { method: "POST", body: JSON.stringify({ conversation_id: c.id }) }),
        );
      }
    },
  );
  assert.equal(error, undefined, error?.stack);
  assert.equal(result, undefined);
  assert.equal((await cancelled).status, 200);
  const last = events.at(-1);
  assert.deepEqual([last.type, last.code], ["RUN_ERROR", "CANCELLED"]);
  const answer = (await conversationOf(user, threadId)).messages[1];
  assert.equal(answer.cancelled, true);
  const text = events
    .filter((e) => e.type === "TEXT_MESSAGE_CONTENT")
    .map((e) => e.delta)
    .join("");
  assert.equal(answer.content, `${text}\n\n[cancelled]`);
});

test("a run sent on the thread while another streams is queued (CUSTOM status Queued), then answers after it", async () => {
  const user = "agui-queue";
  const threadId = newThread();
  let second;
  const first = await run(agent(user, threadId, "Long [mock:words=30] [mock:delay=20]"), {}, (event) => {
    // Another client on the same thread sends while this answer streams.
    if (event.type === "TEXT_MESSAGE_CONTENT" && !second) {
      second = run(agent(user, threadId, "And then [mock:words=3]"), { runId: "run-queued" });
    }
  });
  const queued = await second;
  assert.equal(first.error, undefined, first.error?.stack);
  assert.equal(queued.error, undefined, queued.error?.stack);
  const statuses = queued.events.filter((e) => e.type === "CUSTOM" && e.name === "status").map((e) => e.value.message);
  assert.equal(statuses[0], "Queued", "it opened queued");
  assert.equal(queued.events.at(-1).type, "RUN_FINISHED");
  const conversation = await conversationOf(user, threadId);
  assert.deepEqual(
    conversation.messages.map((m) => m.role),
    ["user", "assistant", "user", "assistant"],
    "one branch, the queued question after the first answer",
  );
  assert.equal(conversation.messages[1].id, first.result.message_id);
  assert.equal(conversation.messages[3].id, queued.result.message_id);
  assert.equal(queued.result.message, "alpha bravo charlie");
});

test("an image part (inline data source) is an attachment: the model gets the image, the question keeps it", async () => {
  const user = "agui-image";
  const threadId = newThread();
  const a = agent(user, threadId, [
    { type: "text", text: "What is this?" },
    { type: "image", source: { type: "data", value: base64Of("small.png"), mimeType: "image/png" } },
  ]);
  const { result, error } = await run(a);
  assert.equal(error, undefined, error?.stack);
  const text = a.messages
    .filter((m) => m.role === "assistant")
    .map((m) => m.content ?? "")
    .join("");
  assert.ok(text.includes("[1 image 64×48 png]"), text);
  const [question, answer] = (await conversationOf(user, threadId)).messages;
  assert.equal(question.content, "What is this?");
  assert.equal(result.message, answer.content);
  assert.equal(question.attachments.length, 1);
  assert.equal(question.attachments[0].media_type, "image/png");
  assert.equal(question.attachments[0].size, readFileSync(join(fixtures, "small.png")).length);
});

test("a document part of a CSV file goes to the model as a text file", async () => {
  const user = "agui-document";
  const threadId = newThread();
  const a = agent(user, threadId, [
    { type: "text", text: "Sum the populations" },
    {
      type: "document",
      source: { type: "data", value: base64Of("cities.csv"), mimeType: "text/csv" },
      metadata: { filename: "cities.csv" },
    },
  ]);
  const { result, error } = await run(a);
  assert.equal(error, undefined, error?.stack);
  const text = a.messages
    .filter((m) => m.role === "assistant")
    .map((m) => m.content ?? "")
    .join("");
  assert.ok(text.includes("[1 text file cities.csv of 3 lines]"), text);
  const [question, answer] = (await conversationOf(user, threadId)).messages;
  assert.equal(result.message, answer.content);
  assert.equal(question.attachments.length, 1);
  assert.equal(question.attachments[0].name, "cities.csv");
  assert.equal(question.attachments[0].media_type, "text/csv");
});

test("a body with no user message is a 400 before any stream", async () => {
  const response = await fetch(`${chatd.base}/api/agui`, {
    method: "POST",
    headers: { "content-type": "application/json", "x-client-id": "agui-bad" },
    body: JSON.stringify({ threadId: "t", runId: "r", messages: [], tools: [], context: [], state: {}, forwardedProps: {} }),
  });
  assert.equal(response.status, 400);
  assert.deepEqual(await response.json(), {
    code: "VALIDATION_ERROR",
    message: "messages holds no user message",
    field: "messages",
  });
});

/** The interrupt a waiting run finished with, checked against what the agent keeps. */
function interruptOf(agent, first) {
  assert.equal(first.error, undefined, first.error?.stack);
  const finished = first.events.at(-1);
  assert.equal(finished.type, "RUN_FINISHED");
  assert.equal(finished.outcome?.type, "interrupt", JSON.stringify(finished));
  assert.equal(finished.outcome.interrupts.length, 1);
  assert.deepEqual(
    agent.pendingInterrupts.map((i) => i.id),
    finished.outcome.interrupts.map((i) => i.id),
    "the agent keeps the interrupts to answer",
  );
  return finished.outcome.interrupts[0];
}

test("an approval is an interrupt; resume[] goes on with the same answer", async () => {
  const user = "agui-approve";
  const threadId = newThread();
  const a = agent(user, threadId, 'Add [mock:tool=calculator {"expression": "6 * 7"}]');
  const first = await run(a, { forwardedProps: { profile: "vetted" } });
  const interrupt = interruptOf(a, first);
  assert.equal(interrupt.reason, "tool_approval");
  const trace = (await conversationOf(user, threadId)).messages.length;
  assert.equal(trace, 1, "nothing answered yet: the run waits");

  const resume = [{ interruptId: interrupt.id, status: "resolved", payload: { approved: true } }];
  const second = await run(a, { runId: `run-${threads}-2`, resume });
  assert.equal(second.error, undefined, second.error?.stack);
  assert.equal(second.events[0].type, "RUN_STARTED");
  assert.equal(second.events[0].runId, `run-${threads}-2`);
  assert.ok(second.result.message.includes("calculator said 42"), second.result.message);
  const conversation = await conversationOf(user, threadId);
  assert.deepEqual(conversation.messages.map((m) => m.role), ["user", "assistant"], "one answer");
  assert.equal(second.result.message_id, conversation.messages[1].id);
  assert.equal(second.result.message, conversation.messages[1].content);
  const [toolMessage] = a.messages.filter((m) => m.role === "tool");
  assert.equal(toolMessage.toolCallId, interrupt.toolCallId);
  assert.equal(toolMessage.content, "42");
  assert.deepEqual(a.pendingInterrupts, []);
});

test("a client tool from tools[] is an interrupt; its result in resume[] goes to the model", async () => {
  const user = "agui-client";
  const threadId = newThread();
  const a = agent(user, threadId, "Where am I? [mock:tool=get_location {}]");
  const tools = [{ name: "get_location", description: "Where the user is", parameters: { type: "object", properties: {} } }];
  const first = await run(a, { tools });
  const interrupt = interruptOf(a, first);
  assert.equal(interrupt.reason, "client_tool");
  const calls = a.messages.flatMap((m) => m.toolCalls ?? []);
  assert.deepEqual(
    calls.map((c) => [c.id, c.function.name]),
    [[interrupt.toolCallId, "get_location"]],
  );

  const resume = [{ interruptId: interrupt.id, status: "resolved", payload: { city: "Oslo" } }];
  const second = await run(a, { runId: `run-${threads}-2`, tools, resume });
  assert.equal(second.error, undefined, second.error?.stack);
  assert.ok(second.result.message.includes('get_location said {"city":"Oslo"}'), second.result.message);
  const answer = (await conversationOf(user, threadId)).messages[1];
  assert.equal(answer.tool_history[0].output, '{"city":"Oslo"}');
});
