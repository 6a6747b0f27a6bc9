//! The end of a run the agent loop ran: its answer, trace and terminal event made of what
//! the loop produced, then ended as every run is (`chat::ending`).

use std::sync::Arc;

use crate::chat::live::ending::End;
use crate::chat::live::runs::Emitter;
use crate::chat::run::payloads;
use crate::domain::{Cost, Message, Role, RunError, Span, TraceStatus, now};
use crate::events::{CancelledEvent, CompletePayload, ErrorEvent, Event};
use crate::providers::ProviderErrorKind;
use crate::store::{RunFinish, Store};

use super::{Ending, Output, RunPlan};

pub(super) async fn finish(
    plan: &RunPlan,
    emitter: &mut Emitter,
    store: &Arc<dyn Store>,
    ending: Ending,
    mut output: Output,
) {
    // A context state cleared aside is gone before the run's end is told.
    plan.context.cleared().await;
    if matches!(ending, Ending::Cancelled) {
        // A call cancelled before its result (or before its arguments were whole) would be
        // an unanswered call that providers refuse in every later turn: drop it.
        for turn in &mut output.turns {
            let answered: Vec<&str> = turn.tool_results.iter().map(|r| r.tool_call_id.as_str()).collect();
            turn.tool_calls.retain(|c| answered.contains(&c.id.as_str()));
        }
    }
    let extracted = payloads::extract(&output.captured, &plan.payload_types);
    output.warnings.extend(extracted.warnings);
    output.payloads.extend(extracted.payloads);
    if !output.warnings.is_empty() {
        tracing::warn!(warnings = ?output.warnings, "the answer's markers had problems");
        let last_call = output.spans.iter_mut().rev().find_map(|span| match span {
            Span::Llm { attributes, .. } => Some(attributes),
            Span::Tool { .. } => None,
        });
        if let Some(attributes) = last_call {
            attributes.warnings.clone_from(&output.warnings);
        }
    }
    let thinking = (!output.thinking.is_empty()).then(|| output.thinking.clone());
    let mut message = Message::new(plan.conversation_id, Some(plan.user_message_id), Role::Assistant, String::new());
    message.id = plan.message_id;
    message.thinking = thinking.clone();
    message.model = Some(plan.request.model.clone());
    message.trace_id = Some(plan.trace_id);
    message.usage = Some(output.usage);
    let cost = Cost::of(output.cost.usd(), Some(&output.usage));
    message.cost = cost;
    message.tool_calls = output.turns.iter().flat_map(|t| t.tool_calls.clone()).collect();
    message.tool_history = output.tool_history.clone();
    message.payloads = output.payloads.clone();
    message.suggested_values = extracted.suggested_values.clone();
    message.suggested_actions = extracted.suggested_actions.clone();
    message.turns = output.turns;
    if let Some((comparison_id, variant)) = &plan.comparison {
        message.comparison_id = Some(*comparison_id);
        message.variant = Some(variant.clone());
    }
    let (status, assistant, error, terminal) = match ending {
        Ending::Completed => {
            message.content = output.text.clone();
            let diagnostics = plan.diagnostics.clone().map(|mut d| {
                d.raw_llm_response = output.raw_text;
                d
            });
            let payload = CompletePayload {
                message: output.text,
                thinking,
                suggested_values: extracted.suggested_values,
                suggested_actions: extracted.suggested_actions,
                custom_payload: output.payloads.last().cloned(),
                tool_history: output.tool_history,
                conversation_id: plan.conversation_id,
                message_id: plan.message_id,
                trace_id: plan.trace_id,
                model: plan.request.model.clone(),
                finish_reason: if output.finish_reason.is_empty() { "stop".to_owned() } else { output.finish_reason },
                usage: output.usage,
                cost,
                diagnostics,
            };
            (TraceStatus::Completed, Some(message), None, Event::Complete { payload: Box::new(payload) })
        }
        Ending::Cancelled => {
            message.cancelled = true;
            message.content = if output.text.is_empty() {
                "[cancelled]".to_owned()
            } else {
                format!("{}\n\n[cancelled]", output.text)
            };
            let cancelled = Event::Cancelled(Box::new(CancelledEvent {
                partial_text: output.text,
                partial_thinking: thinking,
                message_id: plan.message_id,
                trace_id: plan.trace_id,
                model: plan.request.model.clone(),
            }));
            (TraceStatus::Cancelled, Some(message), None, cancelled)
        }
        Ending::NotParked => {
            let message = "The run could not wait for its tool calls: the database did not take its state";
            let event = error_event(plan, "SERVICE_UNAVAILABLE", message, true);
            let detail = RunError::new("SERVICE_UNAVAILABLE", message, Some(output.text));
            (TraceStatus::Error, None, Some(detail), event)
        }
        Ending::Failed(error) => {
            let next = match error.kind {
                ProviderErrorKind::Network => "check that its server runs and answers at its base_url",
                ProviderErrorKind::Unauthorized => "check its API key (api_key_env or api_key_file)",
                ProviderErrorKind::RateLimited => "the provider limits this key's rate; wait, or raise the limit",
                ProviderErrorKind::Unavailable | ProviderErrorKind::Parse => {
                    "the provider failed; its message says why"
                }
            };
            tracing::warn!(
                code = error.code(),
                error = %error.message,
                profile = %plan.profile,
                provider = %plan.provider_id,
                "model call failed: {next} (providers.{})",
                plan.provider_id
            );
            metrics::counter!("chatd_provider_errors_total", "code" => error.code()).increment(1);
            let event = error_event(plan, error.code(), &error.message, error.retryable);
            let detail = RunError::new(error.code(), &error.message, Some(output.text));
            (TraceStatus::Error, None, Some(detail), event)
        }
    };
    metrics::counter!("chatd_runs_total", "status" => status.as_str()).increment(1);
    let record = RunFinish {
        trace_id: plan.trace_id,
        user_id: plan.user_id.clone(),
        status,
        ended_at: now(),
        usage: output.usage,
        cost_usd: cost.cost_usd,
        error,
        spans: output.spans,
        assistant_message: assistant,
    };
    crate::chat::live::ending::end(store, emitter, End::saving(record, terminal)).await;
}

pub(super) fn error_event(plan: &RunPlan, code: &str, message: &str, retryable: bool) -> Event {
    Event::Error(Box::new(ErrorEvent {
        code: code.to_owned(),
        message: message.to_owned(),
        retryable,
        message_id: plan.message_id,
        trace_id: plan.trace_id,
    }))
}
