//! Run starts are written together: every start that arrives while the previous write is
//! under way goes into the next transaction (a group commit). A lone start is written at
//! once, as before; a burst of new chats shares one commit instead of queueing for one each.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::store::{RunStart, Store, StoreError};

/// Starts written in one transaction, at most.
const MAX_GROUP: usize = 256;

type Written = (RunStart, Result<(), StoreError>);

struct Pending {
    start: RunStart,
    done: oneshot::Sender<Written>,
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

    /// Persists `start`; returns it once it is in the database.
    pub async fn write(&self, start: RunStart) -> Result<RunStart, StoreError> {
        let stopped = || StoreError::Conflict("the start writer stopped".into());
        let (done, wait) = oneshot::channel();
        self.tx.send(Pending { start, done }).map_err(|_| stopped())?;
        let (start, result) = wait.await.map_err(|_| stopped())?;
        result.map(|()| start)
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
                    let _ = p.done.send((p.start, Ok(())));
                }
            }
            // One start that cannot be written (its conversation was deleted meanwhile)
            // must not fail the others: each is tried on its own.
            Err(e) if group.len() == 1 => {
                let p = group.pop().expect("one start");
                let _ = p.done.send((p.start, Err(e)));
            }
            Err(_) => {
                for p in group.drain(..) {
                    let result = store.start_runs(&[&p.start]).await;
                    let _ = p.done.send((p.start, result));
                }
            }
        }
    }
}
