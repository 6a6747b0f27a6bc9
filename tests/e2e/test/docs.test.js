// The API reference at /docs in headless Chromium, with every request that does not go to
// chatd refused: it must render the whole document from this server alone, under its CSP.

import { test } from "node:test";
import assert from "node:assert/strict";
import { screenshot, withChatdAndBrowser } from "../support/harness.js";

let chatd;
let browser;
withChatdAndBrowser((started) => ({ chatd, browser } = started));

test("the API reference renders offline, from the binary, under its CSP", async () => {
  const context = await browser.newContext({ viewport: { width: 1200, height: 800 } });
  const elsewhere = [];
  await context.route("**/*", (route) => {
    if (route.request().url().startsWith(chatd.base)) return route.continue();
    elsewhere.push(route.request().url());
    return route.abort();
  });
  const page = await context.newPage();
  const problems = [];
  page.on("pageerror", (error) => problems.push(String(error)));
  page.on("console", (message) => {
    if (message.type() === "error") problems.push(message.text());
  });
  try {
    await page.goto(`${chatd.base}/docs`);
    const chat = page.locator("#op-chat_stream");
    await chat.waitFor();
    assert.match(await chat.locator("h3").innerText(), /post\s*\/api\/chat\/stream/i);
    // The body's schema is a link to its section, which lists its fields.
    await chat.locator('a[href="#schema-ChatRequest"]').first().click();
    const request = page.locator("#schema-ChatRequest");
    assert.ok(await request.isVisible());
    assert.ok((await request.locator("td code").allInnerTexts()).includes("message"));
    assert.ok((await page.locator("section.operation").count()) >= 20, "every operation is listed");
    // Descriptions' inline Markdown: a `code` span is a <code> element, never literal
    // backticks, and what it holds stays text (`data: <event>` makes no element).
    const about = page.locator("#about");
    assert.deepEqual(await about.locator("code").allInnerTexts(), ["ErrorBody", "Event"]);
    assert.ok(!(await page.locator("#reference").innerText()).includes("`"), "no backtick is left in the page");
    assert.ok((await page.locator("#reference p code, #reference td code").allInnerTexts()).includes("data: <event>"));
    assert.equal(await page.locator("#reference event").count(), 0);
    // The icon the page links, and the one browsers ask for by habit.
    assert.equal(await page.locator('link[rel="icon"]').getAttribute("href"), "/favicon.svg");
    for (const path of ["/favicon.svg", "/favicon.ico"]) {
      const icon = await page.request.get(`${chatd.base}${path}`);
      assert.equal(icon.status(), 200, path);
      assert.equal(icon.headers()["content-type"], "image/svg+xml", path);
    }
    assert.deepEqual(elsewhere, [], "nothing was asked of another host");
    assert.deepEqual(problems, [], "no errors, no CSP violations");
    await screenshot(page, "docs");
  } finally {
    await context.close();
  }
});
