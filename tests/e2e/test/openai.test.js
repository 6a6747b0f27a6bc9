// The official `openai` TypeScript SDK (pinned in package.json) against chatd's Responses API
// (CONTRACT.md §20), with `baseURL` pointed at chatd and nothing else chatd-specific. Its
// strict stream helper (`responses.stream`) rebuilds every answer from the events; what it
// and the plain calls return is compared with what chatd stored.

import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";
import { startChatd } from "../support/harness.js";

let chatd;
before(async () => {
  chatd = await startChatd();
});
after(async () => {
  await chatd?.stop();
});

/** A client as `user` (auth mode `none`: the X-Client-Id header; the key is not read). */
const client = (user) =>
  new OpenAI({ baseURL: `${chatd.base}/v1`, apiKey: "unused", defaultHeaders: { "x-client-id": user }, maxRetries: 0 });

const conversationId = (id) => id.replace(/^conv_/, "").replace(/^(.{8})(.{4})(.{4})(.{4})(.{12})$/, "$1-$2-$3-$4-$5");

async function stored(user, conversation) {
  const { status, body } = await chatd.api(`/api/conversations/${conversationId(conversation)}`, user);
  assert.equal(status, 200);
  return body;
}

test("the profiles are the models", async () => {
  const models = await client("oa-models").models.list();
  const ids = models.data.map((m) => m.id).sort();
  assert.deepEqual(ids, ["default", "other", "vetted"]);
  assert.ok(models.data.every((m) => m.object === "model"));
});

test("a plain answer is what chatd stored", async () => {
  const openai = client("oa-plain");
  const response = await openai.responses.create({ model: "default", input: "Hello there" });
  assert.equal(response.object, "response");
  assert.equal(response.status, "completed");
  assert.equal(response.model, "default");
  assert.equal(response.output_text, "Mock reply: Hello there");
  const conversation = await stored("oa-plain", response.conversation.id);
  assert.equal(conversation.messages.at(-1).content, response.output_text);
  assert.equal(conversation.messages.at(-1).role, "assistant");
  assert.ok(response.usage.output_tokens > 0);
  assert.equal(response.usage.total_tokens, response.usage.input_tokens + response.usage.output_tokens);
  assert.equal(typeof response.usage.input_tokens_details.cached_tokens, "number");
  const reasoning = response.output.find((item) => item.type === "reasoning");
  assert.ok(reasoning?.summary[0].text.length > 0, "the mock's thinking, as a reasoning summary");

  const again = await openai.responses.retrieve(response.id);
  assert.equal(again.output_text, response.output_text);
  assert.equal(again.status, "completed");
});

test("the stream helper rebuilds the stored answer, numbered densely from 0", async () => {
  const openai = client("oa-stream");
  const stream = openai.responses.stream({ model: "default", input: "Stream this [mock:words=30]" });
  const numbers = [];
  const types = [];
  stream.on("event", (event) => {
    numbers.push(event.sequence_number);
    types.push(event.type);
  });
  const response = await stream.finalResponse();
  assert.deepEqual(numbers, numbers.map((_, i) => i), "dense sequence numbers from 0");
  assert.equal(types[0], "response.created");
  assert.equal(types.at(-1), "response.completed");
  const conversation = await stored("oa-stream", response.conversation.id);
  assert.equal(response.output_text, conversation.messages.at(-1).content);
  assert.ok(response.output_text.split(" ").length >= 30);

  // The same events again from the log, after any number N: exactly those after N, as numbered.
  const all = [];
  for await (const event of await openai.responses.retrieve(response.id, { stream: true })) all.push(event);
  assert.deepEqual(all.map((e) => e.sequence_number), numbers);
  assert.deepEqual(all.map((e) => e.type), types);
  const n = 5;
  const rest = [];
  for await (const event of await openai.responses.retrieve(response.id, { stream: true, starting_after: n })) {
    rest.push(event);
  }
  assert.deepEqual(rest.map((e) => e.sequence_number), numbers.slice(n + 1));
});

test("turns continue a conversation, and previous_response_id branches from an answer", async () => {
  const openai = client("oa-turns");
  const first = await openai.responses.create({ model: "default", input: "First question" });
  const second = await openai.responses.create({
    model: "default",
    input: "Second question",
    conversation: first.conversation.id,
  });
  assert.equal(second.conversation.id, first.conversation.id);
  let conversation = await stored("oa-turns", first.conversation.id);
  assert.deepEqual(
    conversation.messages.map((m) => m.content),
    ["First question", first.output_text, "Second question", second.output_text],
  );
  // From the first answer again: a sibling of the second question, on the active branch.
  const branched = await openai.responses.create({
    model: "other",
    input: [{ role: "user", content: [{ type: "input_text", text: "Another second question" }] }],
    previous_response_id: first.id,
  });
  assert.equal(branched.output_text, "Mock reply: Another second question");
  conversation = await stored("oa-turns", first.conversation.id);
  assert.deepEqual(
    conversation.messages.map((m) => m.content),
    ["First question", first.output_text, "Another second question", branched.output_text],
  );
});

test("a tool chatd runs itself is an mcp_call item", async () => {
  const openai = client("oa-tools");
  const stream = openai.responses.stream({
    model: "default",
    input: 'Add them [mock:tool=calculator {"expression": "2 + 40"}]',
  });
  const response = await stream.finalResponse();
  const call = response.output.find((item) => item.type === "mcp_call");
  assert.ok(call, JSON.stringify(response.output));
  assert.equal(call.name, "calculator");
  assert.equal(call.server_label, "chatd");
  assert.deepEqual(JSON.parse(call.arguments), { expression: "2 + 40" });
  assert.match(call.output, /42/);
  assert.equal(call.status, "completed");
  // The stored answer keeps where the call stood (`[[tool:0]]`); the output has the call as
  // an item between the answer's text items instead.
  const conversation = await stored("oa-tools", response.conversation.id);
  const withoutMarkers = (content) => content.replace(/(\n\n)?\[\[tool:\d+\]\]/g, "");
  assert.equal(response.output_text, withoutMarkers(conversation.messages.at(-1).content));
  assert.deepEqual(response.output.map((item) => item.type), ["reasoning", "message", "mcp_call", "reasoning", "message"]);
});

test("each refusal is the SDK's typed error", async () => {
  const openai = client("oa-errors");
  await assert.rejects(openai.responses.create({ model: "nope", input: "Hi" }), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError, e.constructor.name);
    assert.equal(e.status, 404);
    assert.match(e.message, /nope/);
    return true;
  });
  await assert.rejects(openai.responses.create({ model: "default", input: "Hi", store: false }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError, e.constructor.name);
    assert.equal(e.param, "store");
    return true;
  });
  await assert.rejects(openai.responses.create({ model: "default", input: "" }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError);
    assert.equal(e.param, "input");
    return true;
  });
  const mine = await openai.responses.create({ model: "default", input: "Mine" });
  await assert.rejects(client("oa-someone-else").responses.retrieve(mine.id), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError, e.constructor.name);
    return true;
  });
  await assert.rejects(
    client("oa-someone-else").responses.create({ model: "default", input: "Hi", previous_response_id: mine.id }),
    (e) => e instanceof OpenAI.NotFoundError && e.param === "previous_response_id",
  );
});

test("a background response answers at once, and its events are read after any number", async () => {
  const openai = client("oa-background");
  const begun = await openai.responses.create({
    model: "default",
    input: "Take your time [mock:words=60] [mock:delay=20]",
    background: true,
  });
  assert.equal(begun.background, true);
  assert.equal(begun.status, "in_progress");
  assert.equal(begun.output.length, 0);
  // A resume from the raw stream, after event 3: exactly the later events, as numbered.
  const rest = [];
  for await (const event of await openai.responses.retrieve(begun.id, { stream: true, starting_after: 3 })) {
    rest.push(event);
  }
  assert.equal(rest[0].sequence_number, 4);
  assert.deepEqual(rest.map((e) => e.sequence_number), rest.map((_, i) => i + 4));
  assert.equal(rest.at(-1).type, "response.completed");
  const done = await openai.responses.retrieve(begun.id);
  assert.equal(done.status, "completed");
  assert.equal(done.output_text, rest.at(-1).response.output.find((i) => i.type === "message").content[0].text);
  const conversation = await stored("oa-background", done.conversation.id);
  assert.equal(conversation.messages.at(-1).content, done.output_text);
  const items = await openai.responses.inputItems.list(begun.id);
  assert.deepEqual(
    items.data.map((item) => [item.type, item.role, item.content[0].text]),
    [["message", "user", "Take your time [mock:words=60] [mock:delay=20]"]],
  );
});

test("cancel stops a background response, which says so", async () => {
  const openai = client("oa-cancel");
  const begun = await openai.responses.create({
    model: "default",
    input: "A long one [mock:words=400] [mock:delay=20]",
    background: true,
  });
  const cancelled = await openai.responses.cancel(begun.id);
  assert.equal(cancelled.status, "cancelled");
  assert.equal((await openai.responses.retrieve(begun.id)).status, "cancelled");
  const { body } = await chatd.api(`/api/trace/${begun.id.replace(/^resp_/, "").replace(/^(.{8})(.{4})(.{4})(.{4})(.{12})$/, "$1-$2-$3-$4-$5")}`, "oa-cancel");
  assert.equal(body.status, "cancelled");
  // Cancelling again answers the response as it ended.
  assert.equal((await openai.responses.cancel(begun.id)).status, "cancelled");
});

test("instructions add to the profile's for this response only", async () => {
  const openai = client("oa-instructions");
  const told = await openai.responses.create({
    model: "default",
    instructions: "Answer like a pirate.",
    input: "What do you follow? [mock:instructions]",
  });
  assert.equal(told.output_text, "Instructions: Answer like a pirate.");
  const next = await openai.responses.create({
    model: "default",
    input: "And now? [mock:instructions]",
    previous_response_id: told.id,
  });
  assert.equal(next.output_text, "Instructions: none", "not kept for the next response");
});

test("a conversation of the Conversations API is chatd's, across turns and listed as items", async () => {
  const openai = client("oa-conversations");
  const conversation = await openai.conversations.create({ metadata: { topic: "weather" } });
  assert.equal(conversation.object, "conversation");
  assert.deepEqual(conversation.metadata, { topic: "weather" });
  const first = await openai.responses.create({ model: "default", input: "Is it raining?", conversation: conversation.id });
  assert.equal(first.conversation.id, conversation.id);
  const second = await openai.responses.create({
    model: "default",
    input: 'And how warm? [mock:tool=calculator {"expression": "20 + 1"}]',
    conversation: { id: conversation.id },
  });
  // The native API sees the same conversation, with its metadata.
  const native = await stored("oa-conversations", conversation.id);
  assert.deepEqual(native.metadata, { topic: "weather" });
  assert.equal(native.messages.length, 4);
  // Items, oldest first, and paged newest first as the SDK pages them.
  const items = [];
  for await (const item of openai.conversations.items.list(conversation.id, { order: "asc", limit: 1 })) items.push(item);
  assert.deepEqual(
    items.map((item) => [item.role, item.content[0].type, item.content[0].text]),
    [
      ["user", "input_text", "Is it raining?"],
      ["assistant", "output_text", first.output_text],
      ["user", "input_text", 'And how warm? [mock:tool=calculator {"expression": "20 + 1"}]'],
      ["assistant", "output_text", second.output_text],
    ],
  );
  const newest = await openai.conversations.items.list(conversation.id, { limit: 2 });
  assert.deepEqual(newest.data.map((item) => item.role), ["assistant", "user"]);
  assert.equal(newest.has_more, true);
  const updated = await openai.conversations.update(conversation.id, { metadata: { topic: "climate" } });
  assert.deepEqual(updated.metadata, { topic: "climate" });
  assert.deepEqual((await openai.conversations.retrieve(conversation.id)).metadata, { topic: "climate" });
  const deleted = await openai.conversations.delete(conversation.id);
  assert.deepEqual(deleted, { id: conversation.id, object: "conversation.deleted", deleted: true });
  await assert.rejects(openai.conversations.retrieve(conversation.id), (e) => e instanceof OpenAI.NotFoundError);
  assert.equal((await chatd.api(`/api/conversations/${conversationId(conversation.id)}`, "oa-conversations")).status, 404);
  await assert.rejects(client("oa-other").responses.create({ model: "default", input: "x", conversation: first.conversation.id }), (e) => e instanceof OpenAI.NotFoundError);
});

const clock = {
  type: "function",
  name: "clock",
  description: "The time now in a zone",
  parameters: { type: "object", properties: { zone: { type: "string" } }, required: ["zone"] },
  strict: false,
};

test("a function tool's call ends the response, and its output continues the same run", async () => {
  const openai = client("oa-function");
  const first = await openai.responses.create({
    model: "default",
    input: 'What time is it? [mock:tool=clock {"zone": "UTC"}]',
    tools: [clock],
  });
  assert.equal(first.status, "completed");
  const call = first.output.find((item) => item.type === "function_call");
  assert.ok(call, JSON.stringify(first.output));
  assert.equal(call.name, "clock");
  assert.deepEqual(JSON.parse(call.arguments), { zone: "UTC" });
  assert.equal(first.output.at(-1), call, "the call is the response's last item");

  // Streamed, through the SDK's strict helper: the same run goes on after its wait.
  const stream = openai.responses.stream({
    model: "default",
    previous_response_id: first.id,
    input: [{ type: "function_call_output", call_id: call.call_id, output: "10:04 UTC" }],
    tools: [clock],
  });
  const numbers = [];
  stream.on("event", (event) => numbers.push(event.sequence_number));
  const second = await stream.finalResponse();
  assert.deepEqual(numbers, numbers.map((_, i) => i), "numbered from 0 again");
  assert.equal(second.status, "completed");
  assert.ok(second.id.startsWith(`${first.id}_`), `${second.id} goes on with ${first.id}`);
  assert.ok(second.output_text.length > 0);
  assert.ok(!second.output.some((item) => item.type === "function_call"));

  // One run, one answer: the native API sees the call's output in it.
  const conversation = await stored("oa-function", first.conversation.id);
  assert.equal(conversation.messages.length, 2);
  const answer = conversation.messages.at(-1);
  assert.equal(answer.tool_history[0].tool_name, "clock");
  assert.equal(answer.tool_history[0].output, "10:04 UTC");
  const withoutMarkers = (content) => content.replace(/(\n\n)?\[\[tool:\d+\]\]/g, "");
  assert.equal(withoutMarkers(answer.content), first.output_text + second.output_text);

  // Each response reads back as it was, from the log; sent again, the output gets the same one.
  assert.deepEqual((await openai.responses.retrieve(first.id)).output, first.output);
  assert.equal((await openai.responses.retrieve(second.id)).output_text, second.output_text);
  const again = await openai.responses.create({
    model: "default",
    previous_response_id: first.id,
    input: [{ type: "function_call_output", call_id: call.call_id, output: "10:04 UTC" }],
  });
  assert.equal(again.id, second.id);
  assert.equal(again.output_text, second.output_text);
  // What each was sent: the question, then the call's output.
  const asked = await openai.responses.inputItems.list(first.id);
  assert.deepEqual(asked.data.map((item) => item.type), ["message"]);
  const sent = await openai.responses.inputItems.list(second.id);
  assert.deepEqual(
    sent.data.map((item) => [item.type, item.call_id, item.output]),
    [["function_call_output", call.call_id, "10:04 UTC"]],
  );
});

test("a call that needs approval ends the response, and the decision continues the same run", async () => {
  const openai = client("oa-approval");
  const first = await openai.responses.create({
    model: "vetted",
    input: 'Add them [mock:tool=calculator {"expression": "2 + 40"}]',
  });
  const request = first.output.find((item) => item.type === "mcp_approval_request");
  assert.ok(request, JSON.stringify(first.output));
  assert.equal(request.name, "calculator");
  assert.equal(request.server_label, "chatd");
  assert.deepEqual(JSON.parse(request.arguments), { expression: "2 + 40" });
  const second = await openai.responses.create({
    model: "vetted",
    previous_response_id: first.id,
    input: [{ type: "mcp_approval_response", approval_request_id: request.id, approve: true }],
  });
  const call = second.output.find((item) => item.type === "mcp_call");
  assert.ok(call, JSON.stringify(second.output));
  assert.match(call.output, /42/);
  assert.equal(second.status, "completed");
  const decided = await openai.responses.inputItems.list(second.id);
  assert.deepEqual(
    decided.data.map((item) => [item.type, item.approval_request_id, item.approve]),
    [["mcp_approval_response", request.id, true]],
  );
  // A denial, in another run: the call does not run, and the model is told.
  const asked = await openai.responses.create({
    model: "vetted",
    input: 'Add more [mock:tool=calculator {"expression": "1 + 1"}]',
  });
  const denied = await openai.responses.create({
    model: "vetted",
    previous_response_id: asked.id,
    input: [
      {
        type: "mcp_approval_response",
        approval_request_id: asked.output.at(-1).id,
        approve: false,
        reason: "not now",
      },
    ],
  });
  assert.equal(denied.status, "completed");
  assert.ok(!denied.output.some((item) => item.type === "mcp_call"));
  const conversation = await stored("oa-approval", asked.conversation.id);
  assert.match(conversation.messages.at(-1).tool_history[0].output, /denied.*not now/);
});

test("items added to a conversation without a response are its history, and its last one can go", async () => {
  const openai = client("oa-items");
  const conversation = await openai.conversations.create({
    items: [{ type: "message", role: "user", content: "My name is Ada." }],
  });
  const added = await openai.conversations.items.create(conversation.id, {
    items: [
      { type: "message", role: "assistant", content: [{ type: "output_text", text: "Hello Ada." }] },
      { type: "message", role: "user", content: [{ type: "input_text", text: "I like tea." }] },
    ],
  });
  assert.deepEqual(added.data.map((item) => [item.role, item.content[0].text]), [
    ["assistant", "Hello Ada."],
    ["user", "I like tea."],
  ]);
  const one = await openai.conversations.items.retrieve(added.data[1].id, { conversation_id: conversation.id });
  assert.equal(one.content[0].text, "I like tea.");

  // The last item goes; a response then answers after what is left.
  const after = await openai.conversations.items.delete(added.data[1].id, { conversation_id: conversation.id });
  assert.equal(after.id, conversation.id);
  const answered = await openai.responses.create({ model: "default", input: "What is my name?", conversation: conversation.id });
  const native = await stored("oa-items", conversation.id);
  assert.deepEqual(
    native.messages.map((m) => [m.role, m.content]),
    [
      ["user", "My name is Ada."],
      ["assistant", "Hello Ada."],
      ["user", "What is my name?"],
      ["assistant", answered.output_text],
    ],
  );
  // An item others follow stays; so does an item of another type.
  await assert.rejects(
    openai.conversations.items.delete(added.data[0].id, { conversation_id: conversation.id }),
    (e) => e instanceof OpenAI.ConflictError,
  );
  await assert.rejects(
    openai.conversations.items.create(conversation.id, {
      items: [{ type: "message", role: "system", content: "Be terse." }],
    }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === "items",
  );
});

test("metadata is kept with the response, read back and streamed, and bounded as OpenAI bounds it", async () => {
  const openai = client("oa-metadata");
  const metadata = { ticket: "T-42", team: "support" };
  const response = await openai.responses.create({ model: "default", input: "Tag me", metadata });
  assert.deepEqual(response.metadata, metadata);
  assert.deepEqual((await openai.responses.retrieve(response.id)).metadata, metadata);
  const events = [];
  for await (const event of await openai.responses.retrieve(response.id, { stream: true })) events.push(event);
  assert.deepEqual(events[0].response.metadata, metadata);
  assert.deepEqual(events.at(-1).response.metadata, metadata);
  const next = await openai.responses.create({ model: "default", input: "Untagged", previous_response_id: response.id });
  assert.deepEqual(next.metadata, {}, "a response's own, not its conversation's");
  const many = Object.fromEntries(Array.from({ length: 17 }, (_, i) => [`k${i}`, "v"]));
  await assert.rejects(
    openai.responses.create({ model: "default", input: "Too many", metadata: many }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === "metadata",
  );
});

test("an input_image is an attachment the model gets, kept with the question", async () => {
  const openai = client("oa-image");
  const png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
  const response = await openai.responses.create({
    model: "default",
    input: [
      {
        role: "user",
        content: [
          { type: "input_text", text: "What is in it?" },
          { type: "input_image", image_url: `data:image/png;base64,${png}`, detail: "auto" },
        ],
      },
    ],
  });
  assert.match(response.output_text, /\[1 image 1×1 png\]/, response.output_text);
  const conversation = await stored("oa-image", response.conversation.id);
  assert.equal(conversation.messages[0].attachments.length, 1);
  assert.equal(conversation.messages[0].attachments[0].media_type, "image/png");
});
