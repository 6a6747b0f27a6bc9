//! The Vercel AI SDK's endpoints (CONTRACT.md §13.1): what `useChat` with a
//! `DefaultChatTransport({ api: "/api/ui/chat" })` sends (`body`), answered with the UI
//! message stream (`stream`), and its resume (`GET /api/ui/chat/{id}/stream`). The stored
//! history is the truth: of the client's messages only the last user message and the ids
//! are read.

mod body;
mod resume;
mod stream;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};

use self::body::{Trigger, UiChatBody};
use self::stream::UiMessages;
use crate::chat::{Frame, Resumed, Started};
use crate::http::AppState;
use crate::http::chat::until_done;
use crate::http::error::AppError;
use crate::http::extract::{CurrentUser, KeyedJson};
use crate::http::sse::sse;
use crate::http::views::*;
use crate::ids::{MessageId, UserId};

pub fn routes() -> Router<AppState> {
    Router::new().route("/api/ui/chat", post(chat)).route("/api/ui/chat/{id}/stream", get(resume))
}

#[utoipa::path(post, operation_id = "ui_chat", path = "/api/ui/chat", tag = "clients", params(("Idempotency-Key" = Option<String>, Header, description = "Makes a retry of this request get the run it started (within 24 h), from its first event, instead of a second run")), request_body = UiChatBody, responses((status = 200, description = "The run as the AI SDK's UI message stream (`data: <chunk>` frames, then `data: [DONE]`; header `x-vercel-ai-ui-message-stream: v1`)", content_type = "text/event-stream", body = String), Refused, Missing, (status = 413, description = "Too large", body = ErrorBody), (status = 503, description = "Shutting down", body = ErrorBody)))]
async fn chat(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    KeyedJson(key, body): KeyedJson<UiChatBody>,
) -> Result<Response, AppError> {
    body.check_ids()?;
    if let Some(continued) = continuation(&state, &user, &body).await? {
        return Ok(continued);
    }
    // The stream ends where the run waits: the client's next request goes on with it.
    let frames = match state.chat.start_for_client(&user, body.into_turn()?, key).await? {
        Started::New(run) => until_done(&state, run, false).boxed(),
        Started::Again(trace) => state.chat.follow(*trace, 0, false).boxed(),
    };
    Ok(ui_stream(sse(&state, frames, UiMessages::new())))
}

/// The client's next request after its answer's run waited (CONTRACT.md §15): a
/// `submit-message` naming the answer, whose tool parts carry approval responses
/// (`approval-responded`) or client tools' outputs (`output-available`, `output-error`).
/// They settle the run's calls, and the stream goes on with the same message where it
/// stopped; `None` when no run of that answer waits.
async fn continuation(state: &AppState, user: &UserId, body: &UiChatBody) -> Result<Option<Response>, AppError> {
    let (Trigger::SubmitMessage, Some(id)) = (body.trigger, &body.message_id) else { return Ok(None) };
    let Some(answer) = body.messages.last().filter(|m| m.role == "assistant" && m.id == *id) else {
        return Ok(None);
    };
    let Ok(message_id) = id.parse::<uuid::Uuid>().map(MessageId::from) else { return Ok(None) };
    let answers = answer.wait_answers();
    let Some(answered) = state.chat.answer_waits(user, message_id, answers).await? else {
        return Ok(None);
    };
    let frames = state.chat.follow(answered.trace, answered.waited_to, false);
    Ok(Some(ui_stream(sse(state, frames, UiMessages::continuing(message_id)))))
}

#[utoipa::path(get, operation_id = "ui_chat_resume", path = "/api/ui/chat/{id}/stream", tag = "clients", params(("id" = String, Path, description = "The chat's id (a conversation's id or external_id)")), responses((status = 200, description = "The chat's running run from its first chunk, then live, until `[DONE]`", content_type = "text/event-stream", body = String), (status = 204, description = "No run of this chat is running"), Refused))]
async fn resume(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path(id): Path<String>,
) -> Result<Response, AppError> {
    let Some(trace_id) = state.chat.running_in_chat(&user, &id).await? else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    match state.chat.resume(&user, trace_id, 0, false).await? {
        Resumed::HeardAll => Ok(StatusCode::NO_CONTENT.into_response()),
        Resumed::Frames(frames) => {
            // What the run said before the client came back, as far as it had said it then.
            let said = match state.chat.runs().get(trace_id) {
                Some(run) => run.last_seq(),
                None => state.store.trace_events(trace_id, 0).await?.last().map_or(0, |e| e.seq as u64),
            };
            Ok(ui_stream(sse(&state, without_voided(frames, said), UiMessages::new())))
        }
    }
}

/// `frames`, the first up to seq `said` (the replay of what was said before) without what a
/// `step_reset` among them voided: the client rebuilds the message from its first chunk.
fn without_voided(mut frames: BoxStream<'static, Frame>, said: u64) -> impl Stream<Item = Frame> + Send + 'static {
    async_stream::stream! {
        let mut replayed: Vec<Frame> = Vec::new();
        while replayed.last().is_none_or(|frame| frame.seq < said) {
            let Some(frame) = frames.next().await else { break };
            replayed.push(frame);
        }
        for frame in resume::drop_voided(replayed) {
            yield frame;
        }
        while let Some(frame) = frames.next().await {
            yield frame;
        }
    }
}

/// Marks a response as the UI message stream's first version, as the AI SDK's own servers do.
fn ui_stream(mut response: Response) -> Response {
    response.headers_mut().insert("x-vercel-ai-ui-message-stream", HeaderValue::from_static("v1"));
    response
}
