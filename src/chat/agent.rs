//! The run itself, from `start` to `done`: call the model, turn what it streams into clean
//! events, then persist the result and end the stream with exactly one terminal event.
//! Tool calls and the multi-step loop arrive with the tools (see README, "not done yet").

use std::sync::Arc;

use std::panic::AssertUnwindSafe;

use futures_util::{FutureExt, StreamExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::runs::{Emitter, Runs};
use super::turn::Turn;
use crate::domain::{Message, Role, ToolCall, TraceStatus, Usage, now};
use crate::events::{CompletePayload, Event};
use crate::providers::{LlmProvider, ModelRequest, ProviderError, transport};
use crate::store::{RunFinish, Store};

/// Everything a started run needs; built by the service once validation passed.
pub struct RunPlan {
    pub conversation_id: Uuid,
    pub user_message_id: Uuid,
    pub message_id: Uuid,
    pub trace_id: Uuid,
    pub profile: String,
    pub provider: Arc<dyn LlmProvider>,
    pub request: ModelRequest,
}

/// What the model calls produced, however the run ended.
#[derive(Debug, Default)]
struct Output {
    /// The answer and the thinking exactly as the client received them.
    text: String,
    thinking: String,
    usage: Usage,
    finish_reason: String,
    spans: Vec<serde_json::Value>,
    /// Signed thinking blocks, raw, to send back to the provider in later turns.
    thinking_blocks: Vec<serde_json::Value>,
    /// Tool calls the model asked for, in the order they began.
    tool_calls: Vec<ToolCall>,
}

enum Ending {
    Completed,
    Cancelled,
    Failed(ProviderError),
}

/// Runs the plan in its own task and cleans up after it, even if the run panics: the trace
/// is closed as an error and every listener still gets `error` then `done`.
pub async fn supervise(plan: RunPlan, mut emitter: Emitter, store: Arc<dyn Store>, runs: Runs) {
    let (trace_id, conversation_id, message_id) =
        (plan.trace_id, plan.conversation_id, plan.message_id);
    let run = AssertUnwindSafe(execute(plan, &mut emitter, &*store))
        .catch_unwind()
        .await;
    if run.is_err() {
        tracing::error!(%trace_id, "run panicked");
        let failed = RunFinish {
            trace_id,
            status: TraceStatus::Error,
            ended_at: now(),
            usage: Usage::default(),
            error: Some(json!({"code": "INTERNAL", "message": "Internal error"})),
            spans: Vec::new(),
            assistant_message: None,
        };
        if let Err(e) = store.finish_run(&failed).await {
            tracing::error!(error = %e, %trace_id, "could not close the failed run's trace");
        }
        if !emitter.run().is_finished() {
            emitter.emit(Event::Error {
                code: "INTERNAL".into(),
                message: "Internal error".into(),
                retryable: true,
                message_id,
                trace_id,
            });
            emitter.emit(Event::Done {
                conversation_id,
                message_id,
                trace_id,
            });
        }
    }
    if let Err(e) = emitter.flush().await {
        tracing::error!(error = %e, %trace_id, "the run's last events could not be logged");
    }
    runs.remove(trace_id);
}

/// Runs the plan to its end. Every path emits exactly one of `complete`, `cancelled`,
/// `error`, then `done`, and persists what it must.
#[tracing::instrument(skip_all, fields(trace_id = %plan.trace_id, conversation_id = %plan.conversation_id))]
async fn execute(plan: RunPlan, emitter: &mut Emitter, store: &dyn Store) {
    let cancel = emitter.run().cancel.clone();
    emitter.emit(Event::Start {
        conversation_id: plan.conversation_id,
        user_message_id: plan.user_message_id,
        message_id: plan.message_id,
        trace_id: plan.trace_id,
        model: plan.request.model.clone(),
        profile: plan.profile.clone(),
    });
    let mut output = Output::default();
    let ending = call_model(&plan, emitter, &cancel, &mut output).await;
    finish(&plan, emitter, store, ending, output).await;
}

/// One model call, streamed out as events and into `output`.
async fn call_model(
    plan: &RunPlan,
    emitter: &mut Emitter,
    cancel: &CancellationToken,
    output: &mut Output,
) -> Ending {
    let started_at = now();
    emitter.emit(Event::Status {
        message: "Thinking…".to_owned(),
    });
    let mut turn = Turn::new(output.tool_calls.len() as u32);
    let ending = tokio::select! {
        biased;
        () = cancel.cancelled() => Ending::Cancelled,
        ending = stream_turn(plan, emitter, &mut turn) => ending,
    };
    let ended_at = now();
    let turn = turn.output;
    output.text.push_str(&turn.text);
    output.thinking.push_str(&turn.thinking);
    output.usage.add(&turn.usage);
    output.thinking_blocks.extend(turn.thinking_blocks);
    output.tool_calls.extend(turn.tool_calls);
    if let Some(reason) = &turn.finish_reason {
        output.finish_reason.clone_from(reason);
    }
    output.spans.push(json!({
        "kind": "llm",
        "name": format!("chat {}", plan.request.model),
        "started_at": started_at,
        "ended_at": ended_at,
        "duration_ms": (ended_at - started_at).num_milliseconds(),
        "status": match &ending { Ending::Completed => "ok", Ending::Cancelled => "cancelled", Ending::Failed(_) => "error" },
        "attributes": {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": plan.request.model,
            "gen_ai.usage.input_tokens": turn.usage.input_tokens,
            "gen_ai.usage.output_tokens": turn.usage.output_tokens,
            "gen_ai.response.finish_reasons": turn.finish_reason.into_iter().collect::<Vec<_>>(),
        },
    }));
    if turn.usage != Usage::default() {
        emitter.emit(Event::Usage(turn.usage));
    }
    ending
}

async fn stream_turn(plan: &RunPlan, emitter: &mut Emitter, turn: &mut Turn) -> Ending {
    let mut stream = match plan.provider.stream(&plan.request).await {
        Ok(stream) => stream,
        Err(error) => return Ending::Failed(error),
    };
    let mut events = Vec::new();
    while let Some(event) = stream.next().await {
        let applied = event.and_then(|event| turn.apply(event, &mut events));
        for event in events.drain(..) {
            emitter.emit(event);
        }
        if let Err(error) = applied {
            return Ending::Failed(error);
        }
        if turn.finished() {
            return Ending::Completed;
        }
    }
    // Adapters end their streams with an error when the terminal frame is missing; a
    // provider that simply stops is one more case of the same.
    Ending::Failed(transport::network_error())
}

async fn finish(
    plan: &RunPlan,
    emitter: &mut Emitter,
    store: &dyn Store,
    ending: Ending,
    output: Output,
) {
    let thinking = (!output.thinking.is_empty()).then(|| output.thinking.clone());
    let mut message = Message::new(
        plan.conversation_id,
        Some(plan.user_message_id),
        Role::Assistant,
        String::new(),
    );
    message.id = plan.message_id;
    message.thinking = thinking.clone();
    message.model = Some(plan.request.model.clone());
    message.trace_id = Some(plan.trace_id);
    message.usage = Some(output.usage);
    message.tool_calls = output.tool_calls.clone();
    if !output.thinking_blocks.is_empty() {
        message.provider_state = Some(json!({"anthropic": {"thinking": output.thinking_blocks}}));
    }
    let (status, assistant, error, terminal) = match ending {
        Ending::Completed => {
            message.content = output.text.clone();
            let payload = CompletePayload {
                message: output.text,
                thinking,
                suggested_values: Vec::new(),
                suggested_actions: Vec::new(),
                custom_payload: None,
                tool_history: Vec::new(),
                conversation_id: plan.conversation_id,
                message_id: plan.message_id,
                trace_id: plan.trace_id,
                model: plan.request.model.clone(),
                finish_reason: output.finish_reason,
                usage: output.usage,
                diagnostics: None,
            };
            let complete = Event::Complete {
                payload: Box::new(payload),
            };
            (TraceStatus::Completed, Some(message), None, complete)
        }
        Ending::Cancelled => {
            message.cancelled = true;
            message.content = if output.text.is_empty() {
                "[cancelled]".to_owned()
            } else {
                format!("{}\n\n[cancelled]", output.text)
            };
            let cancelled = Event::Cancelled {
                partial_text: output.text,
                partial_thinking: thinking,
                message_id: plan.message_id,
                trace_id: plan.trace_id,
                model: plan.request.model.clone(),
            };
            (TraceStatus::Cancelled, Some(message), None, cancelled)
        }
        Ending::Failed(error) => {
            tracing::warn!(code = error.code(), error = %error.message, "model call failed");
            let event = error_event(plan, error.code(), &error.message, error.retryable);
            let detail = json!({"code": error.code(), "message": error.message, "partial_text": output.text});
            (TraceStatus::Error, None, Some(detail), event)
        }
    };
    let record = RunFinish {
        trace_id: plan.trace_id,
        status,
        ended_at: now(),
        usage: output.usage,
        error,
        spans: output.spans,
        assistant_message: assistant,
    };
    // The answer is stored before the client hears `complete`, so a load right after sees it.
    let terminal = match store.finish_run(&record).await {
        Ok(()) => terminal,
        Err(e) => {
            tracing::error!(error = %e, "could not persist the run's result");
            error_event(
                plan,
                "SERVICE_UNAVAILABLE",
                "The answer could not be saved",
                true,
            )
        }
    };
    emitter.emit(terminal);
    emitter.emit(Event::Done {
        conversation_id: plan.conversation_id,
        message_id: plan.message_id,
        trace_id: plan.trace_id,
    });
}

fn error_event(plan: &RunPlan, code: &str, message: &str, retryable: bool) -> Event {
    Event::Error {
        code: code.to_owned(),
        message: message.to_owned(),
        retryable,
        message_id: plan.message_id,
        trace_id: plan.trace_id,
    }
}
