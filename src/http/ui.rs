//! The Vercel AI SDK's endpoints (CONTRACT.md §13.1): what `useChat` with a
//! `DefaultChatTransport({ api: "/api/ui/chat" })` sends, and its resume
//! (`GET /api/ui/chat/{id}/stream`). The body's other fields (`metadata`, part `state`, …)
//! are the client library's and are ignored; the stored history is the truth.

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::Value;

use super::AppState;
use super::chat::until_done;
use super::error::AppError;
use super::extract::{CurrentUser, KeyedJson};
use super::sse::{UiMessages, sse};
use super::views::*;
use crate::chat::waits::{WaitAnswer, output_text};
use crate::chat::{AttachmentRef, ClientTurn, Intent, Resumed, Started};
use crate::ids::{MessageId, UserId};
use futures_util::StreamExt;

pub fn routes() -> Router<AppState> {
    Router::new().route("/api/ui/chat", post(chat)).route("/api/ui/chat/{id}/stream", get(resume))
}

/// The body `DefaultChatTransport` sends (and fields `useChat`'s `body` adds).
#[derive(Deserialize, utoipa::ToSchema)]
pub struct UiChatBody {
    /// The chat: a conversation's id or `external_id`, else a new conversation's
    /// `external_id`.
    id: String,
    /// The client's messages; the last user message is the one sent.
    messages: Vec<UiMessage>,
    #[serde(default)]
    trigger: Trigger,
    /// With `submit-message`: the user message edited; with `regenerate-message`: the answer
    /// regenerated (else the last one).
    #[serde(default, rename = "messageId")]
    message_id: Option<String>,
    /// The profile to answer with (`useChat`'s `body`).
    #[serde(default)]
    profile: Option<String>,
    /// Page context for the system prompt, as in `POST /api/chat/stream`.
    #[serde(default)]
    context: Option<Value>,
    /// Tools the client runs (`onToolCall`), as in `POST /api/chat/stream` (CONTRACT.md §15).
    #[serde(default)]
    client_tools: Vec<crate::chat::request::ClientTool>,
    /// What the message does while a run of the chat is going (CONTRACT.md §16).
    #[serde(default)]
    multitask: Option<crate::config::Multitask>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Trigger {
    #[default]
    SubmitMessage,
    RegenerateMessage,
}

/// A `UIMessage` of the AI SDK: only its id, role and parts are read.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct UiMessage {
    id: String,
    role: String,
    /// A user message's text parts; an answer's tool parts, when they answer a waiting run.
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    parts: Vec<Value>,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum UiPart {
    Text {
        text: String,
    },
    /// A file the user attached: a `data:` URL (what `useChat` sends for files picked in the
    /// browser), or an `http(s)` URL where `files.fetch_remote` allows.
    #[serde(rename_all = "camelCase")]
    File {
        url: String,
        #[serde(default)]
        filename: Option<String>,
    },
    /// Any other part (`step-start`, tool parts, …): not read.
    #[serde(other)]
    Other,
}

/// The longest id or name a client library sends (a chat, thread, run, message or tool call
/// id; a profile or tool name), in characters. The libraries' own ids are far shorter; a
/// longer one would be stored and listed back with every conversation.
pub const MAX_ID_CHARS: usize = 256;

/// `value`, if it is no longer than [`MAX_ID_CHARS`]; else a 400 naming `field`.
pub(super) fn bounded<'a>(field: &str, value: &'a str) -> Result<&'a str, AppError> {
    match value.chars().nth(MAX_ID_CHARS) {
        None => Ok(value),
        Some(_) => Err(AppError::validation(field, format!("{field} is longer than {MAX_ID_CHARS} characters"))),
    }
}

impl UiChatBody {
    /// Refuses an id or name past [`MAX_ID_CHARS`], before anything reads them.
    fn check_ids(&self) -> Result<(), AppError> {
        bounded("id", &self.id)?;
        if let Some(id) = &self.message_id {
            bounded("messageId", id)?;
        }
        if let Some(profile) = &self.profile {
            bounded("profile", profile)?;
        }
        for message in &self.messages {
            bounded("messages", &message.id)?;
        }
        for tool in &self.client_tools {
            bounded("client_tools", &tool.name)?;
        }
        Ok(())
    }

    fn into_turn(self) -> Result<ClientTurn, AppError> {
        if self.id.trim().is_empty() {
            return Err(AppError::validation("id", "id (the chat's id) cannot be empty"));
        }
        let last = last_user_message(self.messages, |m| &m.role)?;
        let mut text = String::new();
        let mut attachments = Vec::new();
        for part in &last.parts {
            let part = serde_json::from_value::<UiPart>(part.clone())
                .map_err(|e| AppError::validation("messages", format!("A message part does not read: {e}")))?;
            match &part {
                UiPart::Text { text: part } => text.push_str(part),
                UiPart::File { url, filename } => attachments.push(AttachmentRef::url(url, filename.clone())),
                UiPart::Other => {}
            }
        }
        let intent = match (self.trigger, self.message_id) {
            (Trigger::SubmitMessage, None) => Intent::Send,
            (Trigger::SubmitMessage, Some(id)) => Intent::Edit(id),
            (Trigger::RegenerateMessage, id) => Intent::Regenerate(id),
        };
        Ok(ClientTurn {
            chat_id: self.id,
            text,
            message_id: Some(last.id),
            intent,
            profile: self.profile,
            context: self.context,
            client_tools: self.client_tools,
            attachments,
            multitask: self.multitask,
        })
    }
}

/// The last of a client's messages whose role is `user`: the one it sends (both client
/// libraries send the whole thread).
pub(super) fn last_user_message<M>(messages: Vec<M>, role: impl Fn(&M) -> &str) -> Result<M, AppError> {
    messages
        .into_iter()
        .rev()
        .find(|m| role(m) == "user")
        .ok_or_else(|| AppError::validation("messages", "messages holds no user message"))
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
    let answers = answer.parts.iter().filter_map(wait_answer).collect();
    let Some(answered) = state.chat.answer_waits(user, message_id, answers).await? else {
        return Ok(None);
    };
    let frames = state.chat.follow(answered.trace, answered.waited_to, false);
    Ok(Some(ui_stream(sse(state, frames, UiMessages::continuing(message_id)))))
}

/// What a tool part of the AI SDK says of a waiting call, if anything.
fn wait_answer(part: &Value) -> Option<WaitAnswer> {
    let kind = part.get("type")?.as_str()?;
    if !(kind.starts_with("tool-") || kind == "dynamic-tool") {
        return None;
    }
    let tool_call_id = bounded("messages", part.get("toolCallId")?.as_str()?).ok()?.to_owned();
    match part.get("state")?.as_str()? {
        "approval-responded" => {
            let approval = part.get("approval")?;
            Some(WaitAnswer::Approval {
                approval_id: approval.get("id")?.as_str()?.parse().ok()?,
                approved: approval.get("approved")?.as_bool()?,
                reason: approval.get("reason").and_then(Value::as_str).map(str::to_owned),
            })
        }
        "output-available" => {
            Some(WaitAnswer::Result { tool_call_id, output: output_text(part.get("output")?), is_error: false })
        }
        "output-error" => Some(WaitAnswer::Result {
            tool_call_id,
            output: part.get("errorText").map(output_text).unwrap_or_default(),
            is_error: true,
        }),
        _ => None,
    }
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
        Resumed::Frames(frames) => Ok(ui_stream(sse(&state, frames, UiMessages::new()))),
    }
}

/// Marks a response as the UI message stream's first version, as the AI SDK's own servers do.
fn ui_stream(mut response: Response) -> Response {
    response.headers_mut().insert("x-vercel-ai-ui-message-stream", HeaderValue::from_static("v1"));
    response
}
