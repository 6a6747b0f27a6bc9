//! A run as stored (CONTRACT.md §9): its trace, the spans of its model and tool calls, what
//! it ended with, and the context state that trimming records. These are written as JSON
//! columns; the types here are what those columns hold.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{TraceStatus, Usage};
use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId, UserId};

/// A run as stored: its trace (CONTRACT.md §9), without the events.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Trace {
    pub trace_id: TraceId,
    pub conversation_id: ConversationId,
    pub user_message_id: MessageId,
    pub message_id: MessageId,
    pub user_id: UserId,
    pub status: TraceStatus,
    pub model: String,
    pub profile: String,
    pub started_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    pub usage: Option<Usage>,
    #[serde(flatten)]
    pub cost: super::Cost,
    pub error: Option<RunError>,
    pub spans: Vec<Span>,
    pub comparison_id: Option<ComparisonId>,
    pub variant: Option<String>,
    /// The starting request's `traceparent` (W3C Trace Context), where traces are exported
    /// and one came: the run's OTLP spans join that trace (CONTRACT.md §18). Not shown.
    #[serde(skip)]
    pub traceparent: Option<String>,
    /// The starting request's `metadata` (the Responses API's, CONTRACT.md §20), answered
    /// with each of its responses. Not shown.
    #[serde(skip)]
    pub metadata: Option<serde_json::Value>,
}

impl Trace {
    /// A new running trace of `user`'s run answering `user_message`, started now.
    pub fn start(user_id: &UserId, user_message: &super::Message, model: &str, profile: &str) -> Self {
        Trace {
            trace_id: TraceId::new(),
            conversation_id: user_message.conversation_id,
            user_message_id: user_message.id,
            message_id: MessageId::new(),
            user_id: user_id.clone(),
            status: TraceStatus::Running,
            model: model.to_owned(),
            profile: profile.to_owned(),
            started_at: super::now(),
            ended_at: None,
            usage: None,
            cost: super::Cost::default(),
            error: None,
            spans: Vec::new(),
            comparison_id: None,
            variant: None,
            traceparent: None,
            metadata: None,
        }
    }
}

/// Why a run did not complete, as its trace keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RunError {
    /// The contract's error code (`RATE_LIMITED`, `INTERRUPTED`, …).
    pub code: String,
    pub message: String,
    /// The answer's text streamed before the failure (none where the run failed inside).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_text: Option<String>,
}

impl RunError {
    pub fn new(code: &str, message: &str, partial_text: Option<String>) -> Self {
        Self { code: code.to_owned(), message: message.to_owned(), partial_text }
    }
}

/// One timed step of a run: a model call or a tool call, with OpenTelemetry GenAI
/// attributes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Span {
    /// A model call (`chat {model}`).
    Llm {
        #[serde(flatten)]
        timing: SpanTiming,
        status: CallStatus,
        attributes: Box<LlmAttributes>,
    },
    /// A tool call (`execute_tool {tool}`).
    Tool {
        #[serde(flatten)]
        timing: SpanTiming,
        status: ToolStatus,
        attributes: ToolAttributes,
    },
}

/// A span's name and when it ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SpanTiming {
    pub name: String,
    pub started_at: DateTime<Utc>,
    pub ended_at: DateTime<Utc>,
    pub duration_ms: u64,
}

impl SpanTiming {
    pub fn new(name: String, started_at: DateTime<Utc>, ended_at: DateTime<Utc>) -> Self {
        let duration_ms = u64::try_from((ended_at - started_at).num_milliseconds()).unwrap_or(0);
        Self { name, started_at, ended_at, duration_ms }
    }
}

/// How a model call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CallStatus {
    Ok,
    Cancelled,
    Error,
}

/// How a tool call ended (the `tool_complete` event's `status` too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolStatus {
    Success,
    Error,
    Cancelled,
    Timeout,
    /// A person denied the call, or its approval expired: it did not run.
    Denied,
}

/// A model call's attributes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct LlmAttributes {
    /// Always `chat`.
    #[serde(rename = "gen_ai.operation.name")]
    pub operation_name: String,
    #[serde(rename = "gen_ai.request.model")]
    pub request_model: String,
    #[serde(rename = "gen_ai.usage.input_tokens")]
    pub input_tokens: u64,
    #[serde(rename = "gen_ai.usage.output_tokens")]
    pub output_tokens: u64,
    /// The token counts are chatd's estimate: the provider sent none, or not all.
    #[serde(rename = "chatd.usage.estimated", skip_serializing_if = "std::ops::Not::not")]
    pub usage_estimated: bool,
    /// The provider's prompt cache: what it read, and wrote, of this call's input.
    #[serde(rename = "gen_ai.usage.cache_read.input_tokens", skip_serializing_if = "Option::is_none")]
    pub cache_read_tokens: Option<u64>,
    #[serde(rename = "gen_ai.usage.cache_creation.input_tokens", skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
    /// What the request marked for the cache, in estimated tokens (CONTRACT.md §21).
    #[serde(rename = "chatd.prompt_cache.prefix_tokens", skip_serializing_if = "Option::is_none")]
    pub cache_prefix_tokens: Option<u64>,
    /// What the call cost in US dollars, where its model has a price (CONTRACT.md §18).
    #[serde(rename = "chatd.cost_usd", skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    #[serde(rename = "gen_ai.response.finish_reasons")]
    pub finish_reasons: Vec<String>,
    /// What trimming did to this call's request; `null` when it sent the whole history.
    #[serde(rename = "chatd.context")]
    pub context: Option<ContextState>,
    /// Problems with the answer's markers, on the run's last model call.
    #[serde(rename = "chatd.warnings", skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// A tool call's attributes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct ToolAttributes {
    /// Always `execute_tool`.
    #[serde(rename = "gen_ai.operation.name")]
    pub operation_name: String,
    #[serde(rename = "gen_ai.tool.name")]
    pub tool_name: String,
    #[serde(rename = "gen_ai.tool.call.id")]
    pub tool_call_id: String,
}

/// What context trimming kept of a conversation for its latest model call (stored per
/// conversation, shown with it, and on the call's span).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct ContextState {
    pub strategy: ContextStrategy,
    /// The profile's `context_limit`, in tokens.
    pub limit: u32,
    /// The share of the limit the request may fill.
    pub threshold: f64,
    /// The request's estimated tokens before trimming, and after.
    pub estimate_before: u64,
    pub estimate: u64,
    /// How many history messages were dropped, and kept.
    pub dropped: usize,
    pub kept: usize,
    /// The first message kept, and the last one dropped.
    pub kept_from: Option<MessageId>,
    pub dropped_through: Option<MessageId>,
    /// What the model wrote of the dropped messages (`trim_oldest_with_summary`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ContextStrategy {
    /// The oldest messages were dropped.
    #[default]
    TrimOldest,
    /// …and replaced by the model's summary of them in the system prompt.
    TrimOldestWithSummary,
}

impl ContextStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            ContextStrategy::TrimOldest => "trim_oldest",
            ContextStrategy::TrimOldestWithSummary => "trim_oldest_with_summary",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_span_reads_and_writes_the_stored_json() {
        let stored = json!({
            "kind": "llm", "name": "chat m", "started_at": "2026-01-01T00:00:00Z",
            "ended_at": "2026-01-01T00:00:01Z", "duration_ms": 1000, "status": "ok",
            "attributes": {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m",
                "gen_ai.usage.input_tokens": 3, "gen_ai.usage.output_tokens": 4,
                "gen_ai.response.finish_reasons": ["stop"], "chatd.context": null},
        });
        let span: Span = serde_json::from_value(stored.clone()).unwrap();
        let Span::Llm { attributes, .. } = &span else { panic!("an llm span: {span:?}") };
        assert_eq!(attributes.output_tokens, 4);
        assert_eq!(serde_json::to_value(&span).unwrap(), stored);
        let tool = json!({
            "kind": "tool", "name": "execute_tool t", "started_at": "2026-01-01T00:00:00Z",
            "ended_at": "2026-01-01T00:00:00Z", "duration_ms": 0, "status": "timeout",
            "attributes": {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t",
                "gen_ai.tool.call.id": "c1"},
        });
        let span: Span = serde_json::from_value(tool.clone()).unwrap();
        assert!(matches!(span, Span::Tool { status: ToolStatus::Timeout, .. }));
        assert_eq!(serde_json::to_value(&span).unwrap(), tool);
    }
}
