//! What differs between chatd alone on its database (SQLite: one process) and beside other
//! replicas (Postgres): asked once, when the chat service is built ([`for_store`]), and
//! answered by one of two [`Cluster`]s. The run code tells, checks and beats through it and
//! never asks which it is. Runs that outlive their server plug in here.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::news::RunNews;
use super::runs::Runs;
use crate::domain::{Trace, now};
use crate::ids::TraceId;
use crate::store::{Notice, RunningTrace, Store};

/// How often this process says its runs are alive.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// A shared store's running trace whose heartbeat is older than this has lost its process.
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// The processes that share this chatd's database.
#[async_trait]
pub trait Cluster: Send + Sync {
    /// Tells whoever waits on `notice` in this process, and in the others.
    async fn tell(&self, notice: Notice);
    /// Tells this process at once, and the others in the background (a start does not wait
    /// on them).
    fn tell_soon(&self, notice: Notice);
    /// Whether a live process (this one aside) holds this run: else it is left, to be
    /// recovered or taken up.
    fn held_alive(&self, trace: &RunningTrace) -> bool;
    /// Whether a run this process does not hold may be going on in another, telling as its
    /// log grows.
    fn runs_elsewhere(&self) -> bool;
    /// What a start must check in its transaction because other processes start runs too:
    /// the runs of the conversation it saw going (where one existed), and the user's limit
    /// of running runs, counted by the database; `None` where this process sees every run.
    fn start_checks(&self, existing: bool, going: &[Trace], limit: usize) -> (Option<Vec<TraceId>>, Option<usize>);
    /// Says this process's runs (`queued` of them waiting their turn) are alive; every
    /// [`HEARTBEAT`].
    async fn heartbeat(&self, replica_id: &str, runs: &Runs);
    /// Whether runs that other processes leave (drained, or gone) are looked for at every
    /// heartbeat: alone, those left are found at start-up.
    fn others_leave_runs(&self) -> bool;
}

/// The cluster of the processes that share `store`.
pub fn for_store(store: Arc<dyn Store>, news: RunNews) -> Arc<dyn Cluster> {
    match store.is_shared() {
        true => Arc::new(Replicas { store, news }),
        false => Arc::new(Alone { news }),
    }
}

/// One process: every run it does not hold is left; nothing to tell anyone else.
struct Alone {
    news: RunNews,
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

    fn runs_elsewhere(&self) -> bool {
        false
    }

    fn start_checks(&self, _existing: bool, _going: &[Trace], _limit: usize) -> (Option<Vec<TraceId>>, Option<usize>) {
        (None, None)
    }

    async fn heartbeat(&self, _replica_id: &str, _runs: &Runs) {}

    fn others_leave_runs(&self) -> bool {
        false
    }
}

/// Several processes on one Postgres: they tell each other with `NOTIFY`, beat for the runs
/// they hold, and the database checks what one process cannot see.
struct Replicas {
    store: Arc<dyn Store>,
    news: RunNews,
}

#[async_trait]
impl Cluster for Replicas {
    async fn tell(&self, notice: Notice) {
        self.news.tell(notice);
        if let Err(e) = self.store.notify(notice).await {
            tracing::warn!(error = %e, ?notice, "could not tell the other replicas");
        }
    }

    fn tell_soon(&self, notice: Notice) {
        self.news.tell(notice);
        let store = self.store.clone();
        tokio::spawn(async move {
            if let Err(e) = store.notify(notice).await {
                tracing::warn!(error = %e, ?notice, "could not tell the other replicas");
            }
        });
    }

    fn held_alive(&self, trace: &RunningTrace) -> bool {
        let stale = chrono::Duration::from_std(STALE_AFTER).expect("a small duration");
        trace.replica_id.as_deref().is_some_and(|r| !r.is_empty())
            && trace.heartbeat_at.is_some_and(|at| now() - at <= stale)
    }

    fn runs_elsewhere(&self) -> bool {
        true
    }

    fn start_checks(&self, existing: bool, going: &[Trace], limit: usize) -> (Option<Vec<TraceId>>, Option<usize>) {
        let going_seen = existing.then(|| going.iter().map(|t| t.trace_id).collect());
        (going_seen, going.is_empty().then_some(limit))
    }

    async fn heartbeat(&self, replica_id: &str, runs: &Runs) {
        if runs.is_empty() {
            return;
        }
        let queued: Vec<_> = runs.all().iter().filter(|run| run.is_queued()).map(|run| run.trace_id).collect();
        if let Err(e) = self.store.heartbeat(replica_id, now(), &queued).await {
            tracing::warn!(error = %e, "heartbeat failed");
        }
    }

    fn others_leave_runs(&self) -> bool {
        true
    }
}
