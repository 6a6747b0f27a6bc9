//! Domain types shared by the store, the run and the HTTP layer: conversations, messages,
//! traces, and the small value types they carry. Enums parse from strings with a `Result`,
//! so a bad value is refused where it enters. A run's trace, its spans and the context
//! state it records are in [`trace`].

pub mod branch;
pub mod budget;
mod trace;
pub mod webhook;

pub use branch::{branch, branch_through};
pub use trace::{
    CallStatus, ContextState, ContextStrategy, LlmAttributes, RunError, Span, SpanTiming, ToolAttributes, ToolStatus,
    Trace,
};

use chrono::{DateTime, SubsecRound, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{ComparisonId, ConversationId, FileId, MessageId, TraceId, UserId};

/// The current time, cut to microseconds: both databases then store and return it exactly,
/// so a pagination cursor made from a returned time matches the stored one.
pub fn now() -> DateTime<Utc> {
    Utc::now().trunc_subsecs(6)
}

macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($variant),+ }

        impl $name {
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            pub fn parse(text: &str) -> Result<Self, UnknownValue> {
                match text {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownValue { kind: stringify!($name), value: text.to_owned() }),
                }
            }
        }
    };
}

/// A stored string that names no variant: a corrupted row or a newer schema.
#[derive(Debug, thiserror::Error)]
#[error("unknown {kind} value '{value}'")]
pub struct UnknownValue {
    pub kind: &'static str,
    pub value: String,
}

string_enum!(Role { User = "user", Assistant = "assistant", System = "system", Tool = "tool" });
string_enum!(Rating { Up = "up", Down = "down" });
string_enum!(
    /// A vote on an A/B comparison.
    Preference { A = "a", B = "b", Tie = "tie", BothBad = "both_bad" }
);
string_enum!(
    /// A run's state in its trace (CONTRACT.md §9); `waiting`: for an approval or a client
    /// tool's result (§15); `queued`: sent while another run of its conversation was going,
    /// it starts once that one ends (§16).
    TraceStatus {
        Queued = "queued",
        Running = "running",
        Waiting = "waiting",
        Completed = "completed",
        Cancelled = "cancelled",
        Error = "error",
        Interrupted = "interrupted",
    }
);

impl TraceStatus {
    /// Whether a run in this state will send more (queued, running or waiting).
    pub fn is_going(self) -> bool {
        matches!(self, TraceStatus::Running | TraceStatus::Waiting | TraceStatus::Queued)
    }
}

/// Token counts of one model call, or summed over a run (CONTRACT.md §18). `input_tokens`
/// is every input token, those read from or written to the provider's prompt cache
/// included (as OpenAI and Gemini count them; Anthropic's three counts are added up);
/// `output_tokens` every output token, reasoning included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Of the input, what the provider read from its prompt cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_tokens: Option<u64>,
    /// Of the input, what the provider wrote to its prompt cache (Anthropic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
    /// Of those, what it keeps for an hour (Anthropic's breakdown by TTL), for the price:
    /// the rest is kept five minutes. Not sent: the contract's usage has no such field.
    #[serde(skip)]
    pub cache_write_1h_tokens: Option<u64>,
    /// Of the output, the model's reasoning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
    /// Some of these counts are chatd's own estimate (about four characters a token): the
    /// provider sent none, or not all (CONTRACT.md §18). Absent when they are the provider's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub estimated: bool,
}

impl Usage {
    pub fn add(&mut self, other: &Usage) {
        fn sum(a: Option<u64>, b: Option<u64>) -> Option<u64> {
            match (a, b) {
                (None, None) => None,
                (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
            }
        }
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cache_read_tokens = sum(self.cache_read_tokens, other.cache_read_tokens);
        self.cache_write_tokens = sum(self.cache_write_tokens, other.cache_write_tokens);
        self.cache_write_1h_tokens = sum(self.cache_write_1h_tokens, other.cache_write_1h_tokens);
        self.reasoning_tokens = sum(self.reasoning_tokens, other.reasoning_tokens);
        self.estimated |= other.estimated;
    }
}

/// What a model call or a run cost (CONTRACT.md §18), beside its usage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Cost {
    /// US dollars, where a price is known; absent (never 0) where none is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    /// The usage it was priced from is chatd's estimate.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cost_estimated: bool,
}

impl Cost {
    /// `usd` for `usage`: estimated where the usage is.
    pub fn of(usd: Option<f64>, usage: Option<&Usage>) -> Self {
        Self { cost_usd: usd, cost_estimated: usd.is_some() && usage.is_some_and(|u| u.estimated) }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SuggestedValue {
    pub label: String,
    pub value: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SuggestedAction {
    pub label: String,
    pub action: String,
    #[serde(default = "client_handler")]
    pub handler: String,
    #[serde(default)]
    pub data: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub style: Option<String>,
}

fn client_handler() -> String {
    "client".to_owned()
}

/// One executed tool call as the client and the trace see it (`tool_history[N]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ToolRecord {
    pub tool_call_id: String,
    pub tool_name: String,
    pub input: Value,
    pub output: String,
    pub is_error: bool,
    pub duration_ms: u64,
}

/// A tool call as the model asked for it, kept to send back in later turns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub input: Value,
    /// Why the model's arguments could not be read (not JSON): the call is answered with
    /// this as a tool error instead of being run, and the model may try again. Its `input`
    /// is then `{}`. Only the run that made the call needs it.
    #[serde(skip)]
    pub invalid_arguments: Option<String>,
}

/// A tool's answer as the model gets it back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ToolResult {
    pub tool_call_id: String,
    pub tool_name: String,
    pub content: String,
    pub is_error: bool,
}

/// One model call of an assistant message: what the model said and asked for, and what
/// its tools answered. Stored with the message so later turns send the exchange back to
/// the provider in its own format.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AssistantTurn {
    pub text: String,
    /// Signed thinking blocks (Anthropic), sent back as received.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub thinking_blocks: Vec<ThinkingBlock>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_results: Vec<ToolResult>,
}

impl AssistantTurn {
    /// A turn of `text` alone: what an answer stored without its turns is sent as.
    pub fn of_text(text: &str) -> Self {
        AssistantTurn { text: text.to_owned(), ..AssistantTurn::default() }
    }

    /// Whether this turn is [`of_text`](Self::of_text)`(text)`, without making one.
    pub fn is_text(&self, text: &str) -> bool {
        let AssistantTurn { text: said, thinking_blocks, tool_calls, tool_results } = self;
        said == text && thinking_blocks.is_empty() && tool_calls.is_empty() && tool_results.is_empty()
    }
}

/// A block of the model's thinking with the provider's proof of it, which later turns must
/// send back unchanged (Anthropic's `thinking` content block).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ThinkingBlock {
    Thinking { thinking: String, signature: String },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Feedback {
    pub rating: Option<Rating>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Conversation {
    pub id: ConversationId,
    #[serde(skip)]
    pub user_id: UserId,
    pub title: String,
    pub profile: Option<String>,
    pub system_prompt: Option<String>,
    pub metadata: Value,
    /// The id a client library gave this conversation (the AI SDK's chat id, AG-UI's thread
    /// id; CONTRACT.md §13), unique among its user's conversations. Absent when none did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub external_id: Option<String>,
    /// The newest message of the branch that loading shows.
    #[serde(skip)]
    pub active_leaf_id: Option<MessageId>,
    pub message_count: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub last_message_at: DateTime<Utc>,
}

impl Conversation {
    /// A new, empty conversation of `user`, created now.
    pub fn new(user_id: &UserId, title: String) -> Self {
        let at = now();
        Conversation {
            id: ConversationId::new(),
            user_id: user_id.clone(),
            title,
            profile: None,
            system_prompt: None,
            metadata: Value::Object(Default::default()),
            external_id: None,
            active_leaf_id: None,
            message_count: 0,
            created_at: at,
            updated_at: at,
            last_message_at: at,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Message {
    pub id: MessageId,
    pub conversation_id: ConversationId,
    pub parent_id: Option<MessageId>,
    pub role: Role,
    pub content: String,
    pub thinking: Option<String>,
    /// An answer's model calls, oldest first, with the thinking signatures and tool
    /// exchanges the next turns must send back. Empty for the user's messages, and for an
    /// answer stored without them (by hand, or by another version).
    #[serde(skip)]
    pub turns: Vec<AssistantTurn>,
    pub tool_calls: Vec<ToolCall>,
    pub tool_history: Vec<ToolRecord>,
    pub payloads: Vec<Value>,
    pub suggested_values: Vec<SuggestedValue>,
    pub suggested_actions: Vec<SuggestedAction>,
    pub cancelled: bool,
    pub model: Option<String>,
    pub trace_id: Option<TraceId>,
    pub usage: Option<Usage>,
    #[serde(flatten)]
    pub cost: Cost,
    pub feedback: Option<Feedback>,
    pub comparison_id: Option<ComparisonId>,
    pub variant: Option<String>,
    /// The id the client library gave a user message (CONTRACT.md §13), so that a later
    /// edit of it finds it. Absent when none did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
    /// The files a user message carries (CONTRACT.md §14), in the order they were given;
    /// absent when it carries none (as every message did before attachments).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<Attachment>,
    pub created_at: DateTime<Utc>,
}

/// A request's `Idempotency-Key` (CONTRACT.md §16) and a hash of what it asked (its endpoint
/// and body): the same key with another request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    pub key: String,
    pub request_hash: String,
}

/// A file a user stored (CONTRACT.md §14). Its bytes are in the file storage under its
/// `sha256`; files with the same bytes share them.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct StoredFile {
    pub id: FileId,
    #[serde(skip)]
    pub user_id: UserId,
    pub name: String,
    /// Read from the bytes, never taken from the client.
    pub media_type: String,
    pub size: u64,
    /// Hex.
    pub sha256: String,
    /// An image's size in pixels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
    pub created_at: DateTime<Utc>,
}

impl StoredFile {
    /// The file as a message carries it.
    pub fn attachment(&self) -> Attachment {
        Attachment {
            file_id: self.id,
            name: self.name.clone(),
            media_type: self.media_type.clone(),
            size: self.size,
            sha256: self.sha256.clone(),
            width: self.width,
            height: self.height,
        }
    }
}

/// A file as a message carries it: enough to show it and to find its bytes again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Attachment {
    pub file_id: FileId,
    pub name: String,
    pub media_type: String,
    pub size: u64,
    /// Hex; where its bytes are.
    pub sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
}

impl Attachment {
    pub fn is_image(&self) -> bool {
        self.media_type.starts_with("image/")
    }

    pub fn is_pdf(&self) -> bool {
        self.media_type == "application/pdf"
    }

    /// Text files go to the model as text.
    pub fn is_text(&self) -> bool {
        !self.is_image() && !self.is_pdf()
    }
}

impl Message {
    /// A message with only the required parts set; the rest empty.
    pub fn new(conversation_id: ConversationId, parent_id: Option<MessageId>, role: Role, content: String) -> Self {
        Self {
            id: MessageId::new(),
            conversation_id,
            parent_id,
            role,
            content,
            thinking: None,
            turns: Vec::new(),
            tool_calls: Vec::new(),
            tool_history: Vec::new(),
            payloads: Vec::new(),
            suggested_values: Vec::new(),
            suggested_actions: Vec::new(),
            cancelled: false,
            model: None,
            trace_id: None,
            usage: None,
            cost: Cost::default(),
            feedback: None,
            comparison_id: None,
            variant: None,
            client_id: None,
            attachments: Vec::new(),
            created_at: now(),
        }
    }

    /// The turns of an answer that its content does not already say: none where its one
    /// turn is its content alone (the answer is sent as that turn without them), so that
    /// most answers are not stored twice.
    pub fn turns_to_keep(&self) -> &[AssistantTurn] {
        match self.turns.as_slice() {
            [turn] if turn.is_text(&self.content) => &[],
            turns => turns,
        }
    }
}

/// One vote, as kept in a comparison's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Vote {
    pub preference: Preference,
    pub at: DateTime<Utc>,
}

/// Two answers to one user message, by two profiles, and the user's vote.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Comparison {
    pub comparison_id: ComparisonId,
    pub conversation_id: ConversationId,
    #[serde(skip)]
    pub user_id: UserId,
    pub user_message_id: MessageId,
    pub trace_a: TraceId,
    pub trace_b: TraceId,
    pub profile_a: String,
    pub profile_b: String,
    pub model_a: String,
    pub model_b: String,
    pub preference: Option<Preference>,
    pub voted_at: Option<DateTime<Utc>>,
    pub vote_history: Vec<Vote>,
    pub created_at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_round_trip_and_refuse_unknown_text() {
        for role in [Role::User, Role::Assistant, Role::System, Role::Tool] {
            assert_eq!(Role::parse(role.as_str()).unwrap(), role);
        }
        assert!(Rating::parse("meh").is_err());
        assert_eq!(TraceStatus::parse("interrupted").unwrap(), TraceStatus::Interrupted);
    }
}
