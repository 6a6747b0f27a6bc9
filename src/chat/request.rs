//! A chat request (CONTRACT.md §4) as the native endpoint's body reads it, and as the client
//! libraries' requests are mapped onto it: the data a start checks and plans; and what its
//! start comes to.

use serde::Deserialize;
use serde_json::Value;

use crate::ids::{ConversationId, FileId, MessageId};

/// The body of `POST /api/chat/stream` (CONTRACT.md §4).
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
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
    pub attachments: Vec<AttachmentRef>,
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
    /// What a client's request adds to the system prompt's instructions for this run (the
    /// Responses API's `instructions`, CONTRACT.md §20); never read from this body.
    #[serde(skip)]
    pub instructions: Option<String>,
    /// This run's output limit and temperature over the profile's (the Responses API's
    /// `max_output_tokens` and `temperature`); never read from this body.
    #[serde(skip)]
    pub max_tokens: Option<u32>,
    #[serde(skip)]
    pub temperature: Option<f64>,
    /// Kept with the run's trace (the Responses API's `metadata`); never read from this body.
    #[serde(skip)]
    pub metadata: Option<Value>,
}

/// An attachment as a request names it: a stored file, or a URL (`data:` or, where
/// allowed, `http(s)`) to store first.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AttachmentRef {
    #[serde(default)]
    pub file_id: Option<FileId>,
    /// `data:<type>;base64,<bytes>`, or an `http(s)` URL with `files.fetch_remote`.
    #[serde(default)]
    pub url: Option<String>,
    /// The file's name, for a URL (a file id's file has its own).
    #[serde(default)]
    pub name: Option<String>,
}

impl AttachmentRef {
    pub fn file(id: FileId) -> Self {
        Self { file_id: Some(id), url: None, name: None }
    }

    pub fn url(url: impl Into<String>, name: Option<String>) -> Self {
        Self { file_id: None, url: Some(url.into()), name }
    }
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

/// What a start came to: its runs, or why the chat service looks again. (A refusal that
/// answers the request, such as a user over the limit of running runs, is an error.)
#[derive(Debug)]
pub(in crate::chat) enum Begun<T> {
    Started(T),
    /// The request's `Idempotency-Key` names a run already: another start recorded it first,
    /// or its run is the one going in the conversation. That run is the answer.
    KeyTaken,
    /// A run of the conversation began on another replica after the start looked.
    Moved,
    /// A client library's new chat was made by another request meanwhile.
    ChatTaken,
}

impl<T> Begun<T> {
    pub(in crate::chat) fn map<U>(self, f: impl FnOnce(T) -> U) -> Begun<U> {
        match self {
            Begun::Started(t) => Begun::Started(f(t)),
            Begun::KeyTaken => Begun::KeyTaken,
            Begun::Moved => Begun::Moved,
            Begun::ChatTaken => Begun::ChatTaken,
        }
    }
}
