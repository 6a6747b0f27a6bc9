//! A model turn's tool calls: run concurrently, each with its timeout, bounded retries and
//! progress, their events interleaved by `tool_call_id`; each call's result goes back to
//! the model, its record into the history, its span into the trace.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::chat::live::runs::Emitter;
use crate::chat::run::payloads;
use crate::domain::{Span, SpanTiming, ToolAttributes, ToolCall, ToolRecord, ToolResult, now};
use crate::events::{Event, ToolCompleteEvent, ToolProgressEvent, ToolStartEvent, ToolStatus};
use crate::tools::{Tool, ToolCallContext, ToolError, ToolProgress};

use super::park::{PendingTurn, keep_step};
use super::{Output, RunPlan, ToolLimits};
use crate::store::{Settlement, Wait};

/// What one tool call came to.
struct Finished {
    slot: usize,
    status: ToolStatus,
    text: String,
    payload: Option<Value>,
    started_at: chrono::DateTime<chrono::Utc>,
    duration: Duration,
}

/// A model turn's calls after their first pass.
pub(super) enum TurnTools {
    /// Every call's result for the model, in the order the calls were made (only those
    /// that ran, if the run was cancelled meanwhile).
    Settled(Vec<ToolResult>),
    /// Some calls wait for a person or the frontend; the others have run.
    Waiting(PendingTurn),
}

/// Starts a model turn's calls: `tool_start` for each, then those that need nobody run at
/// once (concurrently; events interleave by `tool_call_id`), while the gated ones
/// (CONTRACT.md §15) are left for the run to wait on.
pub(super) async fn start_turn(
    plan: &RunPlan,
    emitter: &mut Emitter,
    cancel: &CancellationToken,
    calls: Vec<ToolCall>,
    output: &mut Output,
    iteration: u32,
) -> TurnTools {
    let first = output.tool_history.len();
    for (slot, call) in calls.iter().enumerate() {
        emitter.emit(Event::ToolStart(Box::new(ToolStartEvent {
            tool_call_id: call.id.clone(),
            tool: call.name.clone(),
            input: call.input.clone(),
            index: (first + slot) as u32,
            timestamp: now(),
        })));
    }
    // `tool_history[N]` is call N whatever order the calls finish in: hold their places.
    output.tool_history.extend(calls.iter().map(|call| ToolRecord {
        tool_call_id: call.id.clone(),
        tool_name: call.name.clone(),
        input: call.input.clone(),
        output: String::new(),
        is_error: false,
        duration_ms: 0,
    }));
    // A call whose arguments did not parse fails at once, gated or not.
    let gated = |call: &ToolCall| call.invalid_arguments.is_none() && plan.gates.contains_key(&call.name);
    let now_slots: Vec<usize> = (0..calls.len()).filter(|&slot| !gated(&calls[slot])).collect();
    let results = calls.iter().map(|_| None).collect();
    let mut pending = PendingTurn { first, calls, results };
    // The model call is a completed step: what it asked for is kept, announced.
    keep_step(plan, emitter, output, &pending, iteration);
    run_calls(plan, emitter, cancel, &mut pending, &now_slots, output, iteration).await;
    settled_or_waiting(cancel, pending)
}

/// Continues a turn whose process died while its calls ran (CONTRACT.md §19): a call that
/// completed is not run again; one that had not is run again if its tool is idempotent, else
/// reported interrupted to the model; gated calls wait again.
pub(super) async fn continue_turn(
    plan: &RunPlan,
    emitter: &mut Emitter,
    cancel: &CancellationToken,
    mut pending: PendingTurn,
    output: &mut Output,
    iteration: u32,
) -> TurnTools {
    let by_name: HashMap<&str, &Arc<dyn Tool>> = plan.tools.iter().map(|t| (t.name(), t)).collect();
    let mut again = Vec::new();
    // The interrupted calls' events go to the log with the checkpoint that keeps them.
    emitter.hold(true);
    for slot in 0..pending.calls.len() {
        let call = &pending.calls[slot];
        if pending.results[slot].is_some() || call.invalid_arguments.is_none() && plan.gates.contains_key(&call.name) {
            continue;
        }
        // A tool that is gone fails again at once ("No such tool"): as good as idempotent.
        if call.invalid_arguments.is_some() || by_name.get(call.name.as_str()).is_none_or(|tool| tool.idempotent()) {
            again.push(slot);
            continue;
        }
        let done = Finished {
            slot,
            status: ToolStatus::Error,
            text: INTERRUPTED_CALL.to_owned(),
            payload: None,
            started_at: now(),
            duration: Duration::ZERO,
        };
        tool_done(plan, emitter, output, call, pending.first + slot, &done);
        pending.results[slot] = Some(result_of(call, done));
    }
    keep_step(plan, emitter, output, &pending, iteration);
    emitter.hold(false);
    run_calls(plan, emitter, cancel, &mut pending, &again, output, iteration).await;
    settled_or_waiting(cancel, pending)
}

/// What the model is told of a call that was running when its process died, whose tool
/// may not run twice.
pub const INTERRUPTED_CALL: &str =
    "The server stopped while this tool call ran, and it was not run again (it may or may not have taken effect)";

/// The turn's results once every call has one (or the run was cancelled); else the turn
/// waits on the calls left.
fn settled_or_waiting(cancel: &CancellationToken, pending: PendingTurn) -> TurnTools {
    if cancel.is_cancelled() || pending.results.iter().all(Option::is_some) {
        return TurnTools::Settled(pending.results.into_iter().flatten().collect());
    }
    TurnTools::Waiting(pending)
}

/// Settles the calls a run waited on, as they were decided: approved calls run now, denied
/// (or expired) ones are reported `denied` and told to the model so, client tools' results
/// are taken as their output. Returns every answered call's result, in call order.
pub(super) async fn resume_turn(
    plan: &RunPlan,
    emitter: &mut Emitter,
    cancel: &CancellationToken,
    mut pending: PendingTurn,
    waits: &[Wait],
    output: &mut Output,
    iteration: u32,
) -> Vec<ToolResult> {
    let PendingTurn { first, ref calls, ref mut results } = pending;
    let mut approved = Vec::new();
    for slot in 0..calls.len() {
        if results[slot].is_some() || cancel.is_cancelled() {
            continue;
        }
        let call = &calls[slot];
        let Some(wait) = waits.iter().find(|w| w.tool_call_id == call.id) else { continue };
        let (status, text) = match &wait.settled {
            None => continue,
            Some(Settlement::Approved) => {
                approved.push(slot);
                continue;
            }
            Some(Settlement::Denied { reason: Some(reason) }) => {
                (ToolStatus::Denied, format!("The user denied this tool call: {reason}"))
            }
            Some(Settlement::Denied { reason: None }) => {
                (ToolStatus::Denied, "The user denied this tool call".to_owned())
            }
            Some(Settlement::Expired) => {
                (ToolStatus::Denied, "The user denied this tool call: approval expired".to_owned())
            }
            Some(Settlement::Result { output, is_error }) => {
                (if *is_error { ToolStatus::Error } else { ToolStatus::Success }, output.clone())
            }
        };
        let waited = (now() - wait.created_at).to_std().unwrap_or_default();
        let done = Finished { slot, status, text, payload: None, started_at: wait.created_at, duration: waited };
        tool_done(plan, emitter, output, call, first + slot, &done);
        results[slot] = Some(result_of(call, done));
    }
    run_calls(plan, emitter, cancel, &mut pending, &approved, output, iteration).await;
    pending.results.into_iter().flatten().collect()
}

/// A finished call's result as the model gets it.
fn result_of(call: &ToolCall, done: Finished) -> ToolResult {
    let content = match done.status {
        ToolStatus::Success => done.text,
        _ => format!("Error: {}", done.text),
    };
    ToolResult {
        tool_call_id: call.id.clone(),
        tool_name: call.name.clone(),
        content,
        is_error: done.status != ToolStatus::Success,
    }
}

/// Runs the calls at `slots` of a turn, concurrently; each result goes into the turn as it
/// comes, kept with the run's progress (a completed call never runs again, CONTRACT.md §19).
async fn run_calls(
    plan: &RunPlan,
    emitter: &mut Emitter,
    cancel: &CancellationToken,
    pending: &mut PendingTurn,
    slots: &[usize],
    output: &mut Output,
    iteration: u32,
) {
    if slots.is_empty() {
        return;
    }
    let (first, calls) = (pending.first, pending.calls.clone());
    let by_name: HashMap<&str, &Arc<dyn Tool>> = plan.tools.iter().map(|t| (t.name(), t)).collect();
    let names: Vec<&str> = slots.iter().map(|&slot| calls[slot].name.as_str()).collect();
    emitter.emit(Event::Status { message: format!("Running {}…", names.join(", ")) });
    // A call that may not run twice starts once the step that asked for it is written: a
    // process that died before then would leave a checkpoint from before the model call,
    // and the run's next process would ask the model, and run the tool, again.
    let once = |slot: &usize| {
        let call = &calls[*slot];
        call.invalid_arguments.is_none() && by_name.get(call.name.as_str()).is_some_and(|tool| !tool.idempotent())
    };
    if slots.iter().any(once)
        && let Err(error) = emitter.flush().await
    {
        // The database is away: the call runs (a tool is not held hostage to it), without that promise.
        tracing::warn!(%error, "the step before a call that may not run twice was not written");
    }

    let (progress_tx, mut progress_rx) = mpsc::unbounded_channel::<(usize, ToolProgress)>();
    let mut running = FuturesUnordered::new();
    for &slot in slots {
        let call = &calls[slot];
        let tool = by_name.get(call.name.as_str()).map(|t| Arc::clone(t));
        // Its own token: a timeout stops this call only; cancelling the run stops them all.
        let (input, token, limits) = (call.input.clone(), cancel.child_token(), plan.limits);
        let invalid = call.invalid_arguments.clone();
        let idempotency_key = Some(format!("{}:{}", plan.trace_id, call.id));
        let (forward, mut reports) = mpsc::unbounded_channel();
        let progress = progress_tx.clone();
        running.push(async move {
            let started_at = now();
            let started = Instant::now();
            let relay = async move {
                while let Some(report) = reports.recv().await {
                    let _ = progress.send((slot, report));
                }
            };
            let ctx = ToolCallContext { progress: forward, cancel: token, idempotency_key };
            let call = async {
                match invalid {
                    Some(why) => (ToolStatus::Error, why, None),
                    None => call_tool(tool, input, ctx, limits).await,
                }
            };
            let ((status, text, payload), ()) = tokio::join!(call, relay);
            Finished { slot, status, text, payload, started_at, duration: started.elapsed() }
        });
    }
    drop(progress_tx);

    while !running.is_empty() {
        tokio::select! {
            Some((slot, report)) = progress_rx.recv() => emit_progress(emitter, &calls[slot], report),
            Some(done) = running.next() => {
                // A call's progress reports are all queued before its result: send them first.
                while let Ok((slot, report)) = progress_rx.try_recv() {
                    emit_progress(emitter, &calls[slot], report);
                }
                let slot = done.slot;
                // The call's events and the checkpoint that keeps its result go to the log
                // together: a log that shows the call completed is never read beside a
                // checkpoint from before it (another process would run it again).
                emitter.hold(true);
                tool_done(plan, emitter, output, &calls[slot], first + slot, &done);
                pending.results[slot] = Some(result_of(&calls[slot], done));
                if !cancel.is_cancelled() {
                    keep_step(plan, emitter, output, pending, iteration);
                }
                emitter.hold(false);
            }
        }
    }
}

fn emit_progress(emitter: &mut Emitter, call: &ToolCall, report: ToolProgress) {
    emitter.emit(Event::ToolProgress(Box::new(ToolProgressEvent {
        tool_call_id: call.id.clone(),
        tool: call.name.clone(),
        stage: report.stage,
        message: report.message,
        progress: report.progress,
        data: report.data,
    })));
}

/// Calls a tool with its timeout and bounded retries; never fails the run.
async fn call_tool(
    tool: Option<Arc<dyn Tool>>,
    input: Value,
    ctx: ToolCallContext,
    limits: ToolLimits,
) -> (ToolStatus, String, Option<Value>) {
    let Some(tool) = tool else {
        return (ToolStatus::Error, "No such tool is available".to_owned(), None);
    };
    let mut attempt = 0;
    loop {
        let call = tool.call(input.clone(), ctx.clone());
        let outcome = tokio::select! {
            biased;
            () = ctx.cancel.cancelled() => Err(None),
            outcome = tokio::time::timeout(limits.timeout, call) => outcome.map_err(|_| Some(())),
        };
        match outcome {
            Ok(Ok(mut output)) => {
                // Tool output is text for a person and a model, cleaned as the model's text is:
                // no control characters (terminal escapes, NUL, which Postgres cannot store).
                output.text.retain(crate::chat::run::clean::visible);
                if let Some(payload) = &mut output.payload {
                    crate::chat::live::runs::strip_nul(payload);
                }
                return (ToolStatus::Success, output.text, output.payload);
            }
            Ok(Err(ToolError { message, retryable: true })) if attempt < limits.max_retries => {
                attempt += 1;
                tracing::info!(tool = %tool.name(), attempt, error = %message, "retrying tool call");
                tokio::time::sleep(Duration::from_millis(100 * 2u64.pow(attempt))).await;
            }
            Ok(Err(mut error)) => {
                error.message.retain(crate::chat::run::clean::visible);
                return (ToolStatus::Error, error.message, None);
            }
            Err(None) => return (ToolStatus::Cancelled, "cancelled".to_owned(), None),
            Err(Some(())) => {
                // Tell the tool to stop (an MCP server gets notifications/cancelled).
                ctx.cancel.cancel();
                let secs = limits.timeout.as_secs_f64();
                return (ToolStatus::Timeout, format!("the tool did not answer within {secs} s"), None);
            }
        }
    }
}

/// Reports a finished call: `tool_output`, `tool_complete`, then the `[[tool:N]]` marker.
fn tool_done(
    plan: &RunPlan,
    emitter: &mut Emitter,
    output: &mut Output,
    call: &ToolCall,
    index: usize,
    done: &Finished,
) {
    let full_length = done.text.chars().count();
    let truncated = full_length > plan.limits.max_output_chars;
    let shown: String =
        if truncated { done.text.chars().take(plan.limits.max_output_chars).collect() } else { done.text.clone() };
    // A denied call did not run: it has no output (CONTRACT.md §15).
    if done.status != ToolStatus::Denied {
        emitter.emit(Event::ToolOutput { tool_call_id: call.id.clone(), output: shown, truncated, full_length });
    }
    let duration_ms = done.duration.as_millis() as u64;
    let status = serde_json::to_value(done.status).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    metrics::counter!("chatd_tool_calls_total", "tool" => call.name.clone(), "status" => status).increment(1);
    let summary = done.text.lines().next().map(|l| l.chars().take(120).collect::<String>()).filter(|s| !s.is_empty());
    emitter.emit(Event::ToolComplete(Box::new(ToolCompleteEvent {
        tool_call_id: call.id.clone(),
        tool: call.name.clone(),
        index: index as u32,
        status: done.status,
        duration_ms,
        summary,
    })));
    let separator = if output.text.is_empty() { "" } else { "\n\n" };
    let marker = format!("{separator}[[tool:{index}]]");
    output.text.push_str(&marker);
    output.after_marker = true;
    emitter.emit(Event::TextDelta { text: marker.into() });

    if let Some(payload) = &done.payload {
        let kind = payload.get("type").and_then(Value::as_str).unwrap_or(&call.name).to_owned();
        let data = payload.get("data").cloned().unwrap_or_else(|| payload.clone());
        let summary = payload.get("summary").and_then(Value::as_str);
        output.payloads.push(payloads::custom_payload(&kind, data, summary));
    }
    output.tool_history[index] = ToolRecord {
        tool_call_id: call.id.clone(),
        tool_name: call.name.clone(),
        input: call.input.clone(),
        output: done.text.clone(),
        is_error: done.status != ToolStatus::Success,
        duration_ms,
    };
    let ended_at = done.started_at + chrono::Duration::milliseconds(duration_ms as i64);
    output.spans.push(Span::Tool {
        timing: SpanTiming {
            name: format!("execute_tool {}", call.name),
            started_at: done.started_at,
            ended_at,
            duration_ms,
        },
        status: done.status,
        attributes: ToolAttributes {
            operation_name: "execute_tool".to_owned(),
            tool_name: call.name.clone(),
            tool_call_id: call.id.clone(),
        },
    });
}
