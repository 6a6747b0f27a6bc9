//! Following a run from a seq (CONTRACT.md §6): live from this process's fan-out while the
//! run is here, else from its log, read again whenever the process running it tells that
//! the log grew. Nothing here polls; every wait is woken.

use crate::ids::{TraceId, UserId};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};

use super::control::ControlError;
use super::core::Core;
use super::news::Watch;
use super::runs::{Frame, LiveRun};
use crate::domain::{Trace, TraceStatus};
use crate::events::{ErrorEvent, Event, LoggedEvent};
use crate::store::Store;

/// How long a follower waits, after a run on another process ended, for its last events
/// to be logged (they follow within a flush interval; a crashed process never logs them).
const LAST_EVENTS_WAIT: Duration = Duration::from_secs(2);

/// How long reading a trace waits for a run that has sent `done` to have its log written.
const LOGGED_WAIT: Duration = Duration::from_secs(2);

/// What a client that resumes a run gets.
pub enum Resumed {
    /// The run has ended and the client has seen its `done` already.
    HeardAll,
    /// The events after its seq, then the live ones, until `done`.
    Frames(BoxStream<'static, Frame>),
}

impl Core {
    /// Follows the user's run `trace_id` from the event after `after`.
    pub async fn resume(&self, user: &UserId, trace_id: TraceId, after: u64) -> Result<Resumed, ControlError> {
        let trace = self.store.get_trace(user, trace_id).await.map_err(ControlError::missing("Trace"))?;
        if let Some(run) = self.runs.get(trace_id) {
            if run.heard_all(after) {
                return Ok(Resumed::HeardAll);
            }
            return Ok(Resumed::Frames(run.follow(after).boxed()));
        }
        // Watching before reading: nothing the run's process tells can fall in between.
        let news = self.news.watch(trace_id);
        // The log from the client's last event on, read once: whether that event was `done`,
        // and what the client missed.
        let mut missed = self.store.trace_events(trace_id, after.saturating_sub(1) as i64).await?;
        let saw_done = missed.first().is_some_and(|e| e.seq as u64 == after && e.kind == "done");
        missed.retain(|e| e.seq as u64 > after);
        if missed.is_empty()
            && trace.status != TraceStatus::Running
            // (A seq beyond the log's end needs the whole log to tell.)
            && (saw_done || logged_done(&*self.store, trace_id).await?.is_some_and(|done| after >= done))
        {
            return Ok(Resumed::HeardAll);
        }
        let follower = LogFollower { store: self.store.clone(), trace, after, news };
        Ok(Resumed::Frames(follower.frames(missed).boxed()))
    }

    /// Waits (bounded) until a run of this process that has sent `done` has its log
    /// written, so that a trace read right after its stream ended is whole.
    pub async fn logged(&self, trace_id: TraceId) {
        if let Some(run) = self.runs.get(trace_id).filter(|run| run.is_finished()) {
            let _ = tokio::time::timeout(LOGGED_WAIT, run.logged()).await;
        }
    }
}

/// A run's frames from its first, for the client that started it: with `cancel_on_drop`,
/// the run is cancelled if that client goes away before `done` (a resuming client never
/// cancels by leaving).
pub fn from_the_start(run: Arc<LiveRun>, cancel_on_drop: bool) -> impl Stream<Item = Frame> + Send + 'static {
    let mut guard = DisconnectGuard { run: run.clone(), cancel_on_drop, done: false };
    run.follow(0).map(move |frame| {
        // Borrowing the whole guard makes the closure own all of it (not just `done`),
        // so the guard lives, and drops, with the stream.
        let guard = &mut guard;
        guard.done |= frame.is_last();
        frame
    })
}

/// The seq of the run's logged `done`, if it has one.
async fn logged_done(store: &dyn Store, trace_id: TraceId) -> Result<Option<u64>, crate::store::StoreError> {
    let events = store.trace_events(trace_id, 0).await?;
    Ok(events.iter().rev().find(|e| e.kind == "done").map(|e| e.seq as u64))
}

/// A run that is not in this process, followed through its log.
struct LogFollower {
    store: Arc<dyn Store>,
    trace: Trace,
    /// The last seq given out.
    after: u64,
    news: Watch,
}

impl LogFollower {
    /// `missed` (the log after `after`, already read), then what is logged later, until
    /// `done`; a run whose process died ends with one error and `done`.
    fn frames(mut self, missed: Vec<LoggedEvent>) -> impl Stream<Item = Frame> + Send + 'static {
        let trace_id = self.trace.trace_id;
        async_stream::stream! {
            let mut events = missed;
            loop {
                for event in events.drain(..) {
                    let frame = Frame::logged(event);
                    self.after = frame.seq;
                    let last = frame.is_last();
                    yield frame;
                    if last {
                        return;
                    }
                }
                if !self.more_to_come().await {
                    // A `done` at or before `after`: the client has seen the end.
                    if matches!(logged_done(&*self.store, trace_id).await, Ok(Some(done)) if self.after >= done) {
                        return;
                    }
                    // Its process died before it could say so (an interrupted run): end the
                    // stream the way the contract promises, with one terminal event.
                    for frame in self.ending() {
                        yield frame;
                    }
                    return;
                }
                events = match self.store.trace_events(trace_id, self.after as i64).await {
                    Ok(events) => events,
                    Err(e) => {
                        tracing::warn!(error = %e, %trace_id, "resume could not read the log");
                        return;
                    }
                };
            }
        }
    }

    /// Waits for the run's process to log more; false when nothing more will come.
    async fn more_to_come(&mut self) -> bool {
        if !self.store.is_shared() {
            // One process per database, and the run is not in it: it has logged all it ever
            // will.
            return false;
        }
        let running = matches!(
            self.store.get_trace(&self.trace.user_id, self.trace.trace_id).await,
            Ok(now) if now.status == TraceStatus::Running
        );
        if running {
            // Its process tells when the log grows; if the process dies, the replica that
            // finds it marks the run interrupted and tells that too.
            self.news.changed().await;
            true
        } else {
            // Marked over before its last events are logged: they follow within a flush
            // interval, or never.
            tokio::time::timeout(LAST_EVENTS_WAIT, self.news.changed()).await.is_ok()
        }
    }

    /// An `error` and `done` for a run that will never send its own.
    fn ending(&self) -> [Frame; 2] {
        let Trace { trace_id, message_id, conversation_id, .. } = self.trace;
        [
            Frame::new(
                self.after + 1,
                Event::Error(Box::new(ErrorEvent {
                    code: "SERVICE_UNAVAILABLE".into(),
                    message: "The server stopped during the run".into(),
                    retryable: true,
                    message_id,
                    trace_id,
                })),
            ),
            Frame::new(self.after + 2, Event::Done { conversation_id, message_id, trace_id }),
        ]
    }
}

/// Cancels the run if the client goes away before `done` (with `on_disconnect = "cancel"`).
struct DisconnectGuard {
    run: Arc<LiveRun>,
    cancel_on_drop: bool,
    done: bool,
}

impl Drop for DisconnectGuard {
    fn drop(&mut self) {
        if self.cancel_on_drop && !self.done && !self.run.is_finished() {
            tracing::info!(trace_id = %self.run.trace_id, "client left; cancelling its run");
            self.run.cancel.cancel();
        }
    }
}
