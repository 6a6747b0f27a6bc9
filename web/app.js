// The page: conversations in the sidebar, the chat beside them. A message goes out as
// POST /api/chat/stream (or /api/ab/stream in A/B mode) and its events render as they come;
// Stop is POST /api/cancel_stream. While a run streams, its trace id, last event seq and the
// answer so far are kept in sessionStorage, so a reload picks the run up again with
// GET /api/chat/stream/{trace_id} and Last-Event-ID. Errors show in the banner with the
// contract's messages (the JSON envelope's `message`, or an `error` event's). Files chosen,
// dropped or pasted are uploaded at once (POST /api/files) and go with the next message as
// its attachments. While a conversation is open, GET /api/conversations/{id}/stream is
// followed too: runs of it that another tab or client started show as they stream.

import { api, ApiError, credentials } from "./api.js";
import { AnswerView, describeFile, el, traceView, userBubble } from "./render.js";

const $ = (id) => document.getElementById(id);
const RUN_KEY = "chatd.run";
/** The profile last chosen, kept across reloads while the server still lists it. */
const PROFILE_KEY = "chatd.profile";

const page = {
  conversationId: null,
  /**
   * The run being shown: {controller, view?, traceId?, cancel?, seq, traces, expected}:
   * `traces` its trace ids known so far, `expected` how many starts are still to come.
   */
  run: null,
  /** Trace ids of the runs this tab shows from its own streams: the conversation's stream skips them. */
  mine: new Set(),
  /** The conversation's stream followed: {id, controller, runs, held}. */
  watch: null,
  leaving: false,
};

const hooks = {
  suggest: (value) => send(value, { interaction_type: "value_selected" }),
  act: runAction,
  feedback: rate,
  trace: showTrace,
  decide: (approvalId, approved) => api.decide(approvalId, approved).catch(ignoreSettled),
  clientTool: runPageTool,
};

// ---- the page's own tools (client tools, contract §15) ---------------------------------

/** Tools this page runs itself: offered to the model with every message. */
const PAGE_TOOLS = {
  get_time_zone: {
    description: "The user's time zone and UTC offset, as their browser knows them",
    parameters: { type: "object", properties: {} },
    run: () => ({
      time_zone: Intl.DateTimeFormat().resolvedOptions().timeZone,
      utc_offset_minutes: -new Date().getTimezoneOffset(),
    }),
  },
};

const pageToolSpecs = () =>
  Object.entries(PAGE_TOOLS).map(([name, t]) => ({ name, description: t.description, parameters: t.parameters }));

/** Runs a page tool a run asks for and sends its result back. */
async function runPageTool(event, traceId) {
  const tool = PAGE_TOOLS[event.tool];
  let result;
  try {
    if (!tool) throw new Error(`This page has no tool named ${event.tool}`);
    result = { tool_call_id: event.tool_call_id, output: tool.run(event.input) };
  } catch (error) {
    result = { tool_call_id: event.tool_call_id, output: error.message, is_error: true };
  }
  await api.toolResult(traceId, result).catch(ignoreSettled);
}

/** A decision or a result that was taken already (a replayed request after a reload) is fine. */
function ignoreSettled(error) {
  if (error.code !== "CONFLICT") showError(error);
}

// ---- errors ----------------------------------------------------------------------------

function showError(error) {
  $("banner-text").textContent = error.message || "Something went wrong";
  $("banner").dataset.code = error.code ?? "";
  $("banner").hidden = false;
  // chatd refused our credentials (an `error` event with this code is the model's key instead).
  if (error.status === 401) $("settings").open = true;
}

function clearError() {
  $("banner").hidden = true;
}

// ---- attachments (contract §14) --------------------------------------------------------

/**
 * The files the next message carries, in the order they came: `{file, controller, upload,
 * stored, chip}`; `stored` is the server's record once the upload is in.
 */
const pending = [];

/**
 * A URL an <img> may show for a Blob. A data: URL: the page's Content-Security-Policy
 * (img-src 'self' data:) takes no blob: URLs.
 */
function imageData(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

/** Stored images shown, by file id: each is fetched once (with the page's credentials). */
const images = new Map();
const IMAGES_KEPT = 200;

function imageUrl(fileId) {
  let url = images.get(fileId);
  if (!url) {
    url = api.file(fileId).then(imageData);
    url.catch(() => images.delete(fileId));
    remember(fileId, url);
  }
  return url;
}

function remember(fileId, url) {
  images.set(fileId, url);
  if (images.size > IMAGES_KEPT) images.delete(images.keys().next().value);
}

/** A file without a name (as some pastes come) gets one by its kind. */
function fileName(file) {
  if (file.name) return file.name;
  const ext = file.type.split("/")[1]?.split(/[+;]/)[0] || "bin";
  return `pasted.${ext}`;
}

const uploading = () => pending.some((item) => !item.stored);

/** Send waits for the uploads: a message goes with all its files or not yet. */
function updateSend() {
  $("send").disabled = Boolean(page.run) || uploading();
  if (uploading()) $("send").title = "Waiting for the files to upload";
  else $("send").removeAttribute("title");
}

/** Uploads each file at once; a chip shows it meanwhile, and is dropped if it is refused. */
function attach(files) {
  for (const file of files) {
    const item = { file, name: fileName(file), controller: new AbortController(), stored: null };
    item.chip = attachmentChip(item);
    pending.push(item);
    $("attachments").append(item.chip);
    item.upload = api.upload(file, item.name, item.controller.signal).then(
      (stored) => {
        item.stored = stored;
        item.chip.dataset.state = "ready";
        item.chip.dataset.fileId = stored.id;
        item.chip.removeAttribute("aria-busy");
        item.chip.title = `${stored.name} (${describeFile(stored)})`;
      },
      (error) => {
        if (item.controller.signal.aborted) return;
        showError(error);
        drop(item);
      },
    );
    item.upload.finally(updateSend);
  }
  showAttachments();
  updateSend();
}

/** A pending file's chip: a thumbnail of an image (read from the local file), else its name. */
function attachmentChip(item) {
  const image = item.file.type.startsWith("image/");
  const preview = image
    ? el("img", { class: "attachment-thumb", alt: item.name })
    : el("span", { class: "attachment-name" }, item.name);
  if (image) imageData(item.file).then((url) => (preview.src = url), () => {});
  return el(
    "li",
    { class: "attachment-chip", "data-state": "uploading", "aria-busy": "true", title: item.name },
    preview,
    el(
      "button",
      {
        class: "attachment-remove",
        type: "button",
        "aria-label": `Remove ${item.name}`,
        onclick: () => {
          discard(item);
          $("input").focus();
        },
      },
      "×",
    ),
  );
}

function drop(item) {
  const index = pending.indexOf(item);
  if (index >= 0) pending.splice(index, 1);
  item.chip.remove();
  showAttachments();
  updateSend();
}

/** The × of a chip: stops its upload, or deletes the stored file no message carries yet. */
function discard(item) {
  if (item.stored) api.deleteFile(item.stored.id).catch(() => {});
  else item.controller.abort();
  drop(item);
}

function showAttachments() {
  $("attachments").hidden = pending.length === 0;
}

/** Takes the uploaded files off the composer for a message; their images are known already. */
function takeAttachments() {
  const taken = pending.splice(0);
  $("attachments").replaceChildren();
  showAttachments();
  for (const item of taken) {
    const preview = item.chip.querySelector("img.attachment-thumb");
    if (preview?.src) remember(item.stored.id, Promise.resolve(preview.src));
  }
  return taken;
}

/** A message refused before its stream opened gives its files back to the composer. */
function giveBack(taken) {
  pending.unshift(...taken);
  $("attachments").prepend(...taken.map((item) => item.chip));
  showAttachments();
  updateSend();
}

/** A stored file as a message carries it. */
const asAttachment = (stored) => ({
  file_id: stored.id,
  name: stored.name,
  media_type: stored.media_type,
  size: stored.size,
  sha256: stored.sha256,
  width: stored.width,
  height: stored.height,
});

/** Files dragged over the chat (or the composer) and dropped are attached. */
function wireDrop() {
  const carriesFiles = (event) => event.dataTransfer?.types.includes("Files");
  const area = document.querySelector("main");
  let depth = 0; // dragenter/dragleave come for each child crossed
  const dropping = (on) => $("composer").classList.toggle("dropping", on);
  area.addEventListener("dragenter", (event) => {
    if (!carriesFiles(event)) return;
    event.preventDefault();
    depth += 1;
    dropping(true);
  });
  area.addEventListener("dragover", (event) => {
    if (!carriesFiles(event)) return;
    event.preventDefault();
    event.dataTransfer.dropEffect = "copy";
  });
  area.addEventListener("dragleave", (event) => {
    if (!carriesFiles(event)) return;
    depth = Math.max(0, depth - 1);
    if (depth === 0) dropping(false);
  });
  area.addEventListener("drop", (event) => {
    if (!carriesFiles(event)) return;
    event.preventDefault();
    depth = 0;
    dropping(false);
    attach([...event.dataTransfer.files]);
    $("input").focus();
  });
  // A file dropped anywhere else must not replace the page with itself.
  for (const type of ["dragover", "drop"]) {
    window.addEventListener(type, (event) => {
      if (carriesFiles(event)) event.preventDefault();
    });
  }
}

// ---- conversations ---------------------------------------------------------------------

async function loadConversations() {
  try {
    const { conversations } = await api.conversations();
    $("conversations").replaceChildren(...conversations.map(conversationItem));
    const current = conversations.find((c) => c.id === page.conversationId);
    if (current) $("title").textContent = current.title;
  } catch (error) {
    showError(error);
  }
}

function conversationItem(conversation) {
  const item = el(
    "li",
    { class: "conv", "data-id": conversation.id, "aria-current": conversation.id === page.conversationId && "page" },
    el("button", { class: "conv-open", onclick: () => openConversation(conversation.id) }, conversation.title),
  );
  item.append(
    el("button", { class: "conv-rename", title: "Rename", "aria-label": "Rename", onclick: () => rename(item, conversation) }, "✎"),
    el("button", { class: "conv-delete", title: "Delete", "aria-label": "Delete", onclick: () => remove(conversation) }, "✕"),
  );
  return item;
}

function rename(item, conversation) {
  const input = el("input", { class: "conv-title", value: conversation.title, "aria-label": "New title" });
  let finished = false;
  const finish = async (save) => {
    if (finished) return;
    finished = true;
    const title = input.value.trim();
    if (save && title && title !== conversation.title) {
      try {
        await api.rename(conversation.id, title);
        if (conversation.id === page.conversationId) $("title").textContent = title;
      } catch (error) {
        showError(error);
      }
    }
    await loadConversations();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  item.querySelector(".conv-open").replaceWith(input);
  input.focus();
  input.select();
}

async function remove(conversation) {
  if (!confirm(`Delete "${conversation.title}" and all its messages?`)) return;
  try {
    await api.remove(conversation.id);
  } catch (error) {
    return showError(error);
  }
  if (conversation.id === page.conversationId) newChat();
  await loadConversations();
}

function setConversation(id, title) {
  page.conversationId = id;
  watch(id);
  history.replaceState(null, "", id ? `#/c/${id}` : location.pathname);
  if (title !== undefined) $("title").textContent = title;
  for (const item of document.querySelectorAll(".conv")) {
    if (item.dataset.id === id) item.setAttribute("aria-current", "page");
    else item.removeAttribute("aria-current");
  }
}

/** Opens or closes the sidebar where it is a drawer (a narrow window); elsewhere a no-op. */
function drawer(open) {
  document.body.classList.toggle("drawer-open", open);
  $("scrim").hidden = !open;
  $("menu").setAttribute("aria-expanded", String(open));
}

function newChat() {
  detach();
  watch(null);
  setConversation(null, "New chat");
  $("messages").replaceChildren(el("p", { class: "empty" }, "Ask anything. Answers stream in as they are written."));
  $("input").focus();
}

async function openConversation(id) {
  detach();
  watch(null); // opened afresh below: the messages are drawn anew
  let conversation;
  try {
    conversation = await api.conversation(id);
  } catch (error) {
    showError(error);
    return false;
  }
  setConversation(id, conversation.title);
  const nodes = conversation.messages.map((message) =>
    message.role === "user"
      ? storedUserBubble(message)
      : message.role === "assistant"
        ? AnswerView.fromMessage(hooks, message).node
        : null,
  );
  $("messages").replaceChildren(...nodes.filter(Boolean));
  // Runs going as it loaded: the stream gives them whole, unless one ends before it opens.
  if (page.watch?.id === id) page.watch.going = conversation.active_runs ?? [];
  scrollDown();
  return true;
}

function storedUserBubble(message) {
  const bubble = userBubble(message.content, message.attachments ?? [], imageUrl);
  if (message.id) bubble.dataset.messageId = message.id;
  return bubble;
}

function addNode(node) {
  $("messages").querySelector(".empty")?.remove();
  $("messages").append(node);
  scrollDown();
}

function scrollDown() {
  const messages = $("messages");
  messages.scrollTop = messages.scrollHeight;
}

// ---- runs ------------------------------------------------------------------------------

function setBusy(busy) {
  updateSend();
  $("stop").hidden = !busy;
  $("stop").disabled = !page.run?.cancel;
}

/** Stops showing the current run (it goes on server-side, and stays in the conversation). */
function detach() {
  if (!page.run) return;
  page.run.controller.abort();
  // Not shown by this tab any more: the conversation's stream may show it when it is opened again.
  for (const traceId of page.run.traces ?? []) page.mine.delete(traceId);
  page.run = null;
  sessionStorage.removeItem(RUN_KEY);
  setBusy(false);
  release(page.watch);
}

/** A run of this tab's own started: its events come on its own stream. */
function ownStart(run, traceId) {
  if (run.traces.has(traceId)) return;
  run.traces.add(traceId);
  page.mine.add(traceId);
  run.expected = Math.max(0, run.expected - 1);
  release(page.watch);
}

/** Keeps what a reload needs: at most every 200 ms, and always when the page goes. */
function saveRun(force = false) {
  const run = page.run;
  if (!run?.view || !run.traceId || (!force && Date.now() - (run.savedAt ?? 0) < 200)) return;
  run.savedAt = Date.now();
  const saved = {
    trace_id: run.traceId,
    conversation_id: page.conversationId,
    message_id: run.view.state.messageId,
    seq: run.seq,
    state: run.view.snapshot(),
  };
  sessionStorage.setItem(RUN_KEY, JSON.stringify(saved));
}

/** Sends a message; `files` are taken composer files (uploaded), its attachments. */
async function send(text, extra = {}, files = []) {
  const message = text.trim();
  if (!message || page.run) return;
  clearError();
  const body = { message, client_tools: pageToolSpecs(), ...extra };
  if (files.length > 0) body.attachments = files.map((item) => ({ file_id: item.stored.id }));
  if (page.conversationId) body.conversation_id = page.conversationId;
  const bubble = userBubble(message, files.map((item) => asAttachment(item.stored)), imageUrl);
  addNode(bubble);
  const refusal = { bubble, message, files };
  if ($("ab-mode").checked) {
    await compare({ ...body, profile_a: $("profile-a").value, profile_b: $("profile-b").value }, refusal);
  } else {
    if ($("profile").value) body.profile = $("profile").value;
    await chat(body, refusal);
  }
}

async function chat(body, refusal) {
  const view = new AnswerView(hooks);
  addNode(view.node);
  const run = { controller: new AbortController(), view, seq: 0, traces: new Set(), expected: 1 };
  await stream(run, api.stream("/api/chat/stream", body, run.controller.signal), refusal);
}

/** Undoes a send that was refused before its stream opened: nothing was stored. */
function giveBackMessage(refusal) {
  refusal.bubble.remove();
  $("input").value = refusal.message;
  giveBack(refusal.files);
}

/** Shows a run's events in `run.view` until `done`; `refusal` undoes the send if it is refused. */
async function stream(run, events, refusal) {
  page.run = run;
  setBusy(true);
  const apply = (event) => {
    if (event.type === "start") {
      Object.assign(run, { traceId: event.trace_id, cancel: { trace_id: event.trace_id } });
      ownStart(run, event.trace_id);
      const isNew = page.conversationId !== event.conversation_id;
      setConversation(event.conversation_id);
      if (isNew) loadConversations();
      setBusy(true);
    }
    if (event.type === "error") showError(event);
    run.view.apply(event);
    saveRun();
    scrollDown();
  };
  try {
    await follow(run, events, apply);
  } catch (error) {
    if (refusal && !run.traceId) {
      // Refused before the stream opened: nothing was stored; give the text and files back.
      giveBackMessage(refusal);
      run.view.node.remove();
      // A profile the server no longer has (it was configured otherwise since the list was
      // read): read the list again, so the choice shown is one that exists.
      if (error.field?.startsWith("profile")) loadProfiles();
    } else {
      run.view.apply({ type: "error", message: error.message });
    }
    showError(error);
  } finally {
    finish(run);
  }
}

/** Feeds `events` to `apply` until `done`; when the connection drops, resumes by trace id. */
async function follow(run, events, apply) {
  for (let resumes = 0; ; resumes += 1) {
    try {
      for await (const event of events) {
        run.seq = event.seq;
        apply(event);
        if (event.type === "done") return;
      }
    } catch (error) {
      if (run.controller.signal.aborted) return;
      if (!(error instanceof ApiError && error.status === 0 && run.traceId)) throw error;
    }
    if (run.controller.signal.aborted) return;
    if (!run.traceId || resumes >= 3) throw new ApiError(0, "NETWORK_ERROR", "Connection failed");
    await new Promise((resolve) => setTimeout(resolve, 250 * 2 ** resumes));
    events = api.resume(run.traceId, run.seq, run.controller.signal);
  }
}

function finish(run) {
  if (page.run !== run || page.leaving) return;
  page.run = null;
  sessionStorage.removeItem(RUN_KEY);
  setBusy(false);
  release(page.watch);
  loadConversations();
}

async function stop() {
  const target = page.run?.cancel;
  if (!target) return;
  $("stop").disabled = true;
  try {
    await api.cancel(target);
  } catch (error) {
    // The run ended while the cancel was on its way: its own events say how.
    if (error.code !== "CONFLICT") showError(error);
  }
}

/** After a reload: shows the conversation, then follows the saved run (see `start`) from its last event. */
async function resumeSaved(saved) {
  if (!saved) return false;
  page.mine.add(saved.trace_id); // before the conversation's stream opens
  if (!(await openConversation(saved.conversation_id))) return true;
  if (document.querySelector(`.msg[data-message-id="${saved.message_id}"]`)) return true; // stored since
  const view = new AnswerView(hooks, saved.state);
  addNode(view.node);
  const run = { controller: new AbortController(), view, seq: saved.seq, traceId: saved.trace_id };
  Object.assign(run, { traces: new Set([saved.trace_id]), expected: 0 });
  run.cancel = { trace_id: saved.trace_id };
  await stream(run, api.resume(saved.trace_id, saved.seq, run.controller.signal));
  return true;
}

// ---- the conversation's stream: runs other tabs started -----------------------------------

/** Buttons of an answer another tab asked for: its page tools run there, not here. */
const followHooks = { ...hooks, clientTool: null };

/** Follows the conversation `id`'s stream (null: none); the one followed before is closed. */
function watch(id) {
  if (page.watch && page.watch.id === id) return;
  page.watch?.controller.abort();
  page.watch = null;
  if (!id) return;
  // runs: trace id → {view, seq} (view null: this tab's own run); held: events of runs that
  // started while this tab's own start was still to come (they may be its own).
  const w = { id, controller: new AbortController(), runs: new Map(), held: new Map() };
  page.watch = w;
  keepWatching(w);
}

/** Reads the stream; when the connection drops, opens it again (runs going replay from their start). */
async function keepWatching(w) {
  const { signal } = w.controller;
  for (let failures = 0; !signal.aborted; ) {
    try {
      for await (const event of api.watch(w.id, signal, () => catchUp(w))) {
        failures = 0;
        watched(w, event);
      }
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof ApiError && error.status !== 0) return; // gone (404), or not allowed
    }
    if (signal.aborted) return;
    failures += 1;
    await new Promise((resolve) => setTimeout(resolve, Math.min(30_000, 500 * 2 ** failures)));
  }
}

/**
 * Once the stream is open: a run that was going when the conversation loaded and ended before
 * the stream opened is not in it, so its stored answer is shown instead.
 */
async function catchUp(w) {
  const going = (w.going ?? []).filter((run) => !page.mine.has(run.trace_id));
  w.going = [];
  if (going.length === 0) return;
  let conversation;
  try {
    conversation = await api.conversation(w.id);
  } catch {
    return;
  }
  const still = new Set((conversation.active_runs ?? []).map((run) => run.trace_id));
  for (const run of going) {
    if (page.watch !== w || still.has(run.trace_id) || w.runs.has(run.trace_id) || w.held.has(run.trace_id)) continue;
    if ($("messages").querySelector(`.msg.assistant[data-message-id="${run.message_id}"]`)) continue;
    const index = conversation.messages.findIndex((m) => m.id === run.message_id);
    if (index < 0) continue;
    const node = AnswerView.fromMessage(hooks, conversation.messages[index]).node;
    const asked = conversation.messages[index - 1];
    const question = asked && $("messages").querySelector(`.msg.user[data-message-id="${asked.id}"]`);
    if (question) question.after(node);
    else addNode(node);
  }
}

/** One event of the conversation's stream: shown when its run is another tab's. */
function watched(w, event) {
  const traceId = event.trace_id;
  if (!traceId || page.watch !== w) return;
  const held = w.held.get(traceId);
  if (held) return void held.push(event);
  let entry = w.runs.get(traceId);
  if (!entry) {
    if (event.type !== "start") return; // its start was missed: not shown
    if (page.mine.has(traceId)) return void w.runs.set(traceId, { view: null });
    if (page.run?.expected > 0) return void w.held.set(traceId, [event]);
    entry = followRun(w, event);
  }
  if (!entry.view || event.seq <= entry.seq) return; // this tab's own, or seen before a reconnect
  entry.seq = event.seq;
  entry.view.apply(event);
  if (event.type === "done") loadConversations();
  scrollDown();
}

/** Once this tab's own starts are known (or its run ended), the events held back are shown. */
function release(w) {
  if (!w || w.held.size === 0 || page.run?.expected > 0) return;
  const held = [...w.held.values()];
  w.held.clear();
  for (const events of held) for (const event of events) watched(w, event);
}

/** A run another tab started: an answer that fills in as it streams, after its question. */
function followRun(w, event) {
  const view = new AnswerView(followHooks);
  view.node.dataset.traceId = event.trace_id;
  if (event.message_id) view.node.dataset.messageId = event.message_id;
  // Opened while it ran: a stored copy of the answer (if any) gives way to the live one.
  const stored = event.message_id && $("messages").querySelector(`.msg.assistant[data-message-id="${event.message_id}"]`);
  // Right after its question where that shows: a message queued behind this run follows it.
  const question =
    event.user_message_id && $("messages").querySelector(`.msg.user[data-message-id="${event.user_message_id}"]`);
  if (stored) stored.replaceWith(view.node);
  else if (question) question.after(view.node);
  else addNode(view.node);
  const entry = { view, seq: -Infinity };
  w.runs.set(event.trace_id, entry);
  showQuestion(w, event, view);
  return entry;
}

/** The question of a run another tab started: the start doesn't carry it, the conversation does. */
async function showQuestion(w, event, view) {
  const shown = () =>
    !event.user_message_id || document.querySelector(`.msg.user[data-message-id="${event.user_message_id}"]`);
  if (shown()) return;
  let conversation;
  try {
    conversation = await api.conversation(w.id);
  } catch {
    return; // the answer shows without it
  }
  if (page.watch !== w || !view.node.isConnected || shown()) return;
  const message = conversation.messages.find((m) => m.id === event.user_message_id);
  if (message) view.node.before(storedUserBubble(message));
  $("title").textContent = conversation.title;
  scrollDown();
}

// ---- A/B -------------------------------------------------------------------------------

async function compare(body, refusal) {
  const views = { a: new AnswerView(hooks), b: new AnswerView(hooks) };
  const heads = { a: el("h3", {}, "A"), b: el("h3", {}, "B") };
  const votes = el("div", { class: "votes", hidden: true });
  addNode(
    el(
      "section",
      { class: "comparison" },
      el("div", { class: "ab" }, ...["a", "b"].map((side) => el("div", { class: `side side-${side}` }, heads[side], views[side].node))),
      votes,
    ),
  );
  const run = { controller: new AbortController(), seq: 0, traces: new Set(), expected: 2 };
  page.run = run;
  setBusy(true);
  try {
    await follow(run, api.stream("/api/ab/stream", body, run.controller.signal), (event) => {
      if (event.type === "comparison") {
        run.cancel = { comparison_id: event.comparison_id };
        run.comparisonId = event.comparison_id;
        heads.a.textContent = `A · ${event.a.model}`;
        heads.b.textContent = `B · ${event.b.model}`;
        setBusy(true);
      } else if (event.variant) {
        if (event.type === "start") ownStart(run, event.trace_id);
        if (event.type === "start" && page.conversationId !== event.conversation_id) {
          setConversation(event.conversation_id);
        }
        if (event.type === "error") showError(event);
        views[event.variant].apply(event);
      } else if (event.type === "done") {
        voteButtons(votes, run.comparisonId);
      }
      scrollDown();
    });
  } catch (error) {
    if (!run.comparisonId) {
      giveBackMessage(refusal);
      votes.parentElement.remove();
    }
    showError(error);
  } finally {
    finish(run);
  }
}

function voteButtons(votes, comparisonId) {
  const choices = [
    ["a", "A is better"],
    ["b", "B is better"],
    ["tie", "Tie"],
    ["both_bad", "Both bad"],
  ];
  const result = el("span", { class: "vote-result", role: "status" });
  const buttons = choices.map(([preference, label], chosen) =>
    el(
      "button",
      {
        class: "vote",
        "data-preference": preference,
        onclick: async () => {
          try {
            await api.vote(comparisonId, preference);
          } catch (error) {
            return showError(error);
          }
          buttons.forEach((button, i) => {
            button.disabled = true;
            button.setAttribute("aria-pressed", String(i === chosen));
          });
          result.textContent = `Vote recorded: ${label}`;
        },
      },
      label,
    ),
  );
  votes.replaceChildren(el("span", {}, "Which answer is better?"), ...buttons, result);
  votes.hidden = false;
}

// ---- message buttons -------------------------------------------------------------------

function runAction(action) {
  if (action.handler === "server") {
    send(action.label, { interaction_type: "action_executed", action: { action: action.action, data: action.data } });
  } else {
    // Client actions belong to the app embedding chatd: it listens for this event.
    window.dispatchEvent(new CustomEvent("chatd:action", { detail: action }));
  }
}

async function rate(view, rating) {
  try {
    const result = await api.feedback(view.state.messageId, rating);
    view.setRating(result.feedback?.rating ?? null);
  } catch (error) {
    showError(error);
  }
}

async function showTrace(view) {
  try {
    const trace = await api.traceByMessage(view.state.messageId);
    $("trace-body").replaceChildren(traceView(trace));
    $("trace-dialog").showModal();
  } catch (error) {
    showError(error);
  }
}

// ---- start -----------------------------------------------------------------------------

/**
 * Fills the profile lists from GET /api/profiles, each profile once. The first choice of
 * #profile sends no profile (the conversation's own, else the server's default) and is
 * labelled with the server's default profile, which is therefore not listed again. A profile
 * chosen before is chosen again if the server still has it, else forgotten (the browser's own
 * restoring of the list is off: it would bring back one the server no longer has).
 */
async function loadProfiles() {
  let listed;
  try {
    listed = await api.profiles();
  } catch (error) {
    return showError(error);
  }
  const { profiles, default_profile: fallback } = listed;
  const label = (p) => `${p.id} (${p.model})`;
  const first = profiles.find((p) => p.id === fallback);
  const others = profiles.filter((p) => p !== first);
  $("profile").replaceChildren(
    el("option", { value: "" }, first ? label(first) : "default"),
    ...others.map((p) => el("option", { value: p.id }, label(p))),
  );
  const remembered = localStorage.getItem(PROFILE_KEY);
  if (remembered && others.some((p) => p.id === remembered)) $("profile").value = remembered;
  else localStorage.removeItem(PROFILE_KEY);
  const options = () => profiles.map((p) => el("option", { value: p.id }, label(p)));
  $("profile-a").replaceChildren(...options());
  $("profile-b").replaceChildren(...options());
  if (profiles.length > 1) $("profile-b").selectedIndex = 1;
}

function wire() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("input").value;
    // Kept in the composer until it can go: while a run streams, or a file still uploads.
    if (!text.trim() || page.run || uploading()) return;
    $("input").value = "";
    send(text, {}, takeAttachments());
  });
  $("attach").addEventListener("click", () => $("file-input").click());
  $("file-input").addEventListener("change", () => {
    attach([...$("file-input").files]);
    $("file-input").value = ""; // the same file can be chosen again
    $("input").focus();
  });
  $("input").addEventListener("paste", (event) => {
    const files = [...(event.clipboardData?.files ?? [])];
    if (files.length === 0) return; // text pastes as text
    event.preventDefault();
    attach(files);
  });
  wireDrop();
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    drawer(false);
    newChat();
  });
  $("menu").addEventListener("click", () => drawer(!document.body.classList.contains("drawer-open")));
  $("scrim").addEventListener("click", () => drawer(false));
  $("conversations").addEventListener("click", (event) => {
    if (event.target.closest(".conv-open")) drawer(false);
  });
  $("banner-close").addEventListener("click", clearError);
  $("trace-close").addEventListener("click", () => $("trace-dialog").close());
  $("profile").addEventListener("change", () => {
    if ($("profile").value) localStorage.setItem(PROFILE_KEY, $("profile").value);
    else localStorage.removeItem(PROFILE_KEY);
  });
  $("ab-mode").addEventListener("change", () => {
    $("ab-profiles").hidden = !$("ab-mode").checked;
  });
  $("token").value = credentials.token;
  $("client-id").value = credentials.clientId;
  $("settings-form").addEventListener("submit", (event) => {
    event.preventDefault();
    credentials.save($("token").value, $("client-id").value);
    $("settings").open = false;
    clearError();
    newChat();
    loadProfiles();
    loadConversations();
  });
  window.addEventListener("pagehide", () => {
    saveRun(true);
    page.leaving = true;
    watch(null);
  });
  window.addEventListener("pageshow", (event) => {
    page.leaving = false; // back from the back/forward cache
    if (event.persisted) {
      watch(page.conversationId);
      loadProfiles(); // the server may have been configured otherwise meanwhile
    }
  });
}

async function start() {
  // What the page was opened with, read before anything waits: a message sent while the
  // lists load saves its own run and puts its own conversation in the address.
  const saved = JSON.parse(sessionStorage.getItem(RUN_KEY) ?? "null");
  sessionStorage.removeItem(RUN_KEY);
  const id = location.hash.match(/^#\/c\/([0-9a-f-]{36})$/)?.[1];
  wire();
  await Promise.all([loadProfiles(), loadConversations()]);
  // Unless a message was sent meanwhile: its conversation is what the page shows.
  if (!page.conversationId && !page.run && !(await resumeSaved(saved)) && id) await openConversation(id);
  document.body.dataset.started = "true";
}

start();
