//! The event log writer: every event a run sends is appended to its trace's log, in batches.
//! One writer task serves all runs; it writes when `flush_max_events` are waiting or
//! `flush_interval` has passed since the oldest waiting event, and at once when a run asks
//! for a flush (at its end). Never a database write per token.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::store::{NewEvent, Store, StoreError};

enum Entry {
    Events(Vec<NewEvent>),
    Flush(oneshot::Sender<Result<(), String>>),
}

/// A handle to the writer task; cheap to clone.
#[derive(Clone)]
pub struct EventLog {
    tx: mpsc::UnboundedSender<Entry>,
    batches: Arc<AtomicU64>,
}

impl EventLog {
    /// Starts the writer task. It ends once every handle is dropped, after writing what waits.
    pub fn start(store: Arc<dyn Store>, interval: Duration, max_events: usize) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let batches = Arc::new(AtomicU64::new(0));
        tokio::spawn(write_loop(store, rx, interval, max_events, batches.clone()));
        Self { tx, batches }
    }

    pub fn append(&self, events: Vec<NewEvent>) {
        // The writer only stops when every handle is gone, so this cannot fail while `self`
        // exists.
        let _ = self.tx.send(Entry::Events(events));
    }

    /// Writes everything appended so far; returns once it is in the database.
    pub async fn flush(&self) -> Result<(), String> {
        let (done, wait) = oneshot::channel();
        self.tx.send(Entry::Flush(done)).map_err(|_| "event log writer stopped".to_owned())?;
        wait.await.map_err(|_| "event log writer stopped".to_owned())?
    }

    /// How many batches have been written since start (for tests and metrics).
    pub fn batches_written(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }
}

async fn write_loop(
    store: Arc<dyn Store>,
    mut rx: mpsc::UnboundedReceiver<Entry>,
    interval: Duration,
    max_events: usize,
    batches: Arc<AtomicU64>,
) {
    let mut pending: Vec<NewEvent> = Vec::new();
    let mut waiting: Vec<oneshot::Sender<Result<(), String>>> = Vec::new();
    let mut deadline: Option<Instant> = None;
    loop {
        let wake = match deadline {
            Some(at) => tokio::select! {
                entry = rx.recv() => entry.map_or(Wake::Closed, Wake::Entry),
                () = tokio::time::sleep_until(at) => Wake::Due,
            },
            None => rx.recv().await.map_or(Wake::Closed, Wake::Entry),
        };
        match wake {
            Wake::Entry(Entry::Events(events)) => {
                if pending.is_empty() {
                    deadline = Some(Instant::now() + interval);
                }
                pending.extend(events);
                if pending.len() < max_events {
                    continue;
                }
            }
            Wake::Entry(Entry::Flush(done)) => waiting.push(done),
            Wake::Due => {}
            Wake::Closed => {
                let _ = write(&*store, &mut pending, &batches).await;
                return;
            }
        }
        let result = write(&*store, &mut pending, &batches).await;
        // After a failed write the events stay, and the next try comes an interval later.
        deadline = (!pending.is_empty()).then(|| Instant::now() + interval);
        for done in waiting.drain(..) {
            let _ = done.send(result.clone().map_err(|e| e.to_string()));
        }
    }
}

enum Wake {
    Entry(Entry),
    Due,
    Closed,
}

/// Writes what waits as one batch. If the batch fails, each run's events are tried on their
/// own, so one run whose events cannot be written (its conversation was deleted meanwhile)
/// never holds back the others; those are dropped with an error in the log. A database that
/// is down fails every run: then everything stays for the next try, up to `MAX_PENDING`.
async fn write(store: &dyn Store, pending: &mut Vec<NewEvent>, batches: &AtomicU64) -> Result<(), Arc<StoreError>> {
    if pending.is_empty() {
        return Ok(());
    }
    let started = std::time::Instant::now();
    let error = match store.append_events(pending).await {
        Ok(()) => {
            metrics::histogram!("chatd_event_log_flush_seconds").record(started.elapsed().as_secs_f64());
            batches.fetch_add(1, Ordering::Relaxed);
            pending.clear();
            return Ok(());
        }
        Err(e) => e,
    };
    let mut traces: Vec<uuid::Uuid> = pending.iter().map(|e| e.trace_id).collect();
    traces.sort_unstable();
    traces.dedup();
    let mut kept = Vec::new();
    let mut written_any = false;
    for trace_id in traces {
        let events: Vec<NewEvent> = pending.iter().filter(|e| e.trace_id == trace_id).cloned().collect();
        match store.append_events(&events).await {
            Ok(()) => written_any = true,
            Err(e) => kept.push((trace_id, events, e)),
        }
    }
    if written_any || kept.len() == 1 {
        // The store works: the runs that still fail are beyond saving.
        for (trace_id, events, e) in kept.drain(..) {
            tracing::error!(%trace_id, error = %e, events = events.len(), "dropping events the store refuses");
        }
        batches.fetch_add(1, Ordering::Relaxed);
        pending.clear();
        return Ok(());
    }
    tracing::error!(error = %error, events = pending.len(), "event log write failed; will retry");
    if pending.len() > MAX_PENDING {
        let excess = pending.len() - MAX_PENDING;
        tracing::error!(dropped = excess, "event log backlog full; dropping the oldest events");
        pending.drain(..excess);
    }
    Err(Arc::new(error))
}

/// Events kept for a retry while the database is down, at most.
const MAX_PENDING: usize = 1_000_000;
