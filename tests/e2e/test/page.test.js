// chatd's web page in headless Chromium against a real chatd (mock model, the calculator
// built-in, a slow MCP tool that reports progress, two profiles for A/B). Every check is on
// what a person would see: text, element states, what the server then stores.

import { test } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";
import { inPage, MAX_MESSAGE_CHARS, mockWords, openPage, screenshot, startChatd, withChatdAndBrowser } from "../support/harness.js";

let chatd;
let browser;
withChatdAndBrowser((started) => ({ chatd, browser } = started));

/** Opens the page for one test and closes its context afterwards, failing on page errors. */
const withPage = (t, name, body) => inPage(browser, chatd, name, body);

async function send(page, text) {
  await page.fill("#input", text);
  await page.press("#input", "Enter");
}

const answers = (page) => page.locator(".msg.assistant");
const finished = (page, state = "complete") => page.locator(`.msg.assistant[data-state="${state}"]`);

test("a message streams in, thinking folds away, feedback and the trace are one click away", (t) =>
  withPage(t, "stream", async ({ page, user }) => {
    await send(page, "Tell me a story [mock:words=60] [mock:delay=40]");
    assert.equal(await page.locator(".msg.user").innerText(), "Tell me a story [mock:words=60] [mock:delay=40]");
    // Before the first token the status line says so; then the text grows while it runs.
    await page.locator('.msg.assistant[data-state="running"] .status').filter({ hasText: "Thinking…" }).waitFor();
    await page.locator('.msg.assistant[data-state="running"] .body').filter({ hasText: "alpha bravo" }).waitFor();
    const partial = await answers(page).locator(".body").innerText();
    assert.ok(partial.length < mockWords(60).length, "seen while still streaming");
    await screenshot(page, "streaming");

    await finished(page).waitFor();
    assert.equal((await answers(page).locator(".body").innerText()).trim(), mockWords(60));
    assert.equal(await page.locator(".msg.assistant .status").count(), 0, "no status once done");
    assert.equal(await page.locator("#stop").isVisible(), false);

    // The thinking section is there, collapsed; it opens on a click.
    const thinking = answers(page).locator("details.thinking");
    assert.equal(await thinking.evaluate((d) => d.open), false);
    assert.equal(await thinking.locator(".thinking-text").isVisible(), false);
    await thinking.locator("summary").click();
    assert.match(await thinking.locator(".thinking-text").innerText(), /^The user wrote \d+ characters/);

    // The new conversation heads the list, titled by the message.
    const current = page.locator("#conversations .conv[aria-current]");
    assert.match(await current.innerText(), /^Tell me a story/);

    // Thumbs up is stored, and shown again after a reload.
    await answers(page).getByRole("button", { name: "Good answer" }).click();
    await page.locator('.thumb.up[aria-pressed="true"]').waitFor();
    await page.reload();
    await page.locator('.thumb.up[aria-pressed="true"]').waitFor();
    const id = page.url().split("#/c/")[1];
    const { body } = await chatd.api(`/api/conversations/${id}`, user);
    assert.equal(body.messages.at(-1).feedback.rating, "up");

    // The trace viewer shows the run: its status, spans and logged events.
    await answers(page).getByRole("button", { name: "Trace" }).click();
    const dialog = page.locator("#trace-dialog");
    await dialog.locator(".trace").waitFor();
    assert.match(await dialog.locator(".facts").innerText(), /Status\s+completed/);
    // The mock model has no price: the trace says so rather than $0; nothing came from a cache.
    assert.match(await dialog.locator(".facts").innerText(), /Cost\s+no price/);
    assert.match(await dialog.locator(".facts").innerText(), /Cached\s+0% of the input \(0 tokens\)/);
    assert.match(await dialog.locator(".spans").innerText(), /llm/);
    assert.equal(await dialog.locator(".events li summary").first().innerText(), "1 · start");
    assert.match(await dialog.locator(".events li summary").last().innerText(), /· done$/);
    await screenshot(page, "trace");
    await page.click("#trace-close");
    assert.equal(await dialog.isVisible(), false);
  }));

test("answers render as safe Markdown", (t) =>
  withPage(t, "markdown", async ({ page }) => {
    await send(page, "markdown please");
    await finished(page).waitFor();
    const body = answers(page).locator(".body");
    assert.equal(await body.locator("h2").innerText(), "Plan");
    assert.equal(await body.locator("strong").innerText(), "bold");
    assert.equal(await body.locator("em").innerText(), "italic");
    assert.equal(await body.locator("p code").innerText(), "code");
    assert.deepEqual(await body.locator("ul li").allInnerTexts(), ["one", "two"]);
    assert.equal(await body.locator("pre code").innerText(), "let x = 1;");
    assert.equal(await body.locator("a").count(), 1, "only the http(s) link is a link");
    assert.equal(await body.locator("a").getAttribute("href"), "https://example.com/");
    assert.match(await body.innerText(), /\[no link\]\(javascript:alert\(1\)\)/);

    // HTML in a message is shown as text, never run (the mock echoes it back).
    const attack = `<img src=x onerror="window.hacked = 1"> <script>window.hacked = 2</script>`;
    await send(page, attack);
    await finished(page).nth(1).waitFor();
    assert.equal(await answers(page).nth(1).locator(".body").innerText(), `Mock reply: ${attack}`);
    assert.equal(await page.locator("#messages img, #messages script").count(), 0);
    assert.equal(await page.evaluate(() => window.hacked), undefined);
    await screenshot(page, "markdown");
  }));

test("a tool call shows as a collapsed card in place of its marker, and expands", (t) =>
  withPage(t, "tool", async ({ page }) => {
    await send(page, 'Add these [mock:tool=calculator {"expression": "6 * 7"}]');
    await finished(page).waitFor();
    const body = answers(page).locator(".body");
    // Text, the card where [[tool:0]] was, then the text after the tool answered.
    const order = await body.evaluate((b) => [...b.children].map((c) => (c.matches("details.tool") ? "card" : c.innerText)));
    assert.deepEqual(order, ["Mock reply: Add these", "card", "The tools answered: calculator said 42."]);
    assert.ok(!(await body.innerText()).includes("[[tool:"), "no raw marker");

    const card = body.locator("details.tool");
    assert.equal(await card.evaluate((d) => d.open), false, "collapsed by default");
    assert.equal(await card.locator(".tool-output").isVisible(), false);
    assert.equal(await card.locator(".tool-name").innerText(), "calculator");
    assert.match(await card.locator(".tool-state").innerText(), /^success · \d+ ms$/);

    await card.locator("summary").click();
    assert.equal(await card.evaluate((d) => d.open), true);
    assert.deepEqual(JSON.parse(await card.locator(".tool-input").innerText()), { expression: "6 * 7" });
    assert.equal(await card.locator(".tool-output").innerText(), "42");
    assert.match(await card.locator(".tool-duration").innerText(), /^\d+ ms$/);
    await screenshot(page, "tool-card");
  }));

test("a call that needs approval waits on its card: Approve runs it, Deny tells the model", (t) =>
  withPage(t, "approval", async ({ page }) => {
    await page.selectOption("#profile", "vetted");
    await send(page, 'Add these [mock:tool=calculator {"expression": "6 * 7"}]');
    const card = answers(page).last().locator("details.tool");
    await card.locator("button.approve").waitFor();
    assert.equal(await card.locator(".tool-state").innerText(), "awaiting approval");
    assert.equal(await card.evaluate((d) => d.open), false, "the buttons are on the collapsed card");
    await screenshot(page, "approval-waiting");
    await card.locator("button.approve").click();
    await finished(page).waitFor();
    assert.match(await card.locator(".tool-state").innerText(), /^success · \d+ ms$/);
    assert.ok((await answers(page).last().locator(".body").innerText()).includes("calculator said 42"));
    assert.equal(await card.locator("button.approve").count(), 0, "no button once decided");

    await send(page, 'And these [mock:tool=calculator {"expression": "1 + 1"}]');
    const second = answers(page).last().locator("details.tool");
    await second.locator("button.deny").click();
    await finished(page).nth(1).waitFor();
    assert.match(await second.locator(".tool-state").innerText(), /^denied/);
    const text = await answers(page).last().locator(".body").innerText();
    assert.ok(text.includes("The user denied this tool call"), text);
  }));

test("the page's own tool answers the run that asks for it", (t) =>
  withPage(t, "client-tool", async ({ page }) => {
    await send(page, "Which time zone am I in? [mock:tool=get_time_zone {}]");
    await finished(page).waitFor();
    const zone = await page.evaluate(() => Intl.DateTimeFormat().resolvedOptions().timeZone);
    const text = await answers(page).locator(".body").innerText();
    assert.ok(text.includes(`get_time_zone said {"time_zone":"${zone}"`), text);
    assert.match(await answers(page).locator("details.tool .tool-state").innerText(), /^success · \d+ ms$/);
  }));

test("a long tool shows its status line and a live progress bar", (t) =>
  withPage(t, "progress", async ({ page }) => {
    await send(page, 'Count for me [mock:tool=slow_count {"steps": 4}]');
    await page.locator(".msg.assistant .status").filter({ hasText: "Running slow_count…" }).waitFor();
    const card = answers(page).locator('details.tool[data-status="running"]');
    assert.equal(await card.locator(".tool-state").innerText(), "running…");
    // The bar moves with the tool's progress notifications (0.25 per step).
    await card.locator("progress").waitFor();
    await page.waitForFunction(() => Number(document.querySelector("details.tool progress")?.value) >= 0.5);
    assert.match(await card.locator(".tool-note").innerText(), /^step [2-4] of 4$/);
    await screenshot(page, "tool-progress");

    await finished(page).waitFor();
    const done = answers(page).locator("details.tool");
    assert.equal(await done.getAttribute("data-status"), "success");
    assert.equal(await done.locator("progress").count(), 0, "no bar once finished");
    await done.locator("summary").click();
    assert.equal(await done.locator(".tool-output").innerText(), "counted to 4");
  }));

test("Stop cancels mid-answer: the partial text stays, marked cancelled", (t) =>
  withPage(t, "stop", async ({ page, user }) => {
    const full = mockWords(400);
    await send(page, "Go on [mock:words=400] [mock:delay=40] [mock:think=off]");
    await page.locator('.msg.assistant[data-state="running"] .body').filter({ hasText: "charlie" }).waitFor();
    await page.locator("#stop:not([disabled])").click();

    await finished(page, "cancelled").waitFor();
    assert.equal(await answers(page).locator(".mark.cancelled").innerText(), "Cancelled");
    const partial = (await answers(page).locator(".body").innerText()).trim();
    assert.ok(partial.length > 0 && partial.length < full.length, "a part of the answer");
    assert.ok(full.startsWith(partial), "exactly the beginning of the answer");
    assert.equal(await page.locator("#stop").isVisible(), false);
    assert.equal(await page.locator("#send").isDisabled(), false);
    await screenshot(page, "cancelled");

    // Stored as cancelled, and shown the same way when the conversation is opened again.
    const id = page.url().split("#/c/")[1];
    const stored = (await chatd.api(`/api/conversations/${id}`, user)).body.messages.at(-1);
    assert.equal(stored.cancelled, true);
    assert.equal(stored.content, `${partial}\n\n[cancelled]`);
    await page.click("#new-chat");
    await page.locator("#conversations .conv-open").first().click();
    await finished(page, "cancelled").waitFor();
    assert.equal((await answers(page).locator(".body").innerText()).trim(), partial);
    assert.equal(await answers(page).locator(".mark.cancelled").innerText(), "Cancelled");
  }));

test("a reload mid-answer resumes the run from its last event to the full text", (t) =>
  withPage(t, "resume", async ({ page }) => {
    const resumed = [];
    page.on("request", (request) => {
      if (/\/api\/chat\/stream\/[0-9a-f-]{36}$/.test(request.url())) resumed.push(request.headers()["last-event-id"]);
    });
    await send(page, "Keep going [mock:words=200] [mock:delay=30] [mock:think=off]");
    await page.locator('.msg.assistant[data-state="running"] .body').filter({ hasText: "echo foxtrot" }).waitFor();
    await page.reload();

    // Reattached while the run still streams, with the text so far, then to the end.
    await page.locator('.msg.assistant[data-state="running"]').waitFor();
    assert.match(await answers(page).locator(".body").innerText(), /^alpha bravo charlie delta echo foxtrot/);
    await finished(page).waitFor({ timeout: 30_000 });
    assert.equal((await answers(page).locator(".body").innerText()).trim(), mockWords(200));
    assert.equal(await answers(page).count(), 1);
    assert.equal(await page.locator(".msg.user").count(), 1);
    assert.equal(resumed.length, 1, "one resume request");
    assert.ok(Number(resumed[0]) > 1, `resumed after the last event seen, not from the start (${resumed[0]})`);
    await screenshot(page, "resumed");
  }));

test("A/B mode answers in two columns and records the vote", (t) =>
  withPage(t, "ab", async ({ page, user }) => {
    await page.check("#ab-mode");
    await page.selectOption("#profile-a", "default");
    await page.selectOption("#profile-b", "other");
    await send(page, "Compare us");
    await page.locator(".votes").waitFor();
    assert.equal(await page.locator(".side-a h3").innerText(), "A · mock-1");
    assert.equal(await page.locator(".side-b h3").innerText(), "B · mock-2");
    for (const side of ["a", "b"]) {
      const answer = page.locator(`.side-${side} .msg.assistant`);
      assert.equal(await answer.getAttribute("data-state"), "complete");
      assert.equal(await answer.locator(".body").innerText(), "Mock reply: Compare us");
    }
    await page.getByRole("button", { name: "B is better" }).click();
    await page.locator(".vote-result", { hasText: "Vote recorded: B is better" }).waitFor();
    assert.equal(await page.locator(".vote:not([disabled])").count(), 0, "one vote");
    assert.equal(await page.locator('.vote[aria-pressed="true"]').innerText(), "B is better");
    await screenshot(page, "ab");

    // The preferred answer is now the conversation's active branch.
    const id = page.url().split("#/c/")[1];
    const stored = (await chatd.api(`/api/conversations/${id}`, user)).body.messages;
    assert.equal(stored.at(-1).model, "mock-2");
    await page.uncheck("#ab-mode");
    await page.click("#new-chat");
    await page.locator("#conversations .conv-open").first().click();
    await finished(page).waitFor();
    assert.equal(await answers(page).count(), 1);
    assert.equal(await answers(page).locator(".model").innerText(), "mock-2");
  }));

test("errors show in the banner with the contract's messages", (t) =>
  withPage(t, "errors", async ({ page }) => {
    // An `error` event in the stream.
    await send(page, "Hello [mock:error=unauthorized]");
    await page.locator("#banner").waitFor();
    assert.equal(await page.locator("#banner-text").innerText(), "Invalid API key");
    assert.equal(await page.locator("#banner").getAttribute("data-code"), "UNAUTHORIZED");
    assert.equal(await finished(page, "error").locator(".mark.error").innerText(), "Failed: Invalid API key");
    await screenshot(page, "error-event");
    await page.click("#banner-close");
    assert.equal(await page.locator("#banner").isVisible(), false);

    // A refusal before the stream opens: the JSON envelope's message, and the text is kept.
    const long = "x".repeat(MAX_MESSAGE_CHARS + 1);
    const refused = await chatd.api("/api/chat/stream", "someone", { method: "POST", body: JSON.stringify({ message: long }) });
    assert.equal(refused.status, 413);
    await send(page, long);
    await page.locator("#banner").waitFor();
    assert.equal(await page.locator("#banner-text").innerText(), refused.body.message);
    assert.equal(await page.locator("#banner").getAttribute("data-code"), "PAYLOAD_TOO_LARGE");
    assert.equal(await page.locator(".msg.user").count(), 1, "the refused message is not shown as sent");
    assert.equal(await page.inputValue("#input"), long, "the text is back in the composer");
    await screenshot(page, "error-refused");
  }));

test("a message sent while the page's lists still load keeps its answer on the page", async () => {
  // The page reads its lists first; a message sent meanwhile is what it shows then, not a run
  // to resume (it saves itself for a reload as it streams).
  const context = await browser.newContext();
  context.setDefaultTimeout(15_000);
  await context.addInitScript((id) => localStorage.setItem("chatd.clientId", id), `e2e-early-${process.pid}`);
  const page = await context.newPage();
  let letThrough;
  const held = new Promise((resolve) => (letThrough = resolve));
  await page.route((url) => url.pathname === "/api/conversations", async (route) => {
    await held;
    await route.continue();
  });
  try {
    await page.goto(`${chatd.base}/`);
    // A failed run's answer is not stored: drawing the conversation anew from the server
    // would lose it.
    await send(page, "Early [mock:error=unauthorized]");
    await finished(page, "error").waitFor();
    letThrough();
    await page.locator("body[data-started]").waitFor();
    assert.equal(await finished(page, "error").locator(".mark.error").innerText(), "Failed: Invalid API key");
  } finally {
    letThrough();
    await context.close();
  }
});

test("a model call that fails mid-answer and is asked again shows only what survived", (t) =>
  withPage(t, "step-reset", async ({ page }) => {
    // The mock fails after two chunks every time: each retry voids what the call said
    // (`step_reset`), and the last failure keeps the last attempt's words alone.
    await send(page, "Go [mock:words=10] [mock:fail_after=2] [mock:think=off]");
    await finished(page, "error").waitFor();
    const shown = (await answers(page).locator(".body").innerText()).trim();
    const first = mockWords(1);
    assert.ok(shown.startsWith(first) && shown.length < mockWords(10).length, shown);
    assert.equal(shown.split(first).length - 1, 1, `the failed attempts' words are shown once: ${shown}`);
  }));

test("each profile is listed once; a remembered one the server no longer has is dropped", (t) =>
  withPage(t, "profiles", async ({ page }) => {
    const profiles = page.locator("#profile option");
    const listed = async () => {
      await page.locator('#profile option[value="vetted"]').waitFor({ state: "attached" });
      return profiles.allInnerTexts();
    };
    // The first choice sends no profile: it is the server's default, not listed again.
    assert.deepEqual(await listed(), ["default (mock-1)", "other (mock-2)", "vetted (mock-3)"]);
    assert.equal(await profiles.first().getAttribute("value"), "");
    assert.equal(await page.inputValue("#profile"), "");

    // A choice is kept across a reload…
    await page.selectOption("#profile", "vetted");
    await page.reload();
    await listed();
    assert.equal(await page.inputValue("#profile"), "vetted");
    // …while the server lists it: one it no longer has is forgotten.
    await page.evaluate(() => localStorage.setItem("chatd.profile", "retired"));
    await page.reload();
    await listed();
    assert.equal(await page.inputValue("#profile"), "");
    assert.equal(await page.evaluate(() => localStorage.getItem("chatd.profile")), null);

    // A list read before the server's configuration changed: the refusal names the profile,
    // and the list is read again.
    await page.evaluate(() => {
      const stale = Object.assign(document.createElement("option"), { value: "retired", textContent: "retired (old)" });
      document.getElementById("profile").append(stale);
      document.getElementById("profile").value = "retired";
    });
    await send(page, "Hello");
    await page.locator("#banner").waitFor();
    assert.equal(
      await page.locator("#banner-text").innerText(),
      "Profile 'retired' not found: GET /api/profiles lists the configured ones",
    );
    await page.locator('#profile option[value="retired"]').waitFor({ state: "detached" });
    assert.deepEqual(await listed(), ["default (mock-1)", "other (mock-2)", "vetted (mock-3)"]);
    assert.equal(await page.inputValue("#input"), "Hello", "the text is back in the composer");
  }));

test("suggested values send their value; a server action goes back as action_executed", (t) =>
  withPage(t, "suggestions", async ({ page }) => {
    const sent = [];
    page.on("request", (request) => {
      if (request.url().endsWith("/api/chat/stream") && request.method() === "POST") sent.push(request.postDataJSON());
    });
    await send(page, "options please");
    await finished(page).waitFor();
    assert.equal(await answers(page).locator(".body").innerText(), "Pick one.");
    assert.deepEqual(await answers(page).locator(".chip").allInnerTexts(), ["Yes, proceed", "No thanks"]);
    const apply = answers(page).locator(".action");
    assert.equal(await apply.innerText(), "Apply");
    assert.match(await apply.getAttribute("class"), /primary/);
    await screenshot(page, "suggestions");

    await answers(page).getByRole("button", { name: "Yes, proceed" }).click();
    await finished(page).nth(1).waitFor();
    assert.equal(await page.locator(".msg.user").nth(1).innerText(), "yes");
    assert.equal(await answers(page).nth(1).locator(".body").innerText(), "Mock reply: yes");
    assert.equal(sent[1].interaction_type, "value_selected");

    await answers(page).first().getByRole("button", { name: "Apply" }).click();
    await finished(page).nth(2).waitFor();
    assert.equal(sent[2].interaction_type, "action_executed");
    assert.deepEqual(sent[2].action, { action: "apply_schema", data: { schema_id: 7 } });
    assert.equal(sent[2].conversation_id, sent[1].conversation_id, "the same conversation");
  }));

test("conversations: newest first, rename, delete", (t) =>
  withPage(t, "conversations", async ({ page, user }) => {
    await send(page, "First chat");
    await finished(page).waitFor();
    await page.locator("#title", { hasText: "First chat" }).waitFor();
    await page.click("#new-chat");
    assert.equal(await page.locator("#title").innerText(), "New chat");
    await send(page, "Second chat");
    await finished(page).waitFor();
    const titles = () => page.locator("#conversations .conv-open").allInnerTexts();
    await page.locator("#conversations .conv").nth(1).waitFor();
    assert.deepEqual(await titles(), ["Second chat", "First chat"]);

    const second = page.locator("#conversations .conv").first();
    await second.hover();
    await second.getByRole("button", { name: "Rename" }).click();
    await page.fill(".conv-title", "Renamed chat");
    await page.press(".conv-title", "Enter");
    await page.locator("#conversations .conv-open", { hasText: "Renamed chat" }).waitFor();
    assert.deepEqual(await titles(), ["Renamed chat", "First chat"]);
    assert.equal(await page.locator("#title").innerText(), "Renamed chat");
    const listed = (await chatd.api("/api/conversations", user)).body.conversations.map((c) => c.title);
    assert.deepEqual(listed, ["Renamed chat", "First chat"]);

    page.once("dialog", (dialog) => dialog.accept());
    const first = page.locator("#conversations .conv", { hasText: "First chat" });
    await first.hover();
    await first.getByRole("button", { name: "Delete" }).click();
    await first.waitFor({ state: "detached" });
    assert.deepEqual(await titles(), ["Renamed chat"]);
    assert.equal((await chatd.api("/api/conversations", user)).body.conversations.length, 1);

    // Deleting the open conversation leaves an empty new chat.
    page.once("dialog", (dialog) => dialog.accept());
    await second.hover();
    await second.getByRole("button", { name: "Delete" }).click();
    await page.locator("#messages .empty").waitFor();
    assert.equal(await page.locator("#title").innerText(), "New chat");
    // The list is drawn again once the delete is answered: after the empty chat, at times.
    await second.waitFor({ state: "detached" });
    assert.equal(await page.locator("#conversations .conv").count(), 0);
  }));

test("a conversation the openai SDK made is on the page, with its answer", (t) =>
  withPage(t, "openai", async ({ page, user }) => {
    const openai = new OpenAI({
      baseURL: `${chatd.base}/v1`,
      apiKey: "unused",
      defaultHeaders: { "x-client-id": user },
      maxRetries: 0,
    });
    const response = await openai.responses.create({ model: "default", input: "Asked through the SDK" });
    await page.reload();
    await page.locator("#conversations .conv-open", { hasText: "Asked through the SDK" }).click();
    await finished(page).waitFor();
    assert.equal(await page.locator(".msg.user").innerText(), "Asked through the SDK");
    assert.equal((await answers(page).locator(".body").innerText()).trim(), response.output_text);
  }));

test("with auth mode token, the page asks for a token and uses the pasted one", async (t) => {
  const secured = await startChatd({ token: "tok-e2e-secret", user: "pat" });
  t.after(() => secured.stop());
  const { page, context, pageErrors } = await openPage(browser, secured, "token");
  try {
    const refused = await fetch(`${secured.base}/api/conversations`);
    assert.equal(refused.status, 401);
    const { message } = await refused.json();
    // Without a token every call is refused: the contract's message, and the settings open.
    await page.locator("#banner").waitFor();
    assert.equal(await page.locator("#banner-text").innerText(), message);
    assert.equal(await page.locator("#settings").evaluate((d) => d.open), true);
    await screenshot(page, "token-needed");

    await page.fill("#token", "tok-e2e-secret");
    await page.click("#settings-form button[type=submit]");
    assert.equal(await page.locator("#banner").isVisible(), false);
    await send(page, "Hello with a token");
    await finished(page).waitFor();
    assert.equal(await answers(page).locator(".body").innerText(), "Mock reply: Hello with a token");

    // The token is kept for the next visit, and the conversation belongs to its user.
    await page.reload();
    await page.locator("#conversations .conv-open", { hasText: "Hello with a token" }).waitFor();
    assert.equal(await page.locator("#banner").isVisible(), false);
    const listed = await secured.api("/api/conversations", "ignored", { headers: { authorization: "Bearer tok-e2e-secret" } });
    assert.deepEqual(listed.body.conversations.map((c) => c.title), ["Hello with a token"]);
    assert.deepEqual(pageErrors.map(String), []);
  } finally {
    await context.close();
  }
});

test("on a phone-sized window everything is within reach, the conversations in a drawer", async () => {
  // Reduced motion: the drawer opens without its slide, so what is measured is where it stops.
  const context = await browser.newContext({
    viewport: { width: 390, height: 844 },
    isMobile: true,
    hasTouch: true,
    reducedMotion: "reduce",
  });
  context.setDefaultTimeout(15_000);
  await context.addInitScript((id) => localStorage.setItem("chatd.clientId", id), `e2e-phone-${process.pid}`);
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (error) => errors.push(String(error)));
  const inView = async (selector) => {
    const box = await page.locator(selector).boundingBox();
    assert.ok(box, `${selector} is shown`);
    assert.ok(box.x >= 0 && box.y >= 0 && box.x + box.width <= 390 && box.y + box.height <= 844, `${selector} at ${JSON.stringify(box)}`);
  };
  try {
    await page.goto(`${chatd.base}/`);
    for (const selector of ["#menu", "#profile", "#send", "#input"]) await inView(selector);
    assert.equal(await page.evaluate(() => document.documentElement.scrollWidth), 390, "nothing wider than the window");
    assert.ok(!(await page.locator("#new-chat").isVisible()), "the drawer starts closed");

    await send(page, "Hello from a phone");
    await finished(page).waitFor();
    assert.equal(await answers(page).locator(".body").innerText(), "Mock reply: Hello from a phone");

    await page.click("#menu");
    await inView("#new-chat");
    assert.equal(await page.getAttribute("#menu", "aria-expanded"), "true");
    await page.locator(".conv-open", { hasText: "Hello from a phone" }).waitFor();
    await page.click("#new-chat");
    assert.ok(!(await page.locator("#new-chat").isVisible()), "choosing closes the drawer");
    assert.equal(await page.locator("#title").innerText(), "New chat");

    await page.click("#menu");
    await page.locator(".conv-open", { hasText: "Hello from a phone" }).click();
    await page.locator(".msg.user", { hasText: "Hello from a phone" }).waitFor();
    assert.ok(!(await page.locator("#new-chat").isVisible()));
    await screenshot(page, "phone");
    assert.deepEqual(errors, [], "no uncaught errors in the page");
  } finally {
    await context.close();
  }
});
