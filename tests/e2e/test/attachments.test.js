// Attachments on chatd's web page (CONTRACT.md §14) in headless Chromium against a real chatd:
// a file chosen with the paperclip, dropped on the chat or pasted is uploaded at once and
// shown as a chip; the message carries it; the user's bubble shows its thumbnail, fetched with
// the page's credentials, again after a reload. The mock model says what it was sent
// ("[1 image 64×48 png]"), so the answer shows the file reached it.

import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { resolve } from "node:path";
import { inPage, screenshot, withChatdAndBrowser } from "../support/harness.js";

const PNG = resolve(import.meta.dirname, "../../fixtures/files/small.png");
const CSV = resolve(import.meta.dirname, "../../fixtures/files/cities.csv");

let chatd;
let browser;
withChatdAndBrowser((started) => ({ chatd, browser } = started));

/** Opens the page for one test and closes its context afterwards, failing on page errors. */
const withPage = (t, name, body) => inPage(browser, chatd, name, body);

const finished = (page) => page.locator('.msg.assistant[data-state="complete"]');
const readyChip = (page) => page.locator('#attachments .attachment-chip[data-state="ready"]');

/** Waits until the image `selector` finds (the first) is decoded; its natural size. */
async function decoded(page, selector) {
  await page.waitForFunction((s) => {
    const img = document.querySelector(s);
    return img?.complete && img.naturalWidth > 0;
  }, selector);
  return page.locator(selector).first().evaluate((img) => ({ width: img.naturalWidth, height: img.naturalHeight }));
}

/** Builds the PNG in the page from its bytes and hands it over as a drop or a paste would. */
async function handOver(page, how, name) {
  const base64 = readFileSync(PNG).toString("base64");
  await page.evaluate(
    ({ how, name, base64 }) => {
      const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
      const data = new DataTransfer();
      data.items.add(new File([bytes], name, { type: "image/png" }));
      if (how === "paste") {
        document.getElementById("input").dispatchEvent(
          new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true }),
        );
      } else {
        const target = document.getElementById("messages");
        for (const type of ["dragenter", "dragover", "drop"]) {
          target.dispatchEvent(new DragEvent(type, { dataTransfer: data, bubbles: true, cancelable: true }));
        }
      }
    },
    { how, name, base64 },
  );
}

test("an image chosen with the paperclip goes with the message, and its thumbnail stays after a reload", (t) =>
  withPage(t, "attach-image", async ({ page, user }) => {
    const sent = [];
    const downloads = [];
    page.on("request", (request) => {
      if (request.url().endsWith("/api/chat/stream") && request.method() === "POST") sent.push(request.postDataJSON());
      if (/\/api\/files\/[0-9a-f-]{36}$/.test(request.url()) && request.method() === "GET") downloads.push(request.url());
    });
    assert.equal(await page.locator("#attachments").isVisible(), false, "no chips before a file is chosen");
    const attach = page.getByRole("button", { name: "Attach files" });
    assert.equal(await attach.isVisible(), true);

    await page.setInputFiles("#file-input", PNG);
    await readyChip(page).waitFor();
    const fileId = await readyChip(page).getAttribute("data-file-id");
    assert.match(fileId, /^[0-9a-f-]{36}$/);
    assert.deepEqual(await decoded(page, "#attachments .attachment-thumb"), { width: 64, height: 48 });
    assert.equal(await readyChip(page).locator(".attachment-thumb").getAttribute("alt"), "small.png");
    assert.equal(await readyChip(page).getByRole("button", { name: "Remove small.png" }).count(), 1);
    await screenshot(page, "attachment-chip");

    await page.fill("#input", "what is this");
    await page.press("#input", "Enter");
    await finished(page).waitFor();
    assert.deepEqual(sent[0].attachments, [{ file_id: fileId }]);
    assert.equal(await page.locator("#attachments .attachment-chip").count(), 0, "the chips clear on send");
    assert.equal(await page.locator("#attachments").isVisible(), false);

    // The user's bubble: the thumbnail (decoded, named), then the text.
    const bubble = page.locator(".msg.user");
    const thumb = `.msg.user .attachment-thumb[data-file-id="${fileId}"]`;
    assert.deepEqual(await decoded(page, thumb), { width: 64, height: 48 });
    assert.equal(await page.locator(thumb).getAttribute("alt"), "small.png");
    assert.equal(await bubble.locator(".text").innerText(), "what is this");
    const answer = await finished(page).locator(".body").innerText();
    assert.ok(answer.includes("[1 image 64×48 png]"), answer);
    await screenshot(page, "attachment-sent");

    // Stored with the message.
    const id = page.url().split("#/c/")[1];
    const stored = (await chatd.api(`/api/conversations/${id}`, user)).body.messages;
    assert.deepEqual(
      stored[0].attachments.map((a) => [a.file_id, a.name, a.media_type]),
      [[fileId, "small.png", "image/png"]],
    );

    // After a reload the conversation shows it again, its bytes fetched with the page's credentials.
    await page.reload();
    await finished(page).waitFor();
    assert.deepEqual(await decoded(page, thumb), { width: 64, height: 48 });
    assert.ok(downloads.some((url) => url.endsWith(`/api/files/${fileId}`)), "fetched through GET /api/files/{id}");

    // And when it is opened again from the list.
    await page.click("#new-chat");
    assert.equal(await page.locator(".msg.user").count(), 0);
    await page.locator("#conversations .conv-open", { hasText: "what is this" }).click();
    assert.deepEqual(await decoded(page, thumb), { width: 64, height: 48 });
    await screenshot(page, "attachment-reloaded");
  }));

test("a dropped or pasted image becomes a chip; × removes it; a refused file shows in the banner", (t) =>
  withPage(t, "attach-drop", async ({ page, user }) => {
    await handOver(page, "drop", "dropped.png");
    await readyChip(page).filter({ has: page.locator('img[alt="dropped.png"]') }).waitFor();
    await decoded(page, '#attachments img[alt="dropped.png"]');
    assert.equal(await page.locator("#composer").evaluate((c) => c.classList.contains("dropping")), false);

    await handOver(page, "paste", "pasted.png");
    await readyChip(page).filter({ has: page.locator('img[alt="pasted.png"]') }).waitFor();
    assert.equal(await page.inputValue("#input"), "", "a pasted file is not pasted as text");
    assert.equal(await readyChip(page).count(), 2);
    await screenshot(page, "attachment-dropped");

    // × takes a chip off and deletes the file no message carries.
    const dropped = readyChip(page).filter({ has: page.locator('img[alt="dropped.png"]') });
    const droppedId = await dropped.getAttribute("data-file-id");
    const deleting = page.waitForRequest((r) => r.method() === "DELETE" && r.url().includes("/api/files/"));
    await dropped.getByRole("button", { name: "Remove dropped.png" }).click();
    await dropped.waitFor({ state: "detached" });
    assert.equal(await readyChip(page).count(), 1);
    assert.ok((await deleting).url().endsWith(`/api/files/${droppedId}`));

    // A file chatd refuses: its message in the banner, and no chip.
    const form = new FormData();
    form.append("file", new Blob([new Uint8Array([0, 1, 2, 3, 0xff, 0xfe])]), "blob.bin");
    const refused = await fetch(`${chatd.base}/api/files`, { method: "POST", headers: { "x-client-id": user }, body: form });
    assert.equal(refused.status, 400);
    const envelope = await refused.json();
    await page.evaluate(() => {
      const data = new DataTransfer();
      data.items.add(new File([new Uint8Array([0, 1, 2, 3, 0xff, 0xfe])], "blob.bin"));
      document.getElementById("messages").dispatchEvent(new DragEvent("drop", { dataTransfer: data, bubbles: true, cancelable: true }));
    });
    await page.locator("#banner").waitFor();
    assert.equal(await page.locator("#banner-text").innerText(), envelope.message);
    assert.equal(await page.locator("#banner").getAttribute("data-code"), envelope.code);
    await page.locator('#attachments .attachment-chip[title="blob.bin"]').waitFor({ state: "detached" });
    assert.equal(await page.locator("#attachments .attachment-chip").count(), 1, "only the pasted image is left");
  }));

test("a message waits for its uploads; a profile that can't take a file refuses, and the text and files come back", (t) =>
  withPage(t, "attach-refused", async ({ page }) => {
    // Uploads held back: Send waits, and Enter leaves the text where it is.
    let release;
    const held = new Promise((resolve) => (release = resolve));
    await page.route("**/api/files", async (route) => {
      await held;
      await route.continue();
    });
    await page.setInputFiles("#file-input", [PNG, CSV]);
    await page.locator('#attachments .attachment-chip[data-state="uploading"]').nth(1).waitFor();
    assert.equal(await page.locator("#attachments .attachment-name").innerText(), "cities.csv", "a file shows its name");
    assert.equal(await page.locator("#send").isDisabled(), true);
    await page.fill("#input", "what are these");
    await page.press("#input", "Enter");
    assert.equal(await page.locator(".msg.user").count(), 0);
    assert.equal(await page.inputValue("#input"), "what are these");
    release();
    await readyChip(page).nth(1).waitFor();
    assert.equal(await page.locator("#send").isDisabled(), false);
    await page.unroute("**/api/files");

    // Profile "other" takes text only (no `modalities`): 400 on the field "attachments".
    await page.selectOption("#profile", "other");
    await page.press("#input", "Enter");
    await page.locator("#banner").waitFor();
    assert.equal(await page.locator("#banner").getAttribute("data-code"), "VALIDATION_ERROR");
    assert.equal(await page.locator(".msg.user").count(), 0, "the refused message is not shown as sent");
    assert.equal(await page.inputValue("#input"), "what are these", "the text is back");
    assert.equal(await readyChip(page).count(), 2, "the files are back");

    await page.selectOption("#profile", "");
    await page.press("#input", "Enter");
    await finished(page).waitFor();
    assert.equal(await page.locator("#banner").isVisible(), false);
    const bubble = page.locator(".msg.user");
    await decoded(page, ".msg.user .attachment-thumb");
    assert.equal(await bubble.locator(".attachment-file").innerText(), "cities.csv");
    assert.match(await bubble.locator(".attachment-file").getAttribute("title"), /CSV/);
    const answer = await finished(page).locator(".body").innerText();
    assert.ok(answer.includes("1 image 64×48 png"), answer);
    await screenshot(page, "attachment-file-chip");
  }));
