//! The run, from `start` to `done`: the agent loop. Call the model; if it asked for tools,
//! run them (concurrently, each with a timeout and bounded retries), feed the results back
//! and call it again, up to `max_iterations` model calls. Then persist the result and end
//! the stream with exactly one terminal event.

use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{FutureExt, StreamExt};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::context::{self, ContextKeeper};
use super::markers::Captured;
use super::payloads::{self, LlmPayloadType};
use super::turn::{Turn, TurnOutput};
use crate::chat::live::ending::{self, End};
use crate::chat::live::runs::{Emitter, Runs};
use crate::domain::{
    AssistantTurn, CallStatus, ContextStrategy, LlmAttributes, RunError, Span, SpanTiming, ToolRecord, TraceStatus,
    Usage, now,
};
use crate::events::{Diagnostics, ErrorEvent, Event, StartEvent};
use crate::providers::transport::{self, Retries};
use crate::providers::{InputMessage, LlmProvider, ModelRequest, ProviderError};
use crate::store::{RunFinish, Store};
use crate::tools::Tool;
use crate::wake::when_woken;

mod finish;
mod park;
mod tools;

use finish::finish;
pub use park::{Checkpoint, Gate, PendingTurn, Resumption};
pub use tools::INTERRUPTED_CALL;
use tools::{TurnTools, continue_turn, resume_turn, start_turn};

/// Why a continued run's step that was going when its process died is void.
pub const STOPPED_MID_STEP: &str = "The server stopped during this step";

/// Everything a started run needs; built by the service once validation passed.
pub struct RunPlan {
    pub conversation_id: ConversationId,
    pub user_message_id: MessageId,
    pub message_id: MessageId,
    pub trace_id: TraceId,
    pub profile: String,
    /// The id of the profile's provider (`providers.<id>`), for the operator's log.
    pub provider_id: String,
    pub provider: Arc<dyn LlmProvider>,
    pub request: ModelRequest,
    pub tools: Vec<Arc<dyn Tool>>,
    pub max_iterations: u32,
    pub payload_types: Vec<LlmPayloadType>,
    pub limits: ToolLimits,
    /// The diagnostics of the request, when it asked and config allows; the agent adds the
    /// raw model output.
    pub diagnostics: Option<Box<Diagnostics>>,
    /// The comparison and side (`a` or `b`) this run answers for, if any.
    pub comparison: Option<(ComparisonId, String)>,
    pub context_limit: Option<u32>,
    pub context: ContextKeeper,
    /// Whether dropped history is replaced by a model-written summary.
    pub summarize_dropped: bool,
    /// Whose run it is (a waiting call belongs to its user).
    pub user_id: crate::ids::UserId,
    /// The tools whose calls wait (CONTRACT.md §15): for a person's approval, or for the
    /// frontend that runs them.
    pub gates: std::collections::HashMap<String, Gate>,
    pub approval_timeout: Duration,
    /// What the run's continuation after a wait plans its tools from again.
    pub context_value: Option<Value>,
    pub client_tools: Vec<crate::chat::request::ClientTool>,
    /// Reads the request's attachments before each model call (CONTRACT.md §14).
    pub files: crate::chat::run::attachments::FileReader,
    /// How often a model call that failed after output is made again (its provider's
    /// retries, CONTRACT.md §19).
    pub retries: Retries,
    /// The profiles that answer instead when a model call fails retryably (CONTRACT.md
    /// §19), in order; the run goes on with the one that answered.
    pub fallbacks: Vec<Fallback>,
}

/// A profile that answers a run's model call in its own profile's stead: its provider and
/// model, and its sampling and thinking settings; the input stays the run's.
pub struct Fallback {
    pub profile: String,
    pub provider_id: String,
    pub provider: Arc<dyn LlmProvider>,
    pub retries: Retries,
    pub model: String,
    pub temperature: Option<f32>,
    pub max_tokens: Option<u32>,
    pub enable_thinking: bool,
    pub thinking_budget: Option<u32>,
    pub reasoning_effort: Option<String>,
}

impl Fallback {
    /// `request` as this fallback's model is asked it.
    fn ask(&self, request: &mut ModelRequest) {
        request.model.clone_from(&self.model);
        request.temperature = self.temperature;
        request.max_tokens = self.max_tokens;
        request.enable_thinking = self.enable_thinking;
        request.thinking_budget = self.thinking_budget;
        request.reasoning_effort.clone_from(&self.reasoning_effort);
    }
}

#[derive(Debug, Clone, Copy)]
pub struct ToolLimits {
    pub timeout: Duration,
    pub max_output_chars: usize,
    pub max_retries: u32,
}

/// What the run produced, however it ended (kept in a waiting run's checkpoint).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Output {
    /// The answer and the thinking exactly as the client received them.
    text: String,
    thinking: String,
    usage: Usage,
    finish_reason: String,
    spans: Vec<Span>,
    turns: Vec<AssistantTurn>,
    tool_history: Vec<ToolRecord>,
    payloads: Vec<Value>,
    captured: Vec<Captured>,
    warnings: Vec<String>,
    raw_text: String,
    /// A `[[tool:N]]` marker was the last text: the next text starts a new paragraph.
    after_marker: bool,
    /// The model calls made so far, and the one whose thinking was last shown.
    thinking_calls: (u32, u32),
    /// When the run started, until its first token is timed (then `None`).
    #[serde(skip)]
    awaiting_first_token: Option<(Instant, String)>,
}

enum Ending {
    Completed,
    Cancelled,
    Failed(ProviderError),
    /// The run was to wait, and the database did not take its state.
    NotParked,
}

/// Where a run starts: at its beginning, where it waited (once its calls are settled), or
/// after its last completed step, its process gone (CONTRACT.md §19).
pub enum Start {
    Fresh,
    Resumed(Box<park::Resumption>),
    Continued(Box<Continuation>),
}

/// A run that goes on in another process than the one that died running it: from its last
/// completed step (its checkpoint), or from its start where it completed none.
pub struct Continuation {
    pub checkpoint: Option<Checkpoint>,
    /// What the client is told first (`status`).
    pub status: String,
}

/// What a turn begins with where the run goes on mid-turn.
enum Settle {
    /// Its calls waited, and are settled now.
    Waited(PendingTurn, Vec<crate::store::Wait>),
    /// Its process died while its calls ran.
    Interrupted(PendingTurn),
}

/// Emits the run's `start`. Its starter calls this before it spawns the run's task, so that
/// the event is there when the response goes out: it leaves with the headers instead of a
/// trip through the runtime's queues later (at load, each trip is a wait).
pub fn announce(plan: &RunPlan, emitter: &mut Emitter) {
    emitter.emit(Event::Start(Box::new(StartEvent {
        conversation_id: plan.conversation_id,
        user_message_id: plan.user_message_id,
        message_id: plan.message_id,
        trace_id: plan.trace_id,
        model: plan.request.model.clone(),
        profile: plan.profile.clone(),
    })));
}

/// Runs an [announced](announce) plan in its own task and cleans up after it, even if the
/// run panics: the trace is closed as an error and every listener still gets `error` then
/// `done`.
pub async fn supervise(plan: RunPlan, mut emitter: Emitter, store: Arc<dyn Store>, runs: Runs, start: Start) {
    let (trace_id, message_id) = (plan.trace_id, plan.message_id);
    let hand_over = emitter.run().hand_over.clone();
    let run = {
        let run = AssertUnwindSafe(execute(plan, &mut emitter, &store, start)).catch_unwind();
        tokio::select! {
            biased;
            run = run => Some(run),
            () = hand_over.cancelled() => None,
        }
    };
    let Some(run) = run else {
        // Handed over (CONTRACT.md §19): what it said and its last checkpoint go to the log,
        // and another replica goes on from there; its listeners here follow it in the log.
        tracing::info!(%trace_id, "run handed over to another replica");
        emitter.park();
        if let Err(e) = emitter.seal().await {
            tracing::error!(error = %e, %trace_id, "a run handed over could not log its last events");
        }
        runs.remove(emitter.run());
        return;
    };
    if run.is_err() {
        tracing::error!(%trace_id, "run panicked");
        if !emitter.run().is_finished() {
            let record = RunFinish {
                trace_id,
                status: TraceStatus::Error,
                ended_at: now(),
                usage: Usage::default(),
                error: Some(RunError::new("INTERNAL", "Internal error", None)),
                spans: Vec::new(),
                assistant_message: None,
            };
            let terminal = Event::Error(Box::new(ErrorEvent {
                code: "INTERNAL".into(),
                message: "Internal error".into(),
                retryable: true,
                message_id,
                trace_id,
            }));
            ending::end(&store, &mut emitter, End { record: Some(record), terminal }).await;
        }
    }
    // A run that ended has sealed its log; one that parks to wait seals what it logged.
    if !emitter.run().is_finished() {
        if let Err(e) = emitter.seal().await {
            tracing::error!(error = %e, %trace_id, "the run's last events could not be logged");
        }
    }
    runs.remove(emitter.run());
}

/// Runs the plan to its end, after its `start` (or from where it waited). Every path emits
/// exactly one of `complete`, `cancelled`, `error`, then `done`, and persists what it must;
/// or parks the run to wait for its calls (CONTRACT.md §15), to be continued by whichever
/// process settles the last of them.
#[tracing::instrument(skip_all, fields(trace_id = %plan.trace_id, conversation_id = %plan.conversation_id))]
async fn execute(mut plan: RunPlan, emitter: &mut Emitter, store: &Arc<dyn Store>, start: Start) {
    let cancel = emitter.run().cancel.clone();
    let (mut output, first_iteration, mut settle) = match start {
        Start::Fresh => {
            let first = Some((Instant::now(), plan.request.model.clone()));
            (Output { awaiting_first_token: first, ..Output::default() }, 1, None)
        }
        Start::Resumed(resumption) => {
            // The plan asks the checkpoint's request already, of its profile's model (see
            // `Planner::replan`: a fallback that answered before the wait does not stay).
            let park::Resumption { checkpoint, waits } = *resumption;
            (checkpoint.output, checkpoint.iteration, Some(Settle::Waited(checkpoint.pending, waits)))
        }
        Start::Continued(continuation) => {
            let Continuation { checkpoint, status } = *continuation;
            // Where a model call comes next, one may have begun (its clients may have seen
            // its start and some of its output, logged or not): what it said is void.
            let next_call = match &checkpoint {
                None => Some(0),
                Some(c) if c.pending.results.iter().all(Option::is_some) => Some(c.output.thinking_calls.0),
                Some(_) => None,
            };
            if let Some(step) = next_call {
                emitter.emit(Event::StepReset { step, reason: STOPPED_MID_STEP.to_owned() });
            }
            emitter.emit(Event::Status { message: status });
            match checkpoint {
                Some(c) => (c.output, c.iteration, Some(Settle::Interrupted(c.pending))),
                None => (Output::default(), 1, None),
            }
        }
    };
    let markers: Vec<String> = [payloads::SUGGESTED_VALUES, payloads::SUGGESTED_ACTIONS]
        .into_iter()
        .map(str::to_owned)
        .chain(plan.payload_types.iter().map(|t| t.marker.clone()))
        .collect();
    let mut ending = Ending::Completed;
    for iteration in first_iteration..=plan.max_iterations.max(first_iteration) {
        let tools = match settle.take() {
            // The turn that waited: its calls are settled now.
            Some(Settle::Waited(pending, waits)) => {
                TurnTools::Settled(resume_turn(&plan, emitter, &cancel, pending, &waits, &mut output, iteration).await)
            }
            Some(Settle::Interrupted(pending)) => {
                continue_turn(&plan, emitter, &cancel, pending, &mut output, iteration).await
            }
            None => {
                ending = call_model(&mut plan, emitter, &cancel, &mut output, markers.clone()).await;
                let Some(turn) = output.turns.last_mut() else {
                    break;
                };
                if !matches!(ending, Ending::Completed) || turn.tool_calls.is_empty() {
                    break;
                }
                let calls = turn.tool_calls.clone();
                start_turn(&plan, emitter, &cancel, calls, &mut output, iteration).await
            }
        };
        let results = match tools {
            TurnTools::Settled(results) => results,
            TurnTools::Waiting(pending) => match park::park(&plan, emitter, store, output, pending, iteration).await {
                Ok(()) => return,
                Err(unparked) => {
                    output = *unparked;
                    ending = Ending::NotParked;
                    break;
                }
            },
        };
        let turn = output.turns.last_mut().expect("the turn that asked for the tools");
        turn.tool_results = results;
        if cancel.is_cancelled() {
            ending = Ending::Cancelled;
            break;
        }
        // The next call sees this turn and its results.
        plan.request.messages.push(InputMessage::Assistant { id: plan.message_id, turns: vec![turn.clone()] });
        if iteration == plan.max_iterations {
            output.finish_reason = "max_iterations".to_owned();
        }
    }
    finish(&plan, emitter, store, ending, output).await;
}

/// One model call (one step, CONTRACT.md §19), streamed out as events and into `output`. A
/// call that fails retryably after output is made again (the provider's retries), its
/// output void (`step_reset`); one that fails retryably otherwise (before output, after its
/// retries) goes to the plan's next fallback, and the run goes on with the model that
/// answers. Only the attempt that answers is kept.
async fn call_model(
    plan: &mut RunPlan,
    emitter: &mut Emitter,
    cancel: &CancellationToken,
    output: &mut Output,
    markers: Vec<String>,
) -> Ending {
    let started_at = now();
    let step = output.thinking_calls.0;
    emitter.emit(Event::StepStart { step });
    emitter.emit(Event::Status { message: crate::events::THINKING_STATUS.to_owned() });
    let messages = &plan.request.messages;
    let protected = messages.iter().rposition(InputMessage::is_user).map_or(messages.len(), |i| messages.len() - i);
    let mut fitted = context::fit(&plan.request, plan.context_limit, protected);
    if plan.summarize_dropped {
        summarize(plan, &mut fitted).await;
    }
    if output.spans.is_empty() || fitted.state.is_some() {
        plan.context.record(fitted.state.as_ref()).await;
    }
    // Only the files of the messages kept are read.
    if let Err(error) = plan.files.read(&mut fitted.request).await {
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
            ending = stream_turn(plan, &fitted.request, emitter, &mut turn, output) => ending,
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
    output.usage.add(&turn.usage);
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
        attributes: LlmAttributes {
            operation_name: "chat".to_owned(),
            request_model: plan.request.model.clone(),
            input_tokens: turn.usage.input_tokens,
            output_tokens: turn.usage.output_tokens,
            usage_estimated: turn.usage.estimated,
            finish_reasons: turn.finish_reason.iter().cloned().collect(),
            context: fitted.state,
            warnings: Vec::new(),
        },
    });
    if turn.usage != Usage::default() {
        let model = plan.request.model.clone();
        metrics::counter!("chatd_tokens_total", "model" => model.clone(), "direction" => "input")
            .increment(turn.usage.input_tokens);
        metrics::counter!("chatd_tokens_total", "model" => model, "direction" => "output")
            .increment(turn.usage.output_tokens);
        // A call cut short by a failure or a cancel keeps its estimate in the trace (and a
        // cancelled answer's message); its stream goes on to its terminal event without one.
        if !turn.usage.estimated || matches!(ending, Ending::Completed) {
            emitter.emit(Event::Usage(turn.usage));
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
        attributes: LlmAttributes {
            operation_name: "chat".to_owned(),
            request_model: model.to_owned(),
            input_tokens: 0,
            output_tokens: 0,
            usage_estimated: false,
            finish_reasons: Vec::new(),
            context: None,
            warnings: Vec::new(),
        },
    }
}

/// Replaces what trimming dropped by a summary the model writes, kept in the context state
/// and written again only when more is dropped. A failed summary leaves the trim as it is.
async fn summarize(plan: &RunPlan, fitted: &mut context::Trimmed) {
    let Some(state) = fitted.state.as_mut() else { return };
    let dropped = state.dropped;
    if dropped == 0 {
        return;
    }
    let stored = plan.context.stored().await;
    let cached = stored.filter(|s| s.dropped_through == state.dropped_through).and_then(|s| s.summary);
    let summary = match cached {
        Some(summary) => summary,
        None => {
            let request = context::summary_request(&plan.request, &plan.request.messages[..dropped]);
            let Some(summary) = super::turn::complete_text(&*plan.provider, &request).await else {
                tracing::warn!("could not summarise the dropped context");
                return;
            };
            summary
        }
    };
    let prompt = fitted.request.system_prompt.get_or_insert_with(String::new);
    prompt.push_str(&format!("\n\n## Earlier in this conversation\n{summary}"));
    state.strategy = ContextStrategy::TrimOldestWithSummary;
    state.summary = Some(summary);
}

/// Counts what the provider did not (CONTRACT.md §18: usage is never invented, and never
/// zero for work done): a call that produced something, or finished, and came back without
/// input or output tokens gets chatd's estimate of them, marked `estimated`. A call that
/// failed before producing anything did no work to count.
fn estimate_missing_usage(turn: &mut TurnOutput, request: &ModelRequest) {
    let produced = !turn.raw_text.is_empty() || !turn.thinking.is_empty() || !turn.tool_calls.is_empty();
    if !produced && turn.finish_reason.is_none() {
        return;
    }
    if turn.usage.input_tokens == 0 {
        turn.usage.input_tokens = context::request_tokens(request);
        turn.usage.estimated = true;
    }
    if turn.usage.output_tokens == 0 && produced {
        let calls: u64 =
            turn.tool_calls.iter().map(|c| context::estimate(&c.name) + context::estimate(&c.input.to_string())).sum();
        turn.usage.output_tokens = context::estimate(&turn.raw_text) + context::estimate(&turn.thinking) + calls;
        turn.usage.estimated = true;
    }
}

fn status_of(ending: &Ending) -> CallStatus {
    match ending {
        Ending::Completed => CallStatus::Ok,
        Ending::Cancelled => CallStatus::Cancelled,
        Ending::Failed(_) | Ending::NotParked => CallStatus::Error,
    }
}

async fn stream_turn(
    plan: &RunPlan,
    request: &ModelRequest,
    emitter: &mut Emitter,
    turn: &mut Turn,
    output: &mut Output,
) -> Ending {
    let mut stream = match plan.provider.stream(request).await {
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
