//! The legacy stream's vocabulary (CONTRACT.md §11, seed 004): `chunk`, `tool_start`,
//! `tool_output`, `tool_end`, `error`, `done`, each a function of one [`Event`] of the same
//! run. Events with no legacy word are left out.

use crate::ids::{ConversationId, MessageId, TraceId};
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use super::{Event, ToolStatus};

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LegacyEvent<'a> {
    Chunk {
        content: &'a str,
        /// From the run's `start`; null if it was not seen.
        conversation_id: Option<ConversationId>,
    },
    ToolStart {
        tool_call_id: &'a str,
        tool_name: &'a str,
        tool_args: &'a Value,
        timestamp: DateTime<Utc>,
    },
    ToolOutput {
        tool_call_id: &'a str,
        output: &'a str,
        truncated: bool,
        full_length: usize,
    },
    ToolEnd {
        tool_call_id: &'a str,
        status: ToolStatus,
        duration_ms: u64,
    },
    Error {
        /// The error's code.
        status: &'a str,
        message: &'a str,
    },
    Done {
        conversation_id: ConversationId,
        message_id: MessageId,
        trace_id: TraceId,
    },
}

/// Translates one run's events in order: `start` has no legacy word, but its conversation
/// id goes into every `chunk`.
#[derive(Debug, Default)]
pub struct ToLegacy {
    conversation_id: Option<ConversationId>,
}

impl ToLegacy {
    pub fn translate<'a>(&mut self, event: &'a Event) -> Option<LegacyEvent<'a>> {
        Some(match event {
            Event::Start(start) => {
                self.conversation_id = Some(start.conversation_id);
                return None;
            }
            Event::TextDelta { text } => LegacyEvent::Chunk { content: text, conversation_id: self.conversation_id },
            Event::ToolStart(start) => LegacyEvent::ToolStart {
                tool_call_id: &start.tool_call_id,
                tool_name: &start.tool,
                tool_args: &start.input,
                timestamp: start.timestamp,
            },
            Event::ToolOutput { tool_call_id, output, truncated, full_length } => {
                LegacyEvent::ToolOutput { tool_call_id, output, truncated: *truncated, full_length: *full_length }
            }
            Event::ToolComplete(complete) => LegacyEvent::ToolEnd {
                tool_call_id: &complete.tool_call_id,
                status: complete.status,
                duration_ms: complete.duration_ms,
            },
            Event::Error(error) => LegacyEvent::Error { status: &error.code, message: &error.message },
            Event::Done { conversation_id, message_id, trace_id } => {
                LegacyEvent::Done { conversation_id: *conversation_id, message_id: *message_id, trace_id: *trace_id }
            }
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::events::{ErrorEvent, StartEvent, ToolCompleteEvent};

    #[test]
    fn chunks_carry_the_conversation_of_the_runs_start() {
        let conversation_id = ConversationId::new();
        let mut legacy = ToLegacy::default();
        let text = Event::TextDelta { text: "hi".into() };
        assert_eq!(
            serde_json::to_value(legacy.translate(&text)).unwrap(),
            json!({"type": "chunk", "content": "hi", "conversation_id": null})
        );
        let start = Event::Start(Box::new(StartEvent {
            conversation_id,
            user_message_id: MessageId::new(),
            message_id: MessageId::new(),
            trace_id: TraceId::new(),
            model: "m".into(),
            profile: "p".into(),
        }));
        assert!(legacy.translate(&start).is_none());
        assert_eq!(
            serde_json::to_value(legacy.translate(&text)).unwrap(),
            json!({"type": "chunk", "content": "hi", "conversation_id": conversation_id})
        );
        assert!(legacy.translate(&Event::Status { message: "…".into() }).is_none(), "no legacy word for status");
    }

    #[test]
    fn a_tool_complete_is_a_tool_end_and_an_error_names_its_code_status() {
        let mut legacy = ToLegacy::default();
        let complete = Event::ToolComplete(Box::new(ToolCompleteEvent {
            tool_call_id: "c1".into(),
            tool: "calculator".into(),
            index: 0,
            status: ToolStatus::Timeout,
            duration_ms: 12,
            summary: None,
        }));
        assert_eq!(
            serde_json::to_value(legacy.translate(&complete)).unwrap(),
            json!({"type": "tool_end", "tool_call_id": "c1", "status": "timeout", "duration_ms": 12})
        );
        let error = Event::Error(Box::new(ErrorEvent {
            code: "RATE_LIMITED".into(),
            message: "slow down".into(),
            retryable: true,
            message_id: MessageId::new(),
            trace_id: TraceId::new(),
        }));
        assert_eq!(
            serde_json::to_value(legacy.translate(&error)).unwrap(),
            json!({"type": "error", "status": "RATE_LIMITED", "message": "slow down"})
        );
    }
}
