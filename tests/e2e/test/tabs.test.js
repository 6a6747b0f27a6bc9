// Two tabs on one conversation (CONTRACT.md §16), in headless Chromium against a real chatd:
// the page follows GET /api/conversations/{id}/stream while a conversation is open, so a
// message sent in one tab shows in the other as it streams: the question as a user bubble,
// the answer filling in, then complete with the same text. The tabs are two browser contexts
// (storage of their own) signed in as the same user.

import { test } from "node:test";
import assert from "node:assert/strict";
import { inPage, mockWords, screenshot, withChatdAndBrowser } from "../support/harness.js";

let chatd;
let browser;
withChatdAndBrowser((started) => ({ chatd, browser } = started));

async function send(page, text) {
  await page.fill("#input", text);
  await page.press("#input", "Enter");
}

const answers = (page) => page.locator(".msg.assistant");
const finished = (page, state = "complete") => page.locator(`.msg.assistant[data-state="${state}"]`);

/** A second tab: a context of its own, as the same user, opened at `url`. */
async function secondTab(user, url) {
  const context = await browser.newContext({ viewport: { width: 1200, height: 800 } });
  context.setDefaultTimeout(15_000);
  await context.addInitScript((id) => localStorage.setItem("chatd.clientId", id), user);
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (error) => errors.push(String(error)));
  await page.goto(url);
  return { page, context, errors };
}

test("a message sent in one tab streams into another tab showing the conversation", () =>
  inPage(browser, chatd, "tabs", async ({ page, user }) => {
    await send(page, "first question");
    await finished(page).waitFor();
    const id = page.url().split("#/c/")[1];
    assert.match(id, /^[0-9a-f-]{36}$/);

    const tab2 = await secondTab(user, `${chatd.base}/#/c/${id}`);
    try {
      const other = tab2.page;
      await other.locator(".msg.user", { hasText: "first question" }).waitFor();
      await finished(other).waitFor();
      assert.equal(await answers(other).count(), 1);

      const question = "second question [mock:words=40] [mock:delay=20]";
      await send(page, question);

      // Tab 2 shows the question, and the answer while it is still being written.
      const followed = other.locator(".msg.assistant[data-trace-id]");
      await other.locator(".msg.user", { hasText: "second question" }).waitFor();
      await other.locator('.msg.assistant[data-trace-id][data-state="running"] .body').filter({ hasText: "alpha bravo" }).waitFor();
      const partial = await followed.locator(".body").innerText();
      const ownState = await answers(page).nth(1).getAttribute("data-state");
      assert.ok(partial.length < mockWords(40).length, `seen while still streaming: ${partial}`);
      assert.equal(ownState, "running", "tab 1's answer is still streaming");
      assert.equal(await other.locator(".msg.user").nth(1).innerText(), question, "the question before its answer");

      // Both end complete with the same text; each tab shows each message once.
      await finished(page).nth(1).waitFor();
      await other.locator('.msg.assistant[data-trace-id][data-state="complete"]').waitFor();
      const own = (await answers(page).nth(1).locator(".body").innerText()).trim();
      assert.equal(own, mockWords(40));
      assert.equal((await followed.locator(".body").innerText()).trim(), own);
      assert.equal(await answers(other).count(), 2);
      assert.equal(await other.locator(".msg.user").count(), 2);
      assert.equal(await answers(page).count(), 2, "tab 1 doesn't show its own run twice");
      assert.equal(await page.locator(".msg.assistant[data-trace-id]").count(), 0);
      const { body } = await chatd.api(`/api/conversations/${id}`, user);
      assert.equal(await followed.getAttribute("data-message-id"), body.messages.at(-1).id);
      await screenshot(other, "tabs-followed");

      // A tab that opens the conversation while a run of it streams shows that run whole.
      await send(page, "third question [mock:words=40] [mock:delay=60]");
      await answers(page).nth(2).locator(".body").filter({ hasText: "alpha" }).waitFor();
      const tab3 = await secondTab(user, `${chatd.base}/#/c/${id}`);
      try {
        const late = tab3.page;
        // Opened mid-run: the answer is followed live, from the run's first event.
        await late.locator('.msg.assistant[data-trace-id][data-state="running"]').waitFor();
        await late.locator('.msg.assistant[data-trace-id][data-state="complete"]').waitFor();
        assert.equal((await late.locator(".msg.assistant[data-trace-id] .body").innerText()).trim(), mockWords(40));
        assert.equal(await answers(late).count(), 3);
        assert.equal(await late.locator(".msg.user").nth(2).innerText(), "third question [mock:words=40] [mock:delay=60]");
        assert.deepEqual(tab3.errors, [], "no uncaught errors in the third tab");
      } finally {
        await tab3.context.close();
      }
      await other.locator('.msg.assistant[data-trace-id][data-state="complete"]').nth(1).waitFor();
      assert.deepEqual(tab2.errors, [], "no uncaught errors in the second tab");
    } catch (error) {
      await screenshot(tab2.page, "tabs-second-failed").catch(() => {});
      throw error;
    } finally {
      await tab2.context.close();
    }
  }));

test("a message sent in another tab while an answer streams shows as queued, then answers after it", () =>
  inPage(browser, chatd, "tabs-queued", async ({ page, user }) => {
    await send(page, "hello");
    await finished(page).waitFor();
    const id = page.url().split("#/c/")[1];
    const tab2 = await secondTab(user, `${chatd.base}/#/c/${id}`);
    try {
      const other = tab2.page;
      await finished(other).waitFor();
      await send(page, "a long one [mock:words=40] [mock:delay=40]");
      await other.locator('.msg.assistant[data-trace-id][data-state="running"] .body').filter({ hasText: "alpha" }).waitFor();

      // Tab 2 sends while tab 1's answer streams: its own answer shows as queued.
      await send(other, "and then [mock:words=3]");
      const queued = answers(other).nth(2);
      await queued.locator(".status", { hasText: "Queued" }).waitFor();
      assert.equal(await answers(page).nth(1).getAttribute("data-state"), "running", "tab 1's answer still streams");
      // Tab 1 sees that question, queued, after its own answer.
      await page.locator(".msg.user", { hasText: "and then" }).waitFor();
      await page.locator(".msg.assistant[data-trace-id] .status", { hasText: "Queued" }).waitFor();

      // Then both answers complete, in order, in both tabs.
      for (const tab of [page, other]) {
        await finished(tab).nth(2).waitFor();
        const order = await tab.locator(".msg").evaluateAll((nodes) =>
          nodes.map((n) => `${n.classList.contains("user") ? "user" : "assistant"}:${n.innerText.trim().split(/\s+/)[0]}`),
        );
        assert.deepEqual(
          order.map((o) => o.split(":")[0]),
          ["user", "assistant", "user", "assistant", "user", "assistant"],
          order.join(" "),
        );
        assert.equal((await answers(tab).nth(2).locator(".body").innerText()).trim(), mockWords(3));
        assert.equal((await answers(tab).nth(1).locator(".body").innerText()).trim(), mockWords(40));
      }
      const { body } = await chatd.api(`/api/conversations/${id}`, user);
      assert.deepEqual(
        body.messages.map((m) => m.role),
        ["user", "assistant", "user", "assistant", "user", "assistant"],
      );
      assert.equal(body.messages[4].content, "and then [mock:words=3]");
      assert.deepEqual(tab2.errors, [], "no uncaught errors in the second tab");
    } catch (error) {
      await screenshot(tab2.page, "tabs-queued-failed").catch(() => {});
      throw error;
    } finally {
      await tab2.context.close();
    }
  }));
