// What the browser tests stand on: a real chatd (the debug binary) on a free port with a
// temporary SQLite file and a config of its own, and headless Chromium (Debian's package)
// driven by playwright-core. Each test gets a fresh browser context and its own user
// (X-Client-Id, set in the page's own settings storage), so tests never see each other's
// conversations.

import assert from "node:assert/strict";
import { after, before } from "node:test";
import { spawn } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { chromium } from "playwright-core";

const root = resolve(import.meta.dirname, "../../..");
const binary = process.env.CHATD_BIN ?? join(root, "target/debug/chatd");
export const screenshots = join(root, "target/e2e-screenshots");

/** The words `[mock:words=N]` answers with, in order (src/providers/mock.rs). */
const WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"];
export const mockWords = (n) => Array.from({ length: n }, (_, i) => WORDS[i % WORDS.length]).join(" ");

/** Messages over this many characters are refused with 413 (a banner test sends one). */
export const MAX_MESSAGE_CHARS = 2000;

function config(dir, port, auth, cors) {
  const rule = (when, text) => `[[providers.mock.rules]]\nwhen = ${JSON.stringify(when)}\ntext = ${JSON.stringify(text)}\n`;
  return `
[server]
port = ${port}
cors_origins = ${JSON.stringify(cors)}
[database]
url = "sqlite://${dir}/chatd.db"
[files]
url = "file://${dir}/files"
[limits]
max_message_chars = ${MAX_MESSAGE_CHARS}
requests_per_minute = 0
[tools]
builtins = ["calculator", "current_time"]
[providers.mock]
kind = "mock"
delay_ms = 5
chunk_chars = 8
${rule(
  "options please",
  'Pick one.\nSUGGESTED_VALUES: [{"label": "Yes, proceed", "value": "yes"}, {"label": "No thanks", "value": "no"}]\n' +
    'SUGGESTED_ACTIONS: [{"label": "Apply", "action": "apply_schema", "handler": "server", "data": {"schema_id": 7}, "style": "primary"}]',
)}
${rule("markdown please", "## Plan\n\nThis is **bold**, *italic* and `code`.\n\n- one\n- two\n\n```\nlet x = 1;\n```\n\n[a link](https://example.com/) and [no link](javascript:alert(1))")}
[profiles.default]
provider = "mock"
model = "mock-1"
modalities = ["text", "image", "pdf"]
[profiles.other]
provider = "mock"
model = "mock-2"
[profiles.vetted]
provider = "mock"
model = "mock-3"
require_approval = ["calculator"]
[mcp_servers.progress]
command = "node"
args = [${JSON.stringify(join(import.meta.dirname, "progress-server.js"))}]
${auth ? `[auth]\nmode = "token"\n[auth.tokens]\n${JSON.stringify(auth.token)} = ${JSON.stringify(auth.user)}\n` : ""}`;
}

/**
 * A port free now, for a server that binds it later (chatd, a page's server). It comes from
 * below the range the kernel gives out ports from itself (32768–60999 on Linux), where
 * servers listening on port 0 and every outgoing connection get theirs: a port from that
 * range, let go of for another process to bind, could be taken meanwhile, and a test would
 * then speak to another server than its own. (As `free_port` of the Rust tests.)
 */
export async function freePort() {
  let kernelsFirst = 32768;
  try {
    kernelsFirst = Number(readFileSync("/proc/sys/net/ipv4/ip_local_port_range", "utf8").trim().split(/\s+/)[0]) || kernelsFirst;
  } catch {
    // not Linux: the usual range
  }
  const first = Math.max(1024, kernelsFirst - 17000);
  const ports = Math.max(1, kernelsFirst - first);
  for (;;) {
    const port = first + Math.floor(Math.random() * ports);
    const server = createServer();
    const bound = await new Promise((done) => {
      server.once("error", () => done(false));
      server.listen(port, "127.0.0.1", () => done(true));
    });
    if (bound) {
      await new Promise((done) => server.close(done));
      return port;
    }
  }
}

/**
 * Starts chatd and waits until it serves and its MCP test server is ready. Auth mode `none`,
 * or with `auth = {token, user}` mode `token` with that one token; `cors`: the browser origins
 * allowed to call it from another page.
 */
export async function startChatd(auth = null, { cors = [], dir = mkdtempSync(join(tmpdir(), "chatd-e2e-")) } = {}) {
  const port = await freePort();
  writeFileSync(join(dir, "chatd.toml"), config(dir, port, auth, cors));
  const ready = auth ? { authorization: `Bearer ${auth.token}` } : {};
  const child = spawn(binary, ["--config", join(dir, "chatd.toml")], {
    stdio: ["ignore", "ignore", "inherit"],
    env: { ...process.env, RUST_LOG: "warn" },
  });
  const base = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 30_000;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`chatd exited with ${child.exitCode}`);
    try {
      const tools = await (await fetch(`${base}/api/tools`, { headers: ready })).json();
      if (tools.mcp_servers?.some((s) => s.state === "ready")) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) throw new Error("chatd did not become ready");
    await new Promise((r) => setTimeout(r, 100));
  }
  return {
    base,
    /** Calls the API directly, as `user`. */
    api: async (path, user, init = {}) => {
      const response = await fetch(`${base}${path}`, {
        ...init,
        headers: { "x-client-id": user, "content-type": "application/json", ...init.headers },
      });
      return { status: response.status, body: await response.json().catch(() => null) };
    },
    stop: async () => {
      child.kill("SIGTERM");
      await new Promise((done) => (child.exitCode !== null ? done() : child.once("exit", done)));
      rmSync(dir, { recursive: true, force: true });
    },
    /** Kills the process without warning (`kill -9`), keeping its folder for a restart. */
    kill: async () => {
      child.kill("SIGKILL");
      await new Promise((done) => (child.exitCode !== null ? done() : child.once("exit", done)));
    },
    /** Its folder (its SQLite file): `startChatd(auth, {dir})` starts a process on it again. */
    dir,
  };
}

export async function launchBrowser() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM_BIN ?? "/usr/bin/chromium",
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
}

/**
 * A chatd and a browser for a test file's tests: started before them and handed to `use`,
 * stopped after them.
 */
export function withChatdAndBrowser(use) {
  const started = {};
  before(async () => {
    started.chatd = await startChatd();
    started.browser = await launchBrowser();
    use(started);
  });
  after(async () => {
    await started.browser?.close();
    await started.chatd?.stop();
  });
}

let users = 0;

/** A fresh context (no storage shared with other tests) and a page opened at `/` as a new user. */
export async function openPage(browser, chatd, name) {
  const user = `e2e-${name}-${process.pid}-${(users += 1)}`;
  const context = await browser.newContext({ viewport: { width: 1200, height: 800 } });
  context.setDefaultTimeout(15_000);
  await context.addInitScript((id) => localStorage.setItem("chatd.clientId", id), user);
  const page = await context.newPage();
  const pageErrors = [];
  page.on("pageerror", (error) => pageErrors.push(error));
  await page.goto(`${chatd.base}/`);
  return { page, user, context, pageErrors };
}

export async function screenshot(page, name) {
  mkdirSync(screenshots, { recursive: true });
  await page.screenshot({ path: join(screenshots, `${name}.png`), fullPage: true });
}

/**
 * Runs `body` with a page of its own (see openPage), failing on uncaught page errors; a
 * screenshot is kept when it fails, and the page's context is closed either way.
 */
export async function inPage(browser, chatd, name, body) {
  const session = await openPage(browser, chatd, name);
  try {
    await body(session);
    assert.deepEqual(session.pageErrors.map(String), [], "no uncaught errors in the page");
  } catch (error) {
    await screenshot(session.page, `${name}-failed`).catch(() => {});
    throw error;
  } finally {
    await session.context.close();
  }
}
