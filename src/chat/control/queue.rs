//! Runs queued behind others of their conversation (CONTRACT.md §16, `multitask = "enqueue"`).
//! A queued run's trace is `queued` in the store, with what it will need kept beside it; its
//! user message is stored already, after the answer of the run it follows (not stored yet).
//! The process that holds it streams its `start` and a `status` "Queued", then waits, woken
//! when a run ahead of it ends (here, or told by another replica), and claims it from the
//! store once no run of the conversation is going and none was queued before it. Then it is
//! planned on the answers before it and runs in the same stream. A cancel ends it before it
//! starts; a shutdown leaves it queued for another replica or the next start to adopt.

use std::sync::Arc;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::chat::live::ending::{self, End};
use crate::chat::live::runs::{Emitter, LiveRun};
use crate::chat::run::agent;
use crate::chat::run::plan::Asked;
use crate::chat::shared::Shared;
use crate::domain::branch::pending;
use crate::domain::{Conversation, Message, RunError, Trace, TraceStatus, Usage, branch_through, now};
use crate::events::{CancelledEvent, Event};
use crate::ids::UserId;
use crate::store::Store;
use crate::store::{Notice, QueueTurn, RunFinish, StoreError};

/// The `status` a queued run's stream opens with.
pub const QUEUED_STATUS: &str = "Queued";

/// How long a queued run waits, at most, before it looks at the queue again unwoken (every
/// end it waits for wakes it; this only bounds a notice lost with a connection).
const LOOK_AGAIN: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a queued run waits before it looks again after the store failed to answer.
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// How a queued run's wait here ended.
enum Waited {
    /// Claimed: it runs here now, with what it was queued with.
    Turn(Option<Value>),
    /// Cancelled before its turn.
    Cancelled,
    /// Not this process's any more: the server drains, or another process has it.
    Left,
    /// Its conversation was deleted.
    Deleted,
}

/// Holds queued runs until their turn, and takes them up.
#[derive(Clone)]
pub(in crate::chat) struct Queue {
    store: std::sync::Arc<dyn crate::store::Store>,
    runs: crate::chat::live::runs::Runs,
    log: crate::chat::live::log::EventLog,
    cluster: std::sync::Arc<dyn crate::chat::live::cluster::Cluster>,
    news: crate::chat::live::news::RunNews,
    replica_id: std::sync::Arc<str>,
    drain: crate::chat::shared::Drain,
    planner: crate::chat::run::plan::Planner,
}

impl Queue {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self {
            store: shared.store.clone(),
            runs: shared.runs.clone(),
            log: shared.log.clone(),
            cluster: shared.cluster.clone(),
            news: shared.news.clone(),
            replica_id: shared.replica_id.clone(),
            drain: shared.drain.clone(),
            planner: crate::chat::run::plan::Planner::new(shared),
        }
    }

    /// Holds a queued run here until its turn comes (its `start` is emitted already), in a
    /// task of its own.
    pub(in crate::chat) fn hold_queued(&self, trace: Trace, mut emitter: Emitter) {
        emitter.emit(Event::Status { message: QUEUED_STATUS.to_owned() });
        self.wait_here(trace, emitter);
    }

    /// Waits for the queued run's turn in a task of its own, then runs it.
    fn wait_here(&self, trace: Trace, emitter: Emitter) {
        // Marked at once: a queued run does not count as running, nor does the drain wait for it.
        emitter.run().set_queued(true);
        let core = self.clone();
        tokio::spawn(async move { core.queued(trace, emitter).await });
    }

    async fn queued(self, trace: Trace, mut emitter: Emitter) {
        let run = emitter.run().clone();
        let waited = self.wait_turn(&trace, &run).await;
        run.set_queued(false);
        match waited {
            Waited::Turn(queued) => {
                let plan = match queued.map(serde_json::from_value::<Asked>).unwrap_or(Ok(Asked::default())) {
                    Ok(asked) => self.planner.plan_stored(&trace, &asked).await,
                    Err(e) => Err(format!("what it was queued with does not read: {e}")),
                };
                match plan {
                    Ok(plan) => {
                        let (store, runs) = (self.store.clone(), self.runs.clone());
                        Box::pin(agent::supervise(Box::new(plan), emitter, store, runs, agent::Start::Fresh)).await;
                        return;
                    }
                    Err(why) => {
                        tracing::error!(trace_id = %trace.trace_id, error = %why, "a queued run cannot start");
                        let why = format!("The queued run could not start: {why}");
                        super::waits::fail(&self.store, &trace, &mut emitter, why).await;
                    }
                }
            }
            Waited::Cancelled => self.cancel_queued(&trace, &mut emitter).await,
            // Nothing of it is stored any more: its stream ends as cancelled.
            Waited::Deleted => {
                ending::end(&self.store, &mut emitter, End { record: None, terminal: cancelled(&trace) }).await;
            }
            Waited::Left => {
                // Its followers here read on from the log, wherever it goes on.
                emitter.park();
                if let Err(e) = emitter.seal().await {
                    tracing::error!(error = %e, trace_id = %trace.trace_id, "a queued run's events could not be logged");
                }
            }
        }
        self.runs.remove(emitter.run());
        self.tell(Notice::Logged(trace.trace_id)).await;
    }

    /// Waits, woken by the end of each run ahead of it, until the run's turn comes (and claims
    /// it), a cancel, or the drain.
    async fn wait_turn(&self, trace: &Trace, run: &Arc<LiveRun>) -> Waited {
        loop {
            if run.cancel.is_cancelled() {
                return Waited::Cancelled;
            }
            if self.drain.is_on() {
                return self.release(trace).await;
            }
            // Looked at before the store: a run that ends in between is still waited for
            // (its end is kept until it leaves the registry).
            let mut news = self.news.watch_all();
            let here: Vec<Arc<LiveRun>> = self
                .runs
                .in_conversation(trace.conversation_id)
                .into_iter()
                .filter(|r| r.trace_id != trace.trace_id)
                .collect();
            let ahead = match self.store.claim_queued(trace.trace_id, &self.replica_id).await {
                Ok(QueueTurn::Claimed(queued)) => return Waited::Turn(queued),
                Ok(QueueTurn::Behind(ahead)) => ahead,
                Ok(QueueTurn::Gone(status)) => {
                    tracing::warn!(trace_id = %trace.trace_id, ?status, "a queued run held here is no longer queued");
                    return Waited::Left;
                }
                // Its conversation was deleted (on another replica).
                Err(StoreError::NotFound) => return Waited::Deleted,
                Err(e) => {
                    tracing::warn!(error = %e, trace_id = %trace.trace_id, "could not look at a queued run's turn");
                    tokio::select! {
                        () = run.cancel.cancelled() => return Waited::Cancelled,
                        () = self.drain.started() => return self.release(trace).await,
                        () = tokio::time::sleep(RETRY_AFTER) => continue,
                    }
                }
            };
            // A run ahead held here (running, or queued itself) is waited for to its end;
            // the others are told of (a waiting run's continuation tells as it goes on here).
            // News of a run's log comes at every flush: the queue is claimed again only once
            // one of the runs ahead has ended.
            let local = here.into_iter().find(|r| ahead.contains(&r.trace_id) && !r.is_parked());
            let ended = async {
                match local {
                    Some(run) => run.logged().await,
                    None => loop {
                        news.changed(&ahead).await;
                        // One went on here (a waiting run continued), or one ended: look again.
                        let here = ahead.iter().any(|id| self.runs.get(*id).is_some_and(|r| !r.is_parked()));
                        if here || !self.all_going(trace, &ahead).await {
                            break;
                        }
                    },
                }
            };
            tokio::select! {
                () = run.cancel.cancelled() => return Waited::Cancelled,
                () = self.drain.started() => return self.release(trace).await,
                () = ended => {}
                () = tokio::time::sleep(LOOK_AGAIN) => {}
            }
        }
    }

    /// Whether every run of `ahead` is still going (a failed read says no: look again).
    async fn all_going(&self, trace: &Trace, ahead: &[crate::ids::TraceId]) -> bool {
        match self.store.running_in_conversation(&trace.user_id, trace.conversation_id).await {
            Ok(going) => ahead.iter().all(|id| going.iter().any(|t| t.trace_id == *id)),
            Err(_) => false,
        }
    }

    /// Leaves a queued run to whichever process adopts it first (the drain).
    async fn release(&self, trace: &Trace) -> Waited {
        if let Err(e) = self.store.adopt_queued(trace.trace_id, Some(&self.replica_id), "").await {
            tracing::warn!(error = %e, trace_id = %trace.trace_id, "could not leave a queued run to the others");
        }
        Waited::Left
    }

    /// Ends a queued run that never started: `cancelled` with nothing said, no answer stored
    /// (stored before it is said: a queued trace left behind would hold its conversation's
    /// queue).
    async fn cancel_queued(&self, trace: &Trace, emitter: &mut Emitter) {
        let record = RunFinish {
            trace_id: trace.trace_id,
            user_id: trace.user_id.clone(),
            status: TraceStatus::Cancelled,
            ended_at: now(),
            usage: Usage::default(),
            cost_usd: None,
            error: Some(RunError::new("CANCELLED", "Cancelled before its turn came", None)),
            spans: Vec::new(),
            assistant_message: None,
        };
        ending::end(&self.store, emitter, End::saving(record, cancelled(trace))).await;
    }

    /// Takes up queued runs that no live process holds: at start-up, those left by the
    /// processes before (all of them on a store only this process uses); on a shared store,
    /// those a replica left as it drained, or whose replica's heartbeat went stale. Returns
    /// how many it took.
    pub async fn adopt_queued(&self) -> usize {
        let queued = match self.store.queued_traces().await {
            Ok(queued) => queued,
            Err(e) => {
                tracing::warn!(error = %e, "could not look for queued runs to take up");
                return 0;
            }
        };
        let mut adopted = 0;
        for left in queued {
            let id = left.trace.trace_id;
            if self.runs.get(id).is_some() || self.cluster.held_alive(&left) {
                continue;
            }
            if self.take_up(left.trace, left.replica_id.as_deref()).await.is_some() {
                adopted += 1;
            }
        }
        if adopted > 0 {
            tracing::info!(runs = adopted, "took up queued runs");
        }
        adopted
    }

    /// Takes a queued run over from the process `from` that held it (`Some("")`: one that
    /// left it as it drained) and holds it here; `None` if another took it first.
    pub(in crate::chat) async fn take_up(&self, trace: Trace, from: Option<&str>) -> Option<Arc<LiveRun>> {
        let id = trace.trace_id;
        match self.store.adopt_queued(id, from, &self.replica_id).await {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                tracing::warn!(error = %e, trace_id = %id, "could not take up a queued run");
                return None;
            }
        }
        let base = super::waits::last_seq(&*self.store, id).await;
        let (run, emitter) =
            self.runs.register(id, trace.message_id, trace.conversation_id, &trace.user_id, self.log.clone(), base);
        // Whoever follows it from the log (here or elsewhere) follows it live here now.
        self.tell(Notice::Logged(id)).await;
        self.wait_here(trace, emitter);
        Some(run)
    }

    /// Tells this process and the other replicas.
    async fn tell(&self, notice: Notice) {
        self.cluster.tell(notice).await;
    }
}

/// The active branch of a conversation, across the answers of its going runs (a message
/// queued behind a run follows an answer not stored yet).
pub async fn active_branch(
    store: &dyn Store,
    user: &UserId,
    conversation: &Conversation,
    history: &[Message],
) -> Result<Vec<Message>, StoreError> {
    let going = store.running_in_conversation(user, conversation.id).await?;
    Ok(branch_through(history, &pending(&going), conversation.active_leaf_id))
}

/// A queued run's ending before it started: `cancelled` with nothing said.
fn cancelled(trace: &Trace) -> Event {
    Event::Cancelled(Box::new(CancelledEvent {
        partial_text: String::new(),
        partial_thinking: None,
        message_id: trace.message_id,
        trace_id: trace.trace_id,
        model: trace.model.clone(),
    }))
}

/// Takes up queued runs that replicas leave (they drained, or their heartbeat went stale) at
/// every heartbeat, until `shutdown`. (Those left before this process started are taken up
/// by [`Queue::adopt_queued`] at start-up; a store no other process uses has no others.)
pub(in crate::chat) fn spawn_keeper(queue: Queue, shutdown: CancellationToken) {
    if !queue.cluster.others_leave_runs() {
        return;
    }
    let (drain, beat) = (queue.drain.clone(), queue.planner.settings().runs.heartbeat());
    crate::chat::shared::every(queue, drain, beat, shutdown, |queue| async move {
        queue.adopt_queued().await;
    });
}
