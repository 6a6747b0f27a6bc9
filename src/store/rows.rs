//! Row types read with runtime `query_as` + `FromRow`. The same Rust types decode on both
//! backends (uuid ↔ blob/uuid, time ↔ text/timestamptz, `Json` ↔ text/jsonb), so one row
//! type per table serves both; conversions into domain types live here too.

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::types::Json;

use super::{RunningTrace, Settlement, StoreError, Wait, WaitKind};
use crate::domain::{
    AssistantTurn, Attachment, Comparison, ContextState, Conversation, Cost, Feedback, Message, Preference, Role,
    RunError, Span, StoredFile, SuggestedAction, SuggestedValue, ToolCall, ToolRecord, Trace, TraceStatus, Usage, Vote,
};

/// A JSON column's value, serialized once: one type to bind for every JSON column.
pub type JsonText = Json<Box<serde_json::value::RawValue>>;

/// A value for a JSON column.
pub fn json(value: &impl Serialize) -> JsonText {
    Json(serde_json::value::to_raw_value(value).expect("domain values serialize"))
}

/// A JSON column's value as `T`, or `None` (with a warning) where it is not one: a row
/// written by hand or by a newer version still reads, without the part this one cannot.
fn lenient<T: DeserializeOwned>(what: &str, value: Value) -> Option<T> {
    serde_json::from_value(value).map_err(|e| tracing::warn!(error = %e, "a stored {what} is left out")).ok()
}

/// The `provider_state` column of an answer: its model calls, as the next turns send them.
#[derive(Serialize, Deserialize)]
struct ProviderState<T> {
    turns: T,
}

/// The `provider_state` to store for a message: its turns, where they say more than its
/// content ([`Message::turns_to_keep`]; an answer of one turn of text alone, most of them,
/// would otherwise be stored twice).
pub fn provider_state(message: &Message) -> Option<JsonText> {
    let turns = message.turns_to_keep();
    (!turns.is_empty()).then(|| json(&ProviderState { turns }))
}

/// A conversation's stored context state.
pub fn context_state(value: Value) -> Option<ContextState> {
    lenient("context state", value)
}
use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId, UserId};

pub const CONVERSATION_COLUMNS: &str = "id, user_id, title, profile, system_prompt, metadata, \
     external_id, active_leaf_id, message_count, created_at, updated_at, last_message_at";

#[derive(sqlx::FromRow)]
pub struct ConversationRow {
    id: ConversationId,
    user_id: UserId,
    title: String,
    profile: Option<String>,
    system_prompt: Option<String>,
    metadata: Json<Value>,
    external_id: Option<String>,
    active_leaf_id: Option<MessageId>,
    message_count: i64,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    last_message_at: DateTime<Utc>,
}

impl From<ConversationRow> for Conversation {
    fn from(row: ConversationRow) -> Self {
        Conversation {
            id: row.id,
            user_id: row.user_id,
            title: row.title,
            profile: row.profile,
            system_prompt: row.system_prompt,
            metadata: row.metadata.0,
            external_id: row.external_id,
            active_leaf_id: row.active_leaf_id,
            message_count: row.message_count,
            created_at: row.created_at,
            updated_at: row.updated_at,
            last_message_at: row.last_message_at,
        }
    }
}

pub const MESSAGE_COLUMNS: &str = "id, conversation_id, parent_id, role, content, thinking, \
     provider_state, tool_calls, tool_history, payloads, suggested_values, suggested_actions, \
     cancelled, model, trace_id, usage, cost_usd, feedback, comparison_id, variant, client_id, attachments, created_at";

#[derive(sqlx::FromRow)]
pub struct MessageRow {
    id: MessageId,
    conversation_id: ConversationId,
    parent_id: Option<MessageId>,
    role: String,
    content: String,
    thinking: Option<String>,
    provider_state: Option<Json<Value>>,
    tool_calls: Json<Vec<ToolCall>>,
    tool_history: Json<Vec<ToolRecord>>,
    payloads: Json<Vec<Value>>,
    suggested_values: Json<Vec<SuggestedValue>>,
    suggested_actions: Json<Vec<SuggestedAction>>,
    cancelled: bool,
    model: Option<String>,
    trace_id: Option<TraceId>,
    usage: Option<Json<Usage>>,
    cost_usd: Option<f64>,
    feedback: Option<Json<Feedback>>,
    comparison_id: Option<ComparisonId>,
    variant: Option<String>,
    client_id: Option<String>,
    attachments: Json<Value>,
    created_at: DateTime<Utc>,
}

impl TryFrom<MessageRow> for Message {
    type Error = StoreError;

    fn try_from(row: MessageRow) -> Result<Self, StoreError> {
        Ok(Message {
            id: row.id,
            conversation_id: row.conversation_id,
            parent_id: row.parent_id,
            role: Role::parse(&row.role).map_err(|e| StoreError::Corrupt(e.to_string()))?,
            content: row.content,
            thinking: row.thinking,
            turns: row
                .provider_state
                .and_then(|j| lenient::<ProviderState<Vec<AssistantTurn>>>("provider state", j.0))
                .map(|state| state.turns)
                .unwrap_or_default(),
            tool_calls: row.tool_calls.0,
            tool_history: row.tool_history.0,
            payloads: row.payloads.0,
            suggested_values: row.suggested_values.0,
            suggested_actions: row.suggested_actions.0,
            cancelled: row.cancelled,
            model: row.model,
            trace_id: row.trace_id,
            cost: Cost::of(row.cost_usd, row.usage.as_ref().map(|j| &j.0)),
            usage: row.usage.map(|j| j.0),
            feedback: row.feedback.map(|j| j.0),
            comparison_id: row.comparison_id,
            variant: row.variant,
            client_id: row.client_id,
            attachments: lenient::<Vec<Attachment>>("message's attachments", row.attachments.0).unwrap_or_default(),
            created_at: row.created_at,
        })
    }
}

pub const TRACE_COLUMNS: &str = "id, conversation_id, user_id, user_message_id, message_id, \
     status, model, profile, started_at, ended_at, usage, cost_usd, error, spans, comparison_id, variant, traceparent, metadata";

#[derive(sqlx::FromRow)]
pub struct TraceRow {
    id: TraceId,
    conversation_id: ConversationId,
    user_id: UserId,
    user_message_id: MessageId,
    message_id: MessageId,
    status: String,
    model: String,
    profile: String,
    started_at: DateTime<Utc>,
    ended_at: Option<DateTime<Utc>>,
    usage: Option<Json<Usage>>,
    cost_usd: Option<f64>,
    error: Option<Json<Value>>,
    spans: Json<Vec<Value>>,
    comparison_id: Option<ComparisonId>,
    variant: Option<String>,
    traceparent: Option<String>,
    metadata: Option<Json<Value>>,
}

impl TryFrom<TraceRow> for Trace {
    type Error = StoreError;

    fn try_from(row: TraceRow) -> Result<Self, StoreError> {
        Ok(Trace {
            trace_id: row.id,
            conversation_id: row.conversation_id,
            user_message_id: row.user_message_id,
            message_id: row.message_id,
            user_id: row.user_id,
            status: TraceStatus::parse(&row.status).map_err(|e| StoreError::Corrupt(e.to_string()))?,
            model: row.model,
            profile: row.profile,
            started_at: row.started_at,
            ended_at: row.ended_at,
            cost: Cost::of(row.cost_usd, row.usage.as_ref().map(|j| &j.0)),
            usage: row.usage.map(|j| j.0),
            error: row.error.and_then(|j| lenient::<RunError>("run error", j.0)),
            spans: row.spans.0.into_iter().filter_map(|span| lenient::<Span>("span", span)).collect(),
            comparison_id: row.comparison_id,
            variant: row.variant,
            traceparent: row.traceparent,
            metadata: row.metadata.map(|j| j.0),
        })
    }
}

#[derive(sqlx::FromRow)]
pub struct RunningRow {
    #[sqlx(flatten)]
    trace: TraceRow,
    replica_id: Option<String>,
    heartbeat_at: Option<DateTime<Utc>>,
}

impl TryFrom<RunningRow> for RunningTrace {
    type Error = StoreError;

    fn try_from(row: RunningRow) -> Result<Self, StoreError> {
        Ok(RunningTrace { trace: row.trace.try_into()?, replica_id: row.replica_id, heartbeat_at: row.heartbeat_at })
    }
}

pub const COMPARISON_COLUMNS: &str = "id, conversation_id, user_id, user_message_id, trace_a, trace_b, \
     profile_a, profile_b, model_a, model_b, preference, voted_at, vote_history, created_at";

#[derive(sqlx::FromRow)]
pub struct ComparisonRow {
    id: ComparisonId,
    conversation_id: ConversationId,
    user_id: UserId,
    user_message_id: MessageId,
    trace_a: TraceId,
    trace_b: TraceId,
    profile_a: String,
    profile_b: String,
    model_a: String,
    model_b: String,
    preference: Option<String>,
    voted_at: Option<DateTime<Utc>>,
    vote_history: Json<Vec<Vote>>,
    created_at: DateTime<Utc>,
}

impl TryFrom<ComparisonRow> for Comparison {
    type Error = StoreError;

    fn try_from(row: ComparisonRow) -> Result<Self, StoreError> {
        let preference = row
            .preference
            .map(|p| Preference::parse(&p))
            .transpose()
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        Ok(Comparison {
            comparison_id: row.id,
            conversation_id: row.conversation_id,
            user_id: row.user_id,
            user_message_id: row.user_message_id,
            trace_a: row.trace_a,
            trace_b: row.trace_b,
            profile_a: row.profile_a,
            profile_b: row.profile_b,
            model_a: row.model_a,
            model_b: row.model_b,
            preference,
            voted_at: row.voted_at,
            vote_history: row.vote_history.0,
            created_at: row.created_at,
        })
    }
}

pub const WAIT_COLUMNS: &str = "id, trace_id, user_id, kind, tool_call_id, tool, input, created_at, expires_at, \
     outcome, decided_at, reason, output, is_error";

#[derive(sqlx::FromRow)]
pub struct WaitRow {
    id: uuid::Uuid,
    trace_id: TraceId,
    user_id: UserId,
    kind: String,
    tool_call_id: String,
    tool: String,
    input: Json<Value>,
    created_at: DateTime<Utc>,
    expires_at: Option<DateTime<Utc>>,
    outcome: Option<String>,
    decided_at: Option<DateTime<Utc>>,
    reason: Option<String>,
    output: Option<String>,
    is_error: bool,
}

impl TryFrom<WaitRow> for Wait {
    type Error = StoreError;

    fn try_from(row: WaitRow) -> Result<Self, StoreError> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("unknown wait {what}"));
        let settled = match (row.decided_at, row.outcome.as_deref()) {
            (None, _) => None,
            (Some(_), Some("approved")) => Some(Settlement::Approved),
            (Some(_), Some("denied")) => Some(Settlement::Denied { reason: row.reason }),
            (Some(_), Some("expired")) => Some(Settlement::Expired),
            (Some(_), Some("result")) => {
                Some(Settlement::Result { output: row.output.unwrap_or_default(), is_error: row.is_error })
            }
            (Some(_), _) => return Err(corrupt("outcome")),
        };
        Ok(Wait {
            id: row.id,
            trace_id: row.trace_id,
            user_id: row.user_id,
            kind: WaitKind::parse(&row.kind).ok_or_else(|| corrupt("kind"))?,
            tool_call_id: row.tool_call_id,
            tool: row.tool,
            input: row.input.0,
            created_at: row.created_at,
            expires_at: row.expires_at,
            settled,
        })
    }
}

pub const FILE_COLUMNS: &str = "id, user_id, name, media_type, size, sha256, width, height, created_at";

#[derive(sqlx::FromRow)]
pub struct FileRow {
    id: crate::ids::FileId,
    user_id: crate::ids::UserId,
    name: String,
    media_type: String,
    size: i64,
    sha256: String,
    width: Option<i64>,
    height: Option<i64>,
    created_at: DateTime<Utc>,
}

impl From<FileRow> for StoredFile {
    fn from(row: FileRow) -> Self {
        StoredFile {
            id: row.id,
            user_id: row.user_id,
            name: row.name,
            media_type: row.media_type,
            size: row.size.max(0) as u64,
            sha256: row.sha256,
            width: row.width.and_then(|w| u32::try_from(w).ok()),
            height: row.height.and_then(|h| u32::try_from(h).ok()),
            created_at: row.created_at,
        }
    }
}
