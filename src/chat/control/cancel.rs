//! Stopping runs: cancel one run (by trace or by message), both sides of a comparison, a
//! conversation's running runs, or its runs before it is deleted. A run here is cancelled through its token and
//! says how it ended by its last event; a run on another replica is asked by a notice, and
//! the cancel waits, woken by that run's news, to learn how it ended.

use crate::chat::errors::ControlError;
use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId, UserId};
use std::time::Duration;

use crate::chat::shared::Shared;
use crate::domain::{Trace, TraceStatus};
use crate::events::{Event, Sent};
use crate::store::{Notice, StoreError};

/// How long a cancel waits for another process to stop its run.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// How long a cancel waits for a run that parked here to hand over to its continuation.
const HANDOVER_WAIT: Duration = Duration::from_secs(6);

/// How long deleting a conversation waits for its runs to stop.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// What to cancel.
#[derive(Debug, Clone, Copy)]
pub enum CancelTarget {
    Trace(TraceId),
    /// The run that is producing this assistant message.
    Message(MessageId),
    /// Both sides of an A/B comparison.
    Comparison(ComparisonId),
    /// Every run of the conversation that is going: running, waiting or queued (CONTRACT.md
    /// §17).
    Conversation(ConversationId),
}

/// What a cancel stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancelled {
    Run {
        trace_id: TraceId,
        message_id: MessageId,
    },
    /// The sides of the comparison that were still running.
    Comparison {
        comparison_id: ComparisonId,
        trace_ids: Vec<TraceId>,
    },
    /// The conversation's runs that were running, each `(trace_id, message_id)`.
    Conversation {
        conversation_id: ConversationId,
        runs: Vec<(TraceId, MessageId)>,
    },
}

const ENDED: &str = "The run has already ended";

/// Whether a run in this state is stopped through the process that holds it: running, or
/// queued (CONTRACT.md §16). A waiting run is held by none; it is claimed to be stopped.
fn stoppable(status: TraceStatus) -> bool {
    matches!(status, TraceStatus::Running | TraceStatus::Queued)
}

/// Stops runs, here or through the process that holds them.
#[derive(Clone)]
pub(in crate::chat) struct Canceller {
    store: std::sync::Arc<dyn crate::store::Store>,
    runs: crate::chat::live::runs::Runs,
    cluster: std::sync::Arc<dyn crate::chat::live::cluster::Cluster>,
    news: crate::chat::live::news::RunNews,
    replica_id: std::sync::Arc<str>,
    queue: super::queue::Queue,
    waits: super::waits::Waits,
}

impl Canceller {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self {
            store: shared.store.clone(),
            runs: shared.runs.clone(),
            cluster: shared.cluster.clone(),
            news: shared.news.clone(),
            replica_id: shared.replica_id.clone(),
            queue: super::queue::Queue::new(shared),
            waits: super::waits::Waits::new(shared),
        }
    }

    /// Cancels what `target` names, wherever it runs, and waits (bounded) to learn how it
    /// ended: a run that completed first was not cancelled, so exactly one terminal event
    /// is sent.
    pub async fn cancel(&self, user: &UserId, target: CancelTarget) -> Result<Cancelled, ControlError> {
        let trace = match target {
            CancelTarget::Trace(trace_id) => {
                self.store.get_trace(user, trace_id).await.map_err(ControlError::missing("Trace"))?
            }
            CancelTarget::Message(message_id) => {
                self.store.trace_by_message(user, message_id).await.map_err(ControlError::missing("Trace"))?
            }
            CancelTarget::Comparison(comparison_id) => return self.cancel_comparison(user, comparison_id).await,
            CancelTarget::Conversation(conversation_id) => {
                return self.cancel_conversation(user, conversation_id).await;
            }
        };
        self.cancel_run(user, &trace).await?;
        Ok(Cancelled::Run { trace_id: trace.trace_id, message_id: trace.message_id })
    }

    /// Cancels whichever sides of a comparison are still running.
    async fn cancel_comparison(&self, user: &UserId, comparison_id: ComparisonId) -> Result<Cancelled, ControlError> {
        let comparison =
            self.store.get_comparison(user, comparison_id).await.map_err(ControlError::missing("Comparison"))?;
        let mut trace_ids = Vec::new();
        for trace_id in [comparison.trace_a, comparison.trace_b] {
            let trace = self.store.get_trace(user, trace_id).await.map_err(ControlError::missing("Trace"))?;
            match self.cancel_run(user, &trace).await {
                Ok(()) => trace_ids.push(trace_id),
                Err(ControlError::Store(e)) => return Err(ControlError::Store(e)),
                Err(_) => {}
            }
        }
        if trace_ids.is_empty() {
            return Err(ControlError::Ended("Both runs have already ended"));
        }
        Ok(Cancelled::Comparison { comparison_id, trace_ids })
    }

    /// Cancels a conversation's running runs; none running is a conflict.
    async fn cancel_conversation(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
    ) -> Result<Cancelled, ControlError> {
        self.store.get_conversation(user, conversation_id).await.map_err(ControlError::missing("Conversation"))?;
        let mut runs = Vec::new();
        // Newest first: a queued run must not start while the run ahead of it is stopped.
        for trace in self.store.running_in_conversation(user, conversation_id).await?.into_iter().rev() {
            match self.cancel_run(user, &trace).await {
                Ok(()) => runs.push((trace.trace_id, trace.message_id)),
                Err(ControlError::Store(e)) => return Err(ControlError::Store(e)),
                Err(_) => {}
            }
        }
        if runs.is_empty() {
            return Err(ControlError::Ended("No run of this conversation is running"));
        }
        Ok(Cancelled::Conversation { conversation_id, runs })
    }

    pub(in crate::chat) async fn cancel_run(&self, user: &UserId, trace: &Trace) -> Result<(), ControlError> {
        let mut status = trace.status;
        // A run may park while it is being cancelled, or a decision claim it meanwhile: look
        // again, a few times.
        for _ in 0..3 {
            if status == TraceStatus::Waiting {
                // Nobody runs it: this replica claims it and ends it (CONTRACT.md §15).
                // In a task of its own: a client that leaves meanwhile must not leave the run
                // claimed and never ended.
                let (core, trace_id) = (self.clone(), trace.trace_id);
                let claimed = tokio::spawn(async move {
                    let claim = core.store.claim_waiting(trace_id, &core.replica_id).await?;
                    Ok::<_, StoreError>(match claim {
                        Some(claim) => Some(core.waits.go_on(claim, true).await),
                        None => None,
                    })
                });
                let claimed = claimed.await.map_err(|_| ControlError::NoAnswer)??;
                if let Some(run) = claimed {
                    return self.cancelled_here(run).await.unwrap_or(Err(ControlError::Ended(ENDED)));
                }
                // A decision claimed it first: it runs now, somewhere.
                status = self.store.get_trace(user, trace.trace_id).await?.status;
            }
            if !stoppable(status) {
                return Err(ControlError::Ended(ENDED));
            }
            let mut here = self.runs.get(trace.trace_id);
            if let Some(parked) = here.clone().filter(|run| run.is_parked()) {
                // Claimed and about to go on here: its continuation takes the parked one's place.
                let _ = tokio::time::timeout(HANDOVER_WAIT, parked.logged()).await;
                here = self.runs.get(trace.trace_id).filter(|run| !run.is_parked());
            }
            if here.is_none() && status == TraceStatus::Queued {
                // Left by a replica that drained, and not taken up yet: taken up here, to stop.
                here = self.queue.take_up(trace.clone(), Some("")).await;
            }
            let Some(run) = here else {
                return self.cancel_elsewhere(user, trace.trace_id).await;
            };
            match self.cancelled_here(run).await {
                Some(result) => return result,
                // It parked before it saw the cancel: it waits in the store now.
                None => status = self.store.get_trace(user, trace.trace_id).await?.status,
            }
        }
        Err(ControlError::Ended(ENDED))
    }

    /// Cancels a run of this process and learns how it ended; `None` if it parked to wait
    /// instead (for the first cancel asked of it).
    async fn cancelled_here(
        &self,
        run: std::sync::Arc<crate::chat::live::runs::LiveRun>,
    ) -> Option<Result<(), ControlError>> {
        // Exactly one of simultaneous cancels is the one that cancelled.
        let first = run.claim_cancel();
        run.cancel.cancel();
        run.finished().await;
        if !first {
            return Some(Err(ControlError::Ended("The run is being cancelled already")));
        }
        if run.is_parked() {
            return None;
        }
        Some(match run.ending().as_ref().and_then(Sent::event) {
            Some(Event::Cancelled(_)) => Ok(()),
            _ => Err(ControlError::Ended(ENDED)),
        })
    }

    /// Asks the process running it (if any is) to cancel a run, and waits for its news.
    async fn cancel_elsewhere(&self, user: &UserId, trace_id: TraceId) -> Result<(), ControlError> {
        // Watching before asking: the run's last events cannot be told in between.
        let mut news = self.news.watch(trace_id);
        // A run of this process leaves the registry only once its end is stored: one that
        // ended (cancelled by another request, say) since this cancel read it is over, not
        // elsewhere.
        if !stoppable(self.store.get_trace(user, trace_id).await?.status) {
            return Err(ControlError::Ended(ENDED));
        }
        self.store.notify(&[Notice::Cancel(trace_id)]).await?;
        let ended = async {
            loop {
                let status = self.store.get_trace(user, trace_id).await?.status;
                if !stoppable(status) {
                    return Ok::<_, StoreError>(status);
                }
                news.changed().await;
            }
        };
        match tokio::time::timeout(CANCEL_WAIT, ended).await {
            Ok(Ok(TraceStatus::Cancelled)) => Ok(()),
            Ok(Ok(_)) => Err(ControlError::Ended(ENDED)),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(ControlError::NoAnswer),
        }
    }

    /// Cancels this process's runs in a conversation and waits (bounded) for them to end,
    /// so that deleting it leaves no run writing into it.
    pub async fn stop_runs_in(&self, user: &UserId, conversation_id: ConversationId) {
        let runs: Vec<_> =
            self.runs.in_conversation(conversation_id).into_iter().filter(|r| r.user_id == *user).collect();
        for run in &runs {
            run.cancel.cancel();
        }
        let ended = async {
            for run in &runs {
                run.finished().await;
            }
        };
        let _ = tokio::time::timeout(STOP_WAIT, ended).await;
    }
}

impl Canceller {
    /// Tells whoever follows a conversation, here and on the other replicas, that it was
    /// deleted: their streams end.
    pub async fn conversation_deleted(&self, conversation_id: ConversationId) {
        self.cluster.tell(Notice::Deleted(conversation_id)).await;
    }
}
