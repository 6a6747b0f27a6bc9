//! The chat stream and what a client can do with a run: start it (`POST /api/chat/stream`),
//! resume it (`GET /api/chat/stream/{trace_id}` with `Last-Event-ID` or `?after=`) and cancel
//! it (`POST /api/cancel_stream`). Each SSE frame is `id: <seq>` + `data: <json>`, with
//! `: ping` keep-alives when idle.

use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::Stream;
use serde::Deserialize;

use super::AppState;
use super::error::AppError;
use super::extract::{AppJson, AppQuery, CurrentUser, IdPath, KeyedJson};
use super::sse::{Native, sse};
use super::views::*;
use crate::chat::{CancelTarget, Cancelled, ChatRequest, Frame, LiveRun, Resumed, Started};
use crate::config::OnDisconnect;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/chat/stream", post(stream))
        .route("/api/chat/stream/{id}", get(resume))
        .route("/api/cancel_stream", post(cancel))
}

#[utoipa::path(post, operation_id = "chat_stream", path = "/api/chat/stream", tag = "chat", params(("Idempotency-Key" = Option<String>, Header, description = "Makes a retry of this request get the run it started (within 24 h), from its first event, instead of a second run")), request_body = ChatRequest, responses((status = 200, description = "The run's events as SSE (`id: <seq>`, `data: <event>`)", content_type = "text/event-stream", body = SseFrame), Refused, Missing, (status = 413, description = "Too large", body = ErrorBody), (status = 503, description = "Shutting down", body = ErrorBody)))]
async fn stream(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    KeyedJson(key, request): KeyedJson<ChatRequest>,
) -> Result<Response, AppError> {
    let request = ChatRequest { idempotency_key: key, ..request };
    Ok(match state.chat.start_once(&user, request).await? {
        Started::New(run) => sse(&state, from_the_start(&state, run), Native),
        Started::Again(trace) => sse(&state, state.chat.follow(*trace, 0, true), Native),
    })
}

/// A run's frames from its first, for the client that started it (cancelled if it leaves
/// early, with `on_disconnect = "cancel"`), on through its waits (CONTRACT.md §15).
pub(super) fn from_the_start(state: &AppState, run: Arc<LiveRun>) -> impl Stream<Item = Frame> + Send + 'static {
    until_done(state, run, true)
}

/// A run's frames from its first, to its `done` or, without `through_waits`, to where it
/// waits.
pub(super) fn until_done(
    state: &AppState,
    run: Arc<LiveRun>,
    through_waits: bool,
) -> impl Stream<Item = Frame> + Send + 'static {
    let cancel_on_drop = state.settings.stream.on_disconnect == OnDisconnect::Cancel;
    state.chat.follow_from_the_start(run, cancel_on_drop, through_waits)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResumeQuery {
    after: Option<u64>,
}

#[utoipa::path(get, operation_id = "resume_stream", path = "/api/chat/stream/{id}", tag = "chat", params(("id" = Uuid, Path, description = "Trace id"), ("after" = Option<u64>, Query, description = "Replay events after this seq (or send Last-Event-ID)"), ("Last-Event-ID" = Option<String>, Header, description = "The last seq received")), responses((status = 200, description = "Missed events, then live ones, until `done`", content_type = "text/event-stream", body = SseFrame), (status = 204, description = "The run has ended and the client has seen its `done` already"), Refused, Missing))]
async fn resume(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(trace_id): IdPath<TraceId>,
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
    match state.chat.resume(&user, trace_id, after, true).await? {
        // A client that saw the run's `done` has nothing left to hear: 204, which also tells
        // an EventSource to stop reconnecting (instead of a stream that ends at once, again
        // and again).
        Resumed::HeardAll => Ok(StatusCode::NO_CONTENT.into_response()),
        Resumed::Frames(frames) => Ok(sse(&state, frames, Native)),
    }
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    trace_id: Option<TraceId>,
    message_id: Option<MessageId>,
    /// Cancels both sides of an A/B comparison.
    comparison_id: Option<ComparisonId>,
    /// Cancels the conversation's running runs (409 when none runs).
    conversation_id: Option<ConversationId>,
}

#[utoipa::path(post, operation_id = "cancel_stream", path = "/api/cancel_stream", tag = "chat", request_body = CancelBody, responses((status = 200, description = "Cancelled", body = CancelResult), Refused, Missing, (status = 409, description = "The run already ended", body = ErrorBody), (status = 503, description = "The run did not answer", body = ErrorBody)))]
async fn cancel(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppJson(body): AppJson<CancelBody>,
) -> Result<Json<CancelResult>, AppError> {
    let target = match (body.comparison_id, body.trace_id, body.message_id, body.conversation_id) {
        (Some(comparison_id), ..) => CancelTarget::Comparison(comparison_id),
        (None, Some(trace_id), ..) => CancelTarget::Trace(trace_id),
        (None, None, Some(message_id), _) => CancelTarget::Message(message_id),
        (None, None, None, Some(conversation_id)) => CancelTarget::Conversation(conversation_id),
        (None, None, None, None) => {
            return Err(AppError::validation(
                "trace_id",
                "trace_id, message_id, comparison_id or conversation_id is required",
            ));
        }
    };
    Ok(Json(match state.chat.cancel(&user, target).await? {
        Cancelled::Run { trace_id, message_id } => CancelResult::run(trace_id, message_id),
        Cancelled::Comparison { comparison_id, trace_ids } => CancelResult::comparison(comparison_id, trace_ids),
        Cancelled::Conversation { conversation_id, runs } => CancelResult::conversation(conversation_id, runs),
    }))
}
