//! Runs that outlive their server (CONTRACT.md §19): a run whose process died goes on here,
//! from its last completed step. At start-up this process looks for running runs no live
//! process holds (on SQLite, every run the process before left `running`); on a shared
//! store it looks again at every heartbeat for those whose replica went quiet for
//! `runs.takeover_after_secs`. The store lets exactly one process take each over; that one
//! continues it at the seq after the last one logged, with a `step_reset` for a step its
//! clients saw in part, and tells its followers, wherever they are, to follow it here.

use std::sync::Arc;

use futures_util::StreamExt;

use crate::chat::live::cluster::Cluster;
use crate::chat::live::log::EventLog;
use crate::chat::live::runs::Runs;
use crate::chat::run::agent::{self, Checkpoint, Continuation, Start};
use crate::chat::run::plan::{Asked, Planner};
use crate::chat::shared::Shared;
use crate::domain::{Message, Role, RunError, TraceStatus, now};
use crate::events::Event;
use crate::store::{Notice, RunFinish, RunningTrace, Store};

/// The `status` a run continued by another replica than the one that started it sends.
pub const CONTINUED_ELSEWHERE: &str = "Continued on another server";
/// The `status` a run continued by the process that replaced its own (one database, one
/// process: SQLite) sends.
pub const CONTINUED_AFTER_RESTART: &str = "Continued after a restart";

/// How far above the last logged seq a continued run's events are numbered. A process hands
/// events to its listeners as they come and logs them in batches (`stream.flush_interval_ms`),
/// so the clients of one that died may have seen a few it never logged. A client that
/// resumes with the `Last-Event-ID` of one of those must still get the continuation's first
/// event (the `step_reset` that voids what it saw): seq skips this many once, at the
/// take-over, instead of numbering two different events alike. (A flush interval holds a
/// few dozen events at a fast model's pace.)
pub const SEQ_GAP: u64 = 1000;

/// How many left runs one process takes over at once: each holds a database connection for
/// its few statements, and half the default pool leaves the rest to the runs going here.
/// (One at a time, 1,000 took ~1.9 s; four at a time ~0.75 s, as eight did.)
const TAKEN_AT_ONCE: usize = 4;

/// Finds the runs of processes that are gone and continues them here.
#[derive(Clone)]
pub(in crate::chat) struct Takeover {
    store: Arc<dyn Store>,
    runs: Runs,
    log: EventLog,
    cluster: Arc<dyn Cluster>,
    replica_id: Arc<str>,
    planner: Planner,
    continue_runs: bool,
}

impl Takeover {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self {
            store: shared.store.clone(),
            runs: shared.runs.clone(),
            log: shared.log.clone(),
            cluster: shared.cluster.clone(),
            replica_id: shared.replica_id.clone(),
            planner: Planner::new(shared),
            continue_runs: shared.settings.runs.continue_after_restart,
        }
    }

    pub(in crate::chat) fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Stops, without an end, the runs going here that another replica took over while this
    /// one seemed gone (its beats did not reach the database in time): one process runs a run.
    pub(in crate::chat) async fn drop_lost(&self) {
        let going: Vec<_> = self.runs.all().into_iter().filter(|run| run.is_running()).collect();
        if going.is_empty() {
            return;
        }
        let ids: Vec<_> = going.iter().map(|run| run.trace_id).collect();
        for id in self.cluster.lost(&self.replica_id, &ids).await {
            tracing::error!(trace_id = %id, "another replica took this run over; stopping it here");
            if let Some(run) = going.iter().find(|run| run.trace_id == id) {
                run.hand_over.cancel();
            }
        }
    }

    /// Whether another replica is alive to take over this one's runs.
    pub(in crate::chat) async fn others_alive(&self) -> bool {
        self.cluster.others_alive(&self.replica_id).await
    }

    /// Leaves this process's running runs (handed over) to the other replicas.
    pub(in crate::chat) async fn release_running(&self) {
        self.cluster.release_running(&self.replica_id).await;
    }

    /// Continues here the running runs whose process is gone (or, with
    /// `runs.continue_after_restart = false`, marks them `interrupted`, CONTRACT.md §9): at
    /// start-up every one no live process holds, afterwards those whose replica went quiet.
    /// Returns how many this process took.
    pub(in crate::chat) async fn recover(&self, at_start: bool) -> usize {
        if at_start {
            // Replicas gone for a day are forgotten (one row each).
            let long_ago = now() - chrono::Duration::days(1);
            if let Err(e) = self.store.forget_replicas(long_ago).await {
                tracing::warn!(error = %e, "could not forget the replicas gone long ago");
            }
        }
        let left = self.cluster.left_running(&self.replica_id, &self.runs, at_start).await;
        // A few at a time: each is a few round trips, and a replica that dies may leave
        // a thousand.
        let recovered = futures_util::stream::iter(left)
            .map(|run| async move {
                match self.continue_runs {
                    true => self.take_over(run).await,
                    false => interrupt_left(&self.store, &run).await,
                }
            })
            .buffer_unordered(TAKEN_AT_ONCE)
            .filter(|taken| std::future::ready(*taken))
            .count()
            .await;
        if recovered > 0 {
            let what = if self.continue_runs { "continued" } else { "marked interrupted" };
            tracing::warn!(runs = recovered, "{what} runs whose process stopped");
        }
        recovered
    }

    /// Takes a run over from its process that is gone and continues it here; false if
    /// another process took it first (or it ended meanwhile).
    async fn take_over(&self, left: RunningTrace) -> bool {
        let trace = left.trace;
        let id = trace.trace_id;
        let checkpoint = match self.store.take_over(id, left.replica_id.as_deref(), &self.replica_id).await {
            Ok(Some(checkpoint)) => checkpoint,
            Ok(None) => return false,
            Err(e) => {
                tracing::warn!(error = %e, trace_id = %id, "could not take over a run whose process stopped");
                return false;
            }
        };
        // Its clients may have seen events the process that died published but never
        // logged: the continuation's numbers start above them (see `SEQ_GAP`).
        let logged = super::waits::last_seq(&*self.store, id).await;
        let base = logged + SEQ_GAP;
        let (step, asked) = read_checkpoint(checkpoint);
        let plan = match &step {
            Some(checkpoint) => self.planner.replan(&trace, checkpoint),
            None => self.planner.plan_stored(&trace, &asked).await,
        };
        let (_, mut emitter) =
            self.runs.register(id, trace.message_id, trace.conversation_id, &trace.user_id, self.log.clone(), base);
        // Whoever follows it from the log (here or on another replica) follows it live here.
        self.cluster.tell(Notice::Logged(id)).await;
        let status = match self.cluster.runs_elsewhere() {
            true => CONTINUED_ELSEWHERE,
            false => CONTINUED_AFTER_RESTART,
        };
        match plan {
            Ok(plan) => {
                if logged == 0 {
                    // It died before it logged its `start`: its followers from the log get it.
                    agent::announce(&plan, &mut emitter);
                }
                tracing::info!(trace_id = %id, from = ?left.replica_id, "continuing a run whose process stopped");
                let continuation = Continuation { checkpoint: step, status: status.to_owned() };
                let start = Start::Continued(Box::new(continuation));
                tokio::spawn(agent::supervise(Box::new(plan), emitter, self.store.clone(), self.runs.clone(), start));
            }
            Err(why) => {
                tracing::error!(trace_id = %id, error = %why, "a run whose process stopped cannot go on");
                let (store, runs) = (self.store.clone(), self.runs.clone());
                tokio::spawn(async move {
                    let why = format!("The run could not go on after its server stopped: {why}");
                    super::waits::fail(&store, &trace, &mut emitter, why).await;
                    runs.remove(emitter.run());
                });
            }
        }
        true
    }
}

/// A running run's checkpoint column: the checkpoint of its last completed step, or (none
/// completed) what it was asked.
fn read_checkpoint(stored: Option<serde_json::Value>) -> (Option<Checkpoint>, Asked) {
    let Some(stored) = stored else { return (None, Asked::default()) };
    match serde_json::from_value::<Checkpoint>(stored.clone()) {
        Ok(checkpoint) => (Some(checkpoint), Asked::default()),
        Err(_) => (None, serde_json::from_value(stored).unwrap_or_default()),
    }
}

/// Closes a run whose process is gone as `interrupted` (CONTRACT.md §9, where
/// `runs.continue_after_restart` is off), keeping what it had logged as a partial answer;
/// whether this process closed it (another may have first).
async fn interrupt_left(store: &Arc<dyn Store>, orphan: &RunningTrace) -> bool {
    match interrupt(store, orphan).await {
        Ok(closed) => closed,
        Err(e) => {
            tracing::error!(error = %e, trace_id = %orphan.trace.trace_id, "could not mark a run interrupted");
            false
        }
    }
}

async fn interrupt(store: &Arc<dyn Store>, orphan: &RunningTrace) -> Result<bool, crate::store::StoreError> {
    let trace = &orphan.trace;
    let events = store.trace_events(trace.trace_id, 0).await?;
    let (mut text, mut thinking) = (String::new(), String::new());
    for logged in &events {
        match &logged.event {
            Some(Event::TextDelta { text: piece }) => text.push_str(piece),
            Some(Event::ThinkingDelta { text: piece }) => thinking.push_str(piece),
            _ => {}
        }
    }
    let mut message = Message::new(trace.conversation_id, Some(trace.user_message_id), Role::Assistant, String::new());
    message.id = trace.message_id;
    message.content = if text.is_empty() { "[interrupted]".to_owned() } else { format!("{text}\n\n[interrupted]") };
    message.thinking = (!thinking.is_empty()).then_some(thinking);
    message.cancelled = true;
    message.model = Some(trace.model.clone());
    message.trace_id = Some(trace.trace_id);
    // Nobody hears it live: a replay of its log adds the ending it never sent.
    let record = RunFinish {
        trace_id: trace.trace_id,
        user_id: trace.user_id.clone(),
        status: TraceStatus::Interrupted,
        ended_at: now(),
        usage: trace.usage.unwrap_or_default(),
        cost_usd: trace.cost.cost_usd,
        error: Some(RunError::new("INTERRUPTED", "The server stopped during the run", Some(text))),
        spans: trace.spans.clone(),
        assistant_message: Some(message),
    };
    if !crate::chat::live::ending::save(store, Box::new(record)).await {
        return Ok(false);
    }
    // Whoever follows or cancels it from another process learns that it ended.
    store.notify(&[Notice::Logged(trace.trace_id)]).await?;
    Ok(true)
}
