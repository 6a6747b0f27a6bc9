//! A run that waits (CONTRACT.md §15): when a model turn calls tools that need a person's
//! approval or that run in the frontend, the run stops after the others have run, and what
//! it needs to go on (the model request, the answer so far, the turn and its results) is
//! written with its waits and the request events in one transaction. The process forgets
//! the run; whichever replica settles the last call (or cancels it) claims the run from the
//! store and continues it at the next seq.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Output, RunPlan};
use crate::chat::live::runs::Emitter;
use crate::chat::request::ClientTool;
use crate::domain::{ToolCall, ToolResult, now};
use crate::events::{Event, Sent, ToolApprovalRequestEvent, ToolResultRequestEvent};
use crate::providers::ModelRequest;
use crate::store::{NewEvent, RunPark, Store, Wait, WaitKind};

/// Why a tool's call waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// A person approves or denies it first (`require_approval`).
    Approval,
    /// The frontend runs it and sends its result (a client tool).
    Client,
}

/// A turn whose calls wait: the calls, the first one's run-wide index, and the results of
/// those that ran (`None` for those that wait).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PendingTurn {
    pub first: usize,
    pub calls: Vec<ToolCall>,
    pub results: Vec<Option<ToolResult>>,
}

/// What a waiting run keeps in its trace to go on from.
#[derive(Debug, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The seq of the run's last event before it waited (its requests included): its
    /// continuation's first event is the next.
    pub seq: u64,
    /// The model call (1-based) whose turn waits.
    pub(super) iteration: u32,
    pub(super) request: ModelRequest,
    pub(super) output: Output,
    pub(super) pending: PendingTurn,
    /// The request's context and client tools, to plan the same tools again.
    pub context: Option<Value>,
    pub client_tools: Vec<ClientTool>,
}

impl Checkpoint {
    /// The model request the run goes on with.
    pub fn request(&self) -> ModelRequest {
        self.request.clone()
    }
}

/// Keeps a running run's progress after a completed step (CONTRACT.md §19): a model call
/// that asked for tools, or one of their calls. The checkpoint (a waiting run's, with the
/// turn's results so far) goes to the log writer with the events before it, into the same
/// transaction: nothing waits for it, and the log never runs behind it. Another process
/// continues the run from it if this one dies.
pub(super) fn keep_step(plan: &RunPlan, emitter: &mut Emitter, output: &Output, pending: &PendingTurn, iteration: u32) {
    /// A [`Checkpoint`] by reference: written per step, not copied per step.
    #[derive(Serialize)]
    struct Step<'a> {
        seq: u64,
        iteration: u32,
        request: &'a ModelRequest,
        output: &'a Output,
        pending: &'a PendingTurn,
        context: &'a Option<Value>,
        client_tools: &'a [ClientTool],
    }
    let step = Step {
        seq: emitter.seq(),
        iteration,
        request: &plan.request,
        output,
        pending,
        context: &plan.context_value,
        client_tools: &plan.client_tools,
    };
    emitter.checkpoint(&step);
}

/// A claimed waiting run: its checkpoint and how its calls were settled.
pub struct Resumption {
    pub checkpoint: Checkpoint,
    pub waits: Vec<Wait>,
}

impl Resumption {
    /// A claimed run's resumption, if its checkpoint reads.
    pub fn of(checkpoint: Value, waits: Vec<Wait>) -> Result<Self, serde_json::Error> {
        Ok(Self { checkpoint: serde_json::from_value(checkpoint)?, waits })
    }
}

/// Parks the run: its waits and their request events, with its checkpoint, in one
/// transaction; then the requests go out to listeners and the run's followers go on from
/// the log. Gives the output back if the database did not take it.
pub(super) async fn park(
    plan: &RunPlan,
    emitter: &mut Emitter,
    store: &Arc<dyn Store>,
    output: Output,
    pending: PendingTurn,
    iteration: u32,
) -> Result<(), Box<Output>> {
    let created_at = now();
    let expires_at = created_at + chrono::Duration::from_std(plan.approval_timeout).unwrap_or(chrono::Duration::MAX);
    let mut waits = Vec::new();
    let mut events = Vec::new();
    for (slot, call) in pending.calls.iter().enumerate() {
        let Some(gate) = pending.results[slot].is_none().then(|| plan.gates.get(&call.name)).flatten() else {
            continue;
        };
        let index = (pending.first + slot) as u32;
        let (id, tool_call_id, tool, input) =
            (uuid::Uuid::now_v7(), call.id.clone(), call.name.clone(), call.input.clone());
        let (kind, expires_at, event) = match gate {
            Gate::Approval => (
                WaitKind::Approval,
                Some(expires_at),
                Event::ToolApprovalRequest(Box::new(ToolApprovalRequestEvent {
                    approval_id: id.to_string(),
                    tool_call_id: tool_call_id.clone(),
                    tool: tool.clone(),
                    input: input.clone(),
                    index,
                    expires_at,
                })),
            ),
            Gate::Client => (
                WaitKind::ClientTool,
                None,
                Event::ToolResultRequest(Box::new(ToolResultRequestEvent {
                    tool_call_id: tool_call_id.clone(),
                    tool: tool.clone(),
                    input: input.clone(),
                    index,
                })),
            ),
        };
        waits.push(Wait {
            id,
            trace_id: plan.trace_id,
            user_id: plan.user_id.clone(),
            kind,
            tool_call_id,
            tool,
            input,
            created_at,
            expires_at,
            settled: None,
        });
        events.push(event);
    }
    // Everything before the requests is in the log first: the requests follow it there.
    if let Err(e) = emitter.flush().await {
        tracing::error!(error = %e, "could not log the run's events before it waits");
        return Err(Box::new(output));
    }
    let first_seq = emitter.seq() + 1;
    let logged: Vec<NewEvent> = events
        .iter()
        .zip(first_seq..)
        .map(|(event, seq)| NewEvent {
            trace_id: plan.trace_id,
            seq: seq as i64,
            at: created_at,
            kind: event.kind(),
            data: Sent::text(&serde_json::to_string(event).expect("events always serialize")),
        })
        .collect();
    let (usage, cost_usd, spans) = (output.usage, output.cost.usd(), output.spans.clone());
    let checkpoint = Checkpoint {
        seq: emitter.seq() + events.len() as u64,
        iteration,
        request: plan.request.clone(),
        output,
        pending,
        context: plan.context_value.clone(),
        client_tools: plan.client_tools.clone(),
    };
    let park = RunPark {
        trace_id: plan.trace_id,
        checkpoint: serde_json::to_value(&checkpoint).expect("a checkpoint serializes"),
        usage,
        cost_usd,
        spans,
        waits,
        events: logged,
    };
    if let Err(e) = store.park_run(&park).await {
        tracing::error!(error = %e, "could not park the run to wait for its tool calls");
        return Err(Box::new(checkpoint.output));
    }
    metrics::counter!("chatd_runs_waiting_total").increment(1);
    for event in events {
        emitter.emit_logged(event);
    }
    emitter.park();
    Ok(())
}
