// The Vercel AI SDK's own client code against chatd's /api/ui/chat (CONTRACT.md §13.1): for
// ai 5.0.0, 6.0.0 and the newest 7.x (pinned in package.json, installed side by side as
// ai5, ai6, ai7), `DefaultChatTransport` sends and reconnects, and `readUIMessageStream`
// rebuilds the message exactly as `useChat` does. Each rebuilt message is compared with the
// one chatd stored. The older versions validate every chunk strictly: a field or chunk type
// they do not know fails these tests.

import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import * as ai5 from "ai5";
import * as ai6 from "ai6";
import * as ai7 from "ai7";
import { startChatd } from "../support/harness.js";

const versions = { "ai@5.0.0": ai5, "ai@6.0.0": ai6, "ai@7 (newest)": ai7 };

let chatd;
before(async () => {
  chatd = await startChatd();
});
after(async () => {
  await chatd?.stop();
});

let chats = 0;
const newChat = (version) => `chat-${version.replace(/\W/g, "")}-${process.pid}-${(chats += 1)}`;
const userMessage = (id, text) => ({ id, role: "user", parts: [{ type: "text", text }] });

const fixtures = join(import.meta.dirname, "../../fixtures/files");

/**
 * The `file` part `convertFileListToFileUIParts` makes of a file the user picked in the
 * browser: its type, its name, and a `data:` URL of its bytes as `FileReader.readAsDataURL`
 * reads it. That function needs the browser's FileList and FileReader (Node has neither), so
 * the part is built the same way from a `File` here.
 */
async function fileUIPart(name, type) {
  const file = new File([readFileSync(join(fixtures, name))], name, { type });
  const bytes = Buffer.from(await file.arrayBuffer());
  const url = `data:${file.type};base64,${bytes.toString("base64")}`;
  return { type: "file", mediaType: file.type, filename: file.name, url };
}

function transport(ai, user) {
  return new ai.DefaultChatTransport({ api: `${chatd.base}/api/ui/chat`, headers: { "x-client-id": user } });
}

/** Reads a chunk stream to its end as `useChat` would: the last message, and the errors. */
async function rebuild(ai, stream) {
  const errors = [];
  let message;
  for await (const snapshot of ai.readUIMessageStream({ stream, onError: (e) => errors.push(e.message) })) {
    message = snapshot;
  }
  return { message, errors };
}

async function send(ai, user, { chatId, messages, trigger = "submit-message", messageId, body }) {
  const stream = await transport(ai, user).sendMessages({
    chatId,
    messages,
    trigger,
    messageId,
    abortSignal: undefined,
    body,
  });
  return rebuild(ai, stream);
}

/**
 * The request `useChat` sends after a waiting answer was answered (approval responses or
 * tool outputs in its parts), read on into that same message as `useChat` does.
 */
async function goOn(ai, user, { chatId, messages, body }) {
  const answer = messages.at(-1);
  const stream = await transport(ai, user).sendMessages({
    chatId,
    messages,
    trigger: "submit-message",
    messageId: answer.id,
    abortSignal: undefined,
    body,
  });
  const errors = [];
  let message;
  for await (const snapshot of ai.readUIMessageStream({ message: answer, stream, onError: (e) => errors.push(e.message) })) {
    message = snapshot;
  }
  return { message, errors };
}

/** The conversation as chatd stored it (its active branch). */
async function stored(user, conversationId) {
  const { status, body } = await chatd.api(`/api/conversations/${conversationId}`, user);
  assert.equal(status, 200);
  return body;
}

const textOf = (message) =>
  message.parts
    .filter((p) => p.type === "text")
    .map((p) => p.text)
    .join("");
/** The reasoning parts (one per model call) as the stored answer joins them: by a blank line. */
const reasoningOf = (message) =>
  message.parts
    .filter((p) => p.type === "reasoning")
    .map((p) => p.text)
    .join("\n\n");
/** The stored answer's text as the UI stream carries it: no `[[tool:N]]` markers. */
const withoutMarkers = (content) => content.replace(/(\n\n)?\[\[tool:\d+\]\]/g, "");

for (const [name, ai] of Object.entries(versions)) {
  describe(name, () => {
    test("a tool call with thinking rebuilds the stored answer: text, reasoning, tool part, metadata", async () => {
      const user = `ui-tool-${name}`;
      const chatId = newChat(name);
      const { message, errors } = await send(ai, user, {
        chatId,
        messages: [userMessage("u1", 'Add these [mock:tool=calculator {"expression": "2+3"}]')],
      });
      assert.deepEqual(errors, []);
      const conversation = await stored(user, message.metadata.conversation_id);
      assert.equal(conversation.external_id, chatId, "the chat id became the conversation's external id");
      const [question, answer] = conversation.messages;
      assert.equal(question.client_id, "u1");
      assert.equal(message.id, answer.id, "the client's message is chatd's answer");
      assert.equal(textOf(message), withoutMarkers(answer.content));
      assert.ok(textOf(message).includes("5"), textOf(message));
      assert.equal(reasoningOf(message), answer.thinking);
      const reasonings = message.parts.filter((p) => p.type === "reasoning");
      assert.equal(reasonings.length, 2, "a reasoning part per model call");
      for (const part of reasonings) assert.ok(!part.text.startsWith("\n"), JSON.stringify(part.text));
      const tools = message.parts.filter((p) => p.type === "tool-calculator");
      assert.equal(tools.length, 1);
      assert.equal(tools[0].state, "output-available");
      assert.equal(tools[0].toolCallId, answer.tool_history[0].tool_call_id);
      assert.deepEqual(tools[0].input, answer.tool_history[0].input);
      assert.equal(tools[0].output, answer.tool_history[0].output);
      assert.equal(message.parts.filter((p) => p.type === "step-start").length, 2, "one step per model call");
      assert.equal(message.metadata.trace_id, answer.trace_id);
      assert.equal(message.metadata.model, answer.model);
      assert.equal(message.metadata.finish_reason, "stop");
      assert.deepEqual(message.metadata.usage, answer.usage);
    });

    test("a failing tool is an output-error part", async () => {
      const user = `ui-toolerr-${name}`;
      const { message, errors } = await send(ai, user, {
        chatId: newChat(name),
        messages: [userMessage("u1", 'Divide [mock:tool=calculator {"expression": "1/"}]')],
      });
      assert.deepEqual(errors, []);
      const answer = (await stored(user, message.metadata.conversation_id)).messages[1];
      const [tool] = message.parts.filter((p) => p.type === "tool-calculator");
      assert.equal(tool.state, "output-error");
      assert.equal(answer.tool_history[0].is_error, true);
      assert.equal(tool.errorText, answer.tool_history[0].output);
    });

    test("an error run reaches the client as its error, and no answer is stored", async () => {
      const user = `ui-error-${name}`;
      const chatId = newChat(name);
      const { message, errors } = await send(ai, user, {
        chatId,
        messages: [userMessage("u1", "fail [mock:error=unavailable]")],
      });
      assert.equal(errors.length, 1);
      assert.match(errors[0], /\S/);
      const conversation = await stored(user, message.metadata.conversation_id);
      assert.deepEqual(
        conversation.messages.map((m) => m.role),
        ["user"],
        "the user's message stays, no answer",
      );
      const trace = await chatd.api(`/api/trace/${message.metadata.trace_id}`, user);
      assert.equal(trace.body.status, "error");
      assert.equal(errors[0], trace.body.error.message);
    });

    test("a request refused before the stream is the client's error, with chatd's message", async () => {
      const user = `ui-refused-${name}`;
      await assert.rejects(
        send(ai, user, { chatId: newChat(name), messages: [userMessage("u1", "   ")] }),
        (e) => e.message.includes("Message cannot be empty"),
      );
      await assert.rejects(
        send(ai, user, { chatId: newChat(name), messages: [userMessage("u1", "hi")], body: { profile: "nope" } }),
        (e) => e.message.includes("NOT_FOUND"),
      );
    });

    test("a file part is an attachment: the model gets the image, the stored question keeps it", async () => {
      const user = `ui-file-${name}`;
      const picture = await fileUIPart("small.png", "image/png");
      const question = { id: "u1", role: "user", parts: [{ type: "text", text: "What is this?" }, picture] };
      const { message, errors } = await send(ai, user, { chatId: newChat(name), messages: [question] });
      assert.deepEqual(errors, []);
      assert.ok(textOf(message).includes("[1 image 64×48 png]"), textOf(message));
      const [sent, answer] = (await stored(user, message.metadata.conversation_id)).messages;
      assert.equal(sent.content, "What is this?");
      assert.equal(answer.id, message.id);
      assert.equal(sent.attachments.length, 1);
      const [attachment] = sent.attachments;
      assert.equal(attachment.media_type, "image/png");
      assert.equal(attachment.name, "small.png");
      const bytes = readFileSync(join(fixtures, "small.png"));
      assert.equal(attachment.size, bytes.length);
      const file = await fetch(`${chatd.base}/api/files/${attachment.file_id}`, { headers: { "x-client-id": user } });
      assert.equal(file.status, 200);
      assert.deepEqual(Buffer.from(await file.arrayBuffer()), bytes, "the stored file is the bytes sent");
    });

    test("a file part the profile cannot take is refused before the stream: the client's error", async () => {
      const user = `ui-file-refused-${name}`;
      const picture = await fileUIPart("small.png", "image/png");
      const question = { id: "u1", role: "user", parts: [{ type: "text", text: "What is this?" }, picture] };
      // The `other` profile states no modalities: text only.
      await assert.rejects(
        send(ai, user, { chatId: newChat(name), messages: [question], body: { profile: "other" } }),
        (e) => {
          // ai 5 and 6 throw an Error of the answer's body; ai 7 an APICallError with its status.
          if (name === "ai@7 (newest)") assert.equal(e.statusCode, 400);
          const body = JSON.parse(e.message);
          assert.equal(body.code, "VALIDATION_ERROR", e.message);
          assert.equal(body.field, "attachments", e.message);
          return true;
        },
      );
    });

    test("cancel by conversation stops the run: the client hears abort, the partial answer is stored", async () => {
      const user = `ui-cancel-${name}`;
      const chatId = newChat(name);
      const stream = await transport(ai, user).sendMessages({
        chatId,
        messages: [userMessage("u1", "Long one [mock:words=400] [mock:delay=20] [mock:think=off]")],
        trigger: "submit-message",
        abortSignal: undefined,
      });
      const [mine, watcher] = stream.tee();
      const seen = [];
      const watching = (async () => {
        const reader = watcher.getReader();
        for (;;) {
          const { value, done } = await reader.read();
          if (done) return;
          seen.push(value.type);
          if (value.type === "text-delta" && seen.filter((t) => t === "text-delta").length === 3) {
            const cancel = await chatd.api("/api/cancel_stream", user, {
              method: "POST",
              body: JSON.stringify({ conversation_id: (await conversationOf(user, chatId)).id }),
            });
            assert.equal(cancel.status, 200);
            assert.equal(cancel.body.status, "cancelled");
          }
        }
      })();
      const { message } = await rebuild(ai, mine);
      await watching;
      assert.ok(seen.includes("abort"), seen.join(","));
      assert.ok(!seen.includes("finish"), "a cancelled run does not finish");
      const answer = (await stored(user, message.metadata.conversation_id)).messages[1];
      assert.equal(answer.cancelled, true);
      assert.equal(answer.content, `${textOf(message)}\n\n[cancelled]`);
      const again = await chatd.api("/api/cancel_stream", user, {
        method: "POST",
        body: JSON.stringify({ conversation_id: message.metadata.conversation_id }),
      });
      assert.equal(again.status, 409, "nothing runs any more");
    });

    test("a model call that fails mid-answer is made again: data-step-reset, then the answer that survived", async () => {
      const user = `ui-retry-${name}`;
      const chatId = newChat(name);
      const stream = await transport(ai, user).sendMessages({
        chatId,
        messages: [userMessage("u1", "Retry me [mock:words=30] [mock:fail_once_after=3] [mock:think=off]")],
        trigger: "submit-message",
        abortSignal: undefined,
      });
      const [forMessage, forChunks] = stream.tee();
      const chunks = [];
      const reading = (async () => {
        for await (const chunk of forChunks) chunks.push(chunk);
      })();
      const { message, errors } = await rebuild(ai, forMessage);
      await reading;
      assert.deepEqual(errors, []);
      const reset = chunks.find((c) => c.type === "data-step-reset");
      assert.ok(reset, `a data-step-reset: ${chunks.map((c) => c.type).join(" ")}`);
      assert.equal(reset.data.step, 0);
      assert.equal(reset.transient, true, "seen by onData, not kept in the message");
      const answer = (await stored(user, message.metadata.conversation_id)).messages[1];
      assert.equal(message.id, answer.id, "one message");
      assert.equal(answer.content.split(" ").length, 30);
      // The voided step's text part is the one before the reset (a frontend drops it in
      // onData); the last is the answer.
      const texts = message.parts.filter((p) => p.type === "text");
      assert.equal(texts.at(-1).text, answer.content);
      // A resume once it ended has nothing to stream; a run still going replays without
      // the voided part (see the resume tests).
      assert.equal(await transport(ai, user).reconnectToStream({ chatId }), null);
    });

    test("after a dropped connection, reconnecting gives the whole message once; then 204", async () => {
      const user = `ui-resume-${name}`;
      const chatId = newChat(name);
      const dropped = new AbortController();
      const stream = await transport(ai, user).sendMessages({
        chatId,
        messages: [userMessage("u1", "Tell me [mock:words=60] [mock:delay=15]")],
        trigger: "submit-message",
        abortSignal: dropped.signal,
      });
      const reader = stream.getReader();
      let deltas = 0;
      while (deltas < 3) {
        const { value } = await reader.read();
        if (value.type === "text-delta") deltas += 1;
      }
      dropped.abort();
      await reader.cancel().catch(() => {});
      const resumed = await transport(ai, user).reconnectToStream({ chatId });
      assert.ok(resumed, "the run is still going: a stream");
      const { message, errors } = await rebuild(ai, resumed);
      assert.deepEqual(errors, []);
      const answer = (await stored(user, message.metadata.conversation_id)).messages[1];
      assert.equal(message.id, answer.id);
      assert.equal(textOf(message), answer.content, "the whole answer, once");
      assert.equal(message.parts.filter((p) => p.type === "text").length, 1);
      assert.equal(await transport(ai, user).reconnectToStream({ chatId }), null, "nothing runs: 204");
    });

    test("a message sent from a second tab while the first's answer streams is queued, then answered after it", async () => {
      const user = `ui-queue-${name}`;
      const chatId = newChat(name);
      const first = await send(ai, user, { chatId, messages: [userMessage("u1", "hello")] });
      const history = [userMessage("u1", "hello"), first.message];
      // Two tabs on one chat: the first sends a long question, the second sends while it streams.
      const slow = transport(ai, user).sendMessages({
        chatId,
        messages: [...history, userMessage("u2", "a long one [mock:words=30] [mock:delay=20]")],
        trigger: "submit-message",
        abortSignal: undefined,
      });
      const long = await slow;
      const reader = rebuild(ai, long);
      const queued = await send(ai, user, {
        chatId,
        messages: [...history, userMessage("u3", "and then [mock:words=3]")],
      });
      const { message: longAnswer, errors } = await reader;
      assert.deepEqual(errors, []);
      assert.deepEqual(queued.errors, []);
      assert.equal(textOf(queued.message), "alpha bravo charlie");
      const conversation = await stored(user, first.message.metadata.conversation_id);
      assert.deepEqual(
        conversation.messages.map((m) => [m.role, m.client_id ?? m.id]),
        [
          ["user", "u1"],
          ["assistant", first.message.id],
          ["user", "u2"],
          ["assistant", longAnswer.id],
          ["user", "u3"],
          ["assistant", queued.message.id],
        ],
        "one branch, in the order sent",
      );
      // It ran after the first had answered: its trace started running after that one ended.
      const [longTrace, queuedTrace] = await Promise.all(
        [longAnswer, queued.message].map(async (m) => (await chatd.api(`/api/trace/${m.metadata.trace_id}`, user)).body),
      );
      const firstCall = queuedTrace.spans.find((s) => s.kind === "llm");
      assert.ok(new Date(firstCall.started_at) >= new Date(longTrace.ended_at), "its model call came after");
    });

    test("regenerate and edit become the branches chatd stores", async () => {
      const user = `ui-branch-${name}`;
      const chatId = newChat(name);
      const first = await send(ai, user, { chatId, messages: [userMessage("u1", "First question")] });
      const conversationId = first.message.metadata.conversation_id;
      const [question, firstAnswer] = (await stored(user, conversationId)).messages;

      // Regenerate the answer: a sibling of it under the same question.
      const again = await send(ai, user, {
        chatId,
        messages: [userMessage("u1", "First question")],
        trigger: "regenerate-message",
        messageId: first.message.id,
      });
      const regenerated = (await stored(user, conversationId)).messages;
      assert.deepEqual(
        regenerated.map((m) => m.id),
        [question.id, again.message.id],
      );
      assert.equal(regenerated[1].parent_id, question.id);
      const siblings = await chatd.api(`/api/messages/${again.message.id}/siblings`, user);
      assert.deepEqual(
        siblings.body.siblings.map((s) => s.id),
        [firstAnswer.id, again.message.id],
      );

      // Edit the question (the client keeps its id): a sibling question with its own answer.
      const edited = await send(ai, user, {
        chatId,
        messages: [userMessage("u1", "First question, edited")],
        trigger: "submit-message",
        messageId: "u1",
      });
      const branch = (await stored(user, conversationId)).messages;
      assert.deepEqual(
        branch.map((m) => [m.role, m.role === "user" ? m.content : m.id]),
        [
          ["user", "First question, edited"],
          ["assistant", edited.message.id],
        ],
      );
      assert.equal(branch[0].client_id, "u1");
      assert.notEqual(branch[0].id, question.id);
      const questions = await chatd.api(`/api/messages/${branch[0].id}/siblings`, user);
      assert.deepEqual(
        questions.body.siblings.map((s) => s.id),
        [question.id, branch[0].id],
      );
    });

    // Approvals need ai 6's tool-approval-request chunk; client tools work from ai 5 on, but
    // their next request is what ai 6's sendAutomaticallyWhen helpers send.
    if (name !== "ai@5.0.0") {
      test("an approval ends the stream; the response in the next request goes on with the same message", async () => {
        const user = `ui-approve-${name}`;
        const chatId = newChat(name);
        const question = userMessage("u1", 'Add [mock:tool=calculator {"expression": "6 * 7"}]');
        const first = await send(ai, user, { chatId, messages: [question], body: { profile: "vetted" } });
        assert.deepEqual(first.errors, []);
        const [asked] = first.message.parts.filter((p) => p.type === "tool-calculator");
        assert.equal(asked.state, "approval-requested");
        const trace = await chatd.api(`/api/trace/${first.message.metadata.trace_id}`, user);
        assert.equal(trace.body.status, "waiting");
        assert.equal(asked.approval.id, trace.body.events.find((e) => e.type === "tool_approval_request").data.approval_id);

        // What addToolApprovalResponse makes of the part, then what sendAutomaticallyWhen sends.
        const responded = {
          ...first.message,
          parts: first.message.parts.map((p) =>
            p === asked ? { ...p, state: "approval-responded", approval: { id: asked.approval.id, approved: true } } : p,
          ),
        };
        assert.ok(ai.lastAssistantMessageIsCompleteWithApprovalResponses({ messages: [question, responded] }));
        const { message, errors } = await goOn(ai, user, {
          chatId,
          messages: [question, responded],
          body: { profile: "vetted" },
        });
        assert.deepEqual(errors, []);
        assert.equal(message.id, first.message.id, "the same message goes on");
        const [tool] = message.parts.filter((p) => p.type === "tool-calculator");
        assert.equal(tool.state, "output-available");
        assert.equal(tool.output, "42");
        const conversation = await stored(user, first.message.metadata.conversation_id);
        assert.deepEqual(conversation.messages.map((m) => m.role), ["user", "assistant"], "one answer");
        const answer = conversation.messages[1];
        assert.equal(answer.id, message.id);
        assert.equal(textOf(message), withoutMarkers(answer.content));
        assert.ok(textOf(message).includes("calculator said 42"), textOf(message));
      });

      test("a denied approval is an output-denied part, and the model is told", async () => {
        const user = `ui-deny-${name}`;
        const chatId = newChat(name);
        const question = userMessage("u1", 'Add [mock:tool=calculator {"expression": "1 + 1"}]');
        const first = await send(ai, user, { chatId, messages: [question], body: { profile: "vetted" } });
        const [asked] = first.message.parts.filter((p) => p.type === "tool-calculator");
        const responded = {
          ...first.message,
          parts: first.message.parts.map((p) =>
            p === asked
              ? { ...p, state: "approval-responded", approval: { id: asked.approval.id, approved: false, reason: "not now" } }
              : p,
          ),
        };
        const { message, errors } = await goOn(ai, user, { chatId, messages: [question, responded] });
        assert.deepEqual(errors, []);
        const [tool] = message.parts.filter((p) => p.type === "tool-calculator");
        assert.equal(tool.state, "output-denied");
        assert.ok(textOf(message).includes("The user denied this tool call: not now"), textOf(message));
      });

      test("a client tool's call ends the stream; its output in the next request goes on", async () => {
        const user = `ui-client-${name}`;
        const chatId = newChat(name);
        const body = { client_tools: [{ name: "get_location", description: "Where the user is" }] };
        const question = userMessage("u1", "Where am I? [mock:tool=get_location {}]");
        const first = await send(ai, user, { chatId, messages: [question], body });
        assert.deepEqual(first.errors, []);
        const [call] = first.message.parts.filter((p) => p.type === "tool-get_location");
        assert.equal(call.state, "input-available");
        // What addToolResult (addToolOutput) makes of the part.
        const answered = {
          ...first.message,
          parts: first.message.parts.map((p) => (p === call ? { ...p, state: "output-available", output: { city: "Oslo" } } : p)),
        };
        assert.ok(ai.lastAssistantMessageIsCompleteWithToolCalls({ messages: [question, answered] }));
        const { message, errors } = await goOn(ai, user, { chatId, messages: [question, answered], body });
        assert.deepEqual(errors, []);
        assert.equal(message.id, first.message.id);
        assert.ok(textOf(message).includes('get_location said {"city":"Oslo"}'), textOf(message));
        const answer = (await stored(user, first.message.metadata.conversation_id)).messages[1];
        assert.equal(answer.tool_history[0].output, '{"city":"Oslo"}');
      });
    }
  });
}

/** The user's conversation whose external id is `chatId`. */
async function conversationOf(user, chatId) {
  const { body } = await chatd.api("/api/conversations?limit=100", user);
  const found = body.conversations.find((c) => c.external_id === chatId);
  assert.ok(found, `a conversation for ${chatId}`);
  return found;
}
