//! One model call's worth of provider events turned into client events: text and thinking
//! through the [`Cleaner`], tool calls as `tool_input_*` events with their arguments
//! assembled, thinking signatures kept for the next turn, usage summed. Pure: no I/O, so the
//! agent and the chunking property tests run exactly the same code.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::clean::{Cleaner, Piece};
use super::markers::Captured;
use crate::domain::{ThinkingBlock, ToolCall, Usage};
use crate::events::Event;
use crate::providers::ProviderEvent;

/// What a model call produced, as the client saw it.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct TurnOutput {
    pub text: String,
    pub thinking: String,
    pub usage: Usage,
    /// Set once the provider's terminal frame arrived.
    pub finish_reason: Option<String>,
    /// Signed thinking blocks, raw, to send back to the provider in later turns.
    pub thinking_blocks: Vec<ThinkingBlock>,
    /// The tool calls the model asked for, in the order they began.
    pub tool_calls: Vec<ToolCall>,
    /// The answer as the provider sent it, before cleaning (for diagnostics).
    pub raw_text: String,
    /// Marker blocks cut out of the answer, and those left in because they did not parse.
    pub captured: Vec<Captured>,
    pub invalid_markers: Vec<String>,
}

/// A tool call while its arguments stream in.
struct PendingCall {
    id: String,
    /// Its place in `TurnOutput::tool_calls`, filled when the call ends.
    slot: usize,
    arguments: String,
}

pub struct Turn {
    cleaner: Cleaner,
    pieces: Vec<Piece>,
    raw_thinking: String,
    calls: BTreeMap<u32, PendingCall>,
    /// The run-wide index the next tool call gets (`index` counts a run's calls from 0).
    next_index: u32,
    pub output: TurnOutput,
}

impl Turn {
    /// A turn whose first tool call gets run-wide index `next_index`, cutting out blocks
    /// that start with one of `markers`.
    pub fn new(next_index: u32, markers: Vec<String>) -> Self {
        Self {
            cleaner: Cleaner::with_markers(markers),
            pieces: Vec::new(),
            raw_thinking: String::new(),
            calls: BTreeMap::new(),
            next_index,
            output: TurnOutput::default(),
        }
    }

    /// Applies one provider event, pushing the client events it makes onto `out`.
    pub fn apply(&mut self, event: ProviderEvent, out: &mut Vec<Event>) {
        match event {
            ProviderEvent::Text(text) => {
                self.output.raw_text.push_str(&text);
                self.cleaner.text(text, &mut self.pieces);
            }
            ProviderEvent::Thinking(text) => {
                self.raw_thinking.push_str(&text);
                self.cleaner.thinking(&text, &mut self.pieces);
            }
            ProviderEvent::ThinkingSignature(signature) => {
                let thinking = std::mem::take(&mut self.raw_thinking);
                self.output.thinking_blocks.push(ThinkingBlock::Thinking { thinking, signature });
            }
            ProviderEvent::ToolCallStart { index, id, name } => {
                let id = if id.is_empty() { format!("call_{}", uuid::Uuid::now_v7().simple()) } else { id };
                let run_index = self.next_index;
                self.next_index += 1;
                out.push(Event::ToolInputStart { tool_call_id: id.clone(), tool: name.clone(), index: run_index });
                let slot = self.output.tool_calls.len();
                self.output.tool_calls.push(ToolCall {
                    id: id.clone(),
                    name,
                    input: Value::Null,
                    invalid_arguments: None,
                });
                self.calls.insert(index, PendingCall { id, slot, arguments: String::new() });
            }
            ProviderEvent::ToolCallDelta { index, arguments } => {
                if let Some(call) = self.calls.get_mut(&index) {
                    call.arguments.push_str(&arguments);
                    out.push(Event::ToolInputDelta { tool_call_id: call.id.clone(), delta: arguments });
                }
            }
            ProviderEvent::ToolCallEnd { index } => {
                if let Some(call) = self.calls.remove(&index) {
                    let made = &mut self.output.tool_calls[call.slot];
                    made.input = if call.arguments.trim().is_empty() {
                        json!({})
                    } else {
                        match serde_json::from_str::<Value>(&call.arguments) {
                            Ok(mut input) => {
                                // NUL cannot be stored (Postgres) and means nothing to a tool.
                                crate::chat::live::runs::strip_nul(&mut input);
                                input
                            }
                            // A model's slip, not a broken response: the model hears it as
                            // the call's error and may try again.
                            Err(e) => {
                                made.invalid_arguments = Some(format!(
                                    "The arguments are not valid JSON ({e}): {}",
                                    preview(&call.arguments)
                                ));
                                json!({})
                            }
                        }
                    };
                }
            }
            ProviderEvent::Usage(usage) => self.output.usage.add(&usage),
            ProviderEvent::Finish(reason) => {
                self.cleaner.finish(&mut self.pieces);
                let (captured, invalid) = self.cleaner.markers();
                self.output.captured = captured.to_vec();
                self.output.invalid_markers = invalid.to_vec();
                self.output.finish_reason = Some(reason);
            }
        }
        self.drain(out);
    }

    /// Ends a turn cut short (cancelled): text held back while it might have become a tag
    /// or a marker is sent after all.
    pub fn flush(&mut self, out: &mut Vec<Event>) {
        if !self.finished() {
            self.cleaner.finish(&mut self.pieces);
            self.drain(out);
        }
    }

    fn drain(&mut self, out: &mut Vec<Event>) {
        for piece in self.pieces.drain(..) {
            match piece {
                Piece::Text(text) => {
                    self.output.text.push_str(&text);
                    out.push(Event::TextDelta { text });
                }
                Piece::Thinking(text) => {
                    self.output.thinking.push_str(&text);
                    out.push(Event::ThinkingDelta { text });
                }
            }
        }
    }

    pub fn finished(&self) -> bool {
        self.output.finish_reason.is_some()
    }
}

/// The start of a model's unreadable arguments, as its tool error quotes them.
fn preview(arguments: &str) -> String {
    const MAX_CHARS: usize = 200;
    let cut: String = arguments.chars().filter(|c| *c != '\0').take(MAX_CHARS).collect();
    if arguments.chars().count() > MAX_CHARS { format!("{cut}…") } else { cut }
}

/// One model call run to its end for its cleaned text alone (titles, summaries): `None` if
/// the call fails, breaks off, or says nothing.
pub async fn complete_text(
    provider: &dyn crate::providers::LlmProvider,
    request: &crate::providers::ModelRequest,
) -> Option<String> {
    use futures_util::StreamExt;
    let mut stream = provider.stream(request).await.ok()?;
    let mut turn = Turn::new(0, Vec::new());
    let mut ignored = Vec::new();
    while let Some(Ok(event)) = stream.next().await {
        turn.apply(event, &mut ignored);
        if turn.finished() {
            break;
        }
    }
    let text = turn.output.text.trim();
    (turn.finished() && !text.is_empty()).then(|| text.to_owned())
}
