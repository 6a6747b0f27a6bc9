//! The chat stream and what a client can do with a run: start it (`POST /api/chat/stream`),
//! resume it (`GET /api/chat/stream/{trace_id}` with `Last-Event-ID` or `?after=`) and cancel
//! it (`POST /api/cancel_stream`). Each SSE frame is `id: <seq>` + `data: <json>`, with
//! `: ping` keep-alives when idle.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde::Deserialize;
use uuid::Uuid;

use super::AppState;
use super::error::AppError;
use super::extract::{AppJson, AppQuery, CurrentUser, IdPath};
use super::views::*;
use crate::chat::{CancelOutcome, ChatRequest, Frame, LiveRun};
use crate::config::OnDisconnect;
use crate::domain::{Trace, TraceStatus};
use crate::store::Store;
use crate::wake::when_woken;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/chat/stream", post(stream))
        .route("/api/chat/stream/{id}", get(resume))
        .route("/api/cancel_stream", post(cancel))
}

#[utoipa::path(post, operation_id = "chat_stream", path = "/api/chat/stream", tag = "chat", request_body = ChatRequest, responses((status = 200, description = "The run's events as SSE (`id: <seq>`, `data: <event>`)", content_type = "text/event-stream", body = SseFrame), Refused, Missing, (status = 413, description = "Too large", body = ErrorBody), (status = 503, description = "Shutting down", body = ErrorBody)))]
async fn stream(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppJson(request): AppJson<ChatRequest>,
) -> Result<Response, AppError> {
    let run = state.chat.start(&user, request).await?;
    Ok(sse(&state, from_the_start(&state, run)))
}

/// A run's frames from its first, for the client that started it: with `on_disconnect =
/// "cancel"`, the run is cancelled if that client goes away before `done` (a resuming
/// client never cancels by leaving).
pub(super) fn from_the_start(state: &AppState, run: Arc<LiveRun>) -> impl Stream<Item = Frame> + Send + 'static {
    let cancel_on_drop = state.settings.stream.on_disconnect == OnDisconnect::Cancel;
    DisconnectGuard { run: run.clone(), cancel_on_drop, done: false }.watch(run.follow(0))
}

/// Frames sent in one write, at most (a listener that fell behind catches up in a few).
const FRAMES_PER_WRITE: usize = 512;

/// The SSE response for a stream of frames; ends at `done` or when the server stops. Frames
/// that are ready together go out as one write, and `: ping` goes out when idle.
pub(super) fn sse(state: &AppState, frames: impl Stream<Item = Frame> + Send + 'static) -> Response {
    let frames = frames.take_until(when_woken(state.shutdown.clone().cancelled_owned())).ready_chunks(FRAMES_PER_WRITE);
    let keepalive = state.keepalive();
    let body = async_stream::stream! {
        let mut frames = std::pin::pin!(frames);
        let mut idle = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A ping only after a whole interval without frames: re-arming the timer on every
        // write would cost more than the frames themselves.
        let mut sent = false;
        loop {
            tokio::select! {
                biased;
                batch = frames.next() => match batch {
                    Some(batch) => {
                        sent = true;
                        yield Ok::<_, Infallible>(encode(&batch));
                    }
                    None => break,
                },
                _ = idle.tick() => {
                    if !std::mem::take(&mut sent) {
                        yield Ok(Bytes::from_static(b": ping\n\n"));
                    }
                }
            }
        }
    };
    let mut response = Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Proxies such as nginx must pass each frame on at once.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// Frames as SSE text: `id: <seq>`, `data: <json>` (compact JSON never holds a newline).
fn encode(frames: &[Frame]) -> Bytes {
    let mut out = String::with_capacity(frames.iter().map(|f| f.data.len() + 32).sum());
    let mut seq = itoa::Buffer::new();
    for frame in frames {
        // Pieces pushed one by one: `write!` through `fmt` cost four times as much.
        out.push_str("id: ");
        out.push_str(seq.format(frame.seq));
        out.push_str("\ndata: ");
        out.push_str(&frame.data);
        out.push_str("\n\n");
    }
    Bytes::from(out)
}

/// Cancels the run if the client goes away before `done` (with `on_disconnect = "cancel"`).
struct DisconnectGuard {
    run: Arc<LiveRun>,
    cancel_on_drop: bool,
    done: bool,
}

impl DisconnectGuard {
    fn watch(self, frames: impl Stream<Item = Frame> + Send + 'static) -> impl Stream<Item = Frame> + Send + 'static {
        let mut guard = self;
        frames.map(move |frame| {
            // Borrowing the whole guard makes the closure own all of it (not just `done`),
            // so the guard lives, and drops, with the stream.
            let guard = &mut guard;
            guard.done |= frame.last;
            frame
        })
    }
}

impl Drop for DisconnectGuard {
    fn drop(&mut self) {
        if self.cancel_on_drop && !self.done && !self.run.is_finished() {
            tracing::info!(trace_id = %self.run.trace_id, "client left; cancelling its run");
            self.run.cancel.cancel();
        }
    }
}

/// How long a resume waits for an ended run's last events to be logged.
const LAST_EVENTS_WAIT: Duration = Duration::from_secs(2);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResumeQuery {
    after: Option<u64>,
}

#[utoipa::path(get, operation_id = "resume_stream", path = "/api/chat/stream/{id}", tag = "chat", params(("id" = Uuid, Path, description = "Trace id"), ("after" = Option<u64>, Query, description = "Replay events after this seq (or send Last-Event-ID)"), ("Last-Event-ID" = Option<String>, Header, description = "The last seq received")), responses((status = 200, description = "Missed events, then live ones, until `done`", content_type = "text/event-stream", body = SseFrame), (status = 204, description = "The run has ended and the client has seen its `done` already"), Refused, Missing))]
async fn resume(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(trace_id): IdPath,
    AppQuery(query): AppQuery<ResumeQuery>,
    headers: HeaderMap,
) -> Result<Response, AppError> {
    let after = match headers.get("last-event-id") {
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| AppError::validation("Last-Event-ID", "Last-Event-ID must be an event's seq"))?,
        None => query.after.unwrap_or(0),
    };
    // Seqs are stored as signed 64-bit integers: anything above is no seq of any run.
    if i64::try_from(after).is_err() {
        return Err(AppError::validation("after", "after must be an event's seq"));
    }
    let trace = owned_trace(&*state.store, &user, trace_id).await?;
    // A client that saw the run's `done` has nothing left to hear: 204, which also tells
    // an EventSource to stop reconnecting (instead of a stream that ends at once, again
    // and again).
    let heard_all = axum::http::StatusCode::NO_CONTENT.into_response();
    if let Some(run) = state.chat.runs().get(trace.trace_id) {
        if run.heard_all(after) {
            return Ok(heard_all);
        }
        return Ok(sse(&state, run.follow(after)));
    }
    // The log after `after`, read once: the stream starts with it.
    let missed = state.store.trace_events(trace_id, after as i64).await?;
    if missed.is_empty()
        && trace.status != TraceStatus::Running
        && logged_done(&*state.store, trace_id).await?.is_some_and(|done| after >= done)
    {
        return Ok(heard_all);
    }
    let poll = Duration::from_millis(state.settings.stream.flush_interval_ms.max(10));
    Ok(sse(&state, from_log(state.store.clone(), trace, after, missed, poll)))
}

/// The seq of the run's logged `done`, if it has one.
async fn logged_done(store: &dyn Store, trace_id: Uuid) -> Result<Option<u64>, AppError> {
    let events = store.trace_events(trace_id, 0).await?;
    Ok(events.iter().rev().find(|e| e.kind == "done").map(|e| e.seq as u64))
}

/// Replays a run's logged events after `after` (`missed`, already read), then follows the
/// log (a run on another replica writes it every flush interval) until `done`, or until the
/// run is over.
fn from_log(
    store: Arc<dyn Store>,
    trace: Trace,
    mut after: u64,
    missed: Vec<LoggedEvent>,
    poll: Duration,
) -> impl Stream<Item = Frame> + Send + 'static {
    let trace_id = trace.trace_id;
    let mut ended_at: Option<tokio::time::Instant> = None;
    let mut missed = Some(missed);
    async_stream::stream! {
        loop {
            let read = match missed.take() {
                Some(events) => Ok(events),
                None => store.trace_events(trace_id, i64::try_from(after).unwrap_or(i64::MAX)).await,
            };
            let events = match read {
                Ok(events) => events,
                Err(e) => {
                    tracing::warn!(error = %e, %trace_id, "resume could not read the log");
                    return;
                }
            };
            let read_any = !events.is_empty();
            for event in events {
                after = event.seq as u64;
                let last = event.kind == "done";
                yield Frame { seq: after, data: event.data.to_string().into(), last };
                if last {
                    return;
                }
            }
            if !read_any {
                // A run is marked over before its last events are logged (they follow within
                // a flush interval): after it ends, wait a little for `done`, then stop (a
                // crashed run never logs one).
                let over = !matches!(store.get_trace(&trace.user_id, trace_id).await, Ok(now) if now.status == TraceStatus::Running);
                if over {
                    let deadline = *ended_at.get_or_insert_with(|| tokio::time::Instant::now() + LAST_EVENTS_WAIT);
                    if tokio::time::Instant::now() >= deadline {
                        // A `done` at or before `after`: the client has seen the end.
                        if matches!(logged_done(&*store, trace_id).await, Ok(Some(done)) if after >= done) {
                            return;
                        }
                        // Its process died before it could say so (an interrupted run): end
                        // the stream the way the contract promises, with one terminal event.
                        let ending = [
                            Event::Error {
                                code: "SERVICE_UNAVAILABLE".into(),
                                message: "The server stopped during the run".into(),
                                retryable: true,
                                message_id: trace.message_id,
                                trace_id,
                            },
                            Event::Done { conversation_id: trace.conversation_id, message_id: trace.message_id, trace_id },
                        ];
                        for (i, event) in ending.iter().enumerate() {
                            let data = serde_json::to_string(event).expect("events always serialize");
                            yield Frame { seq: after + 1 + i as u64, data: data.into(), last: i == 1 };
                        }
                        return;
                    }
                }
                tokio::time::sleep(poll).await;
            }
        }
    }
}

async fn owned_trace(store: &dyn Store, user: &str, trace_id: Uuid) -> Result<Trace, AppError> {
    store.get_trace(user, trace_id).await.map_err(AppError::missing("Trace not found"))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    trace_id: Option<Uuid>,
    message_id: Option<Uuid>,
    /// Cancels both sides of an A/B comparison.
    comparison_id: Option<Uuid>,
}

#[utoipa::path(post, operation_id = "cancel_stream", path = "/api/cancel_stream", tag = "chat", request_body = CancelBody, responses((status = 200, description = "Cancelled", body = CancelResult), Refused, Missing, (status = 409, description = "The run already ended", body = ErrorBody), (status = 503, description = "The run did not answer", body = ErrorBody)))]
async fn cancel(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppJson(body): AppJson<CancelBody>,
) -> Result<Json<CancelResult>, AppError> {
    if let Some(comparison_id) = body.comparison_id {
        return cancel_comparison(&state, &user, comparison_id).await;
    }
    let trace = match (body.trace_id, body.message_id) {
        (Some(trace_id), _) => owned_trace(&*state.store, &user, trace_id).await?,
        (None, Some(message_id)) => {
            state.store.trace_by_message(&user, message_id).await.map_err(AppError::missing("Trace not found"))?
        }
        (None, None) => {
            return Err(AppError::validation("trace_id", "trace_id or message_id is required"));
        }
    };
    if trace.status != TraceStatus::Running {
        return Err(AppError::Conflict("The run has already ended".into()));
    }
    match state.chat.cancel(&user, trace.trace_id).await? {
        CancelOutcome::Cancelled => Ok(Json(CancelResult::run(trace.trace_id, trace.message_id))),
        CancelOutcome::AlreadyEnded => Err(AppError::Conflict("The run has already ended".into())),
        CancelOutcome::AlreadyCancelling => Err(AppError::Conflict("The run is being cancelled already".into())),
        CancelOutcome::NoAnswer => Err(AppError::Unavailable("The run did not answer the cancel; try again".into())),
    }
}

/// Cancels whichever sides of a comparison are still running.
async fn cancel_comparison(state: &AppState, user: &str, comparison_id: Uuid) -> Result<Json<CancelResult>, AppError> {
    let comparison =
        state.store.get_comparison(user, comparison_id).await.map_err(AppError::missing("Comparison not found"))?;
    let mut cancelled = Vec::new();
    for trace_id in [comparison.trace_a, comparison.trace_b] {
        let trace = owned_trace(&*state.store, user, trace_id).await?;
        if trace.status == TraceStatus::Running && state.chat.cancel(user, trace_id).await? == CancelOutcome::Cancelled
        {
            cancelled.push(trace_id);
        }
    }
    if cancelled.is_empty() {
        return Err(AppError::Conflict("Both runs have already ended".into()));
    }
    Ok(Json(CancelResult::comparison(comparison_id, cancelled)))
}
