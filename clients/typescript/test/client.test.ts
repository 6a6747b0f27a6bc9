// The client against a real chatd (the binary built by cargo, on a temporary SQLite file
// with the mock model), with a TCP proxy that cuts a stream mid-answer to prove resume.

import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer, connect, type AddressInfo, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { ChatdClient, ChatdError, type SequencedEvent } from "../src/index.js";

const binary = process.env.CHATD_BIN ?? resolve(import.meta.dirname, "../../../../target/debug/chatd");
let chatd: ChildProcess;
let base = "";
let dir = "";

async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((done) => server.listen(0, "127.0.0.1", done));
  const { port } = server.address() as AddressInfo;
  await new Promise((done) => server.close(done));
  return port;
}

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "chatd-ts-"));
  const port = await freePort();
  writeFileSync(
    join(dir, "chatd.toml"),
    `[server]\nport = ${port}\n[database]\nurl = "sqlite://${dir}/chatd.db"\n` +
      `[providers.mock]\nkind = "mock"\ndelay_ms = 5\nchunk_chars = 4\n[profiles.default]\nprovider = "mock"\nmodel = "mock-1"\n`,
  );
  chatd = spawn(binary, ["--config", join(dir, "chatd.toml")], { stdio: "ignore", env: { ...process.env, RUST_LOG: "warn" } });
  base = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 20_000;
  for (;;) {
    try {
      if ((await fetch(`${base}/healthz`)).ok) break;
    } catch {
      if (Date.now() > deadline) throw new Error("chatd did not start");
      await new Promise((r) => setTimeout(r, 50));
    }
  }
});

after(() => {
  chatd?.kill();
  rmSync(dir, { recursive: true, force: true });
});

const client = () => new ChatdClient({ baseUrl: base, headers: { "x-client-id": "ts" } });

async function collect(events: AsyncIterable<SequencedEvent>): Promise<SequencedEvent[]> {
  const all: SequencedEvent[] = [];
  for await (const event of events) all.push(event);
  return all;
}

const text = (events: SequencedEvent[]) =>
  events.map((e) => (e.type === "text_delta" ? e.text : "")).join("");

test("a message streams typed events from start to done", async () => {
  const events = await collect(client().streamChat({ message: "Hello from TypeScript" }));
  assert.equal(events[0].type, "start");
  assert.equal(events.at(-1)!.type, "done");
  assert.deepEqual(events.map((e) => e.seq), events.map((_, i) => i + 1));
  const complete = events.find((e) => e.type === "complete");
  assert.ok(complete && complete.type === "complete");
  assert.equal(complete.payload.message, "Mock reply: Hello from TypeScript");
  assert.equal(text(events), complete.payload.message);
});

test("refusals are ChatdErrors with the contract's code and field", async () => {
  await assert.rejects(collect(client().streamChat({ message: "   " })), (error: unknown) => {
    assert.ok(error instanceof ChatdError);
    assert.equal(error.status, 400);
    assert.equal(error.code, "VALIDATION_ERROR");
    assert.equal(error.field, "message");
    return true;
  });
});

test("cancel stops a run and its stream ends cancelled, done", async () => {
  const c = client();
  const events: SequencedEvent[] = [];
  let deltas = 0;
  for await (const event of c.streamChat({ message: "[mock:words=300] [mock:think=off]" })) {
    events.push(event);
    if (event.type === "text_delta" && ++deltas === 3) {
      const start = events[0];
      assert.ok(start.type === "start");
      const answer = await c.cancel(start.trace_id);
      assert.equal(answer.status, "cancelled");
    }
  }
  assert.deepEqual(events.slice(-2).map((e) => e.type), ["cancelled", "done"]);
});

/** Forwards to chatd; the first connection is cut after `cutAfter` bytes of answer. */
async function cuttingProxy(target: URL, cutAfter: number): Promise<{ url: string; server: Server; connections: () => number }> {
  let first = true;
  let connections = 0;
  const server = createServer((downstream: Socket) => {
    connections += 1;
    const upstream = connect(Number(target.port), target.hostname);
    const cut = first;
    first = false;
    let seen = 0;
    downstream.pipe(upstream);
    upstream.on("data", (chunk: Buffer) => {
      seen += chunk.length;
      downstream.write(chunk);
      if (cut && seen > cutAfter) {
        upstream.destroy();
        downstream.destroy();
      }
    });
    upstream.on("error", () => downstream.destroy());
    downstream.on("error", () => upstream.destroy());
    upstream.on("end", () => downstream.end());
  });
  await new Promise<void>((done) => server.listen(0, "127.0.0.1", done));
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, server, connections: () => connections };
}

test("a network drop mid-answer is resumed with Last-Event-ID: every event once", async () => {
  const message = "[mock:words=80] [mock:think=off]";
  const whole = await collect(client().streamChat({ message }));
  const { url, server, connections } = await cuttingProxy(new URL(base), 1500);
  try {
    const through = new ChatdClient({ baseUrl: url, headers: { "x-client-id": "ts" } });
    const events = await collect(through.streamChat({ message }));
    assert.deepEqual(events.map((e) => e.seq), events.map((_, i) => i + 1), "no event lost or repeated");
    assert.equal(events.at(-1)!.type, "done");
    assert.equal(text(events), text(whole), "the same text as an unbroken stream");
    assert.ok(connections() >= 2, "the first connection was cut and the stream resumed");
  } finally {
    server.close();
  }
});

test("conversation and trace helpers", async () => {
  const c = client();
  const events = await collect(c.streamChat({ message: "helpers" }));
  const start = events[0];
  assert.ok(start.type === "start");
  const listed = await c.listConversations(5);
  assert.ok(listed.conversations.some((conv) => conv.id === start.conversation_id));
  const renamed = await c.renameConversation(start.conversation_id, "Renamed");
  assert.equal(renamed.title, "Renamed");
  const loaded = await c.getConversation(start.conversation_id);
  assert.equal(loaded.messages.length, 2);
  const trace = await c.trace(start.trace_id);
  assert.equal(trace.status, "completed");
  await c.deleteConversation(start.conversation_id);
  await assert.rejects(c.getConversation(start.conversation_id), (e: unknown) => e instanceof ChatdError && e.status === 404);
});
