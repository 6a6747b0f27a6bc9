//! The bodies handlers answer with, as the OpenAPI document describes them: one type per
//! response shape, so the document, the TypeScript types and the real responses agree.

use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

pub use crate::chat::ChatRequest;
pub use crate::domain::{Comparison, ContextState, Conversation, Feedback, Message, Trace, TraceStatus};
pub use crate::events::{Event, LoggedEvent};

/// Every error outside a stream (CONTRACT.md §1).
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    /// VALIDATION_ERROR, UNAUTHORIZED, NOT_FOUND, CONFLICT, PAYLOAD_TOO_LARGE, RATE_LIMITED,
    /// NETWORK_ERROR, SERVICE_UNAVAILABLE or INTERNAL.
    pub code: String,
    pub message: String,
    /// The one field at fault, when there is one.
    pub field: Option<String>,
}

/// What any route of a user may answer instead: 400, 401 and 429, each as an [`ErrorBody`].
#[derive(utoipa::IntoResponses)]
pub enum Refused {
    #[response(status = 400, description = "Invalid input")]
    Invalid(ErrorBody),
    #[response(status = 401, description = "Missing or invalid credentials")]
    Unauthorized(ErrorBody),
    #[response(status = 429, description = "Rate limited")]
    RateLimited(ErrorBody),
}

/// 404, for an id that is unknown or another user's (never 403: no leaking existence).
#[derive(utoipa::IntoResponses)]
pub enum Missing {
    #[response(status = 404, description = "Unknown, or another user's")]
    Missing(ErrorBody),
}

#[derive(Serialize, ToSchema)]
pub struct StatusBody {
    /// `ok` (liveness) or `ready` (readiness).
    pub status: &'static str,
}

#[derive(Serialize, ToSchema)]
pub struct ConversationList {
    pub conversations: Vec<Conversation>,
    /// Pass as `cursor` for the next page; null on the last one.
    pub next_cursor: Option<String>,
}

/// A conversation with the messages of its active branch.
#[derive(Serialize, ToSchema)]
pub struct ConversationView {
    #[serde(flatten)]
    pub conversation: Conversation,
    pub messages: Vec<Message>,
    /// What context trimming kept, if it trimmed.
    pub context_state: Option<ContextState>,
    /// The conversation's runs still going (running, or waiting: CONTRACT.md §15), oldest
    /// first. Their answers are not among the messages yet: follow one from its start with
    /// `GET /api/chat/stream/{trace_id}` (or after `last_seq`, to hear only what is new).
    pub active_runs: Vec<ActiveRun>,
}

/// A run still going, on load (CONTRACT.md §16).
#[derive(Serialize, ToSchema)]
pub struct ActiveRun {
    pub trace_id: TraceId,
    /// The answer it is writing.
    pub message_id: MessageId,
    /// The question it answers (a message queued behind a run follows that run's answer,
    /// which is not among the messages until it ends).
    pub user_message_id: MessageId,
    /// `running`, `waiting` or `queued`.
    pub status: TraceStatus,
    /// The seq of its newest event so far.
    pub last_seq: u64,
}

#[derive(Serialize, ToSchema)]
pub struct FeedbackResult {
    pub message_id: MessageId,
    pub feedback: Option<Feedback>,
}

#[derive(Serialize, ToSchema)]
pub struct SiblingsView {
    pub message_id: MessageId,
    pub parent_id: Option<MessageId>,
    /// The messages at that point, oldest first.
    pub siblings: Vec<SiblingView>,
}

/// A message among its siblings.
#[derive(Serialize, ToSchema)]
pub struct SiblingView {
    #[serde(flatten)]
    pub message: Message,
    /// Whether it is on the conversation's active branch.
    pub active: bool,
}

/// A trace with its timings and logged events (CONTRACT.md §9).
#[derive(Serialize, ToSchema)]
pub struct TraceView {
    #[serde(flatten)]
    pub trace: Trace,
    pub duration_ms: Option<i64>,
    pub events: Vec<LoggedEvent>,
}

/// A cancel's answer: of one run (`trace_id`, `message_id`), of a comparison's runs
/// (`comparison_id`, `trace_ids`), or of a conversation's (`conversation_id`, `trace_ids`,
/// and the first run's `trace_id` and `message_id`).
#[derive(Serialize, ToSchema)]
pub struct CancelResult {
    /// `cancelled`.
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<TraceId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_id: Option<MessageId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comparison_id: Option<ComparisonId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<ConversationId>,
    /// With `comparison_id` or `conversation_id`: the runs that were cancelled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_ids: Option<Vec<TraceId>>,
}

impl CancelResult {
    pub fn run(trace_id: TraceId, message_id: MessageId) -> Self {
        Self {
            status: "cancelled",
            trace_id: Some(trace_id),
            message_id: Some(message_id),
            comparison_id: None,
            conversation_id: None,
            trace_ids: None,
        }
    }

    pub fn comparison(comparison_id: ComparisonId, trace_ids: Vec<TraceId>) -> Self {
        Self {
            status: "cancelled",
            trace_id: None,
            message_id: None,
            comparison_id: Some(comparison_id),
            conversation_id: None,
            trace_ids: Some(trace_ids),
        }
    }

    /// `runs` (`trace_id`, `message_id`) holds one at least.
    pub fn conversation(conversation_id: ConversationId, runs: Vec<(TraceId, MessageId)>) -> Self {
        Self {
            status: "cancelled",
            trace_id: runs.first().map(|run| run.0),
            message_id: runs.first().map(|run| run.1),
            comparison_id: None,
            conversation_id: Some(conversation_id),
            trace_ids: Some(runs.into_iter().map(|run| run.0).collect()),
        }
    }
}

/// The chat body (`ChatRequest`) plus the two profiles to compare.
#[derive(Serialize, ToSchema)]
pub struct AbStreamBody {
    pub message: String,
    pub conversation_id: Option<ConversationId>,
    pub parent_message_id: Option<MessageId>,
    pub context: Option<Value>,
    pub interaction_type: Option<crate::chat::InteractionType>,
    pub action: Option<Value>,
    pub diagnostics: Option<bool>,
    pub profile_a: String,
    pub profile_b: String,
}

/// One Server-Sent Events frame: `id` is the event's seq, `data` a JSON [`Event`] (on the
/// legacy stream, a legacy event). Comment frames (`: ping`) keep idle streams open.
#[derive(Serialize, ToSchema)]
pub struct SseFrame {
    pub id: Option<String>,
    /// JSON text: an `Event` (see components.schemas.Event).
    pub data: String,
    pub event: Option<String>,
    pub retry: Option<u64>,
}

/// A comparison with what each side's run cost.
#[derive(Serialize, ToSchema)]
pub struct ComparisonView {
    #[serde(flatten)]
    pub comparison: Comparison,
    pub a: SideView,
    pub b: SideView,
}

/// One side of a comparison: its run's trace, model, status, time to first token, duration
/// and usage.
#[derive(Serialize, ToSchema)]
pub struct SideView {
    pub trace_id: TraceId,
    pub message_id: MessageId,
    pub model: String,
    pub profile: String,
    pub status: crate::domain::TraceStatus,
    pub time_to_first_token_ms: Option<i64>,
    pub duration_ms: Option<i64>,
    pub usage: Option<crate::domain::Usage>,
    /// What the side cost (CONTRACT.md §18), where its model has a price.
    #[serde(flatten)]
    pub cost: crate::domain::Cost,
}

#[derive(Serialize, ToSchema)]
pub struct LeaderboardView {
    pub models: Vec<crate::chat::arena::Standing>,
    /// Votes counted.
    pub votes: usize,
    /// The Elo K-factor.
    pub k: f64,
    /// Every model's rating before its first vote.
    pub start: f64,
}

#[derive(Serialize, ToSchema)]
pub struct ProfilesView {
    pub profiles: Vec<ProfileView>,
    pub default_profile: String,
}

/// A configured profile, without anything secret (keys live on providers).
#[derive(Serialize, ToSchema)]
pub struct ProfileView {
    pub id: String,
    pub provider: String,
    pub provider_kind: Option<crate::config::ProviderKind>,
    pub model: String,
    /// Whether it is `chat.default_profile`.
    pub default: bool,
    pub enable_thinking: bool,
    pub max_iterations: u32,
    pub context_limit: Option<u32>,
}

#[derive(Serialize, ToSchema)]
pub struct ToolsView {
    pub tools: Vec<ToolView>,
    pub mcp_servers: Vec<crate::tools::mcp::McpServerStatus>,
    /// With `?page=` or `?profile=`: the tools such a request gets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub for_request: Option<Vec<String>>,
}

/// A tool under the name a model sees it by.
#[derive(Serialize, ToSchema)]
pub struct ToolView {
    pub name: String,
    pub description: String,
    /// Its arguments' JSON schema.
    pub input_schema: Value,
    pub source: crate::tools::ToolSource,
    /// Offered on every page.
    pub global: bool,
}

/// One legacy event: `chunk`, `tool_start`, `tool_output`, `tool_end`, `error` or `done`.
#[derive(Serialize, ToSchema)]
pub struct LegacyEvent {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(flatten)]
    pub fields: std::collections::BTreeMap<String, Value>,
}

#[derive(Serialize, ToSchema)]
pub struct LegacyConversation {
    pub conversation_id: ConversationId,
    pub title: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub last_message_at: chrono::DateTime<chrono::Utc>,
    pub messages: Vec<LegacyMessage>,
}

/// A message in the legacy vocabulary.
#[derive(Serialize, ToSchema)]
pub struct LegacyMessage {
    pub message_id: MessageId,
    pub role: crate::domain::Role,
    pub content: String,
    pub timestamp: chrono::DateTime<chrono::Utc>,
    /// The rating, if the message has one.
    pub feedback: Option<crate::domain::Rating>,
    pub trace_id: Option<TraceId>,
}

#[derive(Serialize, ToSchema)]
pub struct LegacyList {
    pub conversations: Vec<LegacyListed>,
}

/// A conversation in the legacy list.
#[derive(Serialize, ToSchema)]
pub struct LegacyListed {
    pub conversation_id: ConversationId,
    pub title: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub last_message_at: chrono::DateTime<chrono::Utc>,
}
