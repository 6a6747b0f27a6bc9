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

use crate::store::{RunStart, Store, StoreError};

/// Starts written in one transaction, at most.
const MAX_GROUP: usize = 256;

/// What is done with a start once it is written, or could not be; called in the writer's
/// task, so it must not block.
type Then = Box<dyn FnOnce(Result<RunStart, StoreError>) + Send>;

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

    /// Persists `start`, then calls `then` with it (or with why it could not be written).
    pub fn write(&self, start: RunStart, then: impl FnOnce(Result<RunStart, StoreError>) + Send + 'static) {
        if let Err(mpsc::error::SendError(p)) = self.tx.send(Pending { start, then: Box::new(then) }) {
            (p.then)(Err(StoreError::Conflict("the start writer stopped".into())));
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
            Ok(()) => {
                for p in group.drain(..) {
                    (p.then)(Ok(p.start));
                }
            }
            // One start that cannot be written (its conversation was deleted meanwhile)
            // must not fail the others: each is tried on its own.
            Err(e) if group.len() == 1 => {
                let p = group.pop().expect("one start");
                (p.then)(Err(e));
            }
            Err(_) => {
                for p in group.drain(..) {
                    let result = store.start_runs(&[&p.start]).await;
                    (p.then)(result.map(|()| p.start));
                }
            }
        }
    }
}
