//! What the chat service's rooms are built from: the parts every clone of the service shares.
//! It has no behaviour of its own; each room (`start::starter::Starter`,
//! `control::cancel::Canceller`, `control::queue::Queue`, `control::waits::Waits`,
//! `live::replay::Follower`, …) takes the parts it uses from it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_util::sync::CancellationToken;

use super::live::cluster::Cluster;
use super::live::log::EventLog;
use super::live::news::RunNews;
use super::live::runs::Runs;
use super::start::idempotency::KeyTurns;
use super::start::starts::StartWriter;
use super::start::turns::Turns;
use crate::config::Settings;
use crate::files::Files;
use crate::ids::ConversationId;
use crate::providers::Providers;
use crate::store::Store;
use crate::tools::Registry;

/// The parts the chat service's rooms are built from; every clone shares them.
#[derive(Clone)]
pub(in crate::chat) struct Shared {
    pub(in crate::chat) settings: Arc<Settings>,
    pub(in crate::chat) store: Arc<dyn Store>,
    pub(in crate::chat) providers: Providers,
    /// What the providers' models cost (CONTRACT.md §18).
    pub(in crate::chat) prices: Arc<crate::pricing::Prices>,
    pub(in crate::chat) tools: Arc<Registry>,
    pub(in crate::chat) runs: Runs,
    pub(in crate::chat) log: EventLog,
    pub(in crate::chat) starts: StartWriter,
    /// For server-side action handlers given as URLs.
    pub(in crate::chat) http: reqwest::Client,
    /// This process, as the owner of the runs it starts.
    pub(in crate::chat) replica_id: Arc<str>,
    pub(in crate::chat) drain: Drain,
    /// What other processes tell of their runs.
    pub(in crate::chat) news: RunNews,
    /// Whether, and how, other processes share the store.
    pub(in crate::chat) cluster: Arc<dyn Cluster>,
    /// Attachments' bytes (CONTRACT.md §14).
    pub(in crate::chat) files: Files,
    /// Requests with the same `Idempotency-Key` take turns (CONTRACT.md §16).
    pub(in crate::chat) key_turns: KeyTurns,
    /// New messages of one conversation take turns (CONTRACT.md §16).
    pub(in crate::chat) conversation_turns: Turns<ConversationId>,
}

/// Whether the server drains for shutdown: no new runs, and queued runs leave this process
/// (CONTRACT.md §16).
#[derive(Clone, Default)]
pub(in crate::chat) struct Drain {
    draining: Arc<AtomicBool>,
    drained: CancellationToken,
}

impl Drain {
    /// Refuses new runs from now on.
    pub(in crate::chat) fn start(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.drained.cancel();
    }

    pub(in crate::chat) fn is_on(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Resolves once the drain has started.
    pub(in crate::chat) async fn started(&self) {
        self.drained.cancelled().await
    }
}

/// Runs `job` every `period` until `shutdown`, on a clone of `room`; not while the server
/// drains.
pub(in crate::chat) fn every<R, F, Fut>(
    room: R,
    drain: Drain,
    period: std::time::Duration,
    shutdown: CancellationToken,
    job: F,
) where
    R: Clone + Send + 'static,
    F: Fn(R) -> Fut + Send + 'static,
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
            if !drain.is_on() {
                job(room.clone()).await;
            }
        }
    });
}
