// A page built on the AI SDK's `useChat` (@ai-sdk/react, pinned in package.json, bundled once
// here with esbuild; support/use-chat/app.js) in headless Chromium, served from its own origin
// and talking to chatd across it (CORS), as a frontend on another host would. It streams an
// answer with a tool call, survives a reload mid-answer (`resume: true`), and stops a run.

import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { build } from "esbuild";
import { freePort, launchBrowser, screenshot, startChatd } from "../support/harness.js";

let chatd;
let browser;
let site;
let origin;
let bundleDir;

before(async () => {
  bundleDir = mkdtempSync(join(tmpdir(), "chatd-use-chat-"));
  await build({
    entryPoints: [join(import.meta.dirname, "../support/use-chat/app.js")],
    bundle: true,
    format: "esm",
    outfile: join(bundleDir, "app.js"),
    define: { "process.env.NODE_ENV": '"production"' },
    logLevel: "error",
  });
  const page = '<!doctype html><meta charset="utf-8"><title>useChat</title><div id="root"></div><script type="module" src="/app.js"></script>';
  const port = await freePort();
  origin = `http://127.0.0.1:${port}`;
  site = createServer((request, response) => {
    if (request.url.startsWith("/app.js")) {
      response.writeHead(200, { "content-type": "text/javascript" }).end(readFileSync(join(bundleDir, "app.js")));
    } else {
      response.writeHead(200, { "content-type": "text/html" }).end(page);
    }
  });
  await new Promise((done) => site.listen(port, "127.0.0.1", done));
  chatd = await startChatd(null, { cors: [origin] });
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
  await chatd?.stop();
  await new Promise((done) => (site ? site.close(done) : done()));
  if (bundleDir) rmSync(bundleDir, { recursive: true, force: true });
});

let opened = 0;

/** The page for one chat of a new user; fails on uncaught page errors. */
async function withChat(name, body) {
  opened += 1;
  const user = `use-chat-${name}-${process.pid}-${opened}`;
  const chat = `chat-${name}-${process.pid}-${opened}`;
  const context = await browser.newContext({ viewport: { width: 1000, height: 800 } });
  context.setDefaultTimeout(15_000);
  const page = await context.newPage();
  const pageErrors = [];
  page.on("pageerror", (error) => pageErrors.push(error));
  const url = `${origin}/?chatd=${encodeURIComponent(chatd.base)}&chat=${chat}&user=${user}`;
  await page.goto(url);
  try {
    await body({ page, user, chat, url });
    assert.deepEqual(pageErrors.map(String), [], "no uncaught errors in the page");
  } catch (error) {
    await screenshot(page, `use-chat-${name}-failed`).catch(() => {});
    throw error;
  } finally {
    await context.close();
  }
}

async function send(page, text) {
  await page.fill("#input", text);
  await page.click("#send");
}

/** The answer's text as the page shows it. */
const answerText = (page) =>
  page.$$eval('article[data-role="assistant"] p.text', (ps) => ps.map((p) => p.textContent).join(""));

/** The chat's stored conversation, found by its external id. */
async function stored(user, chat) {
  const { body } = await chatd.api("/api/conversations?limit=100", user);
  const found = body.conversations.find((c) => c.external_id === chat);
  assert.ok(found, `a conversation for ${chat}`);
  return (await chatd.api(`/api/conversations/${found.id}`, user)).body;
}

const withoutMarkers = (content) => content.replace(/(\n\n)?\[\[tool:\d+\]\]/g, "");

test("useChat streams an answer with a tool call from chatd", async () => {
  await withChat("tool", async ({ page, user, chat }) => {
    await send(page, 'Add [mock:tool=calculator {"expression": "2+3"}]');
    await page.waitForSelector('.tool[data-state="output-available"]');
    await page.waitForFunction(() => document.querySelector("#status").textContent === "ready");
    assert.equal(await page.textContent(".tool"), "calculator → 5");
    const answer = (await stored(user, chat)).messages[1];
    assert.equal(await answerText(page), withoutMarkers(answer.content));
    assert.equal(await page.getAttribute('article[data-role="assistant"]', "data-id"), answer.id);
  });
});

test("a reload mid-answer resumes it: the whole answer, once", async () => {
  await withChat("reload", async ({ page, user, chat, url }) => {
    await send(page, "Tell me [mock:words=120] [mock:delay=25] [mock:think=off]");
    await page.waitForFunction(() => (document.querySelector("article[data-role=assistant] p.text")?.textContent.length ?? 0) > 20);
    await page.goto(url);
    await page.waitForSelector('article[data-role="assistant"] p.text');
    const during = (await stored(user, chat)).messages;
    assert.equal(during.length, 1, "the answer was still being written when the page came back");
    await page.waitForFunction(() => document.querySelector("#status").textContent === "ready", null, { timeout: 30_000 });
    const answer = (await stored(user, chat)).messages[1];
    assert.equal(await answerText(page), answer.content);
    assert.equal(await page.locator('article[data-role="assistant"]').count(), 1);
  });
});

test("the stop button stops the run on chatd; the page keeps what was said", async () => {
  await withChat("stop", async ({ page, user, chat }) => {
    await send(page, "Go on [mock:words=400] [mock:delay=25] [mock:think=off]");
    await page.waitForFunction(() => (document.querySelector("article[data-role=assistant] p.text")?.textContent.length ?? 0) > 10);
    await page.click("#stop");
    await page.waitForFunction(() => document.querySelector("#status").textContent === "ready");
    const answer = (await stored(user, chat)).messages[1];
    assert.equal(answer.cancelled, true);
    assert.equal(`${await answerText(page)}\n\n[cancelled]`, answer.content);
    const trace = await chatd.api(`/api/trace/${answer.trace_id}`, user);
    assert.equal(trace.body.status, "cancelled");
  });
});
