//! Following a run from a seq (CONTRACT.md §6): live from this process's fan-out while the
//! run is here, else from its log, read again whenever the process running it tells that
//! the log grew. Nothing here polls; every wait is woken.

use crate::ids::{TraceId, UserId};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};

use super::news::ConversationNews;
use super::runs::{Follow, Frame, LiveRun};
use crate::chat::errors::ControlError;
use crate::chat::shared::Shared;
use crate::domain::{Trace, TraceStatus};
use crate::events::{ErrorEvent, Event, LoggedEvent};
use crate::store::{Store, StoreError};

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

/// Follows runs (live or from their logs) and conversations.
#[derive(Clone)]
pub(in crate::chat) struct Follower {
    store: std::sync::Arc<dyn crate::store::Store>,
    runs: crate::chat::live::runs::Runs,
    news: crate::chat::live::news::RunNews,
    cluster: std::sync::Arc<dyn crate::chat::live::cluster::Cluster>,
}

impl Follower {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self {
            store: shared.store.clone(),
            runs: shared.runs.clone(),
            news: shared.news.clone(),
            cluster: shared.cluster.clone(),
        }
    }

    /// Follows the user's run `trace_id` from the event after `after` (and, with
    /// `through_waits`, on through its waits; else it stops where the run waits).
    pub async fn resume(
        &self,
        user: &UserId,
        trace_id: TraceId,
        after: u64,
        through_waits: bool,
    ) -> Result<Resumed, ControlError> {
        let trace = self.store.get_trace(user, trace_id).await.map_err(ControlError::missing("Trace"))?;
        if let Some(run) = self.runs.get(trace_id) {
            if run.heard_all(after) {
                return Ok(Resumed::HeardAll);
            }
        } else if !trace.status.is_going() {
            // The log from the client's last event on, read once: whether that event was
            // `done`, and whether the client missed anything.
            let mut missed = self.store.trace_events(trace_id, after.saturating_sub(1) as i64).await?;
            let saw_done = missed.first().is_some_and(|e| e.seq as u64 == after && e.kind == "done");
            missed.retain(|e| e.seq as u64 > after);
            // (A seq beyond the log's end needs the whole log to tell.)
            if missed.is_empty()
                && (saw_done || logged_done(&*self.store, trace_id).await?.is_some_and(|done| after >= done))
            {
                return Ok(Resumed::HeardAll);
            }
        }
        Ok(Resumed::Frames(self.follow(trace, after, through_waits).boxed()))
    }

    /// A run's frames from its first, for the client that started it, then, if it waits
    /// (CONTRACT.md §15) and `through_waits`, on from the log and its continuation, until
    /// `done`. With `cancel_on_drop`, the run is cancelled if that client goes away while it
    /// runs here (a resuming client never cancels by leaving).
    pub fn follow_from_the_start(
        &self,
        run: Arc<LiveRun>,
        cancel_on_drop: bool,
        through_waits: bool,
    ) -> impl Stream<Item = Frame> + Send + 'static {
        FromTheStart {
            // Listening from now, not from the response's first read: the run keeps its
            // frames for this client meanwhile.
            live: Some(run.clone().follow(0)),
            rest: None,
            guard: DisconnectGuard { run, cancel_on_drop, done: false },
            after: 0,
            core: self.clone(),
            through_waits,
        }
    }

    /// The frames of a run after `after`, from its log and wherever it goes on, for a client
    /// that followed it live from its start (see [`FromTheStart`]); `None` where its trace
    /// could not be read: the stream ends there, not the run.
    fn rest_from_the_log(
        &self,
        run: Arc<LiveRun>,
        after: u64,
        through_waits: bool,
    ) -> impl Stream<Item = Option<Frame>> + Send + 'static {
        let core = self.clone();
        async_stream::stream! {
            let trace = match core.store.get_trace(&run.user_id, run.trace_id).await {
                Ok(trace) => trace,
                Err(e) => {
                    tracing::warn!(error = %e, trace_id = %run.trace_id, "could not follow a run from its log");
                    yield None;
                    return;
                }
            };
            let mut rest = std::pin::pin!(core.follow(trace, after, through_waits));
            while let Some(frame) = rest.next().await {
                yield Some(frame);
            }
        }
    }

    /// Follows a run from `after` wherever it is, until `done`: live while it runs in this
    /// process, else from its log, read again whenever its process (or whoever continues it
    /// after a wait) tells that the log grew. A run whose process died ends with one error
    /// and `done`. Without `through_waits`, the frames end where the run waits.
    pub fn follow(&self, trace: Trace, after: u64, through_waits: bool) -> impl Stream<Item = Frame> + Send + 'static {
        let core = self.clone();
        let trace_id = trace.trace_id;
        async_stream::stream! {
            let mut after = after;
            let mut trace = trace;
            loop {
                if let Some(run) = core.runs.get(trace_id).filter(|run| !run.is_parked() && after >= run.base()) {
                    let mut live = std::pin::pin!(run.clone().follow(after));
                    while let Some(frame) = live.next().await {
                        after = frame.seq;
                        let last = frame.is_last();
                        yield frame;
                        if last {
                            return;
                        }
                    }
                    if after < run.base() {
                        // Fell behind what the run keeps here: on from the log.
                        continue;
                    }
                    if !run.is_parked() || !through_waits {
                        // Ended with `done` at or before `after`, or waits.
                        return;
                    }
                    continue;
                }
                // Watching before reading: nothing told meanwhile is missed.
                let mut news = core.news.watch(trace_id);
                let events = match core.store.trace_events(trace_id, after as i64).await {
                    Ok(events) => events,
                    Err(e) => {
                        tracing::warn!(error = %e, %trace_id, "could not read a run's log to follow it");
                        return;
                    }
                };
                let read_any = !events.is_empty();
                for event in events {
                    let frame = Frame::logged(event);
                    after = frame.seq;
                    let last = frame.is_last();
                    yield frame;
                    if last {
                        return;
                    }
                }
                if let Some(parked) = core.runs.get(trace_id).filter(|run| run.is_parked()) {
                    // Parked here a moment ago, its log being sealed (its continuation, if it
                    // is claimed meanwhile, waits for that too): then look again.
                    let _ = tokio::time::timeout(LOGGED_WAIT, parked.logged()).await;
                    if !read_any && core.runs.get(trace_id).is_some_and(|run| Arc::ptr_eq(&run, &parked)) {
                        news.changed().await;
                    }
                    continue;
                }
                if let Some(run) = core.runs.get(trace_id).filter(|run| !run.is_parked()) {
                    // It went on here: live from where its numbers begin, past the gap after
                    // its log's end. (Not from its first frame kept: the frames before that
                    // are logged, perhaps since the read above.)
                    if !read_any && after < run.begins_after {
                        after = run.begins_after;
                    }
                    continue;
                }
                if read_any {
                    continue;
                }
                match core.store.get_trace(&trace.user_id, trace_id).await {
                    Ok(now) => trace = now,
                    Err(e) => {
                        tracing::warn!(error = %e, %trace_id, "could not read a followed run's trace");
                        return;
                    }
                }
                let told = match trace.status {
                    // Its process (or whoever continues it) tells when the log grows; a
                    // process that dies is found, and its run marked interrupted and told.
                    TraceStatus::Running | TraceStatus::Queued if core.cluster.runs_elsewhere() => {
                        news.changed().await;
                        true
                    }
                    TraceStatus::Waiting if !through_waits => return,
                    TraceStatus::Waiting => {
                        news.changed().await;
                        true
                    }
                    // Marked so by whoever found its process dead: nothing more comes.
                    TraceStatus::Interrupted => false,
                    // Ended (its last events follow within a flush interval, or never), or
                    // running in no process here: a waiting run that is being taken over
                    // here, or one whose process died.
                    _ => tokio::time::timeout(LAST_EVENTS_WAIT, news.changed()).await.is_ok(),
                };
                if told {
                    continue;
                }
                // A `done` at or before `after`: the client has seen the end.
                if matches!(logged_done(&*core.store, trace_id).await, Ok(Some(done)) if after >= done) {
                    return;
                }
                // Its process died before it could say so (an interrupted run): end the
                // stream the way the contract promises, with one terminal event.
                for frame in unlogged_ending(&trace, after) {
                    yield frame;
                }
                return;
            }
        }
    }

    /// Everything that happens in a conversation (CONTRACT.md §16): each run that is going,
    /// from its first event, and each run that starts later, tagged with its trace id, until
    /// the listener leaves. Runs that overlap (an A/B pair) interleave as their events come.
    pub fn follow_conversation(
        &self,
        user: &UserId,
        conversation_id: crate::ids::ConversationId,
    ) -> impl Stream<Item = (TraceId, Frame)> + Send + 'static {
        let (core, user) = (self.clone(), user.clone());
        // Watching from the call, before the stream is first polled (after the response's
        // head is sent): a run that starts meanwhile, however short, is this stream's.
        let mut started = core.news.watch_conversation(conversation_id);
        let opened_at = crate::domain::now();
        async_stream::stream! {
            let mut followed = std::collections::HashSet::new();
            let mut runs = futures_util::stream::SelectAll::new();
            // The runs going now; then each run told to have started (however short); and
            // whenever news may have been missed, the going ones and those started since the
            // last look (a second early: replicas' clocks differ).
            let mut last_look = None;
            loop {
                let looked_at = crate::domain::now();
                // A conversation deleted while news was missed: nothing more will come.
                if let Err(e) = core.store.get_conversation(&user, conversation_id).await {
                    if !matches!(e, StoreError::NotFound) {
                        tracing::warn!(error = %e, %conversation_id, "could not read a followed conversation");
                    }
                    return;
                }
                let traces = match last_look {
                    // Runs that ended before the stream opened are none of this stream's:
                    // known, so a later look passes them; one that ended since it opened (its
                    // first poll comes after the response's head) is followed from its log.
                    // (Another replica's `ended_at` is by its clock.)
                    None => match core.store.running_in_conversation(&user, conversation_id).await {
                        Ok(mut going) => {
                            let since = opened_at.min(looked_at) - chrono::Duration::seconds(1);
                            match core.store.runs_started_since(&user, conversation_id, since).await {
                                Ok(started) => {
                                    for trace in started {
                                        if trace.status.is_going() || going.iter().any(|g| g.trace_id == trace.trace_id) {
                                            continue;
                                        }
                                        if trace.ended_at.is_some_and(|at| at < opened_at) {
                                            followed.insert(trace.trace_id);
                                        } else {
                                            going.push(trace);
                                        }
                                    }
                                    Ok(going)
                                }
                                Err(e) => Err(e),
                            }
                        }
                        Err(e) => Err(e),
                    },
                    Some(since) => match core.store.running_in_conversation(&user, conversation_id).await {
                        Ok(mut going) => core
                            .store
                            .runs_started_since(&user, conversation_id, since - chrono::Duration::seconds(1))
                            .await
                            .map(|started| {
                                going.extend(started);
                                going
                            }),
                        Err(e) => Err(e),
                    },
                };
                last_look = Some(looked_at);
                match traces {
                    Ok(traces) => {
                        for trace in traces {
                            let trace_id = trace.trace_id;
                            if followed.insert(trace_id) {
                                runs.push(core.follow(trace, 0, true).map(move |frame| (trace_id, frame)).boxed());
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, %conversation_id, "could not read a followed conversation's runs");
                        return;
                    }
                }
                loop {
                    let next = tokio::select! {
                        item = runs.next(), if !runs.is_empty() => Ok(item),
                        news = started.changed() => Err(news),
                    };
                    match next {
                        Ok(Some(item)) => yield item,
                        // Every run followed so far has ended: wait for the next.
                        Ok(None) => {}
                        Err(ConversationNews::Started(trace_id)) => {
                            if followed.contains(&trace_id) {
                                continue;
                            }
                            match core.store.get_trace(&user, trace_id).await {
                                Ok(trace) => {
                                    followed.insert(trace_id);
                                    runs.push(core.follow(trace, 0, true).map(move |frame| (trace_id, frame)).boxed());
                                }
                                Err(e) => tracing::warn!(error = %e, %trace_id, "could not read a started run's trace"),
                            }
                        }
                        Err(ConversationNews::Missed) => break,
                        // Its runs were stopped before it went: their last events, then the
                        // stream's end.
                        Err(ConversationNews::Deleted) => {
                            let deadline = tokio::time::Instant::now() + DELETED_DRAIN;
                            while let Ok(Some(item)) = tokio::time::timeout_at(deadline, runs.next()).await {
                                yield item;
                            }
                            return;
                        }
                    }
                }
            }
        }
    }

    /// The user's runs of a conversation that are going (CONTRACT.md §16), oldest first,
    /// each with the seq of its newest event: live where it runs here, else as logged.
    pub async fn active_runs(
        &self,
        user: &UserId,
        conversation_id: crate::ids::ConversationId,
    ) -> Result<Vec<(Trace, u64)>, StoreError> {
        let mut active = Vec::new();
        for trace in self.store.running_in_conversation(user, conversation_id).await? {
            let last_seq = match self.runs.get(trace.trace_id).filter(|run| !run.is_parked()) {
                Some(run) => run.last_seq(),
                None => self.store.trace_events(trace.trace_id, 0).await?.last().map_or(0, |e| e.seq as u64),
            };
            active.push((trace, last_seq));
        }
        Ok(active)
    }

    /// Waits (bounded) until a run of this process that has sent `done`, or stopped to wait,
    /// has its log written, so that a trace read right after its stream ended is whole.
    pub async fn logged(&self, trace_id: TraceId) {
        self.sealed_here(trace_id, false, tokio::time::Instant::now() + LOGGED_WAIT).await;
    }

    /// A run's trace and its log, as they stand, and whole where the run has ended: a run
    /// saves its trace, sends its last events, then logs them, here or on another process.
    /// So a read right after its stream ended, on any replica, waits for the logged `done`
    /// (all waits together at most [`LAST_EVENTS_WAIT`]): where the run is in this process,
    /// until it has sealed its log; where another process may be writing it, until that
    /// process tells that it did. A run whose process died never logs one: one marked
    /// interrupted, or that ended more than [`ENDED_LATELY`] ago, is read as it is.
    pub async fn whole_log(&self, trace: Trace) -> Result<(Trace, Vec<LoggedEvent>), StoreError> {
        let trace_id = trace.trace_id;
        let deadline = tokio::time::Instant::now() + LAST_EVENTS_WAIT;
        let trace = match trace.status.is_going() {
            true => self.store.get_trace(&trace.user_id, trace_id).await?,
            false => trace,
        };
        self.sealed_here(trace_id, !trace.status.is_going(), deadline).await;
        let behind_lately = !trace.status.is_going()
            && trace.status != TraceStatus::Interrupted
            && self.cluster.runs_elsewhere()
            && trace.ended_at.is_some_and(|at| crate::domain::now() - at < ENDED_LATELY);
        loop {
            // Watching before reading: the news of its last batch is not missed.
            let mut news = self.news.watch(trace_id);
            let events = self.store.trace_events(trace_id, 0).await?;
            let whole = events.last().is_some_and(|e| e.kind == "done");
            if whole
                || !behind_lately
                || tokio::time::Instant::now() >= deadline
                || tokio::time::timeout_at(deadline, news.changed()).await.is_err()
            {
                return Ok((trace, events));
            }
        }
    }

    /// Waits, until `deadline`, for a run of this process that has `ended` (its trace says
    /// so: it may be sending its last events), finished or parked to have its log sealed.
    async fn sealed_here(&self, trace_id: TraceId, ended: bool, deadline: tokio::time::Instant) {
        if let Some(run) = self.runs.get(trace_id).filter(|run| ended || run.is_finished() || run.is_parked()) {
            let _ = tokio::time::timeout_at(deadline, run.logged()).await;
        }
    }
}

/// How long after its trace says it ended a run's log may still lack its last events
/// (replicas' clocks differ, and a busy process flushes late); longer, and they never come.
const ENDED_LATELY: chrono::TimeDelta = chrono::TimeDelta::seconds(10);

/// How long a deleted conversation's stream still passes on its stopped runs' last events.
const DELETED_DRAIN: Duration = Duration::from_secs(5);

/// The seq of the run's logged `done`, if it has one.
async fn logged_done(store: &dyn Store, trace_id: TraceId) -> Result<Option<u64>, StoreError> {
    let events = store.trace_events(trace_id, 0).await?;
    Ok(events.iter().rev().find(|e| e.kind == "done").map(|e| e.seq as u64))
}

/// Where `trace` has ended and its whole `log` (see [`Follower::whole_log`]) has no `done`:
/// the ending a follower is told in its place.
pub fn ending_never_logged(trace: &Trace, log: &[LoggedEvent]) -> Option<[Frame; 2]> {
    let last = log.last();
    let never = !trace.status.is_going() && last.is_none_or(|e| e.kind != "done");
    never.then(|| unlogged_ending(trace, last.map_or(0, |e| e.seq as u64)))
}

/// The `error` and `done` that stand in, for whoever follows or reads it, for the end of a
/// run whose process died before it could log its own (its log's last seq is `after`).
fn unlogged_ending(trace: &Trace, after: u64) -> [Frame; 2] {
    let Trace { trace_id, message_id, conversation_id, .. } = *trace;
    [
        Frame::new(
            after + 1,
            Event::Error(Box::new(ErrorEvent {
                code: "SERVICE_UNAVAILABLE".into(),
                message: "The server stopped during the run".into(),
                retryable: true,
                message_id,
                trace_id,
            })),
        ),
        Frame::new(after + 2, Event::Done { conversation_id, message_id, trace_id }),
    ]
}

/// [`Follower::follow_from_the_start`]'s frames: the run's own, live, handed on one by one
/// as they come (no generator between them and the client); then, where the client fell
/// behind what the run keeps here or the run waits, the rest from its log.
struct FromTheStart {
    /// The run's frames here, until they end.
    live: Option<Follow>,
    /// Then the rest from the log (boxed: a client rarely gets here).
    rest: Option<BoxStream<'static, Option<Frame>>>,
    /// Lives, and drops, with the stream.
    guard: DisconnectGuard,
    /// The seq of the last frame handed on.
    after: u64,
    core: Follower,
    through_waits: bool,
}

impl Stream for FromTheStart {
    type Item = Frame;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Frame>> {
        let this = self.get_mut();
        if let Some(live) = &mut this.live {
            match std::task::ready!(live.poll_next_unpin(cx)) {
                Some(frame) => {
                    this.after = frame.seq;
                    this.guard.done |= frame.is_last();
                    return Poll::Ready(Some(frame));
                }
                None => {
                    this.live = None;
                    // The client fell behind what the run keeps here: the rest from the log,
                    // then live again, and leaving still stops the run while it runs here.
                    // Else it waits (or ended): leaving no longer stops it, and a wait is
                    // followed on from the log.
                    let run = &this.guard.run;
                    let behind = !this.guard.done && this.after < run.base() && !run.is_parked();
                    if !behind {
                        this.guard.done = true;
                        if !run.is_parked() || !this.through_waits {
                            return Poll::Ready(None);
                        }
                    }
                    this.rest = Some(this.core.rest_from_the_log(run.clone(), this.after, this.through_waits).boxed());
                }
            }
        }
        let Some(rest) = &mut this.rest else {
            return Poll::Ready(None);
        };
        match std::task::ready!(rest.poll_next_unpin(cx)) {
            Some(Some(frame)) => {
                this.guard.done |= frame.is_last() || this.guard.run.is_parked();
                Poll::Ready(Some(frame))
            }
            ended => {
                // `Some(None)`: the trace could not be read, and the stream ends here, not
                // the client; the run goes on.
                this.guard.done |= ended.is_some();
                this.rest = None;
                Poll::Ready(None)
            }
        }
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
