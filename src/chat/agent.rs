//! The run, from `start` to `done`: the agent loop. Call the model; if it asked for tools,
//! run them (concurrently, each with a timeout and bounded retries), feed the results back
//! and call it again, up to `max_iterations` model calls. Then persist the result and end
//! the stream with exactly one terminal event.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::context::{self, ContextKeeper};
use super::markers::Captured;
use super::payloads::{self, LlmPayloadType};
use super::runs::{Emitter, Runs};
use super::turn::Turn;
use crate::domain::{AssistantTurn, Message, Role, ToolCall, ToolRecord, ToolResult, TraceStatus, Usage, now};
use crate::events::{CompletePayload, Event, ToolStatus};
use crate::providers::{LlmProvider, ModelRequest, ProviderError, transport};
use crate::store::{RunFinish, Store};
use crate::tools::{Tool, ToolCallContext, ToolError, ToolProgress};
use crate::wake::when_woken;

/// Everything a started run needs; built by the service once validation passed.
pub struct RunPlan {
    pub conversation_id: Uuid,
    pub user_message_id: Uuid,
    pub message_id: Uuid,
    pub trace_id: Uuid,
    pub profile: String,
    pub provider: Arc<dyn LlmProvider>,
    pub request: ModelRequest,
    pub tools: Vec<Arc<dyn Tool>>,
    pub max_iterations: u32,
    pub payload_types: Vec<LlmPayloadType>,
    pub limits: ToolLimits,
    /// The diagnostics of the request, when it asked and config allows; the agent adds the
    /// raw model output.
    pub diagnostics: Option<Value>,
    /// The comparison and side (`a` or `b`) this run answers for, if any.
    pub comparison: Option<(Uuid, String)>,
    pub context_limit: Option<u32>,
    pub context: ContextKeeper,
    /// Whether dropped history is replaced by a model-written summary.
    pub summarize_dropped: bool,
}

#[derive(Debug, Clone, Copy)]
pub struct ToolLimits {
    pub timeout: Duration,
    pub max_output_chars: usize,
    pub max_retries: u32,
}

/// What the run produced, however it ended.
#[derive(Debug, Default)]
struct Output {
    /// The answer and the thinking exactly as the client received them.
    text: String,
    thinking: String,
    usage: Usage,
    finish_reason: String,
    spans: Vec<Value>,
    turns: Vec<AssistantTurn>,
    tool_history: Vec<ToolRecord>,
    payloads: Vec<Value>,
    captured: Vec<Captured>,
    warnings: Vec<String>,
    raw_text: String,
    /// A `[[tool:N]]` marker was the last text: the next text starts a new paragraph.
    after_marker: bool,
    /// When the run started, until its first token is timed (then `None`).
    awaiting_first_token: Option<(Instant, String)>,
}

enum Ending {
    Completed,
    Cancelled,
    Failed(ProviderError),
}

/// Emits the run's `start`. Its starter calls this before it spawns the run's task, so that
/// the event is there when the response goes out: it leaves with the headers instead of a
/// trip through the runtime's queues later (at load, each trip is a wait).
pub fn announce(plan: &RunPlan, emitter: &mut Emitter) {
    emitter.emit(Event::Start {
        conversation_id: plan.conversation_id,
        user_message_id: plan.user_message_id,
        message_id: plan.message_id,
        trace_id: plan.trace_id,
        model: plan.request.model.clone(),
        profile: plan.profile.clone(),
    });
}

/// Runs an [announced](announce) plan in its own task and cleans up after it, even if the
/// run panics: the trace is closed as an error and every listener still gets `error` then
/// `done`.
pub async fn supervise(plan: RunPlan, mut emitter: Emitter, store: Arc<dyn Store>, runs: Runs) {
    let (trace_id, conversation_id, message_id) = (plan.trace_id, plan.conversation_id, plan.message_id);
    let run = AssertUnwindSafe(execute(plan, &mut emitter, &store)).catch_unwind().await;
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
            emitter.emit(Event::Done { conversation_id, message_id, trace_id });
        }
    }
    if let Err(e) = emitter.seal().await {
        tracing::error!(error = %e, %trace_id, "the run's last events could not be logged");
    }
    runs.remove(trace_id);
}

/// Runs the plan to its end, after its `start`. Every path emits exactly one of `complete`,
/// `cancelled`, `error`, then `done`, and persists what it must.
#[tracing::instrument(skip_all, fields(trace_id = %plan.trace_id, conversation_id = %plan.conversation_id))]
async fn execute(mut plan: RunPlan, emitter: &mut Emitter, store: &Arc<dyn Store>) {
    let cancel = emitter.run().cancel.clone();
    let mut output =
        Output { awaiting_first_token: Some((Instant::now(), plan.request.model.clone())), ..Output::default() };
    let markers: Vec<String> = [payloads::SUGGESTED_VALUES, payloads::SUGGESTED_ACTIONS]
        .into_iter()
        .map(str::to_owned)
        .chain(plan.payload_types.iter().map(|t| t.marker.clone()))
        .collect();
    let mut ending = Ending::Completed;
    for iteration in 1..=plan.max_iterations.max(1) {
        ending = call_model(&plan, emitter, &cancel, &mut output, markers.clone()).await;
        let Some(turn) = output.turns.last_mut() else {
            break;
        };
        if !matches!(ending, Ending::Completed) || turn.tool_calls.is_empty() {
            break;
        }
        let calls = turn.tool_calls.clone();
        let results = run_tools(&plan, emitter, &cancel, &calls, &mut output).await;
        let turn = output.turns.last_mut().expect("the turn that asked for the tools");
        turn.tool_results = results;
        if cancel.is_cancelled() {
            ending = Ending::Cancelled;
            break;
        }
        // The next call sees this turn and its results, in the provider's own format.
        let mut exchange = Message::new(plan.conversation_id, None, Role::Assistant, turn.text.clone());
        exchange.provider_state = Some(json!({"turns": [turn]}));
        plan.request.messages.push(exchange);
        if iteration == plan.max_iterations {
            output.finish_reason = "max_iterations".to_owned();
        }
    }
    finish(&plan, emitter, store, ending, output).await;
}

/// One model call, streamed out as events and into `output`.
async fn call_model(
    plan: &RunPlan,
    emitter: &mut Emitter,
    cancel: &CancellationToken,
    output: &mut Output,
    markers: Vec<String>,
) -> Ending {
    let started_at = now();
    emitter.emit(Event::Status { message: "Thinking…".to_owned() });
    let messages = &plan.request.messages;
    let protected = messages.iter().rposition(|m| m.role == Role::User).map_or(messages.len(), |i| messages.len() - i);
    let mut fitted = context::fit(&plan.request, plan.context_limit, protected);
    if plan.summarize_dropped {
        summarize(plan, &mut fitted).await;
    }
    if output.spans.is_empty() || fitted.state.is_some() {
        plan.context.record(fitted.state.as_ref()).await;
    }
    let mut turn = Turn::new(output.tool_history.len() as u32, markers);
    emitter.hold(true);
    let ending = tokio::select! {
        biased;
        () = when_woken(cancel.cancelled()) => Ending::Cancelled,
        ending = stream_turn(plan, &fitted.request, emitter, &mut turn, output) => ending,
    };
    emitter.hold(false);
    if matches!(ending, Ending::Cancelled) {
        let mut held = Vec::new();
        turn.flush(&mut held);
        for event in held {
            emit_content(emitter, output, event);
        }
    }
    let ended_at = now();
    let turn = turn.output;
    output.usage.add(&turn.usage);
    output.raw_text.push_str(&turn.raw_text);
    output.captured.extend(turn.captured);
    output.warnings.extend(
        turn.invalid_markers.into_iter().map(|m| format!("marker left in the text, its JSON did not parse: {m}")),
    );
    if let Some(reason) = &turn.finish_reason {
        output.finish_reason.clone_from(reason);
    }
    output.spans.push(json!({
        "kind": "llm",
        "name": format!("chat {}", plan.request.model),
        "started_at": started_at,
        "ended_at": ended_at,
        "duration_ms": (ended_at - started_at).num_milliseconds(),
        "status": status_of(&ending),
        "attributes": {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": plan.request.model,
            "gen_ai.usage.input_tokens": turn.usage.input_tokens,
            "gen_ai.usage.output_tokens": turn.usage.output_tokens,
            "gen_ai.response.finish_reasons": turn.finish_reason.iter().collect::<Vec<_>>(),
            "chatd.context": fitted.state,
        },
    }));
    if turn.usage != Usage::default() {
        let model = plan.request.model.clone();
        metrics::counter!("chatd_tokens_total", "model" => model.clone(), "direction" => "input")
            .increment(turn.usage.input_tokens);
        metrics::counter!("chatd_tokens_total", "model" => model, "direction" => "output")
            .increment(turn.usage.output_tokens);
        emitter.emit(Event::Usage(turn.usage));
    }
    output.turns.push(AssistantTurn {
        text: turn.text,
        thinking_blocks: turn.thinking_blocks,
        tool_calls: turn.tool_calls,
        tool_results: Vec::new(),
    });
    ending
}

/// Replaces what trimming dropped by a summary the model writes, kept in the context state
/// and written again only when more is dropped. A failed summary leaves the trim as it is.
async fn summarize(plan: &RunPlan, fitted: &mut context::Trimmed) {
    let Some(state) = fitted.state.as_mut() else { return };
    let dropped = state["dropped"].as_u64().unwrap_or(0) as usize;
    if dropped == 0 {
        return;
    }
    let stored = plan.context.stored().await;
    let cached = stored
        .filter(|s| s["dropped_through"] == state["dropped_through"])
        .and_then(|s| s["summary"].as_str().map(str::to_owned));
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
    state["strategy"] = json!("trim_oldest_with_summary");
    state["summary"] = json!(summary);
}

fn status_of(ending: &Ending) -> &'static str {
    match ending {
        Ending::Completed => "ok",
        Ending::Cancelled => "cancelled",
        Ending::Failed(_) => "error",
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
    Ending::Failed(transport::network_error())
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
        Event::ThinkingDelta { text } => {
            output.thinking.push_str(&text);
            emitter.emit(Event::ThinkingDelta { text });
        }
        other => emitter.emit(other),
    }
}

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
async fn run_tools(
    plan: &RunPlan,
    emitter: &mut Emitter,
    cancel: &CancellationToken,
    calls: &[ToolCall],
    output: &mut Output,
) -> Vec<ToolResult> {
    let first = output.tool_history.len();
    let by_name: HashMap<String, &Arc<dyn Tool>> = plan.tools.iter().map(|t| (t.spec().name, t)).collect();
    for (slot, call) in calls.iter().enumerate() {
        emitter.emit(Event::ToolStart {
            tool_call_id: call.id.clone(),
            tool: call.name.clone(),
            input: call.input.clone(),
            index: (first + slot) as u32,
            timestamp: now(),
        });
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
    emitter.emit(Event::ToolProgress {
        tool_call_id: call.id.clone(),
        tool: call.name.clone(),
        stage: report.stage,
        message: report.message,
        progress: report.progress,
        data: report.data,
    });
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
                output.text.retain(super::clean::visible);
                if let Some(payload) = &mut output.payload {
                    super::runs::strip_nul(payload);
                }
                return (ToolStatus::Success, output.text, output.payload);
            }
            Ok(Err(ToolError { message, retryable: true })) if attempt < limits.max_retries => {
                attempt += 1;
                tracing::info!(tool = %tool.spec().name, attempt, error = %message, "retrying tool call");
                tokio::time::sleep(Duration::from_millis(100 * 2u64.pow(attempt))).await;
            }
            Ok(Err(mut error)) => {
                error.message.retain(super::clean::visible);
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
    emitter.emit(Event::ToolComplete {
        tool_call_id: call.id.clone(),
        tool: call.name.clone(),
        index: index as u32,
        status: done.status,
        duration_ms,
        summary,
    });
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
    output.spans.push(json!({
        "kind": "tool",
        "name": format!("execute_tool {}", call.name),
        "started_at": done.started_at,
        "ended_at": ended_at,
        "duration_ms": duration_ms,
        "status": done.status,
        "attributes": {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.id,
        },
    }));
}

async fn finish(plan: &RunPlan, emitter: &mut Emitter, store: &Arc<dyn Store>, ending: Ending, mut output: Output) {
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
        if let Some(span) = output.spans.iter_mut().rev().find(|s| s["kind"] == "llm") {
            span["attributes"]["chatd.warnings"] = json!(output.warnings);
        }
    }
    let thinking = (!output.thinking.is_empty()).then(|| output.thinking.clone());
    let mut message = Message::new(plan.conversation_id, Some(plan.user_message_id), Role::Assistant, String::new());
    message.id = plan.message_id;
    message.thinking = thinking.clone();
    message.model = Some(plan.request.model.clone());
    message.trace_id = Some(plan.trace_id);
    message.usage = Some(output.usage);
    message.tool_calls = output.turns.iter().flat_map(|t| t.tool_calls.clone()).collect();
    message.tool_history = output.tool_history.clone();
    message.payloads = output.payloads.clone();
    message.suggested_values = extracted.suggested_values.clone();
    message.suggested_actions = extracted.suggested_actions.clone();
    message.provider_state = Some(json!({"turns": output.turns}));
    if let Some((comparison_id, variant)) = &plan.comparison {
        message.comparison_id = Some(*comparison_id);
        message.variant = Some(variant.clone());
    }
    let (status, assistant, error, terminal) = match ending {
        Ending::Completed => {
            message.content = output.text.clone();
            let diagnostics = plan.diagnostics.clone().map(|mut d| {
                d["raw_llm_response"] = json!(output.raw_text);
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
            metrics::counter!("chatd_provider_errors_total", "code" => error.code()).increment(1);
            let event = error_event(plan, error.code(), &error.message, error.retryable);
            let detail = json!({"code": error.code(), "message": error.message, "partial_text": output.text});
            (TraceStatus::Error, None, Some(detail), event)
        }
    };
    metrics::counter!("chatd_runs_total", "status" => status.as_str()).increment(1);
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
    let terminal = match retry_while_unavailable(&**store, &record, SAVE_FOR).await {
        Ok(()) => terminal,
        Err(e) => {
            tracing::error!(error = %e, "could not persist the run's result");
            if e.is_unavailable() {
                save_later(store, unsaved(record));
            }
            error_event(plan, "SERVICE_UNAVAILABLE", "The answer could not be saved", true)
        }
    };
    emitter.emit(terminal);
    emitter.emit(Event::Done {
        conversation_id: plan.conversation_id,
        message_id: plan.message_id,
        trace_id: plan.trace_id,
    });
}

/// How long a run's end keeps trying to save its result while the database cannot take
/// writes: a short fault (a disk full for a moment) costs the client a wait, not its answer.
const SAVE_FOR: Duration = Duration::from_secs(5);
/// How long the record of a run whose result could not be saved is tried again, after its
/// client heard so: its trace must not stay `running` once the database is back.
const SAVE_LATER_FOR: Duration = Duration::from_secs(3600);

/// Saves a run's result, trying again (with backoff) for up to `within` while the database
/// is unavailable. Other errors (the run was ended elsewhere) are final.
async fn retry_while_unavailable(
    store: &dyn Store,
    record: &RunFinish,
    within: Duration,
) -> Result<(), crate::store::StoreError> {
    let deadline = tokio::time::Instant::now() + within;
    let mut pause = Duration::from_millis(50);
    loop {
        match store.finish_run(record).await {
            Err(e) if e.is_unavailable() && tokio::time::Instant::now() + pause < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            result => return result,
        }
    }
}

/// What is recorded of a run whose client was told its answer could not be saved: an error
/// with what it had said so far, and no assistant message, as that client saw it.
fn unsaved(mut record: RunFinish) -> RunFinish {
    let partial_text = record.assistant_message.take().map(|m| m.content).unwrap_or_default();
    record.status = TraceStatus::Error;
    record.error = Some(json!({
        "code": "SERVICE_UNAVAILABLE",
        "message": "The answer could not be saved",
        "partial_text": partial_text,
    }));
    record
}

/// Keeps trying to close the trace of a run whose result could not be saved, in the
/// background, until the database takes it (or `SAVE_LATER_FOR` passed: then the trace is
/// closed as interrupted at the next start).
fn save_later(store: &Arc<dyn Store>, record: RunFinish) {
    let store = store.clone();
    tokio::spawn(async move {
        let trace_id = record.trace_id;
        match retry_while_unavailable(&*store, &record, SAVE_LATER_FOR).await {
            Ok(()) => tracing::info!(%trace_id, "closed the trace of a run whose answer could not be saved"),
            Err(e) => tracing::error!(%trace_id, error = %e, "gave up closing the trace of a run"),
        }
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
