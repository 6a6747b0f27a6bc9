//! What other chatd processes say about runs, for whoever in this one waits on a run it does
//! not run itself: a follower of another replica's run reads its log again when told that it
//! grew, a cancel learns that the run it asked to stop has ended. Nothing here polls.

use crate::ids::{ConversationId, TraceId};
use tokio::sync::broadcast;

use crate::store::Notice;

/// Notices kept for a slow waiter before it is told it missed some.
const BACKLOG: usize = 1024;

/// Cheap to clone; every clone tells the same waiters.
#[derive(Clone)]
pub struct RunNews {
    sender: broadcast::Sender<Notice>,
}

impl Default for RunNews {
    fn default() -> Self {
        Self { sender: broadcast::channel(BACKLOG).0 }
    }
}

impl RunNews {
    /// Passes a notice on to every waiter.
    pub fn tell(&self, notice: Notice) {
        // No waiter is no error.
        let _ = self.sender.send(notice);
    }

    /// Starts listening for news of `trace_id`: notices sent from now on are kept for it, so
    /// a waiter that watches before it reads misses none.
    pub fn watch(&self, trace_id: TraceId) -> Watch {
        Watch { trace_id, receiver: self.sender.subscribe() }
    }
}

impl RunNews {
    /// Starts listening for runs that start in `conversation_id`, as [`watch`](Self::watch)
    /// does for a run's log.
    pub fn watch_conversation(&self, conversation_id: ConversationId) -> ConversationWatch {
        ConversationWatch { conversation_id, receiver: self.sender.subscribe() }
    }
}

impl RunNews {
    /// Starts listening for news of any run, for a waiter that learns only later which runs
    /// it waits on (a queued run, CONTRACT.md §16).
    pub fn watch_all(&self) -> RunsWatch {
        RunsWatch { receiver: self.sender.subscribe() }
    }
}

/// News of whichever runs a waiter names.
pub struct RunsWatch {
    receiver: broadcast::Receiver<Notice>,
}

impl RunsWatch {
    /// Returns once there is news of one of `runs`, or news may have been missed. Never
    /// returns where no other process can tell anything.
    pub async fn changed(&mut self, runs: &[TraceId]) {
        next(&mut self.receiver, |notice| matches!(notice, Notice::Logged(id) if runs.contains(&id)).then_some(()))
            .await;
    }
}

/// News of the runs that start in one conversation.
pub struct ConversationWatch {
    conversation_id: ConversationId,
    receiver: broadcast::Receiver<Notice>,
}

/// What a [`ConversationWatch`] heard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConversationNews {
    /// A run of the conversation started.
    Started(TraceId),
    /// The conversation was deleted.
    Deleted,
    /// News may have been missed: read the conversation's runs again.
    Missed,
}

impl ConversationWatch {
    /// The next news of the conversation.
    pub async fn changed(&mut self) -> ConversationNews {
        let conversation_id = self.conversation_id;
        next(&mut self.receiver, |notice| match notice {
            Notice::Started(id, trace_id) if id == conversation_id => Some(ConversationNews::Started(trace_id)),
            Notice::Deleted(id) if id == conversation_id => Some(ConversationNews::Deleted),
            _ => None,
        })
        .await
        .unwrap_or(ConversationNews::Missed)
    }
}

pub struct Watch {
    trace_id: TraceId,
    receiver: broadcast::Receiver<Notice>,
}

impl Watch {
    /// Returns once there is news of the run, or news may have been missed: either way, the
    /// waiter reads the run again. Never returns where no other process can tell anything.
    pub async fn changed(&mut self) {
        let mine = self.trace_id;
        next(&mut self.receiver, |notice| (notice == Notice::Logged(mine)).then_some(())).await;
    }
}

/// The next notice `wanted` picks out (`Some`), or `None` once notices may have been missed.
/// Never returns where no other process can tell anything.
async fn next<T>(receiver: &mut broadcast::Receiver<Notice>, wanted: impl Fn(Notice) -> Option<T>) -> Option<T> {
    loop {
        match receiver.recv().await {
            Ok(Notice::Missed) | Err(broadcast::error::RecvError::Lagged(_)) => return None,
            Ok(notice) => {
                if let Some(found) = wanted(notice) {
                    return Some(found);
                }
            }
            Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_watch_wakes_for_its_run_and_for_missed_news_only() {
        let news = RunNews::default();
        let (mine, other) = (TraceId::new(), TraceId::new());
        let mut watch = news.watch(mine);
        news.tell(Notice::Logged(other));
        news.tell(Notice::Cancel(mine));
        let quiet = tokio::time::timeout(Duration::from_millis(50), watch.changed()).await;
        assert!(quiet.is_err(), "woke for another run's news or a cancel");
        news.tell(Notice::Logged(mine));
        tokio::time::timeout(Duration::from_secs(5), watch.changed()).await.expect("woke for its run");
        news.tell(Notice::Missed);
        tokio::time::timeout(Duration::from_secs(5), watch.changed()).await.expect("woke for missed news");
    }

    #[tokio::test]
    async fn news_told_between_watching_and_waiting_is_not_lost() {
        let news = RunNews::default();
        let run = TraceId::new();
        let mut watch = news.watch(run);
        news.tell(Notice::Logged(run));
        tokio::time::timeout(Duration::from_secs(5), watch.changed()).await.expect("kept the notice");
    }
}
