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
use super::chat::from_the_start;
use super::error::AppError;
use super::extract::{AppJson, CurrentUser};
use super::sse::{Agui, sse};
use super::ui::last_user_message;
use super::views::*;
use crate::chat::{ClientTurn, Intent};
use crate::events::agui::ToAgui;

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
    /// The client's tools: not offered to the model in this version (CONTRACT.md §15 is not
    /// built yet).
    #[serde(default)]
    #[allow(dead_code)]
    #[schema(value_type = Vec<Object>)]
    tools: Vec<Value>,
    /// Entries for the system prompt's context section.
    #[serde(default)]
    context: Vec<AguiContext>,
    /// Answers to interrupts (CONTRACT.md §15): refused in this version.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    resume: Option<Vec<Value>>,
    /// `profile` picks the profile to answer with.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    forwarded_props: Option<Value>,
}

/// One message of the thread: its text content is read.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct AguiMessage {
    id: String,
    role: String,
    /// A string, or (for a user message) an array of parts.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    content: Option<Value>,
}

#[derive(Deserialize, utoipa::ToSchema)]
pub struct AguiContext {
    description: String,
    value: String,
}

impl RunAgentInput {
    fn into_turn(self) -> Result<(ClientTurn, String), AppError> {
        if self.thread_id.trim().is_empty() {
            return Err(AppError::validation("threadId", "threadId cannot be empty"));
        }
        if self.resume.as_ref().is_some_and(|resume| !resume.is_empty()) {
            return Err(AppError::validation("resume", "This server has no interrupts to resume yet"));
        }
        let last = last_user_message(self.messages, |m| &m.role)?;
        let text = match last.content {
            Some(Value::String(text)) => text,
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(part)) => text.push_str(part),
                        _ => {
                            return Err(AppError::validation(
                                "messages",
                                "Only text content is supported yet: send text parts",
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
        let turn = ClientTurn {
            chat_id: self.thread_id,
            text,
            message_id: Some(last.id),
            intent: Intent::Send,
            profile,
            context,
            client_tools: Vec::new(),
        };
        Ok((turn, self.run_id))
    }
}

#[utoipa::path(post, operation_id = "agui_run", path = "/api/agui", tag = "clients", request_body = RunAgentInput, responses((status = 200, description = "The run as AG-UI events (`data: <event>` frames): RUN_STARTED … RUN_FINISHED or RUN_ERROR", content_type = "text/event-stream", body = String), Refused, Missing, (status = 413, description = "Too large", body = ErrorBody), (status = 503, description = "Shutting down", body = ErrorBody)))]
async fn run(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppJson(input): AppJson<RunAgentInput>,
) -> Result<Response, AppError> {
    let (turn, run_id) = input.into_turn()?;
    let thread_id = turn.chat_id.clone();
    let run = state.chat.start_for_client(&user, turn).await?;
    Ok(sse(&state, from_the_start(&state, run), Agui(ToAgui::new(thread_id, run_id))))
}
