//! Run starts are written together: every start that arrives while the previous write is
//! under way goes into the next transaction (a group commit). A lone start is written at
//! once, as before; a burst of new chats shares one commit instead of queueing for one each.
//!
//! What follows a start's commit (launching its runs) is done by the writer's task itself,
//! right after the commit: it happens whether or not the request that asked is still
//! waiting, and a new chat's start reaches its client without one more trip through the
//! runtime's queues.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::store::{RunStart, StartOutcome, Store, StoreError};

/// Starts written in one transaction, at most.
const MAX_GROUP: usize = 256;

/// What is done with a start once it is written, or refused, or could not be; called in the
/// writer's task, so it must not block.
type Then = Box<dyn FnOnce(RunStart, Result<StartOutcome, StoreError>) + Send>;

struct Pending {
    start: RunStart,
    then: Then,
}

/// A handle to the writer task; cheap to clone.
#[derive(Clone)]
pub struct StartWriter {
    tx: mpsc::UnboundedSender<Pending>,
}

impl StartWriter {
    pub fn start(store: Arc<dyn Store>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(write_loop(store, rx));
        Self { tx }
    }

    /// Persists `start`, then calls `then` with it and how its write ended.
    pub fn write(
        &self,
        start: RunStart,
        then: impl FnOnce(RunStart, Result<StartOutcome, StoreError>) + Send + 'static,
    ) {
        if let Err(mpsc::error::SendError(p)) = self.tx.send(Pending { start, then: Box::new(then) }) {
            (p.then)(p.start, Err(StoreError::Conflict("the start writer stopped".into())));
        }
    }
}

async fn write_loop(store: Arc<dyn Store>, mut rx: mpsc::UnboundedReceiver<Pending>) {
    let mut group = Vec::with_capacity(MAX_GROUP);
    while rx.recv_many(&mut group, MAX_GROUP).await > 0 {
        let starts: Vec<&RunStart> = group.iter().map(|p| &p.start).collect();
        let result = store.start_runs(&starts).await;
        drop(starts);
        match result {
            Ok(StartOutcome::Started) => {
                for p in group.drain(..) {
                    hand_over(p, Ok(StartOutcome::Started));
                }
            }
            // The database cannot be written: no start can.
            Err(e) if e.is_unavailable() => {
                let why = e.to_string();
                for p in group.drain(..) {
                    hand_over(p, Err(StoreError::Unavailable(why.clone())));
                }
            }
            written if group.len() == 1 => hand_over(group.pop().expect("one start"), written),
            // One start refused, or that cannot be written (its conversation was deleted
            // meanwhile), must not stop the others: each is tried on its own.
            _ => {
                for p in group.drain(..) {
                    let written = store.start_runs(&[&p.start]).await;
                    hand_over(p, written);
                }
            }
        }
    }
}

/// Hands a start's outcome to its `then`. One that panics (a bug) fails its own request,
/// whose wait ends with the `then` dropped; the writer goes on with the other starts.
fn hand_over(pending: Pending, written: Result<StartOutcome, StoreError>) {
    let Pending { start, then } = pending;
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| then(start, written))).is_err() {
        tracing::error!("what follows a run's start panicked; that request fails, the others go on");
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::oneshot;

    use super::*;
    use crate::domain::{Conversation, Message, Role, Trace};
    use crate::ids::UserId;

    fn new_chat(user: &UserId) -> RunStart {
        let conversation = Conversation::new(user, "a question".into());
        let user_message = Message::new(conversation.id, None, Role::User, "a question".into());
        RunStart {
            traces: vec![Trace::start(user, &user_message, "m", "p")],
            new_conversation: Some(conversation),
            user_message,
            user_message_is_new: true,
            comparison: None,
            replica_id: "replica".into(),
            max_running: None,
            idempotency_key: None,
            asked: None,
            seen: None,
            budget: None,
        }
    }

    #[tokio::test]
    async fn a_follow_up_that_panics_fails_its_own_start_only() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/chatd.db", dir.path().display());
        let store = crate::store::connect(&url, 2).await.expect("a store");
        let writer = StartWriter::start(store.clone());

        let (done, dropped) = oneshot::channel::<()>();
        writer.write(new_chat(&UserId::new("ann")), move |_, _| {
            let _done = done;
            panic!("a bug in what follows a start");
        });
        assert!(dropped.await.is_err(), "the panicking follow-up's wait ends");

        let (done, written) = oneshot::channel();
        let bob = UserId::new("bob");
        let next = new_chat(&bob);
        let id = next.user_message.conversation_id;
        writer.write(next, move |start, written| {
            let _ = done.send(written.map(|outcome| (outcome, start.user_message.conversation_id)));
        });
        assert_eq!(written.await.expect("the writer goes on").expect("written"), (StartOutcome::Started, id));
        assert!(store.get_conversation(&bob, id).await.is_ok());
    }
}
