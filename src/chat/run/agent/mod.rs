//! The run, from `start` to `done`: the agent loop. Call the model; if it asked for tools,
//! run them (concurrently, each with a timeout and bounded retries), feed the results back
//! and call it again, up to `max_iterations` model calls. Then persist the result and end
//! the stream with exactly one terminal event.

use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use serde_json::Value;

use super::context::ContextKeeper;
use super::markers::Captured;
use super::payloads::{self, LlmPayloadType};
use crate::chat::live::ending::{self, End};
use crate::chat::live::runs::{Emitter, Runs};
use crate::domain::{AssistantTurn, RunError, Span, ToolRecord, TraceStatus, Usage, now};
use crate::events::{Diagnostics, ErrorEvent, Event, StartEvent};
use crate::providers::transport::Retries;
use crate::providers::{InputMessage, LlmProvider, ModelRequest, ProviderError};
use crate::store::{RunFinish, Store};
use crate::tools::Tool;
use crate::wake::when_woken;

mod call;
mod finish;
mod park;
mod tools;

use call::call_model;
pub use call::{EarlyCall, send_early};
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
    /// What each model call cost (CONTRACT.md §18).
    pub prices: Arc<crate::pricing::Prices>,
    /// The user's budgets, where any is set: the run ends once its user's spend passes one.
    pub budgets: Option<crate::store::Budgets>,
    /// The run's first model call, where it went out while the run's start was written
    /// ([`send_early`]).
    pub early: Option<EarlyCall>,
}

/// A profile that answers a run's model call in its own profile's stead: its provider and
/// model, and its sampling and thinking settings; the input stays the run's.
pub struct Fallback {
    pub profile: String,
    pub provider_id: String,
    pub provider: Arc<dyn LlmProvider>,
    pub retries: Retries,
    pub model: String,
    pub temperature: Option<f64>,
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

/// Whether the run's user has spent past a budget (CONTRACT.md §18), this run's spend so far
/// and every other run's included (on any replica): then the run makes no further model
/// call. Its spend so far is written first, for the others to count. A database that does
/// not answer stops nothing.
async fn over_budget(plan: &RunPlan, store: &Arc<dyn Store>, output: &Output) -> bool {
    let Some(budgets) = &plan.budgets else { return false };
    if let Err(e) = store.record_progress(plan.trace_id, &output.usage, output.cost.usd()).await {
        tracing::warn!(error = %e, trace_id = %plan.trace_id, "could not write the run's spend so far");
    }
    match store.spend(&plan.user_id, budgets).await {
        Ok(spend) => budgets.spent(&spend),
        Err(e) => {
            tracing::warn!(error = %e, "could not read the user's spend");
            false
        }
    }
}

/// What the run produced, however it ended (kept in a waiting run's checkpoint).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Output {
    /// The answer and the thinking exactly as the client received them.
    text: String,
    thinking: String,
    usage: Usage,
    /// What the model calls cost (a checkpoint from before costs were kept has none).
    #[serde(default)]
    cost: crate::pricing::RunCost,
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
///
/// The task lives as long as the run, and what it holds is what a run costs in memory: the
/// plan comes boxed (each async layer would keep a copy of it, some 1 KB each), and the
/// steps a run takes rarely or only once (its end, a park, tool calls, a file read, a
/// summary) are boxed where they are awaited, so that the task is sized by the step that
/// streams a model's answer.
pub async fn supervise(plan: Box<RunPlan>, mut emitter: Emitter, store: Arc<dyn Store>, runs: Runs, start: Start) {
    let (trace_id, message_id, user_id) = (plan.trace_id, plan.message_id, plan.user_id.clone());
    let hand_over = emitter.run().hand_over.clone();
    let run = {
        let run = AssertUnwindSafe(execute(plan, &mut emitter, &store, start)).catch_unwind();
        // The task wakes once a token: the hand-over is looked at only when it wakes it.
        tokio::select! {
            biased;
            run = run => Some(run),
            () = when_woken(hand_over.cancelled()) => None,
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
                user_id,
                status: TraceStatus::Error,
                ended_at: now(),
                usage: Usage::default(),
                cost_usd: None,
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
            Box::pin(ending::end(&store, &mut emitter, End::saving(record, terminal))).await;
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
async fn execute(mut plan: Box<RunPlan>, emitter: &mut Emitter, store: &Arc<dyn Store>, start: Start) {
    let cancel = emitter.run().cancel.clone();
    let (mut output, first_iteration, mut settle) = match start {
        Start::Fresh => {
            // Clocked from the first model call's going out: before the run began, where it
            // went while the start was written.
            let asked = plan.early.as_ref().map_or_else(Instant::now, |early| early.sent);
            let first = Some((asked, plan.request.model.clone()));
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
            Some(Settle::Waited(pending, waits)) => TurnTools::Settled(
                Box::pin(resume_turn(&plan, emitter, &cancel, pending, &waits, &mut output, iteration)).await,
            ),
            Some(Settle::Interrupted(pending)) => {
                Box::pin(continue_turn(&plan, emitter, &cancel, pending, &mut output, iteration)).await
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
                Box::pin(start_turn(&plan, emitter, &cancel, calls, &mut output, iteration)).await
            }
        };
        let results = match tools {
            TurnTools::Settled(results) => results,
            TurnTools::Waiting(pending) => {
                match Box::pin(park::park(&plan, emitter, store, output, pending, iteration)).await {
                    Ok(()) => return,
                    Err(unparked) => {
                        output = *unparked;
                        ending = Ending::NotParked;
                        break;
                    }
                }
            }
        };
        let turn = output.turns.last_mut().expect("the turn that asked for the tools");
        turn.tool_results = results;
        if cancel.is_cancelled() {
            ending = Ending::Cancelled;
            break;
        }
        // The next call sees this turn and its results.
        Arc::make_mut(&mut plan.request.messages)
            .push(InputMessage::Assistant { id: plan.message_id, turns: vec![turn.clone()] });
        if iteration == plan.max_iterations {
            output.finish_reason = "max_iterations".to_owned();
        } else if over_budget(&plan, store, &output).await {
            output.finish_reason = "budget".to_owned();
            break;
        }
    }
    Box::pin(finish(&plan, emitter, store, ending, output)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of the future an async fn of five arguments returns, without calling it.
    fn future_size<A, B, C, D, E, F>(_: fn(A, B, C, D, E) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    #[test]
    fn a_run_task_is_sized_by_the_step_that_streams() {
        // Every run holds its task for its whole life, so this is what each open stream costs:
        // 10.4 KB when the plan was copied into each async layer and the run's end, parks and
        // tool calls were kept inline.
        let size = future_size(supervise);
        assert!(size <= 4 * 1024, "the run's task takes {size} bytes");
    }
}
