//! The Vercel AI SDK's UI message stream (CONTRACT.md §13.1), as a function of one run's
//! [`Event`]s in order: what `useChat` / `DefaultChatTransport` read, from `ai` 5.0.0 on.
//! Clients before `ai` 5.0.217 / 6.0.231 refuse any field or chunk type they do not know,
//! so only the fields the contract names are ever written.

use std::collections::HashMap;

use serde::Serialize;
use serde_json::Value;

use crate::chat::Frame;
use crate::domain::{SuggestedAction, SuggestedValue, Usage};
use crate::events::parts::{Open, StatusData, StepResetData, is_tool_marker, part_delta};
use crate::events::{Event, THINKING_STATUS, ToolProgressEvent, ToolStatus};
use crate::http::sse::{Encoder, push_data};
use crate::ids::MessageId;
use crate::ids::{ConversationId, TraceId};

/// One chunk of the stream.
#[derive(Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "kebab-case", rename_all_fields = "camelCase")]
pub enum UiChunk<'a> {
    Start {
        message_id: String,
    },
    StartStep,
    FinishStep,
    TextStart {
        id: String,
    },
    TextDelta {
        id: String,
        delta: &'a str,
    },
    TextEnd {
        id: String,
    },
    ReasoningStart {
        id: String,
    },
    ReasoningDelta {
        id: String,
        delta: &'a str,
    },
    ReasoningEnd {
        id: String,
    },
    ToolInputStart {
        tool_call_id: &'a str,
        tool_name: &'a str,
    },
    ToolInputDelta {
        tool_call_id: &'a str,
        input_text_delta: &'a str,
    },
    ToolInputAvailable {
        tool_call_id: &'a str,
        tool_name: &'a str,
        input: &'a Value,
    },
    ToolOutputAvailable {
        tool_call_id: &'a str,
        output: String,
    },
    ToolOutputError {
        tool_call_id: &'a str,
        error_text: String,
    },
    /// The call waits for a person (CONTRACT.md §15; `ai` 6 on).
    ToolApprovalRequest {
        approval_id: &'a str,
        tool_call_id: &'a str,
    },
    /// A person denied the call, or its approval expired: it did not run (`ai` 6 on).
    ToolOutputDenied {
        tool_call_id: &'a str,
    },
    /// A status line: shown while it is current, never part of the message.
    #[serde(rename = "data-status")]
    DataStatus {
        data: StatusData<'a>,
        transient: bool,
    },
    /// A model call's text and thinking so far are void (CONTRACT.md §19): a client drops
    /// the parts of the step since its `start-step`.
    #[serde(rename = "data-step-reset")]
    DataStepReset {
        data: StepResetData<'a>,
        transient: bool,
    },
    /// A running tool's report.
    #[serde(rename = "data-tool-progress")]
    DataToolProgress {
        data: &'a ToolProgressEvent,
        transient: bool,
    },
    MessageMetadata {
        message_metadata: Metadata<'a>,
    },
    /// No fields: `ai` 5.0.0 refuses `finishReason` (it travels in the metadata).
    Finish,
    Abort,
    Error {
        error_text: &'a str,
    },
}

/// What `message-metadata` chunks tell of the answer: at `start` where it comes from, after
/// each model call its usage so far, at the end the complete payload's fields. The client
/// merges them into the message's `metadata`.
#[derive(Debug, Default, PartialEq, Serialize)]
pub struct Metadata<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<ConversationId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<TraceId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub suggested_values: Option<&'a [SuggestedValue]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub suggested_actions: Option<&'a [SuggestedAction]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub custom_payload: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<&'a Usage>,
}

/// Translates one run's events, in order, into chunks.
#[derive(Debug, Default)]
pub struct ToUi {
    open: Open,
    step_open: bool,
    /// The run says where its model calls start (`step_start`); a log written before it
    /// did only has each call's opening status.
    stepped: bool,
    /// Parts started so far, to name the next one.
    parts: usize,
    /// Tools' outputs until their `tool_complete` tells whether they failed.
    outputs: HashMap<String, String>,
    /// The last events were a waiting run's requests (CONTRACT.md §15): a stream that ends
    /// here ends the message's turn for now ([`end`](Self::end)).
    waiting: bool,
}

impl ToUi {
    /// Appends the chunks of `event` to `out`; `done` has none (the stream's `[DONE]` is the
    /// encoder's).
    pub fn translate<'a>(&mut self, event: &'a Event, out: &mut Vec<UiChunk<'a>>) {
        self.waiting = matches!(event, Event::ToolApprovalRequest(_) | Event::ToolResultRequest(_));
        match event {
            Event::Start(start) => {
                out.push(UiChunk::Start { message_id: start.message_id.to_string() });
                out.push(UiChunk::MessageMetadata {
                    message_metadata: Metadata {
                        conversation_id: Some(start.conversation_id),
                        trace_id: Some(start.trace_id),
                        model: Some(&start.model),
                        profile: Some(&start.profile),
                        ..Metadata::default()
                    },
                });
            }
            Event::StepStart { .. } => {
                self.stepped = true;
                self.end_step(out);
                self.start_step(out);
            }
            Event::StepReset { step, reason } => {
                self.close(out);
                out.push(UiChunk::DataStepReset { data: StepResetData { step: *step, reason }, transient: true });
                self.end_step(out);
            }
            Event::Status { message } => {
                if message == THINKING_STATUS && !self.stepped {
                    // Each model call opens with it: a step.
                    self.end_step(out);
                    out.push(UiChunk::StartStep);
                    self.step_open = true;
                }
                out.push(UiChunk::DataStatus { data: StatusData { message }, transient: true });
            }
            Event::ThinkingDelta { text } => {
                let Some(text) = part_delta(&self.open, text) else { return };
                let id = self.open_reasoning(out);
                out.push(UiChunk::ReasoningDelta { id, delta: text });
            }
            Event::TextDelta { text } => {
                // A tool's part already sits where its call happened.
                if is_tool_marker(text) {
                    return;
                }
                let id = self.open_text(out);
                out.push(UiChunk::TextDelta { id, delta: text });
            }
            Event::ToolInputStart { tool_call_id, tool, .. } => {
                self.start_step(out);
                self.close(out);
                out.push(UiChunk::ToolInputStart { tool_call_id, tool_name: tool });
            }
            Event::ToolInputDelta { tool_call_id, delta } => {
                out.push(UiChunk::ToolInputDelta { tool_call_id, input_text_delta: delta });
            }
            Event::ToolStart(start) => {
                self.start_step(out);
                self.close(out);
                out.push(UiChunk::ToolInputAvailable {
                    tool_call_id: &start.tool_call_id,
                    tool_name: &start.tool,
                    input: &start.input,
                });
            }
            Event::ToolProgress(progress) => {
                out.push(UiChunk::DataToolProgress { data: progress, transient: true });
            }
            Event::ToolOutput { tool_call_id, output, .. } => {
                self.outputs.insert(tool_call_id.clone(), output.clone());
            }
            Event::ToolComplete(complete) => {
                let output = self.outputs.remove(&complete.tool_call_id);
                let tool_call_id = complete.tool_call_id.as_str();
                out.push(match complete.status {
                    ToolStatus::Success => {
                        UiChunk::ToolOutputAvailable { tool_call_id, output: output.unwrap_or_default() }
                    }
                    ToolStatus::Denied => UiChunk::ToolOutputDenied { tool_call_id },
                    status => UiChunk::ToolOutputError {
                        tool_call_id,
                        error_text: output
                            .filter(|o| !o.is_empty())
                            .unwrap_or_else(|| format!("The tool call ended: {status:?}").to_lowercase()),
                    },
                });
            }
            Event::ToolApprovalRequest(request) => {
                out.push(UiChunk::ToolApprovalRequest {
                    approval_id: &request.approval_id,
                    tool_call_id: &request.tool_call_id,
                });
            }
            // The client tool's call went out whole at its `tool_start`: the client runs it.
            Event::ToolResultRequest(_) => {}
            Event::Usage(usage) => {
                let message_metadata = Metadata { usage: Some(usage), ..Metadata::default() };
                out.push(UiChunk::MessageMetadata { message_metadata });
            }
            Event::Complete { payload } => {
                self.end_step(out);
                out.push(UiChunk::MessageMetadata {
                    message_metadata: Metadata {
                        conversation_id: Some(payload.conversation_id),
                        trace_id: Some(payload.trace_id),
                        model: Some(&payload.model),
                        suggested_values: Some(&payload.suggested_values),
                        suggested_actions: Some(&payload.suggested_actions),
                        custom_payload: payload.custom_payload.as_ref(),
                        finish_reason: Some(&payload.finish_reason),
                        usage: Some(&payload.usage),
                        ..Metadata::default()
                    },
                });
                out.push(UiChunk::Finish);
            }
            Event::Cancelled(_) => {
                self.end_step(out);
                out.push(UiChunk::Abort);
            }
            Event::Error(error) => {
                self.end_step(out);
                out.push(UiChunk::Error { error_text: &error.message });
            }
            Event::Done { .. } => {}
        }
    }

    /// A message's answer that goes on after its run waited: the same message, from where
    /// it stopped. (Starts with a `start` of the message's id; see [`start`](Self::start).)
    pub fn continuing() -> Self {
        Self { waiting: true, ..Self::default() }
    }

    /// The `start` of a stream that continues message `message_id`.
    pub fn start(message_id: String) -> UiChunk<'static> {
        UiChunk::Start { message_id }
    }

    /// The end of a stream that stops where the run waits (CONTRACT.md §15): the step and
    /// the message end for now; the client's next request goes on with them.
    pub fn end(&mut self, out: &mut Vec<UiChunk<'_>>) {
        if std::mem::take(&mut self.waiting) {
            self.end_step(out);
            out.push(UiChunk::Finish);
        }
    }

    fn start_step(&mut self, out: &mut Vec<UiChunk<'_>>) {
        if !self.step_open {
            out.push(UiChunk::StartStep);
            self.step_open = true;
        }
    }

    /// Ends the open part and the open step.
    fn end_step(&mut self, out: &mut Vec<UiChunk<'_>>) {
        self.close(out);
        if std::mem::take(&mut self.step_open) {
            out.push(UiChunk::FinishStep);
        }
    }

    /// Ends the part being streamed.
    fn close(&mut self, out: &mut Vec<UiChunk<'_>>) {
        match std::mem::replace(&mut self.open, Open::Nothing) {
            Open::Nothing => {}
            Open::Text(id) => out.push(UiChunk::TextEnd { id }),
            Open::Reasoning(id) => out.push(UiChunk::ReasoningEnd { id }),
        }
    }

    fn open_text(&mut self, out: &mut Vec<UiChunk<'_>>) -> String {
        if let Open::Text(id) = &self.open {
            return id.clone();
        }
        self.start_step(out);
        self.close(out);
        let id = self.next_id("text");
        out.push(UiChunk::TextStart { id: id.clone() });
        self.open = Open::Text(id.clone());
        id
    }

    fn open_reasoning(&mut self, out: &mut Vec<UiChunk<'_>>) -> String {
        if let Open::Reasoning(id) = &self.open {
            return id.clone();
        }
        self.start_step(out);
        self.close(out);
        let id = self.next_id("reasoning");
        out.push(UiChunk::ReasoningStart { id: id.clone() });
        self.open = Open::Reasoning(id.clone());
        id
    }

    fn next_id(&mut self, kind: &str) -> String {
        self.parts += 1;
        format!("{kind}-{}", self.parts)
    }
}

/// The AI SDK's UI message stream (CONTRACT.md §13.1): a `data:` frame per chunk, and
/// `data: [DONE]` after the run's `done`. A client resumes it from its first chunk, so the
/// frames carry no ids.
#[derive(Default)]
pub struct UiMessages {
    to_ui: ToUi,
    /// The `start` of a stream that continues a message, sent before its first chunk.
    start: Option<String>,
}

impl UiMessages {
    /// A run's stream from its `start` event.
    pub fn new() -> Self {
        Self { to_ui: ToUi::default(), start: None }
    }

    /// The stream of message `message_id`'s answer going on after its run waited.
    pub fn continuing(message_id: MessageId) -> Self {
        Self { to_ui: ToUi::continuing(), start: Some(message_id.to_string()) }
    }

    fn open(&mut self, out: &mut String) {
        if let Some(message_id) = self.start.take() {
            push_data(out, &serde_json::to_string(&ToUi::start(message_id)).expect("chunks serialize"));
        }
    }
}

impl Encoder for UiMessages {
    type Item = Frame;

    fn end(&mut self, out: &mut String) {
        self.open(out);
        let mut chunks = Vec::new();
        self.to_ui.end(&mut chunks);
        if !chunks.is_empty() {
            for chunk in &chunks {
                push_data(out, &serde_json::to_string(chunk).expect("chunks serialize"));
            }
            push_data(out, "[DONE]");
        }
    }

    fn encode(&mut self, frame: &Frame, out: &mut String) {
        self.open(out);
        let Some(event) = frame.event() else { return };
        let mut chunks = Vec::new();
        self.to_ui.translate(event, &mut chunks);
        for chunk in &chunks {
            push_data(out, &serde_json::to_string(chunk).expect("chunks serialize"));
        }
        if matches!(event, Event::Done { .. }) {
            push_data(out, "[DONE]");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{StartEvent, ToolCompleteEvent, ToolStartEvent};
    use crate::ids::{ConversationId, MessageId, TraceId};
    use serde_json::json;

    fn chunks(events: &[Event]) -> Vec<Value> {
        let mut ui = ToUi::default();
        let mut out = Vec::new();
        for event in events {
            ui.translate(event, &mut out);
        }
        out.iter().map(|chunk| serde_json::to_value(chunk).unwrap()).collect()
    }

    #[test]
    fn parts_open_and_close_around_a_tool_call_and_markers_are_left_out() {
        let start = StartEvent {
            conversation_id: ConversationId::new(),
            user_message_id: MessageId::new(),
            message_id: MessageId::new(),
            trace_id: TraceId::new(),
            model: "m".into(),
            profile: "p".into(),
        };
        let events = [
            Event::Start(Box::new(start.clone())),
            Event::Status { message: THINKING_STATUS.into() },
            Event::ThinkingDelta { text: "hmm".into() },
            Event::TextDelta { text: "Let me".into() },
            Event::ToolStart(Box::new(ToolStartEvent {
                tool_call_id: "c1".into(),
                tool: "calculator".into(),
                input: json!({"expression": "1+1"}),
                index: 0,
                timestamp: chrono::Utc::now(),
            })),
            Event::ToolOutput { tool_call_id: "c1".into(), output: "2".into(), truncated: false, full_length: 1 },
            Event::ToolComplete(Box::new(ToolCompleteEvent {
                tool_call_id: "c1".into(),
                tool: "calculator".into(),
                index: 0,
                status: ToolStatus::Success,
                duration_ms: 1,
                summary: None,
            })),
            Event::TextDelta { text: "\n\n[[tool:0]]".into() },
            Event::Status { message: THINKING_STATUS.into() },
            Event::TextDelta { text: "It is 2.".into() },
        ];
        let types: Vec<String> = chunks(&events).iter().map(|c| c["type"].as_str().unwrap().to_owned()).collect();
        assert_eq!(
            types,
            [
                "start",
                "message-metadata",
                "start-step",
                "data-status",
                "reasoning-start",
                "reasoning-delta",
                "reasoning-end",
                "text-start",
                "text-delta",
                "text-end",
                "tool-input-available",
                "tool-output-available",
                "finish-step",
                "start-step",
                "data-status",
                "text-start",
                "text-delta",
            ]
        );
        let all = chunks(&events);
        assert_eq!(all[0], json!({"type": "start", "messageId": start.message_id.to_string()}));
        assert_eq!(
            all[10],
            json!({"type": "tool-input-available", "toolCallId": "c1", "toolName": "calculator", "input": {"expression": "1+1"}})
        );
        assert_eq!(all[11], json!({"type": "tool-output-available", "toolCallId": "c1", "output": "2"}));
        assert_ne!(all[7]["id"], all[15]["id"], "each text part has its own id");
    }

    #[test]
    fn a_later_model_calls_reasoning_part_starts_at_its_first_line() {
        let start = StartEvent {
            conversation_id: ConversationId::new(),
            user_message_id: MessageId::new(),
            message_id: MessageId::new(),
            trace_id: TraceId::new(),
            model: "m".into(),
            profile: "p".into(),
        };
        // As the agent emits two model calls' thinking: the second after a blank line.
        let events = [
            Event::Start(Box::new(start)),
            Event::Status { message: THINKING_STATUS.into() },
            Event::ThinkingDelta { text: "First.".into() },
            Event::TextDelta { text: "One".into() },
            Event::Status { message: THINKING_STATUS.into() },
            Event::ThinkingDelta { text: "\n\n".into() },
            Event::ThinkingDelta { text: "\nSecond,\n\nthen".into() },
            Event::ThinkingDelta { text: "\n\nmore.".into() },
        ];
        let deltas: Vec<Value> = chunks(&events).into_iter().filter(|c| c["type"] == "reasoning-delta").collect();
        let texts: Vec<&str> = deltas.iter().map(|c| c["delta"].as_str().unwrap()).collect();
        assert_eq!(texts, ["First.", "Second,\n\nthen", "\n\nmore."], "blank lines inside a part stay");
        assert_eq!(deltas[1]["id"], deltas[2]["id"]);
        assert_ne!(deltas[0]["id"], deltas[1]["id"]);
    }

    #[test]
    fn only_a_whole_marker_is_a_marker() {
        for marker in ["[[tool:0]]", "\n\n[[tool:12]]"] {
            assert!(is_tool_marker(marker), "{marker:?}");
        }
        for text in ["[[tool:]]", "see [[tool:0]]", "[[tool:0]] and", "[[tool:x]]", "\n\n"] {
            assert!(!is_tool_marker(text), "{text:?}");
        }
    }

    /// The fields `ai` 5.0.0 accepts of each chunk type (its strict schemas), of those chatd
    /// sends.
    fn allowed(kind: &str) -> &'static [&'static str] {
        match kind {
            "start" => &["type", "messageId"],
            "start-step" | "finish-step" | "finish" | "abort" => &["type"],
            "text-start" | "text-end" | "reasoning-start" | "reasoning-end" => &["type", "id"],
            "text-delta" | "reasoning-delta" => &["type", "id", "delta"],
            "tool-input-start" => &["type", "toolCallId", "toolName"],
            "tool-input-delta" => &["type", "toolCallId", "inputTextDelta"],
            "tool-input-available" => &["type", "toolCallId", "toolName", "input"],
            "tool-output-available" => &["type", "toolCallId", "output"],
            "tool-output-error" => &["type", "toolCallId", "errorText"],
            "message-metadata" => &["type", "messageMetadata"],
            "error" => &["type", "errorText"],
            kind if kind.starts_with("data-") => &["type", "data", "transient"],
            _ => &[],
        }
    }

    proptest::proptest! {
        #[test]
        fn every_run_is_a_well_formed_ui_message_stream(events in crate::events::arbitrary::run_events()) {
            let chunks = chunks(&events);
            assert_eq!(chunks[0]["type"], "start");
            let (mut open, mut step, mut ended) = (None::<String>, false, false);
            let (mut text, mut reasoning) = (String::new(), Vec::<String>::new());
            let mut tools = std::collections::HashSet::new();
            for chunk in &chunks {
                let kind = chunk["type"].as_str().unwrap();
                assert!(!ended, "nothing after the end: {kind}");
                let keys: Vec<&str> = chunk.as_object().unwrap().keys().map(String::as_str).collect();
                for key in &keys {
                    assert!(allowed(kind).contains(key), "{kind} may not carry {key}");
                }
                let id = chunk["id"].as_str().map(str::to_owned);
                match kind {
                    "start-step" => { assert!(!step); step = true; }
                    "finish-step" => { assert!(step && open.is_none()); step = false; }
                    "text-start" | "reasoning-start" => {
                        assert!(step && open.is_none());
                        if kind == "reasoning-start" {
                            reasoning.push(String::new());
                        }
                        open = id;
                    }
                    "text-end" | "reasoning-end" => { assert_eq!(open.take(), id); }
                    "text-delta" => { assert_eq!(open, id); text.push_str(chunk["delta"].as_str().unwrap()); }
                    "reasoning-delta" => { assert_eq!(open, id); reasoning.last_mut().unwrap().push_str(chunk["delta"].as_str().unwrap()); }
                    "tool-input-start" | "tool-input-available" => {
                        assert!(step && open.is_none());
                        tools.insert(chunk["toolCallId"].as_str().unwrap().to_owned());
                    }
                    "tool-output-available" | "tool-output-error" => {
                        assert!(tools.contains(chunk["toolCallId"].as_str().unwrap()), "an output after its input");
                    }
                    "finish" | "abort" | "error" => { assert!(!step && open.is_none()); ended = true; }
                    _ => {}
                }
            }
            assert!(ended, "a terminal chunk");
            let (sent_text, sent_thinking) = crate::events::arbitrary::text_and_thinking(&events);
            assert_eq!(text, sent_text);
            crate::events::arbitrary::assert_parts_of(&reasoning, &sent_thinking);
        }
    }
}
