//! The event log writer: every event a run sends is appended to its trace's log, in batches.
//! One writer task serves all runs; every `flush_interval` it writes what waits as one batch,
//! sooner when `flush_max_events` are waiting, and at once when a run asks for a flush (at
//! its end). Never a database write per token, and no wake-up of the writer per token either.
//! A run that has ended has its log sealed right after its last events are written. A run's
//! checkpoint after a completed step (CONTRACT.md §19) goes with its events, in the same
//! transaction: it costs no wait and no write of its own. Once a run's events are written,
//! the run lets go of its frames that the log now holds ([`LiveRun::let_go`]).
//!
//! [`LiveRun::let_go`]: super::runs::LiveRun::let_go

use crate::ids::TraceId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::MissedTickBehavior;

use super::runs::Runs;
use crate::store::{NewEvent, Progress, Store, StoreError};

type Done = oneshot::Sender<Result<(), String>>;

/// What waits for the next write: events, and checkpoints that follow them.
#[derive(Default)]
struct Pending {
    events: Vec<NewEvent>,
    progress: Vec<Progress>,
}

impl Pending {
    /// Takes `other`'s events and progress. Where this holds none (the writer's batch after a
    /// write), the two trade vectors instead of copying: `other` gets this one's empty room.
    fn append(&mut self, other: &mut Pending) {
        if self.is_empty() {
            std::mem::swap(self, other);
            return;
        }
        self.events.append(&mut other.events);
        self.progress.append(&mut other.progress);
    }

    fn is_empty(&self) -> bool {
        self.events.is_empty() && self.progress.is_empty()
    }
}

enum Control {
    Flush(Done),
    /// Writes what waits, then seals this run's log.
    Seal(TraceId, Done),
    /// `flush_max_events` are waiting: write now.
    Full,
}

/// A handle to the writer task; cheap to clone. Appending only takes a lock: the writer is
/// not woken per event, it wakes every interval (or when asked to flush, or when full).
#[derive(Clone)]
pub struct EventLog {
    pending: Arc<Mutex<Pending>>,
    control: mpsc::UnboundedSender<Control>,
    max_events: usize,
    batches: Arc<AtomicU64>,
}

impl EventLog {
    /// Starts the writer task, which tells `runs` what their logs hold. It ends once every
    /// handle is dropped, after writing what waits.
    pub fn start(store: Arc<dyn Store>, runs: Runs, interval: Duration, max_events: usize) -> Self {
        let (control, rx) = mpsc::unbounded_channel();
        let pending = Arc::new(Mutex::new(Pending::default()));
        let batches = Arc::new(AtomicU64::new(0));
        tokio::spawn(write_loop(store, runs, pending.clone(), rx, interval, batches.clone()));
        Self { pending, control, max_events: max_events.max(1), batches }
    }

    /// Takes `events`, leaving the vector empty with its room (an emitter fills it again).
    pub fn append(&self, events: &mut Vec<NewEvent>) {
        self.append_with(events, None);
    }

    /// Takes `events` and then a run's checkpoint, written in the transaction that writes
    /// them (or after them, where they went out in an earlier write).
    pub fn append_with(&self, events: &mut Vec<NewEvent>, progress: Option<Progress>) {
        let full = {
            let mut pending = self.pending.lock().expect("event log lock");
            pending.events.append(events);
            pending.progress.extend(progress);
            pending.events.len() >= self.max_events
        };
        if full {
            // The writer only stops when every handle is gone, so this cannot fail while
            // `self` exists.
            let _ = self.control.send(Control::Full);
        }
    }

    /// Writes everything appended so far; returns once it is in the database.
    pub async fn flush(&self) -> Result<(), String> {
        let (done, wait) = oneshot::channel();
        self.control.send(Control::Flush(done)).map_err(|_| "event log writer stopped".to_owned())?;
        wait.await.map_err(|_| "event log writer stopped".to_owned())?
    }

    /// Writes everything appended so far, then seals the log of `trace_id`, a run that has
    /// sent `done` ([`Store::seal_logs`]); returns once both are in the database.
    pub async fn seal(&self, trace_id: TraceId) -> Result<(), String> {
        let (done, wait) = oneshot::channel();
        self.control.send(Control::Seal(trace_id, done)).map_err(|_| "event log writer stopped".to_owned())?;
        wait.await.map_err(|_| "event log writer stopped".to_owned())?
    }

    /// How many batches have been written since start (for tests and metrics).
    pub fn batches_written(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }
}

async fn write_loop(
    store: Arc<dyn Store>,
    runs: Runs,
    pending: Arc<Mutex<Pending>>,
    mut control: mpsc::UnboundedReceiver<Control>,
    interval: Duration,
    batches: Arc<AtomicU64>,
) {
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // What is being written, and what a failed write keeps for the next try.
    let mut batch = Pending::default();
    let mut waiting: Vec<Done> = Vec::new();
    let mut sealing: Vec<(TraceId, Done)> = Vec::new();
    let mut unsealed: Vec<TraceId> = Vec::new();
    loop {
        let mut closed = false;
        let mut take = |message: Option<Control>| match message {
            Some(Control::Flush(done)) => waiting.push(done),
            Some(Control::Seal(trace_id, done)) => sealing.push((trace_id, done)),
            Some(Control::Full) => {}
            None => closed = true,
        };
        tokio::select! {
            message = control.recv() => take(message),
            _ = tick.tick() => {}
        }
        while let Ok(message) = control.try_recv() {
            take(Some(message));
        }
        batch.append(&mut pending.lock().expect("event log lock"));
        let newest = newest_by_stretch(&batch.events);
        let result = write(&*store, &mut batch, &batches).await;
        if result.is_ok() {
            for (trace_id, seq) in newest {
                if let Some(run) = runs.get(trace_id) {
                    run.let_go(seq);
                }
            }
        }
        for done in waiting.drain(..) {
            let _ = done.send(result.clone().map_err(|e| e.to_string()));
        }
        if !sealing.is_empty() || !unsealed.is_empty() {
            let (mut logs, done): (Vec<TraceId>, Vec<Done>) = sealing.drain(..).unzip();
            logs.append(&mut unsealed);
            let sealed = match &result {
                Ok(()) => store.seal_logs(&logs).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = &sealed {
                // An unsealed log reads the same, more slowly: it is tried again at the next
                // write, and by the store when it next opens.
                tracing::error!(error = %e, runs = logs.len(), "could not seal the logs of ended runs; will retry");
                unsealed = logs;
                if unsealed.len() > MAX_UNSEALED {
                    unsealed.drain(..unsealed.len() - MAX_UNSEALED);
                }
            }
            for done in done {
                let _ = done.send(sealed.clone());
            }
        }
        if closed {
            return;
        }
    }
}

/// The newest event (by seq) of each stretch of one run's events in `events`. A run's
/// events come together (its emitter hands them over so), so a run is seldom in two
/// stretches; where it is, letting go of the older seq as well does nothing.
fn newest_by_stretch(events: &[NewEvent]) -> Vec<(TraceId, u64)> {
    events
        .chunk_by(|a, b| a.trace_id == b.trace_id)
        .map(|stretch| (stretch[0].trace_id, stretch.iter().map(|event| event.seq as u64).max().unwrap_or(0)))
        .collect()
}

/// Writes what waits as one batch. If the batch fails, each run's events are tried on their
/// own, so one run whose events cannot be written (its conversation was deleted meanwhile)
/// never holds back the others; those are dropped with an error in the log. A database that
/// is down or cannot write (a fault, or every run failing) keeps everything for the next
/// try, up to `MAX_PENDING`.
async fn write(store: &dyn Store, pending: &mut Pending, batches: &AtomicU64) -> Result<(), Arc<StoreError>> {
    if pending.is_empty() {
        return Ok(());
    }
    let started = std::time::Instant::now();
    let error = match store.append_events(&pending.events, &pending.progress).await {
        Ok(()) => {
            metrics::histogram!("chatd_event_log_flush_seconds").record(started.elapsed().as_secs_f64());
            batches.fetch_add(1, Ordering::Relaxed);
            pending.events.clear();
            pending.progress.clear();
            return Ok(());
        }
        Err(e) if e.is_unavailable() => return Err(keep_for_retry(pending, e)),
        Err(e) => e,
    };
    let mut traces: Vec<TraceId> =
        pending.events.iter().map(|e| e.trace_id).chain(pending.progress.iter().map(|p| p.trace_id)).collect();
    traces.sort_unstable();
    traces.dedup();
    let mut kept = Vec::new();
    let mut written_any = false;
    for trace_id in traces {
        let events: Vec<NewEvent> = pending.events.iter().filter(|e| e.trace_id == trace_id).cloned().collect();
        let progress: Vec<Progress> = pending.progress.iter().filter(|p| p.trace_id == trace_id).cloned().collect();
        match store.append_events(&events, &progress).await {
            Ok(()) => written_any = true,
            Err(e) => kept.push((trace_id, (events, progress), e)),
        }
    }
    if written_any || kept.len() == 1 {
        // The store works: the runs that still fail are beyond saving.
        for (trace_id, (events, _), e) in kept.drain(..) {
            tracing::error!(%trace_id, error = %e, events = events.len(), "dropping events the store refuses");
        }
        batches.fetch_add(1, Ordering::Relaxed);
        pending.events.clear();
        pending.progress.clear();
        return Ok(());
    }
    Err(keep_for_retry(pending, error))
}

/// Keeps a batch the database did not take for the next try, up to `MAX_PENDING` events.
fn keep_for_retry(pending: &mut Pending, error: StoreError) -> Arc<StoreError> {
    tracing::error!(error = %error, events = pending.events.len(), "event log write failed; will retry");
    if pending.events.len() > MAX_PENDING {
        let excess = pending.events.len() - MAX_PENDING;
        tracing::error!(dropped = excess, "event log backlog full; dropping the oldest events");
        pending.events.drain(..excess);
    }
    Arc::new(error)
}

/// Logs of ended runs kept for another try at sealing them, at most.
const MAX_UNSEALED: usize = 10_000;

/// Events kept for a retry while the database is down, at most.
const MAX_PENDING: usize = 1_000_000;
