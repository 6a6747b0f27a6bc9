// A minimal chat page on the AI SDK's `useChat` (@ai-sdk/react) and chatd's /api/ui/chat,
// as a frontend developer would write it: no chatd-specific client. Bundled by esbuild in
// tests/e2e/test/use-chat.test.js; chatd's address, the chat id and the user come from the
// query string (`?chatd=…&chat=…&user=…`).

import { createElement as h, useState } from "react";
import { createRoot } from "react-dom/client";
import { useChat } from "@ai-sdk/react";
import { DefaultChatTransport } from "ai";

const params = new URLSearchParams(location.search);
const chatd = params.get("chatd");
const user = params.get("user");
const headers = { "x-client-id": user };
const transport = new DefaultChatTransport({ api: `${chatd}/api/ui/chat`, headers });

function Part({ part }) {
  if (part.type === "text") return h("p", { className: "text" }, part.text);
  if (part.type === "reasoning") return h("p", { className: "reasoning" }, part.text);
  if (part.type.startsWith("tool-")) {
    const result = part.state === "output-error" ? part.errorText : (part.output ?? "");
    return h("div", { className: "tool", "data-state": part.state }, `${part.type.slice(5)} → ${result}`);
  }
  return null;
}

function App() {
  // `resume: true`: after a reload, the chat's running answer streams again from its start.
  const { messages, sendMessage, status, error } = useChat({ id: params.get("chat"), transport, resume: true });
  const [text, setText] = useState("");
  // `stop()` would only drop the connection; chatd stops the run when told to, and the
  // stream then ends with `abort`.
  const stop = async () => {
    const answer = messages.findLast((m) => m.role === "assistant");
    await fetch(`${chatd}/api/cancel_stream`, {
      method: "POST",
      headers: { ...headers, "content-type": "application/json" },
      body: JSON.stringify({ conversation_id: answer?.metadata?.conversation_id }),
    });
  };
  return h(
    "main",
    null,
    h("output", { id: "status" }, status),
    error ? h("output", { id: "error" }, error.message) : null,
    ...messages.map((m) =>
      h(
        "article",
        { key: m.id, "data-role": m.role, "data-id": m.id },
        m.parts.map((part, i) => h(Part, { key: i, part })),
      ),
    ),
    h(
      "form",
      {
        onSubmit: (e) => {
          e.preventDefault();
          sendMessage({ text });
          setText("");
        },
      },
      h("input", { id: "input", value: text, onChange: (e) => setText(e.target.value) }),
      h("button", { id: "send", type: "submit" }, "Send"),
      h("button", { id: "stop", type: "button", onClick: stop }, "Stop"),
    ),
  );
}

createRoot(document.getElementById("root")).render(h(App));
