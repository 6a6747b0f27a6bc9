// Views of messages. An AnswerView is one assistant answer: it applies the run's events
// (CONTRACT.md §5) to its state and renders it — a collapsible thinking section, a status
// line, the answer as Markdown with a tool card in place of each `[[tool:N]]` marker,
// suggested values as chips, suggested actions as buttons, and a mark when it was cancelled
// or failed. The same state comes from a stored message, or from a snapshot after a reload.

import { renderMarkdown } from "./markdown.js";

const MARKER = /\[\[tool:(\d+)\]\]/g;

/** Creates an element: `el("div", {class: "x"}, child, "text")`. */
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === false || value === null || value === undefined) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

const SVG = "http://www.w3.org/2000/svg";
const THUMB =
  "M2 21h3V10H2v11zm20-9.5c0-1.1-.9-2-2-2h-5.7l.9-4.3v-.3c0-.4-.2-.8-.4-1.1L13.7 3 8.6 8.2c-.4.3-.6.8-.6 1.3v9.5c0 " +
  "1.1.9 2 2 2h7.5c.8 0 1.5-.5 1.8-1.2l2.6-6.2c.1-.2.1-.5.1-.7v-1.4z";

/** A thumb drawn inline (no icon font or emoji font needed); CSS turns it down for "down". */
function thumbIcon() {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("aria-hidden", "true");
  const path = document.createElementNS(SVG, "path");
  path.setAttribute("d", THUMB);
  svg.append(path);
  return svg;
}

/**
 * A message of the user's: its attachments (CONTRACT.md §14) above its text, an image as a
 * thumbnail and any other file as a chip with its name. `imageUrl(fileId)` resolves to a URL
 * an <img> may show (the bytes come with the page's credentials: see app.js).
 */
export function userBubble(text, attachments = [], imageUrl = null) {
  const bubble = el("article", { class: "msg user" });
  if (attachments.length > 0) {
    bubble.append(el("div", { class: "attachments" }, ...attachments.map((a) => attachmentView(a, imageUrl))));
  }
  bubble.append(el("div", { class: "text" }, text));
  return bubble;
}

/** What a file is, for a tooltip: "PNG image · 64×48 · 1.2 KB". */
export function describeFile(file) {
  const kind = file.media_type.split(";")[0];
  const [type, sub] = kind.split("/");
  const name =
    type === "image" ? `${sub.toUpperCase()} image` : kind === "application/pdf" ? "PDF" : sub ? sub.toUpperCase() : kind;
  const size = file.width && file.height ? `${file.width}×${file.height}` : null;
  return [name, size, formatBytes(file.size)].filter(Boolean).join(" · ");
}

export function formatBytes(bytes) {
  if (bytes < 1024) return `${bytes} B`;
  if (bytes < 1024 * 1024) return `${(bytes / 1024).toFixed(1)} KB`;
  return `${(bytes / 1024 / 1024).toFixed(1)} MB`;
}

export const isImage = (file) => file.media_type.startsWith("image/");

/** A file's chip: its name, the kind and size in its tooltip. */
function fileChip(attachment) {
  return el(
    "span",
    { class: "attachment-file", "data-file-id": attachment.file_id, title: describeFile(attachment) },
    attachment.name,
  );
}

/** An attachment in a message: a thumbnail once its bytes are in, its name if they can't be. */
function attachmentView(attachment, imageUrl) {
  if (!isImage(attachment) || !imageUrl) return fileChip(attachment);
  const thumb = el("img", {
    class: "attachment-thumb",
    alt: attachment.name,
    title: `${attachment.name} (${describeFile(attachment)})`,
    "data-file-id": attachment.file_id,
    "data-state": "loading",
    // The box is kept while the bytes come, so the conversation doesn't jump.
    width: attachment.width,
    height: attachment.height,
  });
  imageUrl(attachment.file_id).then(
    (url) => {
      thumb.addEventListener("load", () => (thumb.dataset.state = "ready"), { once: true });
      thumb.addEventListener("error", () => (thumb.dataset.state = "broken"), { once: true });
      thumb.src = url;
    },
    () => {
      // Deleted since, or unreachable: the name stays.
      const chip = fileChip(attachment);
      chip.classList.add("missing");
      thumb.replaceWith(chip);
    },
  );
  return thumb;
}

/** A stored message's content without the mark chatd appends to cut-off answers. */
function withoutMark(content) {
  return content.replace(/\n*\[(cancelled|interrupted)\]\s*$/, "");
}

export class AnswerView {
  /**
   * @param {object} hooks what the buttons do: `suggest(value)`, `act(action)`,
   *   `feedback(view, rating)`, `trace(view)`, `decide(approvalId, approved)`; and
   *   `clientTool(event, traceId)`, which runs a tool of the page's when a run asks.
   */
  constructor(hooks, state = {}) {
    this.hooks = hooks;
    this.state = {
      text: "",
      thinking: "",
      status: "",
      tools: {},
      values: [],
      actions: [],
      end: null, // null while running; "complete", "cancelled", "error" or "interrupted"
      error: "",
      messageId: null,
      traceId: null,
      model: "",
      rating: null,
      ...state,
    };
    this.callIndex = {}; // tool_call_id → index
    this.steps = {}; // step → how much text and thinking there was when it started
    for (const tool of Object.values(this.state.tools)) this.callIndex[tool.id] = tool.index;
    this.cards = new Map(); // index → <details>, kept so an open card stays open
    this.node = el("article", { class: "msg assistant" });
    this.render();
  }

  static fromMessage(hooks, message) {
    const tools = {};
    message.tool_history.forEach((record, index) => {
      tools[index] = {
        index,
        id: record.tool_call_id,
        tool: record.tool_name,
        input: record.input,
        output: record.output,
        status: record.is_error ? "error" : "success",
        duration: record.duration_ms,
      };
    });
    const interrupted = /\[interrupted\]\s*$/.test(message.content);
    return new AnswerView(hooks, {
      text: withoutMark(message.content),
      thinking: message.thinking ?? "",
      tools,
      values: message.suggested_values,
      actions: message.suggested_actions,
      end: message.cancelled ? "cancelled" : interrupted ? "interrupted" : "complete",
      messageId: message.id,
      traceId: message.trace_id,
      model: message.model ?? "",
      rating: message.feedback?.rating ?? null,
    });
  }

  /** What a reload needs to carry on from the last event seen. */
  snapshot() {
    return this.state;
  }

  get running() {
    return this.state.end === null;
  }

  apply(event) {
    const s = this.state;
    const tool = (id) => s.tools[this.callIndex[id]];
    switch (event.type) {
      case "start":
        Object.assign(s, { messageId: event.message_id, traceId: event.trace_id, model: event.model });
        break;
      case "step_start":
        this.steps[event.step] = { text: s.text.length, thinking: s.thinking.length };
        break;
      case "step_reset": {
        // The model call failed after it began answering and is made again: what it said is void.
        const at = this.steps[event.step];
        if (at) Object.assign(s, { text: s.text.slice(0, at.text), thinking: s.thinking.slice(0, at.thinking) });
        break;
      }
      case "status":
        s.status = event.message;
        break;
      case "thinking_delta":
        s.thinking += event.text;
        break;
      case "text_delta":
        s.text += event.text;
        s.status = "";
        break;
      case "tool_input_start":
        this.callIndex[event.tool_call_id] = event.index;
        s.tools[event.index] = { index: event.index, id: event.tool_call_id, tool: event.tool, input: "", status: "running" };
        break;
      case "tool_input_delta":
        if (tool(event.tool_call_id)) tool(event.tool_call_id).input += event.delta;
        break;
      case "tool_start":
        this.callIndex[event.tool_call_id] = event.index;
        s.tools[event.index] = {
          ...s.tools[event.index],
          index: event.index,
          id: event.tool_call_id,
          tool: event.tool,
          input: event.input,
          status: "running",
        };
        break;
      case "tool_progress":
        if (tool(event.tool_call_id)) {
          Object.assign(tool(event.tool_call_id), {
            progress: event.progress ?? tool(event.tool_call_id).progress,
            note: [event.stage, event.message].filter(Boolean).join(": "),
          });
        }
        break;
      case "tool_output":
        if (tool(event.tool_call_id)) {
          Object.assign(tool(event.tool_call_id), { output: event.output, truncated: event.truncated });
        }
        break;
      case "tool_approval_request":
        // The run waits for a person: the card asks (contract §15).
        s.tools[event.index] = { ...s.tools[event.index], status: "awaiting approval", approval: event.approval_id };
        s.status = "Waiting for your approval…";
        break;
      case "tool_result_request":
        s.tools[event.index] = { ...s.tools[event.index], status: "running in this page" };
        this.hooks.clientTool?.(event, s.traceId);
        break;
      case "tool_complete":
        s.tools[event.index] = {
          ...s.tools[event.index],
          status: event.status,
          duration: event.duration_ms,
          note: "",
          approval: null,
        };
        break;
      case "complete": {
        const p = event.payload;
        Object.assign(s, { text: p.message, thinking: p.thinking ?? s.thinking, values: p.suggested_values });
        s.actions = p.suggested_actions;
        p.tool_history.forEach((record, index) => {
          s.tools[index] = {
            ...s.tools[index],
            index,
            id: record.tool_call_id,
            tool: record.tool_name,
            input: record.input,
            output: record.output,
            truncated: false,
            duration: record.duration_ms,
            status: s.tools[index]?.status ?? (record.is_error ? "error" : "success"),
          };
        });
        s.end = "complete";
        break;
      }
      case "cancelled":
        Object.assign(s, { text: event.partial_text, thinking: event.partial_thinking ?? s.thinking, end: "cancelled" });
        break;
      case "error":
        Object.assign(s, { end: "error", error: event.message });
        break;
      case "done":
        s.end ??= "complete";
        break;
    }
    if (s.end) s.status = "";
    this.scheduleRender();
  }

  /** Renders at most once a frame, however fast the deltas come. */
  scheduleRender() {
    if (this.pending) return;
    this.pending = requestAnimationFrame(() => {
      this.pending = null;
      this.render();
    });
  }

  render() {
    const s = this.state;
    this.node.dataset.state = s.end ?? "running";
    if (s.messageId) this.node.dataset.messageId = s.messageId;
    const parts = [];
    if (s.thinking) {
      const open = this.node.querySelector(".thinking")?.open ?? false;
      parts.push(
        el(
          "details",
          { class: "thinking", open },
          el("summary", {}, s.end ? "Thinking" : "Thinking…"),
          el("div", { class: "thinking-text" }, s.thinking),
        ),
      );
    }
    if (s.status) parts.push(el("div", { class: "status", role: "status" }, s.status));
    parts.push(this.body());
    if (s.end === "cancelled" || s.end === "interrupted") {
      parts.push(el("div", { class: `mark ${s.end}` }, s.end === "cancelled" ? "Cancelled" : "Interrupted"));
    }
    if (s.end === "error") parts.push(el("div", { class: "mark error" }, `Failed: ${s.error}`));
    if (s.end === "complete" && s.values.length > 0) {
      parts.push(
        el(
          "div",
          { class: "chips" },
          ...s.values.map((v) => el("button", { class: "chip", onclick: () => this.hooks.suggest(v.value) }, v.label)),
        ),
      );
    }
    if (s.end === "complete" && s.actions.length > 0) {
      parts.push(
        el(
          "div",
          { class: "actions" },
          ...s.actions.map((a) =>
            el("button", { class: `action ${a.style ?? "secondary"}`, onclick: () => this.hooks.act(a) }, a.label),
          ),
        ),
      );
    }
    if (s.end && s.end !== "error" && s.messageId) parts.push(this.footer());
    this.node.replaceChildren(...parts);
  }

  /** The answer's Markdown, a tool card at each marker, and cards of calls not yet placed. */
  body() {
    const body = el("div", { class: "body markdown" });
    const placed = new Set();
    let last = 0;
    for (const match of this.state.text.matchAll(MARKER)) {
      this.appendMarkdown(body, this.state.text.slice(last, match.index));
      const index = Number(match[1]);
      placed.add(index);
      body.append(this.card(index));
      last = match.index + match[0].length;
    }
    this.appendMarkdown(body, this.state.text.slice(last));
    for (const index of Object.keys(this.state.tools).map(Number)) {
      if (!placed.has(index)) body.append(this.card(index));
    }
    return body;
  }

  appendMarkdown(parent, text) {
    if (!text.trim()) return;
    const part = document.createElement("div");
    part.className = "md";
    part.innerHTML = renderMarkdown(text); // escaped first: see markdown.js
    parent.append(part);
  }

  /** The tool card of call `index`: collapsed by default, its state updated in place. */
  card(index) {
    const tool = this.state.tools[index] ?? { index, tool: "tool", status: "unknown" };
    let card = this.cards.get(index);
    if (!card) {
      card = el("details", { class: "tool" });
      this.cards.set(index, card);
    }
    card.dataset.index = index;
    card.dataset.status = tool.status;
    const state =
      tool.status === "running"
        ? "running…"
        : tool.duration !== undefined
          ? `${tool.status} · ${tool.duration} ms`
          : tool.status;
    const summary = el(
      "summary",
      {},
      el("span", { class: "tool-name" }, tool.tool),
      el("span", { class: "tool-state" }, state),
    );
    if (tool.status === "running" && typeof tool.progress === "number") {
      summary.append(el("progress", { class: "tool-progress", max: "1", value: String(tool.progress) }));
    }
    if (tool.note) summary.append(el("span", { class: "tool-note" }, tool.note));
    if (tool.approval && tool.status === "awaiting approval") {
      const decide = (approved) => (event) => {
        // A button in the summary would open the card too.
        event.preventDefault();
        tool.status = approved ? "approved" : "denied";
        tool.approval = null;
        this.scheduleRender();
        this.hooks.decide?.(event.currentTarget.dataset.approval, approved);
      };
      summary.append(
        el("button", { class: "approve", "data-approval": tool.approval, onclick: decide(true) }, "Approve"),
        el("button", { class: "deny", "data-approval": tool.approval, onclick: decide(false) }, "Deny"),
      );
    }
    const input = typeof tool.input === "string" ? tool.input : JSON.stringify(tool.input, null, 2);
    const details = el(
      "dl",
      {},
      el("dt", {}, "Input"),
      el("dd", {}, el("pre", { class: "tool-input" }, input ?? "")),
      el("dt", {}, "Output"),
      el("dd", {}, el("pre", { class: "tool-output" }, tool.output ?? (tool.status === "running" ? "…" : ""))),
    );
    if (tool.truncated) details.append(el("dd", { class: "note" }, "Output cut to the configured size"));
    if (tool.duration !== undefined) {
      details.append(el("dt", {}, "Duration"), el("dd", { class: "tool-duration" }, `${tool.duration} ms`));
    }
    card.replaceChildren(summary, details);
    return card;
  }

  footer() {
    const s = this.state;
    const thumb = (rating, label) =>
      el(
        "button",
        {
          class: `thumb ${rating}`,
          "aria-label": label,
          "aria-pressed": String(s.rating === rating),
          onclick: () => this.hooks.feedback(this, s.rating === rating ? null : rating),
        },
        thumbIcon(),
      );
    return el(
      "footer",
      { class: "meta" },
      el("span", { class: "model" }, s.model),
      thumb("up", "Good answer"),
      thumb("down", "Bad answer"),
      el("button", { class: "trace-button", onclick: () => this.hooks.trace(this) }, "Trace"),
    );
  }

  setRating(rating) {
    this.state.rating = rating;
    this.render();
  }
}

/** A trace (CONTRACT.md §9) as a summary, its spans and its events. */
export function traceView(trace) {
  const usage = trace.usage ? `${trace.usage.input_tokens} in / ${trace.usage.output_tokens} out` : "—";
  // What it cost (absent where its model has no price) and how much of its input the
  // provider read from its prompt cache (CONTRACT.md §18, §21).
  const cost =
    typeof trace.cost_usd === "number"
      ? `$${trace.cost_usd.toFixed(trace.cost_usd < 0.01 ? 6 : 4)}${trace.cost_estimated ? " (estimated)" : ""}`
      : "no price";
  const read = trace.usage?.cache_read_tokens ?? 0;
  const cached =
    trace.usage && trace.usage.input_tokens > 0
      ? `${Math.round((100 * read) / trace.usage.input_tokens)}% of the input (${read} tokens)`
      : "—";
  const facts = [
    ["Status", trace.status],
    ["Model", `${trace.model} (${trace.profile})`],
    ["Duration", trace.duration_ms === null || trace.duration_ms === undefined ? "—" : `${trace.duration_ms} ms`],
    ["Tokens", usage],
    ["Cost", cost],
    ["Cached", cached],
    ["Trace id", trace.trace_id],
  ];
  if (trace.error) facts.push(["Error", trace.error.message ?? JSON.stringify(trace.error)]);
  const spans = el(
    "table",
    { class: "spans" },
    el("thead", {}, el("tr", {}, ...["kind", "name", "status", "duration"].map((h) => el("th", {}, h)))),
    el(
      "tbody",
      {},
      ...(trace.spans ?? []).map((span) =>
        el(
          "tr",
          {},
          el("td", {}, span.kind),
          el("td", {}, span.name),
          el("td", {}, span.status),
          el("td", {}, span.duration_ms === null || span.duration_ms === undefined ? "—" : `${span.duration_ms} ms`),
        ),
      ),
    ),
  );
  const events = el(
    "ol",
    { class: "events" },
    ...trace.events.map((event) =>
      el(
        "li",
        {},
        el(
          "details",
          {},
          el("summary", {}, `${event.seq} · ${event.type}`),
          el("pre", {}, JSON.stringify(event.data, null, 2)),
        ),
      ),
    ),
  );
  return el(
    "div",
    { class: "trace" },
    el("dl", { class: "facts" }, ...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])),
    el("h3", {}, "Spans"),
    spans,
    el("h3", {}, `Events (${trace.events.length})`),
    events,
  );
}
