//! What differs between chatd alone on its database (SQLite: one process) and beside other
//! replicas (Postgres): asked once, when the chat service is built ([`for_store`]), and
//! answered by one of two [`Cluster`]s. The run code tells, checks and beats through it and
//! never asks which it is. Runs that outlive their server plug in here.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use super::news::RunNews;
use super::runs::Runs;
use crate::domain::{Conversation, Trace, now};
use crate::ids::TraceId;
use crate::store::{Notice, RunningTrace, Seen, Store};

/// The processes that share this chatd's database.
#[async_trait]
pub trait Cluster: Send + Sync {
    /// Tells whoever waits on `notice` in this process, and in the others.
    async fn tell(&self, notice: Notice);
    /// Tells this process at once, and the others in the background (a start does not wait
    /// on them).
    fn tell_soon(&self, notice: Notice);
    /// Whether a live process (this one aside) holds this run: else it is left, to be
    /// continued or taken up.
    fn held_alive(&self, trace: &RunningTrace) -> bool;
    /// The running runs left by processes that are gone, for this one to continue (this
    /// process's own aside): at start-up every one no live process holds; afterwards, on a
    /// shared store, those whose replica went quiet for `runs.takeover_after_secs`.
    async fn left_running(&self, replica_id: &str, runs: &Runs, at_start: bool) -> Vec<RunningTrace>;
    /// Whether a run this process does not hold may be going on in another, telling as its
    /// log grows.
    fn runs_elsewhere(&self) -> bool;
    /// What a start must check in its transaction because other processes start runs too:
    /// what it saw of the conversation (where one existed: its going runs and its leaf), and
    /// the user's limit of running runs, counted by the database; `None` where this process
    /// sees every run.
    fn start_checks(
        &self,
        existing: Option<&Conversation>,
        going: &[Trace],
        limit: usize,
    ) -> (Option<Seen>, Option<usize>);
    /// Says this process (and so every run it holds, running or queued) is alive: one write
    /// per `runs.heartbeat_secs`, whatever the number of runs.
    async fn heartbeat(&self, replica_id: &str);
    /// Of the runs going here, those another replica took over meanwhile (this one seemed
    /// gone): they must stop here, without an end.
    async fn lost(&self, replica_id: &str, going: &[TraceId]) -> Vec<TraceId>;
    /// Whether another replica is alive, to take over the runs this one leaves as it stops.
    async fn others_alive(&self, replica_id: &str) -> bool;
    /// Leaves this process's running runs to the others (it drains, and handed them over):
    /// they take them over at their next beat.
    async fn release_running(&self, replica_id: &str);
    /// Whether runs that other processes leave (drained, or gone) are looked for at every
    /// heartbeat: alone, those left are found at start-up.
    fn others_leave_runs(&self) -> bool;
}

/// The cluster of the processes that share `store`; a replica whose heartbeat is older than
/// `takeover_after` is gone.
pub fn for_store(store: Arc<dyn Store>, news: RunNews, takeover_after: Duration) -> Arc<dyn Cluster> {
    match store.is_shared() {
        true => {
            let (soon, told) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(tell_others(store.clone(), told));
            Arc::new(Replicas { store, news, takeover_after, soon })
        }
        false => Arc::new(Alone { store, news }),
    }
}

/// One process: every run it does not hold is left; nothing to tell anyone else.
struct Alone {
    store: Arc<dyn Store>,
    news: RunNews,
}

/// Every running run the store has that `runs` does not hold and `alive` does not keep.
async fn running_left(store: &dyn Store, runs: &Runs, alive: impl Fn(&RunningTrace) -> bool) -> Vec<RunningTrace> {
    match store.running_traces().await {
        Ok(running) => running.into_iter().filter(|r| runs.get(r.trace.trace_id).is_none() && !alive(r)).collect(),
        Err(e) => {
            tracing::error!(error = %e, "could not look for runs whose process stopped");
            Vec::new()
        }
    }
}

#[async_trait]
impl Cluster for Alone {
    async fn tell(&self, notice: Notice) {
        self.news.tell(notice);
    }

    fn tell_soon(&self, notice: Notice) {
        self.news.tell(notice);
    }

    fn held_alive(&self, _trace: &RunningTrace) -> bool {
        false
    }

    async fn left_running(&self, _replica_id: &str, runs: &Runs, at_start: bool) -> Vec<RunningTrace> {
        match at_start {
            true => running_left(&*self.store, runs, |_| false).await,
            false => Vec::new(),
        }
    }

    fn runs_elsewhere(&self) -> bool {
        false
    }

    fn start_checks(
        &self,
        _existing: Option<&Conversation>,
        _going: &[Trace],
        _limit: usize,
    ) -> (Option<Seen>, Option<usize>) {
        (None, None)
    }

    async fn heartbeat(&self, _replica_id: &str) {}

    async fn lost(&self, _replica_id: &str, _going: &[TraceId]) -> Vec<TraceId> {
        Vec::new()
    }

    async fn others_alive(&self, _replica_id: &str) -> bool {
        false
    }

    async fn release_running(&self, _replica_id: &str) {}

    fn others_leave_runs(&self) -> bool {
        false
    }
}

/// Several processes on one Postgres: they tell each other with `NOTIFY`, beat for the runs
/// they hold, and the database checks what one process cannot see.
struct Replicas {
    store: Arc<dyn Store>,
    news: RunNews,
    takeover_after: Duration,
    /// What [`tell_soon`](Cluster::tell_soon) tells the others, to [`tell_others`].
    soon: UnboundedSender<Notice>,
}

/// Notices told at once, at most.
const NOTICES_PER_STATEMENT: usize = 1000;

/// Tells the other replicas the notices [`Replicas::tell_soon`] was given, as they come, the
/// ones that piled up meanwhile together: a burst of 1,000 starts is a few statements, not
/// a statement and a pool connection each. Ends with the cluster.
async fn tell_others(store: Arc<dyn Store>, mut told: UnboundedReceiver<Notice>) {
    let mut notices = Vec::new();
    while told.recv_many(&mut notices, NOTICES_PER_STATEMENT).await > 0 {
        if let Err(e) = store.notify(&notices).await {
            tracing::warn!(error = %e, notices = notices.len(), "could not tell the other replicas");
        }
        notices.clear();
    }
}

#[async_trait]
impl Cluster for Replicas {
    async fn tell(&self, notice: Notice) {
        self.news.tell(notice);
        if let Err(e) = self.store.notify(&[notice]).await {
            tracing::warn!(error = %e, ?notice, "could not tell the other replicas");
        }
    }

    fn tell_soon(&self, notice: Notice) {
        self.news.tell(notice);
        // Gone only with the cluster, when nothing is told any more.
        let _ = self.soon.send(notice);
    }

    fn held_alive(&self, trace: &RunningTrace) -> bool {
        let quiet = chrono::Duration::from_std(self.takeover_after).unwrap_or(chrono::Duration::MAX);
        trace.replica_id.as_deref().is_some_and(|r| !r.is_empty())
            && trace.heartbeat_at.is_some_and(|at| now() - at <= quiet)
    }

    async fn left_running(&self, replica_id: &str, runs: &Runs, at_start: bool) -> Vec<RunningTrace> {
        if at_start {
            return running_left(&*self.store, runs, |r| self.held_alive(r)).await;
        }
        let quiet = chrono::Duration::from_std(self.takeover_after).unwrap_or(chrono::Duration::MAX);
        match self.store.left_running(now() - quiet, replica_id).await {
            Ok(left) => left.into_iter().filter(|r| runs.get(r.trace.trace_id).is_none()).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "could not look for runs of replicas that went quiet");
                Vec::new()
            }
        }
    }

    fn runs_elsewhere(&self) -> bool {
        true
    }

    fn start_checks(
        &self,
        existing: Option<&Conversation>,
        going: &[Trace],
        limit: usize,
    ) -> (Option<Seen>, Option<usize>) {
        let seen = existing.map(|c| Seen {
            going: going.iter().map(|t| (t.trace_id, t.message_id)).collect(),
            leaf: c.active_leaf_id,
        });
        (seen, going.is_empty().then_some(limit))
    }

    async fn heartbeat(&self, replica_id: &str) {
        if let Err(e) = self.store.heartbeat(replica_id, now()).await {
            tracing::warn!(error = %e, "heartbeat failed");
        }
    }

    async fn lost(&self, replica_id: &str, going: &[TraceId]) -> Vec<TraceId> {
        self.store.held_elsewhere(going, replica_id).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "could not check that this replica still holds its runs");
            Vec::new()
        })
    }

    async fn others_alive(&self, replica_id: &str) -> bool {
        let quiet = chrono::Duration::from_std(self.takeover_after).unwrap_or(chrono::Duration::MAX);
        self.store.others_alive(replica_id, now() - quiet).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "could not tell whether other replicas are alive");
            false
        })
    }

    async fn release_running(&self, replica_id: &str) {
        match self.store.release_running(replica_id).await {
            Ok(released) => tracing::info!(runs = released, "left the runs handed over to the other replicas"),
            Err(e) => {
                tracing::error!(error = %e, "could not leave the runs handed over; they are taken over once this replica's heartbeat lapses")
            }
        }
    }

    fn others_leave_runs(&self) -> bool {
        true
    }
}
