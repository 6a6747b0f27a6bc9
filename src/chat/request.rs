//! A chat request (CONTRACT.md §4) as the native endpoint's body reads it, and as the client
//! libraries' requests are mapped onto it: the data a start checks and plans.

use serde::Deserialize;
use serde_json::Value;

use crate::ids::{ConversationId, MessageId};

/// The body of `POST /api/chat/stream` (CONTRACT.md §4).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    pub message: String,
    #[serde(default)]
    pub conversation_id: Option<ConversationId>,
    #[serde(default)]
    pub profile: Option<String>,
    #[serde(default)]
    pub parent_message_id: Option<MessageId>,
    #[serde(default)]
    pub context: Option<Value>,
    #[serde(default)]
    pub interaction_type: InteractionType,
    #[serde(default)]
    pub action: Option<Value>,
    #[serde(default)]
    pub diagnostics: bool,
    /// Tools the frontend runs (CONTRACT.md §15): offered to the model, their calls wait for
    /// `POST /api/runs/{trace_id}/tool_results`.
    #[serde(default)]
    pub client_tools: Vec<ClientTool>,
    /// Files the message carries (CONTRACT.md §14).
    #[serde(default)]
    pub attachments: Vec<crate::chat::run::attachments::AttachmentRef>,
    /// What this message does while a run of its conversation is going (CONTRACT.md §16);
    /// absent: `chat.multitask`.
    #[serde(default)]
    pub multitask: Option<crate::config::Multitask>,
    /// The ids a client library made (CONTRACT.md §13); never read from a body.
    #[serde(skip)]
    pub client: ClientIds,
    /// The request's `Idempotency-Key` header (CONTRACT.md §16); never read from a body.
    #[serde(skip)]
    pub idempotency_key: Option<crate::domain::IdempotencyKey>,
}

/// A tool the frontend runs, as a request declares it.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientTool {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The JSON Schema of its input.
    #[serde(default = "object_schema")]
    #[schema(value_type = Object)]
    pub parameters: Value,
}

fn object_schema() -> Value {
    serde_json::json!({"type": "object", "properties": {}})
}

/// The ids a client library gave a new conversation and the user's message.
#[derive(Debug, Clone, Default)]
pub struct ClientIds {
    /// The conversation's `external_id`, if the request creates it.
    pub chat_id: Option<String>,
    /// The user message's `client_id`.
    pub message_id: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum InteractionType {
    #[default]
    TextInput,
    ValueSelected,
    ActionExecuted,
}
