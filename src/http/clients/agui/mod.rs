//! AG-UI's endpoint (CONTRACT.md §13.2): what `@ag-ui/client`'s `HttpAgent` (and CopilotKit
//! through it) posts, a `RunAgentInput` (`input`), answered with AG-UI events as SSE
//! (`stream`). The thread is a conversation as the AI SDK's chat is (`chat::start::clients`).

mod input;
mod stream;

use axum::Router;
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use futures_util::StreamExt;

use self::input::RunAgentInput;
use self::stream::{Agui, ToAgui};
use crate::chat::Started;
use crate::http::AppState;
use crate::http::chat::until_done;
use crate::http::error::AppError;
use crate::http::extract::{CurrentUser, KeyedJson};
use crate::http::sse::sse;
use crate::http::views::*;
use crate::ids::UserId;

pub fn routes() -> Router<AppState> {
    Router::new().route("/api/agui", post(run))
}

#[utoipa::path(post, operation_id = "agui_run", path = "/api/agui", tag = "clients", params(("Idempotency-Key" = Option<String>, Header, description = "Makes a retry of this request get the run it started (within 24 h), from its first event, instead of a second run")), request_body = RunAgentInput, responses((status = 200, description = "The run as AG-UI events (`data: <event>` frames): RUN_STARTED … RUN_FINISHED or RUN_ERROR", content_type = "text/event-stream", body = String), Refused, Missing, (status = 413, description = "Too large", body = ErrorBody), (status = 503, description = "Shutting down", body = ErrorBody)))]
async fn run(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    KeyedJson(key, input): KeyedJson<RunAgentInput>,
) -> Result<Response, AppError> {
    input.check_ids()?;
    if let Some(continued) = continuation(&state, &user, &input).await? {
        return Ok(continued);
    }
    let (turn, run_id) = input.into_turn()?;
    let thread_id = turn.chat_id.clone();
    // The stream ends where the run waits, with an interrupt outcome.
    let frames = match state.chat.start_for_client(&user, turn, key).await? {
        Started::New(run) => until_done(&state, run, false).boxed(),
        Started::Again(trace) => state.chat.follow(*trace, 0, false).boxed(),
    };
    Ok(sse(&state, frames, Agui::new(ToAgui::new(thread_id, run_id))))
}

/// A run that answers the interrupts of the thread's waiting run (CONTRACT.md §15): with
/// `resume[]`, or with the client tools' results as `tool` messages last in `messages`. The
/// waiting run goes on, under this run's id; `None` when the input answers nothing.
async fn continuation(state: &AppState, user: &UserId, input: &RunAgentInput) -> Result<Option<Response>, AppError> {
    let answers_anything =
        input.resume.as_ref().is_some_and(|r| !r.is_empty()) || input.tool_messages().next().is_some();
    if !answers_anything {
        return Ok(None);
    }
    let Some(trace_id) = state.chat.running_in_chat(user, &input.thread_id).await? else { return Ok(None) };
    let trace = state.store.get_trace(user, trace_id).await?;
    let answers = input.wait_answers();
    let Some(answered) = state.chat.answer_waits(user, trace.message_id, answers).await? else { return Ok(None) };
    let to_agui = ToAgui::continuing(input.thread_id.clone(), input.run_id.clone(), trace.message_id.to_string());
    // From before the requests: a run that still waits ends with its interrupts again.
    let frames = state.chat.follow(answered.trace, answered.waited_from, false);
    Ok(Some(sse(state, frames, Agui::continuing(to_agui))))
}
