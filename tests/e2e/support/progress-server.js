// A tiny MCP server over stdio (newline-delimited JSON-RPC) with one tool, `slow_count`,
// that takes `steps` × 300 ms and sends a progress notification at each step. chatd turns
// those into `tool_progress` events: the page's live progress bar is tested against it.

import { createInterface } from "node:readline";

const STEP_MS = 300;

function send(message) {
  process.stdout.write(`${JSON.stringify({ jsonrpc: "2.0", ...message })}\n`);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function call(id, params) {
  const steps = Math.max(1, Math.min(20, Number(params.arguments?.steps ?? 3)));
  const token = params._meta?.progressToken;
  for (let step = 1; step <= steps; step += 1) {
    await sleep(STEP_MS);
    if (token !== undefined) {
      send({
        method: "notifications/progress",
        params: { progressToken: token, progress: step, total: steps, message: `step ${step} of ${steps}` },
      });
    }
  }
  await sleep(STEP_MS);
  send({ id, result: { content: [{ type: "text", text: `counted to ${steps}` }], isError: false } });
}

const handlers = {
  initialize: (params) => ({
    protocolVersion: params.protocolVersion,
    capabilities: { tools: {} },
    serverInfo: { name: "progress-server", version: "0.1.0" },
  }),
  ping: () => ({}),
  "tools/list": () => ({
    tools: [
      {
        name: "slow_count",
        description: "Counts slowly, reporting progress at each step",
        inputSchema: { type: "object", properties: { steps: { type: "integer" } } },
      },
    ],
  }),
};

createInterface({ input: process.stdin }).on("line", (line) => {
  if (!line.trim()) return;
  const message = JSON.parse(line);
  if (message.id === undefined) return; // a notification: nothing to answer
  if (message.method === "tools/call") return void call(message.id, message.params);
  const handler = handlers[message.method];
  if (handler) send({ id: message.id, result: handler(message.params ?? {}) });
  else send({ id: message.id, error: { code: -32601, message: `no method ${message.method}` } });
});
