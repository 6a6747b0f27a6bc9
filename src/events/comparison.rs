//! The A/B stream's vocabulary (CONTRACT.md §10): `comparison` first, then every event of
//! both runs but their own `done`, each tagged with its `variant`, then one `done` of the
//! comparison.

use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId};
use serde::Serialize;

use super::Event;
use crate::domain::Comparison;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    A,
    B,
}

/// What a comparison's stream says of the pair: where it begins and where it ends.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ComparisonEvent {
    Comparison { comparison_id: ComparisonId, a: SideStart, b: SideStart },
    Done { comparison_id: ComparisonId, conversation_id: ConversationId, message_ids: Pair },
}

#[derive(Debug, Serialize)]
pub struct SideStart {
    pub trace_id: TraceId,
    pub message_id: MessageId,
    pub model: String,
}

#[derive(Debug, Serialize)]
pub struct Pair {
    pub a: MessageId,
    pub b: MessageId,
}

/// One side's event, tagged with its side.
#[derive(Debug, Serialize)]
pub struct Tagged<'a> {
    #[serde(flatten)]
    pub event: &'a Event,
    pub variant: Variant,
}

impl ComparisonEvent {
    /// The first event: the comparison and each side's run (`a` and `b` are their messages).
    pub fn opening(comparison: &Comparison, message_a: MessageId, message_b: MessageId) -> Self {
        let side = |trace_id, message_id, model: &str| SideStart { trace_id, message_id, model: model.to_owned() };
        ComparisonEvent::Comparison {
            comparison_id: comparison.comparison_id,
            a: side(comparison.trace_a, message_a, &comparison.model_a),
            b: side(comparison.trace_b, message_b, &comparison.model_b),
        }
    }

    /// The last event, once both sides are done.
    pub fn closing(comparison: &Comparison, message_a: MessageId, message_b: MessageId) -> Self {
        ComparisonEvent::Done {
            comparison_id: comparison.comparison_id,
            conversation_id: comparison.conversation_id,
            message_ids: Pair { a: message_a, b: message_b },
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::domain::Usage;

    #[test]
    fn a_sides_event_keeps_its_fields_and_gains_its_variant() {
        let delta = Event::TextDelta { text: "hi".into() };
        assert_eq!(
            serde_json::to_value(Tagged { event: &delta, variant: Variant::B }).unwrap(),
            json!({"type": "text_delta", "text": "hi", "variant": "b"})
        );
        let usage = Event::Usage(Box::new(Usage { input_tokens: 3, output_tokens: 4, ..Usage::default() }));
        assert_eq!(
            serde_json::to_value(Tagged { event: &usage, variant: Variant::A }).unwrap(),
            json!({"type": "usage", "input_tokens": 3, "output_tokens": 4, "variant": "a"})
        );
    }
}
