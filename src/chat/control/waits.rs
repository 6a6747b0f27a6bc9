//! Runs that wait (CONTRACT.md §15), from the outside: a person's decision on an approval, a
//! client tool's result, and the expiry of approvals nobody decided settle the calls a run
//! waits on. The replica that settles the last of them claims the run from the store and
//! continues it here, from its checkpoint, at the next seq; cancelling a waiting run claims
//! it the same way and ends it at once.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::chat::errors::ControlError;
use crate::chat::live::runs::LiveRun;
use crate::chat::run::agent::{self, Start};
use crate::chat::shared::Shared;
use crate::domain::{RunError, Trace, TraceStatus, now};
use crate::events::{ErrorEvent, Event};
use crate::ids::{TraceId, UserId};
use crate::store::{Claim, Notice, RunFinish, Settled, Settlement, Store, StoreError, WaitKey};

/// How often each replica looks for approvals whose time is up: a tenth of their timeout,
/// between a second and a minute (an approval expires that much after its time at most).
fn expiry_sweep(timeout_secs: f64) -> Duration {
    Duration::from_secs_f64((timeout_secs / 10.0).clamp(1.0, 60.0))
}

/// How long a continuation here waits for this process to be done with the run's wait
/// (its log sealed) before it takes the run over.
const HANDOVER_WAIT: Duration = Duration::from_secs(5);

/// What a client library's next request says of a waiting run's call (CONTRACT.md §13).
#[derive(Debug, Clone, PartialEq)]
pub enum WaitAnswer {
    Approval { approval_id: Uuid, approved: bool, reason: Option<String> },
    Result { tool_call_id: String, output: String, is_error: bool },
}

/// A client's result as the model gets it: text as it is, any other JSON as its text.
pub fn output_text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// Text from a client as a model and a page may take it: no control characters (as tool
/// output and the model's text are cleaned).
fn cleaned(mut text: String) -> String {
    text.retain(crate::chat::run::clean::visible);
    text
}

/// A waiting run a client's request answered: its trace, the seq of its last event before
/// the requests it waited on, and of the last of them.
pub struct Answered {
    pub trace: Trace,
    pub waited_from: u64,
    pub waited_to: u64,
}

/// Settles waits (approvals, client tools) and continues their runs.
#[derive(Clone)]
pub(in crate::chat) struct Waits {
    settings: std::sync::Arc<crate::config::Settings>,
    store: std::sync::Arc<dyn crate::store::Store>,
    runs: crate::chat::live::runs::Runs,
    log: crate::chat::live::log::EventLog,
    news: crate::chat::live::news::RunNews,
    replica_id: std::sync::Arc<str>,
    drain: crate::chat::shared::Drain,
    planner: crate::chat::run::plan::Planner,
}

impl Waits {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self {
            settings: shared.settings.clone(),
            store: shared.store.clone(),
            runs: shared.runs.clone(),
            log: shared.log.clone(),
            news: shared.news.clone(),
            replica_id: shared.replica_id.clone(),
            drain: shared.drain.clone(),
            planner: crate::chat::run::plan::Planner::new(shared),
        }
    }

    /// Settles what a client's request answers of the waiting run that produces
    /// `message_id` (what it settled already, or does not wait on, is passed over); `None`
    /// when no run of that message waits.
    pub async fn answer_waits(
        &self,
        user: &UserId,
        message_id: crate::ids::MessageId,
        answers: Vec<WaitAnswer>,
    ) -> Result<Option<Answered>, ControlError> {
        let trace = match self.store.trace_by_message(user, message_id).await {
            Ok(trace) if trace.status == TraceStatus::Waiting => trace,
            Ok(_) | Err(StoreError::NotFound) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let events = self.store.trace_events(trace.trace_id, 0).await?;
        let waited_to = events.last().map_or(0, |e| e.seq as u64);
        let waited_from = events
            .iter()
            .rev()
            .find(|e| !matches!(e.kind.as_str(), "tool_approval_request" | "tool_result_request"))
            .map_or(0, |e| e.seq as u64);
        for answer in answers {
            let settled = match answer {
                WaitAnswer::Approval { approval_id, approved, reason } => {
                    self.decide(user, approval_id, approved, reason).await
                }
                WaitAnswer::Result { tool_call_id, output, is_error } => {
                    self.tool_result(user, trace.trace_id, &tool_call_id, output, is_error).await
                }
            };
            match settled {
                Ok(_) | Err(ControlError::Missing(_) | ControlError::Conflict(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(Some(Answered { trace, waited_from, waited_to }))
    }

    /// A person's decision on an approval (`POST /api/approvals/{approval_id}`).
    pub async fn decide(
        &self,
        user: &UserId,
        approval_id: Uuid,
        approved: bool,
        reason: Option<String>,
    ) -> Result<Settled, ControlError> {
        let reason = reason.map(cleaned).filter(|r| !r.is_empty());
        let settlement = if approved { Settlement::Approved } else { Settlement::Denied { reason } };
        self.settle(WaitKey::Approval(approval_id), Some(user), &settlement).await
    }

    /// A client tool's result (`POST /api/runs/{trace_id}/tool_results`).
    pub async fn tool_result(
        &self,
        user: &UserId,
        trace_id: TraceId,
        tool_call_id: &str,
        output: String,
        is_error: bool,
    ) -> Result<Settled, ControlError> {
        let settlement = Settlement::Result { output: cleaned(output), is_error };
        self.settle(WaitKey::Call(trace_id, tool_call_id), Some(user), &settlement).await
    }

    async fn settle(
        &self,
        key: WaitKey<'_>,
        user: Option<&UserId>,
        settlement: &Settlement,
    ) -> Result<Settled, ControlError> {
        let what = match key {
            WaitKey::Approval(_) => "Approval",
            WaitKey::Call(..) => "Tool call",
        };
        // In a task of its own: a client that leaves while its decision claims the run must
        // not leave the run claimed and never continued.
        let (core, user, settlement) = (self.clone(), user.cloned(), settlement.clone());
        let owned = match key {
            WaitKey::Approval(id) => (None, Some(id)),
            WaitKey::Call(trace_id, call) => (Some((trace_id, call.to_owned())), None),
        };
        let task = tokio::spawn(async move {
            let key = match (&owned.0, owned.1) {
                (Some((trace_id, call)), _) => WaitKey::Call(*trace_id, call),
                (None, Some(id)) => WaitKey::Approval(id),
                (None, None) => unreachable!("one of the two is set"),
            };
            let mut settled = core.store.settle_wait(key, user.as_ref(), &settlement, &core.replica_id).await?;
            if let Some(claim) = settled.claimed.take() {
                core.go_on(claim, false).await;
            }
            Ok::<_, StoreError>(settled)
        });
        let settled =
            task.await.map_err(|_| ControlError::Store(StoreError::Unavailable("the decision failed".into())))?;
        settled.map_err(|e| match e {
            StoreError::NotFound => ControlError::Missing(what),
            StoreError::Conflict(why) => ControlError::Conflict(why),
            e => ControlError::Store(e),
        })
    }

    /// Settles every approval whose time is up, as denied ("approval expired"); a run whose
    /// last call that was goes on here. Returns how many expired.
    pub async fn expire_approvals(&self) -> usize {
        let due = match self.store.expired_waits(now(), 100).await {
            Ok(due) => due,
            Err(e) => {
                tracing::warn!(error = %e, "could not look for expired approvals");
                return 0;
            }
        };
        let mut expired = 0;
        for id in due {
            // Another replica may settle it first: then this one has nothing to do.
            if self.settle(WaitKey::Approval(id), None, &Settlement::Expired).await.is_ok() {
                expired += 1;
            }
        }
        expired
    }

    /// Continues a claimed run here, from its checkpoint (or, `cancelled`, ends it at once
    /// as cancelled). Returns the live run.
    pub(in crate::chat) async fn go_on(&self, claim: Claim, cancelled: bool) -> Arc<LiveRun> {
        let Claim { trace, checkpoint, waits } = claim;
        // The process that parked it here may still be sealing its log: the run is one
        // entry of the registry at a time.
        if let Some(parked) = self.runs.get(trace.trace_id) {
            let _ = tokio::time::timeout(HANDOVER_WAIT, parked.logged()).await;
        }
        let resumption =
            agent::Resumption::of(checkpoint, waits).map_err(|e| format!("its checkpoint does not read: {e}"));
        let base = match &resumption {
            Ok(r) => r.checkpoint.seq,
            Err(_) => last_seq(&*self.store, trace.trace_id).await,
        };
        let (run, mut emitter) = self.runs.register(
            trace.trace_id,
            trace.message_id,
            trace.conversation_id,
            &trace.user_id,
            self.log.clone(),
            base,
        );
        if cancelled {
            run.cancel.cancel();
        }
        // Whoever follows it here from the log follows it live from now on.
        self.news.tell(Notice::Logged(trace.trace_id));
        let plan = resumption.as_ref().map_err(Clone::clone).and_then(|r| self.planner.replan(&trace, &r.checkpoint));
        match (plan, resumption) {
            (Ok(plan), Ok(resumption)) => {
                let start = Start::Resumed(Box::new(resumption));
                tokio::spawn(agent::supervise(Box::new(plan), emitter, self.store.clone(), self.runs.clone(), start));
            }
            (Err(why), _) | (_, Err(why)) => {
                tracing::error!(trace_id = %trace.trace_id, error = %why, "a waiting run cannot go on");
                let (store, runs) = (self.store.clone(), self.runs.clone());
                tokio::spawn(async move {
                    let why = format!("The run could not go on after it waited: {why}");
                    fail(&store, &trace, &mut emitter, why).await;
                    runs.remove(emitter.run());
                });
            }
        }
        run
    }
}

pub(in crate::chat) async fn last_seq(store: &dyn Store, trace_id: TraceId) -> u64 {
    match store.trace_events(trace_id, 0).await {
        Ok(events) => events.last().map_or(0, |e| e.seq as u64),
        Err(_) => 0,
    }
}

/// Ends a claimed run that cannot go on: an error and `done`, and its trace closed so.
pub(in crate::chat) async fn fail(
    store: &Arc<dyn Store>,
    trace: &Trace,
    emitter: &mut crate::chat::live::runs::Emitter,
    message: String,
) {
    let record = RunFinish {
        trace_id: trace.trace_id,
        user_id: trace.user_id.clone(),
        status: TraceStatus::Error,
        ended_at: now(),
        usage: trace.usage.unwrap_or_default(),
        cost_usd: trace.cost.cost_usd,
        error: Some(RunError::new("INTERNAL", &message, None)),
        spans: trace.spans.clone(),
        assistant_message: None,
    };
    let terminal = Event::Error(Box::new(ErrorEvent {
        code: "INTERNAL".into(),
        message,
        retryable: false,
        message_id: trace.message_id,
        trace_id: trace.trace_id,
    }));
    crate::chat::live::ending::end(store, emitter, crate::chat::live::ending::End::saving(record, terminal)).await;
}

/// Expires approvals nobody decided, until `shutdown`; on every replica (the store lets
/// exactly one settle each), and after a restart as before it.
pub(in crate::chat) fn spawn_expiry(waits: Waits, shutdown: CancellationToken) {
    let period = expiry_sweep(waits.settings.tools.approval_timeout_secs);
    let drain = waits.drain.clone();
    crate::chat::shared::every(waits, drain, period, shutdown, |waits| async move {
        waits.expire_approvals().await;
    });
}
