// chatd's HTTP API as the page uses it: JSON calls that turn refusals into ApiErrors carrying
// the contract's envelope ({code, message, field}), file uploads and downloads (the page's
// credentials are headers, so a file's bytes are fetched here, never by an <img src>), and
// SSE streams read with fetch (an EventSource cannot POST or send Authorization) through a
// small parser.

const TOKEN_KEY = "chatd.token";
const CLIENT_KEY = "chatd.clientId";

/** Credentials the user pasted: a bearer token (auth modes token and jwt) or a client id (mode none). */
export const credentials = {
  get token() {
    return localStorage.getItem(TOKEN_KEY) ?? "";
  },
  get clientId() {
    return localStorage.getItem(CLIENT_KEY) ?? "";
  },
  save(token, clientId) {
    for (const [key, value] of [[TOKEN_KEY, token], [CLIENT_KEY, clientId]]) {
      if (value.trim()) localStorage.setItem(key, value.trim());
      else localStorage.removeItem(key);
    }
  },
};

/** A refusal: the contract's code and message, the field at fault, the HTTP status (0: no answer). */
export class ApiError extends Error {
  constructor(status, code, message, field) {
    super(message);
    this.status = status;
    this.code = code;
    this.field = field;
  }
}

function headers(extra = {}) {
  const all = { ...extra };
  if (credentials.token) all.authorization = `Bearer ${credentials.token}`;
  if (credentials.clientId) all["x-client-id"] = credentials.clientId;
  return all;
}

/**
 * Sends a request; resolves to the Response when it is 2xx, else throws an ApiError. A body
 * goes as JSON, or a FormData as multipart (the browser writes its content-type and boundary).
 */
async function send(method, path, body, extra = {}, signal) {
  const form = body instanceof FormData;
  let response;
  try {
    response = await fetch(path, {
      method,
      headers: headers(body === undefined || form ? extra : { ...extra, "content-type": "application/json" }),
      body: body === undefined || form ? body : JSON.stringify(body),
      signal,
    });
  } catch (error) {
    if (signal?.aborted) throw error;
    throw new ApiError(0, "NETWORK_ERROR", "Connection failed");
  }
  if (!response.ok) {
    const envelope = await response.json().catch(() => ({}));
    throw new ApiError(
      response.status,
      envelope.code ?? "INTERNAL",
      envelope.message ?? `${response.status} ${response.statusText}`,
      envelope.field,
    );
  }
  return response;
}

async function json(method, path, body) {
  const response = await send(method, path, body);
  return response.status === 204 ? null : response.json();
}

export const api = {
  profiles: () => json("GET", "/api/profiles"),
  conversations: (limit = 50) => json("GET", `/api/conversations?limit=${limit}`),
  conversation: (id) => json("GET", `/api/conversations/${id}`),
  rename: (id, title) => json("PATCH", `/api/conversations/${id}`, { title }),
  remove: (id) => json("DELETE", `/api/conversations/${id}`),
  feedback: (messageId, rating) => json("PUT", `/api/messages/${messageId}/feedback`, { rating }),
  traceByMessage: (messageId) => json("GET", `/api/trace/by_message/${messageId}`),
  cancel: (target) => json("POST", "/api/cancel_stream", target),
  decide: (approvalId, approved) => json("POST", `/api/approvals/${approvalId}`, { approved }),
  toolResult: (traceId, result) => json("POST", `/api/runs/${traceId}/tool_results`, result),
  vote: (comparisonId, preference) => json("POST", `/api/ab/${comparisonId}/vote`, { preference }),
  deleteFile: (id) => json("DELETE", `/api/files/${id}`),

  /** POST /api/files: stores one file (a File or Blob, named `name`); resolves to its record. */
  async upload(file, name = file.name, signal) {
    const form = new FormData();
    form.append("file", file, name || "file");
    return (await send("POST", "/api/files", form, {}, signal)).json();
  },

  /** GET /api/files/{id}: the file's bytes as a Blob of its media type. */
  async file(id) {
    return (await send("GET", `/api/files/${id}`)).blob();
  },

  /** POST /api/chat/stream (or /api/ab/stream): the run's events, after validation passed. */
  async *stream(path, body, signal) {
    yield* events(await send("POST", path, body, { accept: "text/event-stream" }, signal), signal);
  },

  /**
   * GET /api/conversations/{id}/stream: every run of the conversation, the going ones from
   * their first event, then each that starts; each event carries its `trace_id` and `seq`.
   */
  async *watch(conversationId, signal, onOpen) {
    const extra = { accept: "text/event-stream" };
    const response = await send("GET", `/api/conversations/${conversationId}/stream`, undefined, extra, signal);
    onOpen?.();
    yield* events(response, signal);
  },

  /** GET /api/chat/stream/{trace_id}: the events after `after`, then the live ones. */
  async *resume(traceId, after, signal) {
    const extra = { accept: "text/event-stream", "last-event-id": String(after) };
    yield* events(await send("GET", `/api/chat/stream/${traceId}`, undefined, extra, signal), signal);
  },
};

/** The events of an SSE body as `{seq, ...data}`, whatever its chunking; comments are skipped. */
async function* events(response, signal) {
  const reader = response.body.getReader();
  const stop = () => reader.cancel().catch(() => {});
  signal?.addEventListener("abort", stop, { once: true });
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (error) {
        if (signal?.aborted) return;
        throw new ApiError(0, "NETWORK_ERROR", "Connection failed");
      }
      if (chunk.done) return;
      // chatd ends lines with LF alone, as axum's SSE writer does.
      buffer += decoder.decode(chunk.value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = parseFrame(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
        if (frame) yield frame;
      }
    }
  } finally {
    signal?.removeEventListener("abort", stop);
  }
}

/** One SSE frame (`id:` and `data:` lines) as the event's JSON plus its `seq`; null for comments. */
export function parseFrame(text) {
  let id = null;
  const data = [];
  for (const line of text.split("\n")) {
    if (line === "" || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "id") id = value;
    else if (field === "data") data.push(value);
  }
  if (data.length === 0) return null;
  // A conversation's stream names each event `<trace_id>:<seq>`; a run's own stream `<seq>`.
  const seq = id?.includes(":") ? id.slice(id.lastIndexOf(":") + 1) : id;
  return { ...JSON.parse(data.join("\n")), seq: Number(seq ?? 0) };
}
