// A run whose server dies (CONTRACT.md §19), through the AI SDK's own client code: chatd is
// killed with SIGKILL while an answer streams, a new chatd starts on the same SQLite file
// and continues the run from its last completed step, and `DefaultChatTransport`'s
// `reconnectToStream` (what `useChat({resume: true})` calls) rebuilds it, with
// `readUIMessageStream`, as one message: the stored answer, once, without what the killed
// process had said of the step it was in (ai 5.0.0, 6.0.0 and the newest 7.x).

import { after, describe, test } from "node:test";
import assert from "node:assert/strict";
import { rmSync } from "node:fs";
import * as ai5 from "ai5";
import * as ai6 from "ai6";
import * as ai7 from "ai7";
import { startChatd } from "../support/harness.js";

const versions = { "ai@5.0.0": ai5, "ai@6.0.0": ai6, "ai@7 (newest)": ai7 };
const dirs = [];
after(() => dirs.forEach((dir) => rmSync(dir, { recursive: true, force: true })));

const transport = (ai, chatd, user) =>
  new ai.DefaultChatTransport({ api: `${chatd.base}/api/ui/chat`, headers: { "x-client-id": user } });

for (const [name, ai] of Object.entries(versions)) {
  describe(name, () => {
    test("a run continued after its server was killed reads as one message", async () => {
      const first = await startChatd();
      dirs.push(first.dir);
      const user = `continued-${name.replace(/\W/g, "")}`;
      const chatId = `chat-continued-${name.replace(/\W/g, "")}-${process.pid}`;
      const stream = await transport(ai, first, user).sendMessages({
        chatId,
        messages: [{ id: "u1", role: "user", parts: [{ type: "text", text: "Tell me [mock:words=120] [mock:delay=15] [mock:think=off]" }] }],
        trigger: "submit-message",
        abortSignal: undefined,
      });
      const reader = stream.getReader();
      let said = "";
      while (said.split(" ").length < 8) {
        const { value } = await reader.read();
        if (value.type === "text-delta") said += value.delta;
      }
      // Some of it is in the log by now (it is written every 100 ms).
      await new Promise((r) => setTimeout(r, 300));
      await first.kill();
      await reader.cancel().catch(() => {});

      const second = await startChatd(null, { dir: first.dir });
      try {
        const resumed = await transport(ai, second, user).reconnectToStream({ chatId });
        assert.ok(resumed, "the continued run streams");
        const errors = [];
        let message;
        for await (const snapshot of ai.readUIMessageStream({ stream: resumed, onError: (e) => errors.push(e.message) })) {
          message = snapshot;
        }
        assert.deepEqual(errors, []);
        const { body } = await second.api(`/api/conversations/${message.metadata.conversation_id}`, user);
        const answer = body.messages[1];
        assert.equal(message.id, answer.id);
        const texts = message.parts.filter((p) => p.type === "text");
        assert.equal(texts.length, 1, "one text part: the voided one is gone");
        assert.equal(texts[0].text, answer.content, "the whole answer, once");
        assert.equal(answer.content.split(" ").length, 120);
        assert.ok(answer.content.startsWith(said.trim().split(" ").slice(0, 3).join(" ")), "the same answer as began");
      } finally {
        await second.kill();
      }
    });
  });
}
