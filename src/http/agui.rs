//! AG-UI's endpoint (CONTRACT.md §13.2): what `@ag-ui/client`'s `HttpAgent` (and CopilotKit
//! through it) posts, a `RunAgentInput`, answered with AG-UI events as SSE. The thread is a
//! conversation as the AI SDK's chat is (`chat::clients`).

use axum::Router;
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::AppState;
use super::chat::until_done;
use super::error::AppError;
use super::extract::{CurrentUser, KeyedJson};
use super::sse::{Agui, sse};
use super::ui::{bounded, last_user_message};
use super::views::*;
use crate::chat::request::ClientTool;
use crate::chat::waits::{WaitAnswer, output_text};
use crate::chat::{AttachmentRef, ClientTurn, Intent, Started};
use crate::events::agui::ToAgui;
use crate::ids::{FileId, UserId};
use futures_util::StreamExt;

pub fn routes() -> Router<AppState> {
    Router::new().route("/api/agui", post(run))
}

/// AG-UI's `RunAgentInput`; its other fields (`state`, `protocolVersion`, …) are ignored.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunAgentInput {
    /// The thread: a conversation's id or `external_id`, else a new conversation's
    /// `external_id`.
    thread_id: String,
    /// Echoed in `RUN_STARTED` and `RUN_FINISHED`.
    run_id: String,
    /// The client's messages; the last user message is the one sent.
    #[serde(default)]
    messages: Vec<AguiMessage>,
    /// The client's tools (CONTRACT.md §15): offered to the model; a call of one ends the run
    /// with an interrupt, and the client's next run (a tool message, or `resume[]`) answers it.
    #[serde(default)]
    tools: Vec<AguiTool>,
    /// Entries for the system prompt's context section.
    #[serde(default)]
    context: Vec<AguiContext>,
    /// Answers to the interrupts of the thread's waiting run (CONTRACT.md §15).
    #[serde(default)]
    resume: Option<Vec<ResumeEntry>>,
    /// `profile` picks the profile to answer with.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    forwarded_props: Option<Value>,
}

/// One message of the thread: its text content is read (and a `tool` message's call id
/// and error).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AguiMessage {
    id: String,
    role: String,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    error: Option<String>,
    /// A string, or (for a user message) an array of parts.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    content: Option<Value>,
}

/// A tool of the client's.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct AguiTool {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    parameters: Option<Value>,
}

/// An answer to one interrupt: an approval (`payload.approved`, `payload.reason`; `cancelled`
/// denies it) or a client tool's result (`payload`; `cancelled` is an error result).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResumeEntry {
    interrupt_id: String,
    /// `resolved` or `cancelled`.
    status: String,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    payload: Option<Value>,
}

#[derive(Deserialize, utoipa::ToSchema)]
pub struct AguiContext {
    description: String,
    value: String,
}

impl RunAgentInput {
    /// Refuses an id or name past [`MAX_ID_CHARS`](super::ui::MAX_ID_CHARS), before
    /// anything reads them.
    fn check_ids(&self) -> Result<(), AppError> {
        bounded("threadId", &self.thread_id)?;
        bounded("runId", &self.run_id)?;
        for message in &self.messages {
            bounded("messages", &message.id)?;
            if let Some(call) = &message.tool_call_id {
                bounded("messages", call)?;
            }
        }
        for tool in &self.tools {
            bounded("tools", &tool.name)?;
        }
        for entry in self.resume.iter().flatten() {
            bounded("resume", &entry.interrupt_id)?;
        }
        if let Some(Value::String(profile)) = self.forwarded_props.as_ref().and_then(|props| props.get("profile")) {
            bounded("forwardedProps", profile)?;
        }
        Ok(())
    }

    fn into_turn(self) -> Result<(ClientTurn, String), AppError> {
        if self.thread_id.trim().is_empty() {
            return Err(AppError::validation("threadId", "threadId cannot be empty"));
        }
        if self.resume.as_ref().is_some_and(|resume| !resume.is_empty()) {
            return Err(AppError::validation("resume", "No run of this thread waits for these interrupts"));
        }
        let client_tools = self
            .tools
            .into_iter()
            .map(|t| ClientTool {
                name: t.name,
                description: t.description,
                parameters: t.parameters.unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}})),
            })
            .collect();
        let last = last_user_message(self.messages, |m| &m.role)?;
        let mut attachments = Vec::new();
        let text = match last.content {
            Some(Value::String(text)) => text,
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match part.get("type").and_then(Value::as_str) {
                        Some("text") => text.push_str(part.get("text").and_then(Value::as_str).unwrap_or_default()),
                        Some("image" | "document" | "binary") => attachments.push(attachment(&part)?),
                        _ => {
                            return Err(AppError::validation(
                                "messages",
                                "A user message's parts may be text, image, document or binary",
                            ));
                        }
                    }
                }
                text
            }
            _ => String::new(),
        };
        let context = (!self.context.is_empty()).then(|| {
            Value::Object(
                self.context.into_iter().map(|c| (c.description, Value::String(c.value))).collect::<Map<_, _>>(),
            )
        });
        let profile = match self.forwarded_props.as_ref().and_then(|props| props.get("profile")) {
            None | Some(Value::Null) => None,
            Some(Value::String(profile)) => Some(profile.clone()),
            Some(_) => return Err(AppError::validation("forwardedProps", "forwardedProps.profile must be a string")),
        };
        let multitask = match self.forwarded_props.as_ref().and_then(|props| props.get("multitask")) {
            None | Some(Value::Null) => None,
            Some(value) => Some(serde_json::from_value(value.clone()).map_err(|_| {
                AppError::validation("forwardedProps", "forwardedProps.multitask is reject, interrupt or rollback")
            })?),
        };
        let turn = ClientTurn {
            chat_id: self.thread_id,
            text,
            message_id: Some(last.id),
            intent: Intent::Send,
            profile,
            context,
            client_tools,
            attachments,
            multitask,
        };
        Ok((turn, self.run_id))
    }
}

/// An AG-UI image, document or binary part as an attachment (CONTRACT.md §14): its
/// `source` (`data`: base64 with its `mimeType`; `url`: a `data:` or `http(s)` URL), or a
/// binary part's `data`, `url` or `id` (a file chatd stored).
fn attachment(part: &Value) -> Result<AttachmentRef, AppError> {
    let text = |value: &Value, key: &str| value.get(key).and_then(Value::as_str).map(str::to_owned);
    let name = text(part, "filename").or_else(|| part.get("metadata").and_then(|m| text(m, "filename")));
    let bad = || AppError::validation("messages", "A file part needs a source (data with its mimeType, or a url)");
    if let Some(source) = part.get("source") {
        return match (text(source, "type").as_deref(), text(source, "value"), text(source, "mimeType")) {
            (Some("data"), Some(data), Some(mime)) => {
                Ok(AttachmentRef::url(format!("data:{mime};base64,{data}"), name))
            }
            (Some("url"), Some(url), _) => Ok(AttachmentRef::url(url, name)),
            _ => Err(bad()),
        };
    }
    match (text(part, "data"), text(part, "url"), text(part, "id"), text(part, "mimeType")) {
        (Some(data), _, _, Some(mime)) => Ok(AttachmentRef::url(format!("data:{mime};base64,{data}"), name)),
        (None, Some(url), _, _) => Ok(AttachmentRef::url(url, name)),
        (None, None, Some(id), _) => FileId::parse(&id)
            .map(AttachmentRef::file)
            .map_err(|_| AppError::validation("messages", "A binary part's id must be a file id of POST /api/files")),
        _ => Err(bad()),
    }
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
    let resume = input.resume.as_deref().unwrap_or_default();
    let tool_messages: Vec<&AguiMessage> = input.messages.iter().rev().take_while(|m| m.role == "tool").collect();
    if resume.is_empty() && tool_messages.is_empty() {
        return Ok(None);
    }
    let Some(trace_id) = state.chat.running_in_chat(user, &input.thread_id).await? else { return Ok(None) };
    let trace = state.store.get_trace(user, trace_id).await?;
    let mut answers = Vec::new();
    for entry in resume {
        let resolved = entry.status == "resolved";
        let payload = entry.payload.as_ref();
        if let Ok(approval_id) = entry.interrupt_id.parse::<uuid::Uuid>() {
            answers.push(WaitAnswer::Approval {
                approval_id,
                approved: resolved && payload.and_then(|p| p.get("approved")).and_then(Value::as_bool).unwrap_or(true),
                reason: payload.and_then(|p| p.get("reason")).and_then(Value::as_str).map(str::to_owned),
            });
        }
        answers.push(WaitAnswer::Result {
            tool_call_id: entry.interrupt_id.clone(),
            output: match payload {
                _ if !resolved => "The user cancelled this tool call".to_owned(),
                Some(payload) => output_text(payload),
                None => String::new(),
            },
            is_error: !resolved,
        });
    }
    for message in tool_messages {
        let (Some(tool_call_id), content) = (&message.tool_call_id, &message.content) else { continue };
        let output = content.as_ref().map(output_text).unwrap_or_default();
        answers.push(WaitAnswer::Result {
            tool_call_id: tool_call_id.clone(),
            output: message.error.clone().unwrap_or(output),
            is_error: message.error.is_some(),
        });
    }
    let Some(answered) = state.chat.answer_waits(user, trace.message_id, answers).await? else { return Ok(None) };
    let to_agui = ToAgui::continuing(input.thread_id.clone(), input.run_id.clone(), trace.message_id.to_string());
    // From before the requests: a run that still waits ends with its interrupts again.
    let frames = state.chat.follow(answered.trace, answered.waited_from, false);
    Ok(Some(sse(state, frames, Agui::continuing(to_agui))))
}
