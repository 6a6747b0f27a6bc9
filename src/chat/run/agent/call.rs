//! One model call: one step of a run (CONTRACT.md §19). Its context fitted (and summarised),
//! its files read, its output streamed out as events and into the run's output; a call that
//! fails retryably is made again or answered by a fallback, and only the attempt that
//! answers is kept.

use std::time::Instant;

use chrono::{DateTime, Utc};
use futures_util::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

use super::{Ending, Output, RunPlan};
use crate::chat::live::runs::Emitter;
use crate::chat::run::context;
use crate::chat::run::turn::{Turn, TurnOutput};
use crate::domain::{
    AssistantTurn, CallStatus, ContextState, ContextStrategy, LlmAttributes, Span, SpanTiming, Usage, now,
};
use crate::events::Event;
use crate::providers::transport;
use crate::providers::{InputMessage, ModelRequest, ProviderError, ProviderErrorKind, ProviderStream};
use crate::wake::when_woken;

/// A run's first model call, sent while the run's start was being written: the run takes its
/// answer when it makes that call; a start that is not written drops it unread (the request
/// is aborted). Its answer is `None` where the request's files could not be read then: the
/// run reads them itself (failing as it would) and sends the call anew.
pub struct EarlyCall {
    sent_at: DateTime<Utc>,
    /// The same moment, for the run's time to its first token.
    pub(super) sent: Instant,
    answer: AbortOnDropHandle<Option<Result<ProviderStream, ProviderError>>>,
}

/// Sends `plan`'s first model call now, in a task of its own, before its run starts: the
/// model answers while the start is written (on Postgres, most of a start is its commit).
/// Only a call known before the run starts goes early: one whose context needs no trim (a
/// trim begins from the conversation's stored one, read by the run).
pub fn send_early(plan: &mut RunPlan) {
    let protected = protected(&plan.request.messages);
    if context::fit(&plan.request, plan.context_limit, protected, None).state.is_some() {
        return;
    }
    let (provider, files, mut request) = (plan.provider.clone(), plan.files.clone(), plan.request.clone());
    let span = tracing::info_span!("early_call", trace_id = %plan.trace_id, conversation_id = %plan.conversation_id);
    let answer = tokio::spawn(
        async move {
            // Read by the run's reader, which keeps them for the call.
            files.read(&mut request).await.ok()?;
            Some(provider.stream(&request).await)
        }
        .instrument(span),
    );
    plan.early = Some(EarlyCall { sent_at: now(), sent: Instant::now(), answer: AbortOnDropHandle::new(answer) });
}

/// How many messages at the end of `messages` a trim keeps, whatever they cost: the last
/// user's message on.
fn protected(messages: &[InputMessage]) -> usize {
    messages.iter().rposition(InputMessage::is_user).map_or(messages.len(), |i| messages.len() - i)
}

/// One model call (one step, CONTRACT.md §19), streamed out as events and into `output`. A
/// call that fails retryably after output is made again (the provider's retries), its
/// output void (`step_reset`); one that fails retryably otherwise (before output, after its
/// retries) goes to the plan's next fallback, and the run goes on with the model that
/// answers. Only the attempt that answers is kept.
pub(super) async fn call_model(
    plan: &mut RunPlan,
    emitter: &mut Emitter,
    cancel: &CancellationToken,
    output: &mut Output,
    markers: Vec<String>,
) -> Ending {
    let mut early = plan.early.take();
    let started_at = early.as_ref().map_or_else(now, |e| e.sent_at);
    let step = output.thinking_calls.0;
    emitter.emit(Event::StepStart { step });
    emitter.emit(Event::Status { message: crate::events::THINKING_STATUS.to_owned() });
    let protected = protected(&plan.request.messages);
    // A call sent early was fitted then and needed no trim: it asked what this call asks,
    // and is this call's first attempt.
    let mut fitted = if early.is_some() {
        context::Trimmed { request: plan.request.clone(), state: None }
    } else {
        context::fit(&plan.request, plan.context_limit, protected, None)
    };
    // A request that needs trimming keeps the previous trim's first message while it fits.
    let stored = match fitted.state {
        Some(_) => plan.context.stored().await,
        None => None,
    };
    if stored.is_some() {
        fitted = context::fit(&plan.request, plan.context_limit, protected, stored.as_ref());
    }
    if plan.summarize_dropped {
        Box::pin(summarize(plan, &mut fitted, stored)).await;
    }
    if output.spans.is_empty() || fitted.state.is_some() {
        plan.context.record(fitted.state.as_ref()).await;
    }
    // Only the files of the messages kept are read.
    if let Err(error) = Box::pin(plan.files.read(&mut fitted.request)).await {
        return Ending::Failed(error);
    }
    output.thinking_calls.0 += 1;
    let (mut turn, mut started_at) = (Turn::new(output.tool_history.len() as u32, markers.clone()), started_at);
    let mut retried = 0;
    let ending = loop {
        let (shown, shown_output) = (emitter.seq(), Shown::of(output));
        emitter.hold(true);
        let ending = tokio::select! {
            biased;
            () = when_woken(cancel.cancelled()) => Ending::Cancelled,
            ending = stream_turn(plan, &fitted.request, early.take(), emitter, &mut turn, output) => ending,
        };
        emitter.hold(false);
        let Ending::Failed(error) = &ending else { break ending };
        let after_output = emitter.seq() != shown;
        // After output the same model is asked again while its provider's retries last
        // (before output, the transport has tried already); then the next fallback.
        let again = after_output && retried < plan.retries.max;
        if !error.retryable || !again && plan.fallbacks.is_empty() {
            break ending;
        }
        output.spans.push(failed_call(&fitted.request.model, started_at, &ending));
        let wait = plan.retries.wait(retried, error.retry_after);
        let reason = error.message.clone();
        if after_output {
            shown_output.restore(output);
            emitter.emit(Event::StepReset { step, reason });
            emitter.emit(Event::StepStart { step });
        }
        if again {
            retried += 1;
            tracing::warn!(error = %error, attempt = retried, "model call failed after output; asking again");
            tokio::select! {
                biased;
                () = when_woken(cancel.cancelled()) => break Ending::Cancelled,
                () = tokio::time::sleep(wait) => {}
            }
        } else {
            let fallback = plan.fallbacks.remove(0);
            tracing::warn!(
                error = %error, profile = %plan.profile, fallback = %fallback.profile,
                "model call failed; its fallback answers"
            );
            fallback.ask(&mut fitted.request);
            fallback.ask(&mut plan.request);
            (plan.provider, plan.provider_id, plan.retries) =
                (fallback.provider, fallback.provider_id, fallback.retries);
            emitter.emit(Event::Status { message: format!("Answering with {}", fallback.model) });
            retried = 0;
        }
        (turn, started_at) = (Turn::new(output.tool_history.len() as u32, markers.clone()), now());
    };
    if matches!(ending, Ending::Cancelled) {
        let mut held = Vec::new();
        turn.flush(&mut held);
        for event in held {
            emit_content(emitter, output, event);
        }
    }
    let ended_at = now();
    let mut turn = turn.output;
    estimate_missing_usage(&mut turn, &fitted.request);
    let ttl = fitted.request.prompt_cache.unwrap_or_default();
    let cost = plan.prices.cost(&plan.provider_id, &fitted.request.model, &turn.usage, started_at, ttl);
    output.usage.add(&turn.usage);
    output.cost.add(cost, &turn.usage);
    output.raw_text.push_str(&turn.raw_text);
    output.captured.extend(turn.captured);
    output.warnings.extend(
        turn.invalid_markers.into_iter().map(|m| format!("marker left in the text, its JSON did not parse: {m}")),
    );
    if let Some(reason) = &turn.finish_reason {
        output.finish_reason.clone_from(reason);
    }
    output.spans.push(Span::Llm {
        timing: SpanTiming::new(format!("chat {}", plan.request.model), started_at, ended_at),
        status: status_of(&ending),
        attributes: Box::new(LlmAttributes {
            operation_name: "chat".to_owned(),
            request_model: plan.request.model.clone(),
            input_tokens: turn.usage.input_tokens,
            output_tokens: turn.usage.output_tokens,
            usage_estimated: turn.usage.estimated,
            cache_read_tokens: turn.usage.cache_read_tokens,
            cache_write_tokens: turn.usage.cache_write_tokens,
            cache_prefix_tokens: fitted.request.prompt_cache.map(|_| context::prefix_tokens(&fitted.request)),
            cost_usd: cost,
            finish_reasons: turn.finish_reason.iter().cloned().collect(),
            context: fitted.state,
            warnings: Vec::new(),
        }),
    });
    if turn.usage != Usage::default() {
        crate::report::metrics::record_call(&plan.profile, &turn.usage, cost);
        let model = plan.request.model.clone();
        metrics::counter!("chatd_tokens_total", "model" => model.clone(), "direction" => "input")
            .increment(turn.usage.input_tokens);
        metrics::counter!("chatd_tokens_total", "model" => model, "direction" => "output")
            .increment(turn.usage.output_tokens);
        // A call cut short by a failure or a cancel keeps its estimate in the trace (and a
        // cancelled answer's message); its stream goes on to its terminal event without one.
        if !turn.usage.estimated || matches!(ending, Ending::Completed) {
            emitter.emit(Event::Usage(Box::new(turn.usage)));
        }
    }
    output.turns.push(AssistantTurn {
        text: turn.text,
        thinking_blocks: turn.thinking_blocks,
        tool_calls: turn.tool_calls,
        tool_results: Vec::new(),
    });
    ending
}

/// What a model call's attempt adds to what the client has been shown: undone when the
/// attempt's output is void (`step_reset`).
struct Shown {
    text: usize,
    thinking: usize,
    after_marker: bool,
    thinking_calls: u32,
}

impl Shown {
    fn of(output: &Output) -> Self {
        Self {
            text: output.text.len(),
            thinking: output.thinking.len(),
            after_marker: output.after_marker,
            thinking_calls: output.thinking_calls.1,
        }
    }

    fn restore(self, output: &mut Output) {
        output.text.truncate(self.text);
        output.thinking.truncate(self.thinking);
        output.after_marker = self.after_marker;
        output.thinking_calls.1 = self.thinking_calls;
    }
}

/// The span of a model call's attempt that failed and was made again, or answered by a
/// fallback.
fn failed_call(model: &str, started_at: chrono::DateTime<chrono::Utc>, ending: &Ending) -> Span {
    Span::Llm {
        timing: SpanTiming::new(format!("chat {model}"), started_at, now()),
        status: status_of(ending),
        attributes: Box::new(LlmAttributes {
            operation_name: "chat".to_owned(),
            request_model: model.to_owned(),
            input_tokens: 0,
            output_tokens: 0,
            finish_reasons: Vec::new(),
            ..LlmAttributes::default()
        }),
    }
}

/// Replaces what trimming dropped by a summary the model writes, kept in the context state
/// and written again only when more is dropped. A failed summary leaves the trim as it is.
async fn summarize(plan: &RunPlan, fitted: &mut context::Trimmed, stored: Option<ContextState>) {
    let Some(state) = fitted.state.as_mut() else { return };
    let dropped = state.dropped;
    if dropped == 0 {
        return;
    }
    let cached = stored.filter(|s| s.dropped_through == state.dropped_through).and_then(|s| s.summary);
    let summary = match cached {
        Some(summary) => summary,
        None => {
            let request = context::summary_request(&plan.request, &plan.request.messages[..dropped]);
            let Some(summary) = crate::chat::run::turn::complete_text(&*plan.provider, &request).await else {
                tracing::warn!("could not summarise the dropped context");
                return;
            };
            summary
        }
    };
    let prompt = fitted.request.system_prompt.as_deref().unwrap_or_default();
    fitted.request.system_prompt = Some(format!("{prompt}\n\n## Earlier in this conversation\n{summary}").into());
    state.strategy = ContextStrategy::TrimOldestWithSummary;
    state.summary = Some(summary);
}

/// Counts what the provider did not (CONTRACT.md §18: usage is never invented, and never
/// zero for work done): a call that produced something, or finished, and came back without
/// input or output tokens gets chatd's count of them (with the model's own tokenizer where
/// it is OpenAI's, else four characters a token), marked `estimated`. A call that
/// failed before producing anything did no work to count.
fn estimate_missing_usage(turn: &mut TurnOutput, request: &ModelRequest) {
    let produced = !turn.raw_text.is_empty() || !turn.thinking.is_empty() || !turn.tool_calls.is_empty();
    if !produced && turn.finish_reason.is_none() {
        return;
    }
    let count = context::tokenizer(&request.model);
    if turn.usage.input_tokens == 0 {
        turn.usage.input_tokens = context::request_tokens_by(request, &count);
        turn.usage.estimated = true;
    }
    if turn.usage.output_tokens == 0 && produced {
        let calls: u64 = turn.tool_calls.iter().map(|c| count(&c.name) + count(&c.input.to_string())).sum();
        turn.usage.output_tokens = count(&turn.raw_text) + count(&turn.thinking) + calls;
        turn.usage.estimated = true;
    }
}

pub(super) fn status_of(ending: &Ending) -> CallStatus {
    match ending {
        Ending::Completed => CallStatus::Ok,
        Ending::Cancelled => CallStatus::Cancelled,
        Ending::Failed(_) | Ending::NotParked => CallStatus::Error,
    }
}

/// One attempt of a model call: `request` sent (or `early`'s answer taken), its output
/// streamed into `turn` and out as events.
async fn stream_turn(
    plan: &RunPlan,
    request: &ModelRequest,
    early: Option<EarlyCall>,
    emitter: &mut Emitter,
    turn: &mut Turn,
    output: &mut Output,
) -> Ending {
    let early = match early.map(|early| early.answer) {
        Some(answer) => answer.await,
        None => Ok(None),
    };
    let answer = match early {
        Ok(Some(answer)) => answer,
        // Not sent early, or its files could not be read then.
        Ok(None) => plan.provider.stream(request).await,
        // A provider that panics fails its run as it would in the run's own task.
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(ProviderError::new(ProviderErrorKind::Network, "the model call was stopped")),
    };
    let mut stream = match answer {
        Ok(stream) => stream,
        Err(error) => return Ending::Failed(error),
    };
    let mut events = Vec::new();
    while let Some(event) = next_event(&mut stream, emitter).await {
        let event = match event {
            Ok(event) => event,
            Err(error) => return Ending::Failed(error),
        };
        turn.apply(event, &mut events);
        for event in events.drain(..) {
            emit_content(emitter, output, event);
        }
        if turn.finished() {
            return Ending::Completed;
        }
    }
    // Adapters end their streams with an error when the terminal frame is missing; a
    // provider that simply stops is one more case of the same.
    Ending::Failed(transport::cut_off_error())
}

/// The provider's next event. What the turn emitted from what already arrived goes out
/// before it waits for the network, so listeners get each burst at once, in one piece.
async fn next_event<S: futures_util::Stream + Unpin>(stream: &mut S, emitter: &mut Emitter) -> Option<S::Item> {
    if let Some(item) = stream.next().now_or_never() {
        return item;
    }
    // The HTTP client hands a body over chunk by chunk from its connection task: give that
    // task a turn before taking the provider for quiet.
    tokio::task::yield_now().await;
    if let Some(item) = stream.next().now_or_never() {
        return item;
    }
    emitter.publish();
    stream.next().await
}

/// Emits a turn's event, keeping `output` equal to what the client assembles.
fn emit_content(emitter: &mut Emitter, output: &mut Output, event: Event) {
    if matches!(event, Event::TextDelta { .. } | Event::ThinkingDelta { .. }) {
        if let Some((started, model)) = output.awaiting_first_token.take() {
            metrics::histogram!("chatd_time_to_first_token_seconds", "model" => model)
                .record(started.elapsed().as_secs_f64());
        }
    }
    match event {
        Event::TextDelta { mut text } => {
            if std::mem::take(&mut output.after_marker) {
                text.insert_str(0, "\n\n");
            }
            output.text.push_str(&text);
            emitter.emit(Event::TextDelta { text });
        }
        Event::ThinkingDelta { mut text } => {
            // A later model call's thinking starts a paragraph of its own.
            if output.thinking_calls.1 != output.thinking_calls.0 {
                output.thinking_calls.1 = output.thinking_calls.0;
                if !output.thinking.is_empty() {
                    text.insert_str(0, "\n\n");
                }
            }
            output.thinking.push_str(&text);
            emitter.emit(Event::ThinkingDelta { text });
        }
        other => emitter.emit(other),
    }
}
