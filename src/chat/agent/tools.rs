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

use crate::chat::payloads;
use crate::chat::runs::Emitter;
use crate::domain::{Span, SpanTiming, ToolAttributes, ToolCall, ToolRecord, ToolResult, now};
use crate::events::{Event, ToolCompleteEvent, ToolProgressEvent, ToolStartEvent, ToolStatus};
use crate::tools::{Tool, ToolCallContext, ToolError, ToolProgress};

use super::{Output, RunPlan, ToolLimits};

/// What one tool call came to.
struct Finished {
    slot: usize,
    status: ToolStatus,
    text: String,
    payload: Option<Value>,
    started_at: chrono::DateTime<chrono::Utc>,
    duration: Duration,
}

/// Runs one model turn's tool calls concurrently; events interleave by `tool_call_id`.
/// Returns each call's result for the model, in the order the calls were made.
pub(super) async fn run_tools(
    plan: &RunPlan,
    emitter: &mut Emitter,
    cancel: &CancellationToken,
    calls: &[ToolCall],
    output: &mut Output,
) -> Vec<ToolResult> {
    let first = output.tool_history.len();
    let by_name: HashMap<String, &Arc<dyn Tool>> = plan.tools.iter().map(|t| (t.spec().name, t)).collect();
    for (slot, call) in calls.iter().enumerate() {
        emitter.emit(Event::ToolStart(Box::new(ToolStartEvent {
            tool_call_id: call.id.clone(),
            tool: call.name.clone(),
            input: call.input.clone(),
            index: (first + slot) as u32,
            timestamp: now(),
        })));
    }
    let names: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
    emitter.emit(Event::Status { message: format!("Running {}…", names.join(", ")) });

    let (progress_tx, mut progress_rx) = mpsc::unbounded_channel::<(usize, ToolProgress)>();
    let mut running = FuturesUnordered::new();
    for (slot, call) in calls.iter().enumerate() {
        let tool = by_name.get(&call.name).map(|t| Arc::clone(t));
        // Its own token: a timeout stops this call only; cancelling the run stops them all.
        let (input, token, limits) = (call.input.clone(), cancel.child_token(), plan.limits);
        let invalid = call.invalid_arguments.clone();
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
            let ctx = ToolCallContext { progress: forward, cancel: token };
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

    // `tool_history[N]` is call N whatever order the calls finish in: hold their places.
    output.tool_history.extend(calls.iter().map(|call| ToolRecord {
        tool_call_id: call.id.clone(),
        tool_name: call.name.clone(),
        input: call.input.clone(),
        output: String::new(),
        is_error: false,
        duration_ms: 0,
    }));
    let mut finished: Vec<Option<Finished>> = calls.iter().map(|_| None).collect();
    while !running.is_empty() {
        tokio::select! {
            Some((slot, report)) = progress_rx.recv() => emit_progress(emitter, &calls[slot], report),
            Some(done) = running.next() => {
                // A call's progress reports are all queued before its result: send them first.
                while let Ok((slot, report)) = progress_rx.try_recv() {
                    emit_progress(emitter, &calls[slot], report);
                }
                let slot = done.slot;
                tool_done(plan, emitter, output, &calls[slot], first + slot, &done);
                finished[slot] = Some(done);
            }
        }
    }
    calls
        .iter()
        .zip(finished)
        .map(|(call, done)| {
            let done = done.expect("every call finishes");
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
        })
        .collect()
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
                output.text.retain(crate::chat::clean::visible);
                if let Some(payload) = &mut output.payload {
                    crate::chat::runs::strip_nul(payload);
                }
                return (ToolStatus::Success, output.text, output.payload);
            }
            Ok(Err(ToolError { message, retryable: true })) if attempt < limits.max_retries => {
                attempt += 1;
                tracing::info!(tool = %tool.spec().name, attempt, error = %message, "retrying tool call");
                tokio::time::sleep(Duration::from_millis(100 * 2u64.pow(attempt))).await;
            }
            Ok(Err(mut error)) => {
                error.message.retain(crate::chat::clean::visible);
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
    emitter.emit(Event::ToolOutput { tool_call_id: call.id.clone(), output: shown, truncated, full_length });
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
    emitter.emit(Event::TextDelta { text: marker });

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
