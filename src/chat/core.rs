//! The chat service's parts, shared by its rooms (`request`, `plan`, `titles`, `actions`,
//! `replay`, `control`), which each add their methods to [`Core`]; `service` composes them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::log::EventLog;
use super::news::RunNews;
use super::runs::Runs;
use super::starts::StartWriter;
use crate::config::Settings;
use crate::providers::Providers;
use crate::store::Store;
use crate::tools::Registry;

/// What the chat service holds; every clone shares it.
#[derive(Clone)]
pub struct Core {
    pub(super) settings: Arc<Settings>,
    pub(super) store: Arc<dyn Store>,
    pub(super) providers: Providers,
    pub(super) tools: Arc<Registry>,
    pub(super) runs: Runs,
    pub(super) log: EventLog,
    pub(super) starts: StartWriter,
    /// For server-side action handlers given as URLs.
    pub(super) http: reqwest::Client,
    /// This process, as the owner of the runs it starts.
    pub(super) replica_id: String,
    /// Set when the server drains for shutdown: no new runs.
    pub(super) draining: Arc<AtomicBool>,
    /// Cancelled when the server drains: queued runs leave this process (CONTRACT.md §16).
    pub(super) drained: tokio_util::sync::CancellationToken,
    /// What other processes tell of their runs.
    pub(super) news: RunNews,
    /// Whether, and how, other processes share the store.
    pub(super) cluster: Arc<dyn super::cluster::Cluster>,
    /// Attachments' bytes (CONTRACT.md §14).
    pub(super) files: crate::files::Files,
    /// Requests with the same `Idempotency-Key` take turns (CONTRACT.md §16).
    pub(super) key_turns: super::idempotency::KeyTurns,
    /// New messages of one conversation take turns (CONTRACT.md §16).
    pub(super) conversation_turns: super::turns::Turns<crate::ids::ConversationId>,
}

impl Core {
    pub fn runs(&self) -> &Runs {
        &self.runs
    }

    /// The event log writer (its batch count shows how often runs write).
    pub fn event_log(&self) -> &EventLog {
        &self.log
    }

    /// Where this process hears what the others tell of their runs.
    pub fn news(&self) -> &RunNews {
        &self.news
    }

    pub fn replica_id(&self) -> &str {
        &self.replica_id
    }

    /// The processes that share the store.
    pub fn cluster(&self) -> &Arc<dyn super::cluster::Cluster> {
        &self.cluster
    }

    /// Refuses new runs from now on (shutdown).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.drained.cancel();
    }

    /// Whether the server is shutting down (readiness says no meanwhile).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// Runs `job` every `period` until `shutdown`, on a clone of `core`; not while the server
/// drains.
pub(super) fn every<F, Fut>(
    core: Core,
    period: std::time::Duration,
    shutdown: tokio_util::sync::CancellationToken,
    job: F,
) where
    F: Fn(Core) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if !core.is_draining() {
                job(core.clone()).await;
            }
        }
    });
}
