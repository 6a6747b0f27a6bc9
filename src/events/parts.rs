//! What the client vocabularies made of message parts (the AI SDK's UI message stream, AG-UI)
//! share: which part is being streamed, where a later model call's reasoning part starts,
//! and the `[[tool:N]]` marker they leave out.

use serde::Serialize;

/// A `data-status` chunk's data.
#[derive(Debug, PartialEq, Serialize)]
pub struct StatusData<'a> {
    pub message: &'a str,
}

/// A `data-step-reset` chunk's data (AG-UI: the `step_reset` custom event's value): the text
/// and thinking of model call `step` since it started are void (CONTRACT.md §19).
#[derive(Debug, PartialEq, Serialize)]
pub struct StepResetData<'a> {
    pub step: u32,
    pub reason: &'a str,
}

/// The part of the message being streamed now (a text or reasoning part, by its id).
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Open {
    #[default]
    Nothing,
    Text(String),
    Reasoning(String),
}

/// A thinking delta as a vocabulary with a reasoning part per model call carries it. The
/// native stream's thinking is one string, where the agent starts a later call's thinking
/// with a blank line; here that call's thinking is a part of its own, which the blank line
/// would open. So a part starts at its first line; `None` when the delta leaves nothing.
pub fn part_delta<'a>(open: &Open, text: &'a str) -> Option<&'a str> {
    let text = match open {
        Open::Reasoning(_) => text,
        _ => text.trim_start_matches(['\n', '\r']),
    };
    (!text.is_empty()).then_some(text)
}

/// Whether a text delta is only the `[[tool:N]]` marker the agent writes after a tool call
/// (with the blank line before it).
pub fn is_tool_marker(text: &str) -> bool {
    let marker = text.trim_start_matches('\n');
    marker
        .strip_prefix("[[tool:")
        .and_then(|rest| rest.strip_suffix("]]"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}
