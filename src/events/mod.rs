//! The wire events of CONTRACT.md §5: one enum, serde-tagged by `"type"`. Everything a run
//! tells a client goes through [`Event`]; the other vocabularies a stream can speak are
//! functions of it: the legacy one (`legacy`, §11) and the A/B stream's (`comparison`,
//! §10) here; the client libraries' (the AI SDK's UI message stream §13.1, AG-UI's §13.2)
//! each in its folder of `http`, over what they share (`parts`).

#[cfg(test)]
pub(crate) mod arbitrary;
pub mod comparison;
pub mod legacy;
pub mod parts;

use crate::ids::{ConversationId, MessageId, TraceId};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

pub use crate::domain::ToolStatus;
use crate::domain::{SuggestedAction, SuggestedValue, ToolRecord, Usage};

/// A streamed delta's text: kept in place up to 24 bytes (a token is a few), on the heap
/// beyond. Nearly every event of a run is one, and a `String` was an allocation each, freed
/// on another thread.
pub type Text = compact_str::CompactString;

/// The `status` each model call opens with: the other vocabularies start a step on it.
pub const THINKING_STATUS: &str = "Thinking…";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    Start(Box<StartEvent>),
    /// Before each model call; `step` counts the run's model calls from 0 (CONTRACT.md §19).
    StepStart {
        step: u32,
    },
    /// The text and thinking streamed since `step_start {step}` are void: the call failed
    /// after output and is made again (or by a fallback's model). A client drops them and
    /// keeps what follows.
    StepReset {
        step: u32,
        reason: String,
    },
    Status {
        message: String,
    },
    ThinkingDelta {
        #[schema(value_type = String)]
        text: Text,
    },
    TextDelta {
        #[schema(value_type = String)]
        text: Text,
    },
    ToolInputStart {
        tool_call_id: String,
        tool: String,
        index: u32,
    },
    ToolInputDelta {
        tool_call_id: String,
        delta: String,
    },
    ToolStart(Box<ToolStartEvent>),
    ToolProgress(Box<ToolProgressEvent>),
    ToolOutput {
        tool_call_id: String,
        output: String,
        truncated: bool,
        full_length: usize,
    },
    ToolComplete(Box<ToolCompleteEvent>),
    ToolApprovalRequest(Box<ToolApprovalRequestEvent>),
    ToolResultRequest(Box<ToolResultRequestEvent>),
    Usage(Box<Usage>),
    Complete {
        payload: Box<CompletePayload>,
    },
    Cancelled(Box<CancelledEvent>),
    Error(Box<ErrorEvent>),
    Done {
        conversation_id: ConversationId,
        message_id: MessageId,
        trace_id: TraceId,
    },
}

impl Event {
    /// Appends the event's JSON, as serde writes it, to `out`. A delta (nearly every event
    /// of a run) is written without serde's walk of the enum: its one string is all that
    /// varies.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        let (head, text) = match self {
            Event::TextDelta { text } => (&br#"{"type":"text_delta","text":"#[..], text),
            Event::ThinkingDelta { text } => (&br#"{"type":"thinking_delta","text":"#[..], text),
            other => return serde_json::to_writer(out, other).expect("events always serialize"),
        };
        out.reserve(head.len() + text.len() + 3);
        out.extend_from_slice(head);
        serde_json::to_writer(&mut *out, text.as_str()).expect("a string always serializes");
        out.push(b'}');
    }

    /// The `type` tag, as written on the wire and in the trace's event log.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::Start(_) => "start",
            Event::StepStart { .. } => "step_start",
            Event::StepReset { .. } => "step_reset",
            Event::Status { .. } => "status",
            Event::ThinkingDelta { .. } => "thinking_delta",
            Event::TextDelta { .. } => "text_delta",
            Event::ToolInputStart { .. } => "tool_input_start",
            Event::ToolInputDelta { .. } => "tool_input_delta",
            Event::ToolStart(_) => "tool_start",
            Event::ToolProgress(_) => "tool_progress",
            Event::ToolOutput { .. } => "tool_output",
            Event::ToolComplete(_) => "tool_complete",
            Event::ToolApprovalRequest(_) => "tool_approval_request",
            Event::ToolResultRequest(_) => "tool_result_request",
            Event::Usage(_) => "usage",
            Event::Complete { .. } => "complete",
            Event::Cancelled(_) => "cancelled",
            Event::Error(_) => "error",
            Event::Done { .. } => "done",
        }
    }
}

/// The first event of a run: what it answers and with which model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StartEvent {
    pub conversation_id: ConversationId,
    pub user_message_id: MessageId,
    pub message_id: MessageId,
    pub trace_id: TraceId,
    pub model: String,
    pub profile: String,
}

/// A tool call begins, with its whole input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ToolStartEvent {
    pub tool_call_id: String,
    pub tool: String,
    pub input: Value,
    pub index: u32,
    pub timestamp: chrono::DateTime<chrono::Utc>,
}

/// A call waits for a person's decision (CONTRACT.md §15): `POST /api/approvals/{approval_id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ToolApprovalRequestEvent {
    pub approval_id: String,
    pub tool_call_id: String,
    pub tool: String,
    pub input: Value,
    pub index: u32,
    pub expires_at: chrono::DateTime<chrono::Utc>,
}

/// A client tool's call waits for the frontend's result (CONTRACT.md §15):
/// `POST /api/runs/{trace_id}/tool_results`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ToolResultRequestEvent {
    pub tool_call_id: String,
    pub tool: String,
    pub input: Value,
    pub index: u32,
}

/// What a running tool reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ToolProgressEvent {
    pub tool_call_id: String,
    pub tool: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

/// A tool call ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ToolCompleteEvent {
    pub tool_call_id: String,
    pub tool: String,
    pub index: u32,
    pub status: ToolStatus,
    pub duration_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
}

/// The run was cancelled: what it had said.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CancelledEvent {
    pub partial_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partial_thinking: Option<String>,
    pub message_id: MessageId,
    pub trace_id: TraceId,
    pub model: String,
}

/// The run failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorEvent {
    pub code: String,
    pub message: String,
    pub retryable: bool,
    pub message_id: MessageId,
    pub trace_id: TraceId,
}

/// One event of a run's log: what was sent to clients, with its sequence number and time.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct LoggedEvent {
    pub seq: i64,
    pub at: DateTime<Utc>,
    #[serde(rename = "type")]
    pub kind: String,
    /// The event exactly as it was sent (and stored).
    #[schema(value_type = Event)]
    pub data: Box<RawValue>,
    /// The same event, decoded once when it was read; `None` for an event this version does
    /// not know (written by a newer one, or an older shape): it is still kept and replayed
    /// as stored, and the other vocabularies leave it out.
    #[serde(skip)]
    pub event: Option<Event>,
}

impl LoggedEvent {
    /// An event as the store keeps it: its JSON is decoded here, once.
    pub fn decode(seq: i64, at: DateTime<Utc>, data: Box<RawValue>) -> Result<Self, serde_json::Error> {
        let (kind, event) = match serde_json::from_str::<Event>(data.get()) {
            Ok(event) => (event.kind().to_owned(), Some(event)),
            Err(_) => {
                #[derive(Deserialize)]
                struct Tag {
                    #[serde(rename = "type")]
                    kind: String,
                }
                (serde_json::from_str::<Tag>(data.get())?.kind, None)
            }
        };
        Ok(Self { seq, at, kind, data, event })
    }
}

/// An event as a run sent it: its JSON text, exactly as every listener and the log get it,
/// and the typed event where this version knows it (see [`LoggedEvent::event`]). The two
/// share one allocation, which the run's frames, its listeners and its log hold in common
/// (two, at a token an event, were 4–5 % of chatd's instructions per relayed event: a
/// `malloc`, and a `free` on another thread).
#[derive(Clone)]
pub struct Sent(triomphe::Arc<triomphe::HeaderSlice<Option<Event>, str>>);

impl Sent {
    /// `json` must be `event` serialized (or, without an event, an event's JSON).
    pub fn new(event: Option<Event>, json: &str) -> Self {
        Self(triomphe::Arc::from_header_and_str(event, json))
    }

    /// An event's JSON alone, for the log, which reads only the text.
    pub fn text(json: &str) -> Self {
        Self::new(None, json)
    }

    pub fn event(&self) -> Option<&Event> {
        self.0.header.as_ref()
    }

    pub fn json(&self) -> &str {
        &self.0.slice
    }
}

impl std::fmt::Debug for Sent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.json())
    }
}

impl From<LoggedEvent> for Sent {
    fn from(logged: LoggedEvent) -> Self {
        Self::new(logged.event, logged.data.get())
    }
}

/// The `complete` event's payload (CONTRACT.md §5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CompletePayload {
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thinking: Option<String>,
    pub suggested_values: Vec<SuggestedValue>,
    pub suggested_actions: Vec<SuggestedAction>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub custom_payload: Option<Value>,
    pub tool_history: Vec<ToolRecord>,
    pub conversation_id: ConversationId,
    pub message_id: MessageId,
    pub trace_id: TraceId,
    pub model: String,
    pub finish_reason: String,
    pub usage: Usage,
    /// What the run cost (CONTRACT.md §18), where its models have prices.
    #[serde(flatten)]
    pub cost: crate::domain::Cost,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diagnostics: Option<Box<Diagnostics>>,
}

/// What the model was asked and answered, for a developer (CONTRACT.md §5: only when the
/// request asked and config allows; never a secret).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct Diagnostics {
    pub model: String,
    pub max_tokens: Option<u32>,
    pub max_iterations: u32,
    pub temperature: Option<f64>,
    /// The tools offered, by name.
    pub tools: Vec<String>,
    pub system_prompt: String,
    /// What the request added after the history (its context, the payloads so far, an
    /// action's result: CONTRACT.md §21), where it added anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notes: Option<String>,
    /// The history sent, oldest first.
    pub messages: Vec<DiagnosticMessage>,
    /// The request's page context, as the client sent it.
    pub context: Option<Value>,
    /// The answer as the provider sent it, before cleaning.
    pub raw_llm_response: String,
}

/// One message of the history, as [`Diagnostics`] shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DiagnosticMessage {
    pub role: crate::domain::Role,
    pub content: String,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn deltas_are_written_as_serde_writes_them(text in any::<String>(), thinking in any::<bool>()) {
            let text = Text::from(text);
            let event = if thinking { Event::ThinkingDelta { text } } else { Event::TextDelta { text } };
            let mut out = Vec::new();
            event.write_json(&mut out);
            prop_assert_eq!(String::from_utf8(out).unwrap(), serde_json::to_string(&event).unwrap());
        }
    }

    #[test]
    fn events_are_tagged_by_type_and_kind_agrees() {
        let events = [
            Event::Status { message: "Thinking…".into() },
            Event::TextDelta { text: "hi".into() },
            Event::Usage(Box::new(Usage { input_tokens: 3, output_tokens: 4, ..Usage::default() })),
        ];
        for event in events {
            let json = serde_json::to_value(&event).unwrap();
            assert_eq!(json["type"], event.kind());
        }
        let usage =
            serde_json::to_value(Event::Usage(Box::new(Usage { input_tokens: 3, ..Usage::default() }))).unwrap();
        assert_eq!(usage, serde_json::json!({"type": "usage", "input_tokens": 3, "output_tokens": 0}));
    }

    #[test]
    fn a_boxed_event_reads_and_writes_flat_and_events_stay_small() {
        // Every live frame holds its event: the rare, large ones are boxed so that a text
        // delta's frame is not the size of a tool's progress report.
        assert!(std::mem::size_of::<Event>() <= 64, "{} bytes", std::mem::size_of::<Event>());
        let text = r#"{"type":"error","code":"RATE_LIMITED","message":"slow down","retryable":true,"message_id":"0192f0c1-7d7e-7cc5-8a5b-6c6f2d3b7a10","trace_id":"0192f0c1-7d7e-7cc5-8a5b-6c6f2d3b7a11"}"#;
        let event: Event = serde_json::from_str(text).unwrap();
        let Event::Error(error) = &event else { panic!("an error event: {event:?}") };
        assert_eq!((error.code.as_str(), error.retryable), ("RATE_LIMITED", true));
        assert_eq!(serde_json::to_string(&event).unwrap(), text);
    }

    #[test]
    fn a_logged_event_is_decoded_once_and_one_this_version_cannot_type_is_kept_as_stored() {
        let raw = |text: &str| RawValue::from_string(text.to_owned()).unwrap();
        let at = chrono::Utc::now();
        let known = LoggedEvent::decode(1, at, raw(r#"{"type":"text_delta","text":"hi"}"#)).unwrap();
        assert_eq!(known.event, Some(Event::TextDelta { text: "hi".into() }));
        assert_eq!(known.kind, "text_delta");
        // Replayed, it is sent as it was stored, with its typed event for the other vocabularies.
        let sent = Sent::from(known);
        assert_eq!(
            (sent.json(), sent.event()),
            (r#"{"type":"text_delta","text":"hi"}"#, Some(&Event::TextDelta { text: "hi".into() }))
        );
        for (text, kind) in
            [(r#"{"type":"reasoning_file","url":"x"}"#, "reasoning_file"), (r#"{"type":"done"}"#, "done")]
        {
            let unknown = LoggedEvent::decode(2, at, raw(text)).unwrap();
            assert_eq!((unknown.kind.as_str(), unknown.event.is_none()), (kind, true));
            assert_eq!(unknown.data.get(), text, "kept byte for byte");
            let sent = Sent::from(unknown);
            assert_eq!((sent.json(), sent.event()), (text, None), "replayed as stored, untyped");
        }
        assert!(LoggedEvent::decode(3, at, raw(r#"{"text":"no type"}"#)).is_err(), "an event names its type");
    }
}
