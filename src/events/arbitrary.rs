//! Runs' event sequences for property tests of the vocabularies: any number of model calls,
//! each with thinking and text in any order and any chunking, tool calls with and without
//! streamed arguments and with every status, cut short anywhere by a cancel or an error, and
//! always ending with one terminal event and `done` (as the agent sends them).

use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::domain::Usage;

/// One piece of a model call's output.
#[derive(Debug, Clone)]
enum Piece {
    Thinking(String),
    Text(String),
}

/// One tool call of a model call: whether its arguments streamed, and how it ended.
#[derive(Debug, Clone)]
struct Call {
    streamed: bool,
    status: ToolStatus,
    progress: bool,
}

#[derive(Debug, Clone)]
struct ModelCall {
    /// What an attempt that failed after output said first (then `step_reset`), if any.
    voided: Vec<Piece>,
    pieces: Vec<Piece>,
    calls: Vec<Call>,
}

#[derive(Debug, Clone, Copy)]
enum Ending {
    Complete,
    Cancelled,
    Error,
}

fn piece() -> impl Strategy<Value = Piece> {
    prop_oneof!["[a-z \n]{1,12}".prop_map(Piece::Thinking), "[a-zA-Z \n.]{1,12}".prop_map(Piece::Text),]
}

fn call() -> impl Strategy<Value = Call> {
    let status = prop_oneof![
        Just(ToolStatus::Success),
        Just(ToolStatus::Error),
        Just(ToolStatus::Timeout),
        Just(ToolStatus::Cancelled),
    ];
    (any::<bool>(), status, any::<bool>()).prop_map(|(streamed, status, progress)| Call { streamed, status, progress })
}

fn model_call() -> impl Strategy<Value = ModelCall> {
    (prop::collection::vec(piece(), 0..3), prop::collection::vec(piece(), 0..6), prop::collection::vec(call(), 0..3))
        .prop_map(|(voided, pieces, calls)| ModelCall { voided, pieces, calls })
}

/// A whole run's events: `start` … one terminal event, `done`.
pub fn run_events() -> impl Strategy<Value = Vec<Event>> {
    let ending = prop_oneof![Just(Ending::Complete), Just(Ending::Cancelled), Just(Ending::Error)];
    (prop::collection::vec(model_call(), 1..4), ending, any::<prop::sample::Index>())
        .prop_map(|(calls, ending, cut)| build(&calls, ending, cut))
}

/// A run's events to where it waits (CONTRACT.md §15): `start` …, then a model call's
/// requests, a client tool's result or a person's approval (of a call that started), for
/// one to three calls; no terminal event, no `done`.
pub fn waiting_run_events() -> impl Strategy<Value = Vec<Event>> {
    let approvals = prop::collection::vec(any::<bool>(), 1..4);
    (prop::collection::vec(model_call(), 1..3), approvals, any::<prop::sample::Index>()).prop_map(
        |(calls, approvals, cut)| {
            // (A completed run is not cut: its end goes, its requests come instead.)
            let mut events = build(&calls, Ending::Complete, cut);
            events.truncate(events.len() - 2);
            let index = events.iter().filter(|e| matches!(e, Event::ToolComplete(_))).count() as u32;
            let (mut starts, mut requests) = (Vec::new(), Vec::new());
            for (n, approval) in (index..).zip(approvals) {
                let (tool_call_id, input) = (format!("wait_{n}"), json!({"n": n}));
                if approval {
                    starts.push(Event::ToolStart(Box::new(ToolStartEvent {
                        tool_call_id: tool_call_id.clone(),
                        tool: "mcp:deploy".into(),
                        input: input.clone(),
                        index: n,
                        timestamp: chrono::Utc::now(),
                    })));
                    requests.push(Event::ToolApprovalRequest(Box::new(ToolApprovalRequestEvent {
                        approval_id: uuid::Uuid::now_v7().to_string(),
                        tool_call_id,
                        tool: "mcp:deploy".into(),
                        input,
                        index: n,
                        expires_at: chrono::Utc::now(),
                    })));
                } else {
                    requests.push(Event::ToolResultRequest(Box::new(ToolResultRequestEvent {
                        tool_call_id,
                        tool: "clock".into(),
                        input,
                        index: n,
                    })));
                }
            }
            events.extend(starts);
            events.extend(requests);
            events
        },
    )
}

fn build(model_calls: &[ModelCall], ending: Ending, cut: prop::sample::Index) -> Vec<Event> {
    let (conversation_id, message_id, trace_id) = (ConversationId::new(), MessageId::new(), TraceId::new());
    let mut body = Vec::new();
    let mut index = 0u32;
    let said = |piece: &Piece| match piece {
        Piece::Thinking(text) => Event::ThinkingDelta { text: text.into() },
        Piece::Text(text) => Event::TextDelta { text: text.into() },
    };
    for (step, model_call) in (0u32..).zip(model_calls) {
        body.push(Event::StepStart { step });
        body.push(Event::Status { message: THINKING_STATUS.into() });
        if !model_call.voided.is_empty() {
            body.extend(model_call.voided.iter().map(said));
            body.push(Event::StepReset { step, reason: "overloaded".into() });
            body.push(Event::StepStart { step });
        }
        body.extend(model_call.pieces.iter().map(said));
        let ids: Vec<String> = (0..model_call.calls.len()).map(|i| format!("call_{index}_{i}")).collect();
        for (call, id) in model_call.calls.iter().zip(&ids) {
            if call.streamed {
                body.push(Event::ToolInputStart { tool_call_id: id.clone(), tool: "calculator".into(), index });
                body.push(Event::ToolInputDelta { tool_call_id: id.clone(), delta: r#"{"expression":"#.into() });
                body.push(Event::ToolInputDelta { tool_call_id: id.clone(), delta: r#""1+1"}"#.into() });
            }
        }
        body.push(Event::Usage(Box::new(Usage { input_tokens: 10, output_tokens: 5, ..Usage::default() })));
        for (call, id) in model_call.calls.iter().zip(&ids) {
            body.push(Event::ToolStart(Box::new(ToolStartEvent {
                tool_call_id: id.clone(),
                tool: "calculator".into(),
                input: json!({"expression": "1+1"}),
                index,
                timestamp: chrono::Utc::now(),
            })));
            body.push(Event::Status { message: "Running calculator…".into() });
            if call.progress {
                body.push(Event::ToolProgress(Box::new(ToolProgressEvent {
                    tool_call_id: id.clone(),
                    tool: "calculator".into(),
                    stage: None,
                    message: Some("half way".into()),
                    progress: Some(0.5),
                    data: None,
                })));
            }
            if call.status != ToolStatus::Cancelled {
                let output = if call.status == ToolStatus::Success { "2" } else { "Error: no" };
                body.push(Event::ToolOutput {
                    tool_call_id: id.clone(),
                    output: output.into(),
                    truncated: false,
                    full_length: output.len(),
                });
            }
            body.push(Event::ToolComplete(Box::new(ToolCompleteEvent {
                tool_call_id: id.clone(),
                tool: "calculator".into(),
                index,
                status: call.status,
                duration_ms: 1,
                summary: None,
            })));
            body.push(Event::TextDelta { text: format!("\n\n[[tool:{index}]]").into() });
            index += 1;
        }
    }
    // A cancel or an error may come at any point; a completion comes at the end.
    if !matches!(ending, Ending::Complete) {
        body.truncate(cut.index(body.len() + 1));
    }
    let mut events = vec![Event::Start(Box::new(StartEvent {
        conversation_id,
        user_message_id: MessageId::new(),
        message_id,
        trace_id,
        model: "m".into(),
        profile: "p".into(),
    }))];
    events.extend(body);
    events.push(match ending {
        Ending::Complete => Event::Complete {
            payload: Box::new(CompletePayload {
                message: String::new(),
                thinking: None,
                suggested_values: Vec::new(),
                suggested_actions: Vec::new(),
                custom_payload: None,
                tool_history: Vec::new(),
                conversation_id,
                message_id,
                trace_id,
                model: "m".into(),
                finish_reason: "stop".into(),
                usage: Usage::default(),
                cost: crate::domain::Cost::default(),
                diagnostics: None,
            }),
        },
        Ending::Cancelled => Event::Cancelled(Box::new(CancelledEvent {
            partial_text: String::new(),
            partial_thinking: None,
            message_id,
            trace_id,
            model: "m".into(),
        })),
        Ending::Error => Event::Error(Box::new(ErrorEvent {
            code: "SERVICE_UNAVAILABLE".into(),
            message: "down".into(),
            retryable: true,
            message_id,
            trace_id,
        })),
    });
    events.push(Event::Done { conversation_id, message_id, trace_id });
    events
}

/// The text and the thinking a run's events carry, without the tool markers.
pub fn text_and_thinking(events: &[Event]) -> (String, String) {
    let (mut text, mut thinking) = (String::new(), String::new());
    for event in events {
        match event {
            Event::TextDelta { text: delta } if !super::parts::is_tool_marker(delta) => text.push_str(delta),
            Event::ThinkingDelta { text: delta } => thinking.push_str(delta),
            _ => {}
        }
    }
    (text, thinking)
}

/// Checks reasoning as a vocabulary with a part per model call carries it (`parts`, in
/// order) against the thinking the events sent: each part is what was sent from its first
/// line on, none is empty, and only newlines before a part's first line are left out.
pub fn assert_parts_of(parts: &[String], sent: &str) {
    let mut rest = sent;
    for part in parts {
        assert!(!part.is_empty() && !part.starts_with(['\n', '\r']), "{part:?} of {sent:?}");
        rest = rest.trim_start_matches(['\n', '\r']);
        rest = rest.strip_prefix(part.as_str()).unwrap_or_else(|| panic!("{part:?} is not next in {rest:?}"));
    }
    assert!(rest.trim_start_matches(['\n', '\r']).is_empty(), "{rest:?} of {sent:?} was not sent");
}
