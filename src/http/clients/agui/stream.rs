//! AG-UI's events (CONTRACT.md §13.2), as a function of one run's [`Event`]s in order: what
//! `@ag-ui/client`'s `HttpAgent` (and CopilotKit through it) reads. Every START gets its END
//! before the run's last event, as AG-UI's event verifier demands.

use std::collections::HashSet;

use serde::Serialize;

use crate::chat::Frame;
use crate::domain::Usage;
use crate::events::parts::{Open, StatusData, StepResetData, is_tool_marker, part_delta};
use crate::events::{CompletePayload, Event, THINKING_STATUS, ToolCompleteEvent, ToolProgressEvent};
use crate::http::sse::{Encoder, push_data};

/// One AG-UI event.
#[derive(Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "SCREAMING_SNAKE_CASE", rename_all_fields = "camelCase")]
pub enum AguiEvent<'a> {
    RunStarted {
        thread_id: String,
        run_id: String,
    },
    StepStarted {
        step_name: String,
    },
    StepFinished {
        step_name: String,
    },
    TextMessageStart {
        message_id: String,
        role: &'static str,
    },
    TextMessageContent {
        message_id: String,
        delta: &'a str,
    },
    TextMessageEnd {
        message_id: String,
    },
    ReasoningStart {
        message_id: String,
    },
    ReasoningMessageStart {
        message_id: String,
        role: &'static str,
    },
    ReasoningMessageContent {
        message_id: String,
        delta: &'a str,
    },
    ReasoningMessageEnd {
        message_id: String,
    },
    ReasoningEnd {
        message_id: String,
    },
    ToolCallStart {
        tool_call_id: String,
        tool_call_name: &'a str,
        parent_message_id: String,
    },
    ToolCallArgs {
        tool_call_id: &'a str,
        delta: String,
    },
    ToolCallEnd {
        tool_call_id: String,
    },
    ToolCallResult {
        message_id: String,
        tool_call_id: &'a str,
        content: &'a str,
        role: &'static str,
    },
    Custom {
        name: &'static str,
        value: CustomValue<'a>,
    },
    RunFinished {
        thread_id: String,
        run_id: String,
        result: &'a CompletePayload,
    },
    /// The run waits (CONTRACT.md §15): a run whose `resume[]` (or tool messages) answers
    /// these interrupts goes on with it.
    #[serde(rename = "RUN_FINISHED")]
    RunInterrupted {
        thread_id: String,
        run_id: String,
        outcome: Outcome,
    },
    RunError {
        message: String,
        code: String,
    },
}

/// Why a run ended, where it is not plain success.
#[derive(Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Outcome {
    Interrupt { interrupts: Vec<Interrupt> },
}

/// What a waiting run needs: a person's approval (`id` is the approval id) or a client
/// tool's result (`id` is the call's id).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Interrupt {
    pub id: String,
    /// `tool_approval` or `client_tool`.
    pub reason: &'static str,
    pub tool_call_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
}

/// A `CUSTOM` event's value: a status line, a tool's progress or end, a model call's usage.
#[derive(Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum CustomValue<'a> {
    Status(StatusData<'a>),
    StepReset(StepResetData<'a>),
    ToolProgress(&'a ToolProgressEvent),
    ToolComplete(&'a ToolCompleteEvent),
    Usage(&'a Usage),
}

/// Translates one run's events, in order, for the client's thread and run ids.
#[derive(Debug)]
pub struct ToAgui {
    thread_id: String,
    run_id: String,
    /// The answer's id (chatd's assistant message id), from `start`.
    message_id: String,
    open: Open,
    /// The step open now, counted from 0 (as CONTRACT.md §19's `step`).
    step: Option<u32>,
    steps: u32,
    /// Assistant messages started: the first text takes the answer's own id.
    messages: u32,
    /// Reasoning messages started.
    reasonings: u32,
    /// The assistant message tool calls attach to: the latest one started.
    current: Option<String>,
    /// Tool calls started and not yet ended.
    calls: HashSet<String>,
    /// What the run waits for, if its last events asked (CONTRACT.md §15).
    interrupts: Vec<Interrupt>,
    /// The run says where its model calls start (`step_start`); a log written before it
    /// did only has each call's opening status.
    stepped: bool,
}

impl ToAgui {
    pub fn new(thread_id: String, run_id: String) -> Self {
        Self {
            thread_id,
            run_id,
            message_id: String::new(),
            open: Open::Nothing,
            step: None,
            steps: 0,
            messages: 0,
            reasonings: 0,
            current: None,
            calls: HashSet::new(),
            interrupts: Vec::new(),
            stepped: false,
        }
    }

    /// A run that goes on with answer `message_id` after it waited.
    pub fn continuing(thread_id: String, run_id: String, message_id: String) -> Self {
        Self { message_id, ..Self::new(thread_id, run_id) }
    }

    /// `RUN_STARTED`, for a stream that does not begin with the run's `start`.
    pub fn run_started(&self) -> AguiEvent<'static> {
        AguiEvent::RunStarted { thread_id: self.thread_id.clone(), run_id: self.run_id.clone() }
    }

    /// The end of a stream that stops where the run waits: what is open ends, and the run
    /// finishes with the interrupts.
    pub fn end(&mut self, out: &mut Vec<AguiEvent<'_>>) {
        if self.interrupts.is_empty() {
            return;
        }
        self.end_all(out);
        out.push(AguiEvent::RunInterrupted {
            thread_id: self.thread_id.clone(),
            run_id: self.run_id.clone(),
            outcome: Outcome::Interrupt { interrupts: std::mem::take(&mut self.interrupts) },
        });
    }

    /// Appends the AG-UI events of `event` to `out`.
    pub fn translate<'a>(&mut self, event: &'a Event, out: &mut Vec<AguiEvent<'a>>) {
        if !matches!(event, Event::ToolApprovalRequest(_) | Event::ToolResultRequest(_)) {
            self.interrupts.clear();
        }
        match event {
            Event::Start(start) => {
                self.message_id = start.message_id.to_string();
                out.push(AguiEvent::RunStarted { thread_id: self.thread_id.clone(), run_id: self.run_id.clone() });
            }
            Event::StepStart { .. } => {
                self.stepped = true;
                self.end_step(out);
                self.start_step(out);
            }
            Event::StepReset { step, reason } => {
                self.close(out);
                let value = CustomValue::StepReset(StepResetData { step: *step, reason });
                out.push(AguiEvent::Custom { name: "step_reset", value });
                self.end_step(out);
            }
            Event::Status { message } => {
                if message == THINKING_STATUS && !self.stepped {
                    self.end_step(out);
                    self.start_step(out);
                }
                out.push(AguiEvent::Custom { name: "status", value: CustomValue::Status(StatusData { message }) });
            }
            Event::ThinkingDelta { text } => {
                // A reasoning message per model call, as the UI stream's parts.
                let Some(text) = part_delta(&self.open, text) else { return };
                let message_id = self.open_reasoning(out);
                out.push(AguiEvent::ReasoningMessageContent { message_id, delta: text });
            }
            Event::TextDelta { text } => {
                if is_tool_marker(text) {
                    return;
                }
                let message_id = self.open_text(out);
                out.push(AguiEvent::TextMessageContent { message_id, delta: text });
            }
            Event::ToolInputStart { tool_call_id, tool, .. } => {
                self.start_call(tool_call_id, tool, out);
            }
            Event::ToolInputDelta { tool_call_id, delta } => {
                out.push(AguiEvent::ToolCallArgs { tool_call_id, delta: delta.clone() });
            }
            Event::ToolStart(start) => {
                if !self.calls.contains(&start.tool_call_id) {
                    // Its arguments did not stream: they come whole.
                    self.start_call(&start.tool_call_id, &start.tool, out);
                    out.push(AguiEvent::ToolCallArgs {
                        tool_call_id: &start.tool_call_id,
                        delta: start.input.to_string(),
                    });
                }
                self.calls.remove(&start.tool_call_id);
                out.push(AguiEvent::ToolCallEnd { tool_call_id: start.tool_call_id.clone() });
            }
            Event::ToolProgress(progress) => {
                out.push(AguiEvent::Custom { name: "tool_progress", value: CustomValue::ToolProgress(progress) });
            }
            Event::ToolOutput { tool_call_id, output, .. } => {
                out.push(AguiEvent::ToolCallResult {
                    message_id: format!("{}-tool-{tool_call_id}", self.message_id),
                    tool_call_id,
                    content: output,
                    role: "tool",
                });
            }
            Event::ToolComplete(complete) => {
                out.push(AguiEvent::Custom { name: "tool_complete", value: CustomValue::ToolComplete(complete) });
            }
            Event::ToolApprovalRequest(request) => self.interrupts.push(Interrupt {
                id: request.approval_id.clone(),
                reason: "tool_approval",
                tool_call_id: request.tool_call_id.clone(),
                expires_at: Some(request.expires_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
            }),
            Event::ToolResultRequest(request) => self.interrupts.push(Interrupt {
                id: request.tool_call_id.clone(),
                reason: "client_tool",
                tool_call_id: request.tool_call_id.clone(),
                expires_at: None,
            }),
            Event::Usage(usage) => {
                out.push(AguiEvent::Custom { name: "usage", value: CustomValue::Usage(usage) });
            }
            Event::Complete { payload } => {
                self.end_all(out);
                out.push(AguiEvent::RunFinished {
                    thread_id: self.thread_id.clone(),
                    run_id: self.run_id.clone(),
                    result: payload,
                });
            }
            Event::Cancelled(_) => {
                self.end_all(out);
                out.push(AguiEvent::RunError { message: "The run was cancelled".into(), code: "CANCELLED".into() });
            }
            Event::Error(error) => {
                self.end_all(out);
                out.push(AguiEvent::RunError { message: error.message.clone(), code: error.code.clone() });
            }
            Event::Done { .. } => {}
        }
    }

    fn start_step(&mut self, out: &mut Vec<AguiEvent<'_>>) {
        if self.step.is_none() {
            let step = self.steps;
            self.steps += 1;
            self.step = Some(step);
            out.push(AguiEvent::StepStarted { step_name: step_name(step) });
        }
    }

    fn end_step(&mut self, out: &mut Vec<AguiEvent<'_>>) {
        self.close(out);
        if let Some(step) = self.step.take() {
            out.push(AguiEvent::StepFinished { step_name: step_name(step) });
        }
    }

    /// Ends whatever is open before the run's last event.
    fn end_all(&mut self, out: &mut Vec<AguiEvent<'_>>) {
        self.close(out);
        // Calls the end cut short.
        let mut calls: Vec<String> = self.calls.drain().collect();
        calls.sort();
        for tool_call_id in calls {
            out.push(AguiEvent::ToolCallEnd { tool_call_id });
        }
        self.end_step(out);
    }

    fn close(&mut self, out: &mut Vec<AguiEvent<'_>>) {
        match std::mem::replace(&mut self.open, Open::Nothing) {
            Open::Nothing => {}
            Open::Text(message_id) => out.push(AguiEvent::TextMessageEnd { message_id }),
            Open::Reasoning(message_id) => {
                out.push(AguiEvent::ReasoningMessageEnd { message_id: message_id.clone() });
                out.push(AguiEvent::ReasoningEnd { message_id });
            }
        }
    }

    /// A new assistant message's id: the answer's own for the first, then numbered.
    fn new_message(&mut self) -> String {
        self.messages += 1;
        let id = match self.messages {
            1 => self.message_id.clone(),
            n => format!("{}-{n}", self.message_id),
        };
        self.current = Some(id.clone());
        id
    }

    fn open_text(&mut self, out: &mut Vec<AguiEvent<'_>>) -> String {
        if let Open::Text(id) = &self.open {
            return id.clone();
        }
        self.start_step(out);
        self.close(out);
        let message_id = self.new_message();
        out.push(AguiEvent::TextMessageStart { message_id: message_id.clone(), role: "assistant" });
        self.open = Open::Text(message_id.clone());
        message_id
    }

    fn open_reasoning(&mut self, out: &mut Vec<AguiEvent<'_>>) -> String {
        if let Open::Reasoning(id) = &self.open {
            return id.clone();
        }
        self.start_step(out);
        self.close(out);
        self.reasonings += 1;
        let message_id = format!("{}-reasoning-{}", self.message_id, self.reasonings);
        out.push(AguiEvent::ReasoningStart { message_id: message_id.clone() });
        out.push(AguiEvent::ReasoningMessageStart { message_id: message_id.clone(), role: "reasoning" });
        self.open = Open::Reasoning(message_id.clone());
        message_id
    }

    fn start_call<'a>(&mut self, tool_call_id: &'a str, tool: &'a str, out: &mut Vec<AguiEvent<'a>>) {
        self.start_step(out);
        self.close(out);
        let parent_message_id = match &self.current {
            Some(id) => id.clone(),
            None => self.new_message(),
        };
        self.calls.insert(tool_call_id.to_owned());
        out.push(AguiEvent::ToolCallStart {
            tool_call_id: tool_call_id.to_owned(),
            tool_call_name: tool,
            parent_message_id,
        });
    }
}

fn step_name(step: u32) -> String {
    format!("model_call_{step}")
}

/// AG-UI's events (CONTRACT.md §13.2): a `data:` frame per event, no `[DONE]`.
pub struct Agui {
    to_agui: ToAgui,
    /// A run that goes on after a wait: its `RUN_STARTED` goes first.
    started: bool,
}

impl Agui {
    pub fn new(to_agui: ToAgui) -> Self {
        Self { to_agui, started: true }
    }

    /// A stream that does not begin with its run's `start` (a run going on after a wait).
    pub fn continuing(to_agui: ToAgui) -> Self {
        Self { to_agui, started: false }
    }

    fn open(&mut self, out: &mut String) {
        if !std::mem::replace(&mut self.started, true) {
            push_data(out, &serde_json::to_string(&self.to_agui.run_started()).expect("events serialize"));
        }
    }
}

impl Encoder for Agui {
    type Item = Frame;

    fn encode(&mut self, frame: &Frame, out: &mut String) {
        self.open(out);
        let Some(event) = frame.event() else { return };
        let mut events = Vec::new();
        self.to_agui.translate(event, &mut events);
        for event in &events {
            push_data(out, &serde_json::to_string(event).expect("events serialize"));
        }
    }

    fn end(&mut self, out: &mut String) {
        self.open(out);
        let mut events = Vec::new();
        self.to_agui.end(&mut events);
        for event in &events {
            push_data(out, &serde_json::to_string(event).expect("events serialize"));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use serde_json::{Value, json};

    use super::*;
    use crate::events::arbitrary::{run_events, text_and_thinking};

    fn translated(events: &[Event]) -> Vec<Value> {
        let mut agui = ToAgui::new("thread".into(), "run".into());
        let mut out = Vec::new();
        for event in events {
            let mut some = Vec::new();
            agui.translate(event, &mut some);
            out.extend(some.iter().map(|e| serde_json::to_value(e).unwrap()));
        }
        out
    }

    proptest::proptest! {
        /// What AG-UI's verifier checks: one RUN_STARTED first, one RUN_FINISHED or RUN_ERROR
        /// last; content only inside its message, arguments only inside their call; every
        /// START ended before the run ends.
        #[test]
        fn every_run_passes_the_rules_of_ag_ui(events in run_events()) {
            let out = translated(&events);
            assert_eq!(out[0], json!({"type": "RUN_STARTED", "threadId": "thread", "runId": "run"}));
            let last = out.last().unwrap()["type"].as_str().unwrap();
            assert!(matches!(last, "RUN_FINISHED" | "RUN_ERROR"), "{last}");
            let (mut texts, mut reasonings, mut calls) = (HashSet::new(), HashSet::new(), HashSet::new());
            let (mut step, mut reasoning_open) = (None::<String>, false);
            let (mut text, mut thinking) = (String::new(), Vec::<String>::new());
            let mut ended_calls = HashSet::new();
            for (i, event) in out.iter().enumerate() {
                let kind = event["type"].as_str().unwrap();
                let id = |key: &str| event[key].as_str().unwrap().to_owned();
                if i > 0 {
                    assert_ne!(kind, "RUN_STARTED");
                }
                if i + 1 < out.len() {
                    assert!(!matches!(kind, "RUN_FINISHED" | "RUN_ERROR"), "the end comes last");
                }
                match kind {
                    "STEP_STARTED" => { assert!(step.is_none()); step = Some(id("stepName")); }
                    "STEP_FINISHED" => { assert_eq!(step.take(), Some(id("stepName"))); }
                    "TEXT_MESSAGE_START" => { assert!(texts.insert(id("messageId")), "a message starts once"); assert_eq!(event["role"], "assistant"); }
                    "TEXT_MESSAGE_CONTENT" => { assert!(texts.contains(&id("messageId"))); text.push_str(event["delta"].as_str().unwrap()); }
                    "TEXT_MESSAGE_END" => { assert!(texts.remove(&id("messageId"))); }
                    "REASONING_START" => { assert!(!reasoning_open); reasoning_open = true; }
                    "REASONING_MESSAGE_START" => { assert!(reasoning_open && reasonings.insert(id("messageId"))); thinking.push(String::new()); }
                    "REASONING_MESSAGE_CONTENT" => { assert!(reasonings.contains(&id("messageId"))); thinking.last_mut().unwrap().push_str(event["delta"].as_str().unwrap()); }
                    "REASONING_MESSAGE_END" => { assert!(reasonings.remove(&id("messageId"))); }
                    "REASONING_END" => { assert!(reasoning_open && reasonings.is_empty()); reasoning_open = false; }
                    "TOOL_CALL_START" => { assert!(calls.insert(id("toolCallId"))); }
                    "TOOL_CALL_ARGS" => { assert!(calls.contains(&id("toolCallId"))); }
                    "TOOL_CALL_END" => { assert!(calls.remove(&id("toolCallId"))); ended_calls.insert(id("toolCallId")); }
                    "TOOL_CALL_RESULT" => { assert!(ended_calls.contains(&id("toolCallId")), "a result after its call"); }
                    "RUN_FINISHED" | "RUN_ERROR" => {
                        assert!(texts.is_empty() && reasonings.is_empty() && calls.is_empty() && !reasoning_open && step.is_none(), "every START ended: {event}");
                    }
                    _ => {}
                }
            }
            let (sent_text, sent_thinking) = text_and_thinking(&events);
            assert_eq!(text, sent_text);
            crate::events::arbitrary::assert_parts_of(&thinking, &sent_thinking);
        }
    }
}
