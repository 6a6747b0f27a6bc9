//! Live runs: each run has a trace id, a cancellation token and a fan-out of its events to
//! any number of listeners. A run does not belong to the HTTP request that started it; a
//! listener can join at any sequence number and gets every later event, then follows live.
//! A run keeps only the frames someone may still read from memory: those the log has, it lets
//! go once every listener here has taken them (but its last two, and at most [`KEPT`] behind
//! its newest: a long answer would otherwise hold every token it sent until its end, and a
//! listener that stops reading every token sent since); a listener that joins later, or falls
//! further behind, reads them from the log.

use crate::ids::{ConversationId, MessageId, TraceId, UserId};
use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::task::{Context, Poll, Waker};

use chrono::Utc;
use futures_util::Stream;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::log::EventLog;
use crate::events::{Event, LoggedEvent, Sent};
use crate::store::NewEvent;

/// One event of a run as sent: its sequence number, and the event with its JSON, serialized
/// once for every listener (and the log). Live or replayed from the log, a run's events
/// reach every encoder as frames.
#[derive(Debug, Clone)]
pub struct Frame {
    pub seq: u64,
    pub sent: Sent,
    /// Set on `done`, after which a run sends nothing.
    last: bool,
}

impl Frame {
    /// A frame of an event as it was serialized for the run.
    fn sent(seq: u64, sent: Sent) -> Self {
        let last = matches!(sent.event(), Some(Event::Done { .. }));
        Self { seq, sent, last }
    }

    /// A frame of an event no run sent itself (a resumed run whose process died).
    pub fn new(seq: u64, event: Event) -> Self {
        let data = serde_json::to_string(&event).expect("events always serialize");
        Self::sent(seq, Sent::new(Some(event), &data))
    }

    /// A logged event as a frame again: the stored text is what was sent.
    pub fn logged(logged: LoggedEvent) -> Self {
        Self { seq: logged.seq as u64, last: logged.kind == "done", sent: logged.into() }
    }

    /// The event; `None` only for a logged event this version does not know (see
    /// [`LoggedEvent::event`]).
    pub fn event(&self) -> Option<&Event> {
        self.sent.event()
    }

    /// The event's JSON, as it was sent.
    pub fn data(&self) -> &str {
        self.sent.json()
    }

    /// `done`, after which a run sends nothing.
    pub fn is_last(&self) -> bool {
        self.last
    }
}

/// Where a run is in its life here. It moves forward only, and only through the methods of
/// [`LiveRun`] and its [`Emitter`]; whoever needs to know watches [`LiveRun::state`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting its turn behind another run of its conversation (CONTRACT.md §16).
    Queued,
    Running,
    /// Stopped here to wait for its calls (CONTRACT.md §15): in the store from now on, and
    /// its frames here end without `done`.
    Waiting,
    /// Its ending is decided and being saved (`chat::ending`).
    Ending,
    /// Its `done` is sent.
    Ended,
}

/// A run's state: its phase, whether a cancel was asked of it, and whether its log is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunState {
    pub phase: Phase,
    /// Set by the first cancel asked of this run.
    pub cancel_asked: bool,
    /// Its log is written and sealed (it then leaves the registry): the store has all of it.
    pub logged: bool,
}

impl RunState {
    /// Whether the run counts against its user's limit of runs at once: going, ending, or
    /// waiting here; not queued behind another (CONTRACT.md §16: it calls no model till its
    /// turn) and not ended.
    fn counts(&self) -> bool {
        matches!(self.phase, Phase::Running | Phase::Ending | Phase::Waiting)
    }

    /// Whether the run will send no more frames here: it ended, or waits in the store.
    pub fn settled(&self) -> bool {
        matches!(self.phase, Phase::Ended | Phase::Waiting)
    }
}

pub struct LiveRun {
    pub trace_id: TraceId,
    pub message_id: MessageId,
    pub conversation_id: ConversationId,
    pub user_id: UserId,
    pub cancel: CancellationToken,
    /// The seq its numbering here begins after: 0 for a new run; where a run goes on after
    /// a wait, or in another process than the one that died running it, the seqs between
    /// its log's end and this are no event's.
    pub begins_after: u64,
    /// Stops the run where it is, without an end, for another replica to continue it from
    /// its last completed step (a drain that hands its runs over, CONTRACT.md §19).
    pub hand_over: CancellationToken,
    frames: Mutex<Frames>,
    /// How many times the listeners waiting in `frames` were taken to be woken (raised under
    /// its lock): a listener that left its waker there, and finds this unchanged since, is
    /// still waiting there, and a poll that comes before it is woken (its connection woken by
    /// a write, a timer) need not take the lock to learn that nothing was announced.
    wakes: AtomicU64,
    /// The run's state: changed with the frames' lock held where frames go with it (`done`,
    /// a park), so that a listener that reads both under that lock sees them agree; its
    /// phase moves with the registry's lock held too (see [`Self::move_phase`]).
    state: watch::Sender<RunState>,
    /// The registry it is in, which counts each user's runs by phase.
    registry: Weak<Mutex<Registry>>,
}

/// The frames a run keeps of those the log has already while a listener here has not taken
/// them: a listener a little behind (a client that reads slower for a moment) still follows
/// from memory. With no listener here, it keeps as many, for one about to join (an A/B
/// stream not read yet, a client resuming after its read of the log).
pub const KEPT: usize = 16;

/// The frames a run keeps of those the log has, whoever took them: its ending and `done`,
/// for whoever asks how it ended (a cancel, see [`LiveRun::ending`]).
const KEPT_LAST: usize = 2;

/// A run's frames and the listeners waiting for more, under one lock: a listener that finds
/// nothing new leaves its waker under the same lock, so no announcement falls in between.
#[derive(Default)]
struct Frames {
    /// The seq before the first frame of `sent`: 0, where a run that waited goes on
    /// (CONTRACT.md §15), or the last frame it let go; the frames before are in the log.
    base: u64,
    /// Frames `base + 1`, `base + 2`, …
    sent: VecDeque<Frame>,
    waiting: Vec<Waker>,
    /// Each listener here, by its number: the seq of the last frame it took.
    listeners: Vec<(u64, u64)>,
    /// The number of the next listener.
    joined: u64,
}

impl Frames {
    fn wait(&mut self, waker: &Waker) {
        if !self.waiting.iter().any(|w| w.will_wake(waker)) {
            self.waiting.push(waker.clone());
        }
    }

    /// The seq through which frames may be let go, the log having them through `logged`:
    /// those every listener here took, else those more than [`KEPT`] behind the newest; never
    /// the last [`KEPT_LAST`].
    fn releasable(&self, logged: u64) -> u64 {
        let newest = self.base + self.sent.len() as u64;
        let behind = newest.saturating_sub(KEPT as u64);
        let taken = match self.listeners.iter().map(|(_, after)| *after).min() {
            Some(slowest) => slowest.max(behind),
            None => behind,
        };
        logged.min(taken).min(newest.saturating_sub(KEPT_LAST as u64))
    }

    /// The listener `number` took the frames through `after`.
    fn took(&mut self, number: u64, after: u64) {
        if let Some(listener) = self.listeners.iter_mut().find(|(n, _)| *n == number) {
            listener.1 = after;
        }
    }
}

/// A listener's place among a run's frames: from when it is made until it is dropped, the
/// run keeps the frames it has not taken (as many as [`KEPT`] behind the newest).
struct Listening {
    run: Arc<LiveRun>,
    number: u64,
}

impl Listening {
    fn join(run: Arc<LiveRun>, after: u64) -> Self {
        let number = {
            let mut frames = run.frames.lock().expect("frames lock");
            let number = frames.joined;
            frames.joined += 1;
            frames.listeners.push((number, after));
            number
        };
        Self { run, number }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        let mut frames = self.run.frames.lock().expect("frames lock");
        frames.listeners.retain(|(n, _)| *n != self.number);
    }
}

/// The frames a listener keeps room for between takings, at most.
const TAKEN_ROOM: usize = 16;

/// A listener's frames of a run: see [`LiveRun::follow`]. The frames ready together are
/// taken under one lock and handed out one by one from here, without a trip through the
/// lock (or a generator) for each.
pub struct Follow {
    listening: Listening,
    /// The seq of the last frame taken.
    after: u64,
    /// Frames taken, not yet handed out (its room kept from one taking to the next).
    taken: VecDeque<Frame>,
    /// Set when the run had settled as the frames were last taken: they were its last.
    finished: bool,
    /// Where this listener left its waker among the run's waiting ones: the run's
    /// [`wakes`](LiveRun::wakes) then, and the waker.
    waiting: Option<(u64, Waker)>,
}

impl Stream for Follow {
    type Item = Frame;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Frame>> {
        let this = self.get_mut();
        if let Some(frame) = this.taken.pop_front() {
            return Poll::Ready(Some(frame));
        }
        if this.finished {
            return Poll::Ready(None);
        }
        // Still waiting where it left its waker, and polled by the same task: nothing was
        // announced since (the frames a run holds back for a burst are announced with it).
        let run = &this.listening.run;
        if let Some((wakes, waker)) = &this.waiting
            && *wakes == run.wakes.load(Ordering::Acquire)
            && waker.will_wake(cx.waker())
        {
            return Poll::Pending;
        }
        // A listener that caught up on many keeps room for a few, not for them all (shrunk
        // here, not under the run's lock).
        this.taken.shrink_to(TAKEN_ROOM);
        let mut frames = run.frames.lock().expect("frames lock");
        // Set under this lock with `done` (or the park): read here, it agrees with the frames.
        let finished = run.state.borrow().settled();
        // seq n is at index n - base - 1: the first frame after `after` is at index
        // `after - base`, unless the run let go of it.
        let Some(next) = this.after.checked_sub(frames.base) else {
            this.finished = true;
            return Poll::Ready(None);
        };
        let next = usize::try_from(next).unwrap_or(usize::MAX).min(frames.sent.len());
        // (`taken` is empty here: all it held was handed out.)
        this.taken.extend(frames.sent.range(next..).cloned());
        match this.taken.back().map(|frame| frame.seq) {
            Some(seq) => {
                frames.took(this.listening.number, seq);
                drop(frames);
                this.after = seq;
                this.finished = finished;
                Poll::Ready(this.taken.pop_front())
            }
            // A listener that asked for more than a finished run sent has nothing to wait for.
            None if finished => {
                this.finished = true;
                Poll::Ready(None)
            }
            None => {
                frames.wait(cx.waker());
                this.waiting = Some((run.wakes.load(Ordering::Relaxed), cx.waker().clone()));
                Poll::Pending
            }
        }
    }
}

impl LiveRun {
    /// The run's events with `seq > after` (at least [`base`](Self::base)), then the live
    /// ones, until `done`, or until the run parks to wait. The frames end early, without
    /// `done`, where the run let go of the next one this listener needs (it fell more than
    /// [`KEPT`] frames behind the log): the rest is in the log. The listener counts as here
    /// from this call on, not from the stream's first poll: the run keeps what it has not taken.
    pub fn follow(self: Arc<Self>, after: u64) -> Follow {
        Follow {
            listening: Listening::join(self, after),
            after,
            taken: VecDeque::new(),
            finished: false,
            waiting: None,
        }
    }

    /// Lets go of the frames the log has (`logged`: the seq of the newest one written) that
    /// no listener here still needs (see [`Frames::releasable`]).
    pub(super) fn let_go(&self, logged: u64) {
        let mut frames = self.frames.lock().expect("frames lock");
        let through = frames.releasable(logged);
        if through > frames.base {
            let count = usize::try_from(through - frames.base).unwrap_or(usize::MAX).min(frames.sent.len());
            frames.sent.drain(..count);
            frames.base += count as u64;
        }
    }

    /// The run's state, to watch.
    pub fn state(&self) -> watch::Receiver<RunState> {
        self.state.subscribe()
    }

    /// Waits until the run has sent `done`, or parked to wait (then it is in the store, not
    /// here).
    pub async fn finished(&self) {
        let _ = self.state.subscribe().wait_for(RunState::settled).await;
    }

    pub fn is_finished(&self) -> bool {
        self.state.borrow().phase == Phase::Ended
    }

    /// Whether the run stopped here to wait (CONTRACT.md §15).
    pub fn is_parked(&self) -> bool {
        self.state.borrow().phase == Phase::Waiting
    }

    /// Whether the run is going (not queued, waiting, ending or ended).
    pub fn is_running(&self) -> bool {
        self.state.borrow().phase == Phase::Running
    }

    /// Whether the run waits its turn behind another of its conversation (CONTRACT.md §16).
    pub fn is_queued(&self) -> bool {
        self.state.borrow().phase == Phase::Queued
    }

    /// A queued run waits its turn (`true`), or its turn came (`false`).
    pub(in crate::chat) fn set_queued(&self, queued: bool) {
        self.move_phase(|state| match (queued, state.phase) {
            (true, Phase::Running) => {
                state.phase = Phase::Queued;
                true
            }
            (false, Phase::Queued) => {
                state.phase = Phase::Running;
                true
            }
            _ => false,
        });
    }

    /// The run's ending is decided: it is being saved, then said.
    pub(in crate::chat) fn set_ending(&self) {
        self.move_phase(|state| {
            let going = matches!(state.phase, Phase::Queued | Phase::Running);
            if going {
                state.phase = Phase::Ending;
            }
            going
        });
    }

    /// Changes the run's state with `change` (true if it changed anything: its watchers are
    /// told), under the registry's lock, where a change of phase moves the run in or out of
    /// its user's count. (Lock order: a run's frames, the registry, its state.)
    fn move_phase(&self, change: impl FnOnce(&mut RunState) -> bool) {
        let registry = self.registry.upgrade();
        let mut registry = registry.as_ref().map(|registry| registry.lock().expect("runs lock"));
        let mut counted = (false, false);
        self.state.send_if_modified(|state| {
            counted.0 = state.counts();
            let changed = change(state);
            counted.1 = state.counts();
            changed
        });
        if let Some(registry) = registry.as_mut().filter(|_| counted.0 != counted.1) {
            if registry.holds(self) {
                registry.count(&self.user_id, counted.1);
            }
        }
    }

    /// The seq before the first frame the run holds here (the frames before are in the log).
    pub fn base(&self) -> u64 {
        self.frames.lock().expect("frames lock").base
    }

    /// Waits until the run's log is written and sealed: from then on the store has all of it.
    pub async fn logged(&self) {
        let _ = self.state.subscribe().wait_for(|state| state.logged).await;
    }

    /// The event that ended the run (`complete`, `cancelled` or `error`), once it has.
    pub fn ending(&self) -> Option<Sent> {
        let frames = self.frames.lock().expect("frames lock");
        let (ending, done) = (frames.sent.get(frames.sent.len().checked_sub(2)?)?, frames.sent.back()?);
        if done.is_last() { Some(ending.sent.clone()) } else { None }
    }

    /// True for the first cancel asked of this run only.
    pub fn claim_cancel(&self) -> bool {
        let mut first = false;
        self.state.send_if_modified(|state| {
            first = !std::mem::replace(&mut state.cancel_asked, true);
            first
        });
        first
    }

    /// The seq of the run's newest frame so far.
    pub fn last_seq(&self) -> u64 {
        let frames = self.frames.lock().expect("frames lock");
        frames.base + frames.sent.len() as u64
    }

    /// Whether the run has ended and a listener that saw `after` has heard all of it.
    pub fn heard_all(&self, after: u64) -> bool {
        let frames = self.frames.lock().expect("frames lock");
        self.is_finished() && frames.base + frames.sent.len() as u64 <= after
    }
}

/// The registry of runs in this process.
#[derive(Clone, Default)]
pub struct Runs {
    live: Arc<Mutex<Registry>>,
}

/// The runs, and the runs promised to requests that are still being written: counted
/// together under one lock, so that simultaneous requests cannot all pass a user's limit.
#[derive(Default)]
struct Registry {
    runs: HashMap<TraceId, Arc<LiveRun>>,
    /// Each user's runs here whose phase counts against the limit ([`RunState::counts`]),
    /// kept as they move: a start looks its user up instead of walking every run (50,000
    /// of one user took 75 % of a core in starts alone).
    counted: HashMap<UserId, usize>,
    reserved: HashMap<UserId, usize>,
    /// The runs here of each conversation that has some, kept with `runs`: a queued run's
    /// wake and a conversation's delete look theirs up instead of copying every run.
    by_conversation: HashMap<ConversationId, Vec<TraceId>>,
}

impl Registry {
    /// Whether `run` is the one registered under its trace id (a run that waited is
    /// replaced by its continuation).
    fn holds(&self, run: &LiveRun) -> bool {
        self.runs.get(&run.trace_id).is_some_and(|here| std::ptr::eq(Arc::as_ptr(here), run))
    }

    /// One more (`true`) or one fewer of `user`'s runs counted.
    fn count(&mut self, user: &UserId, more: bool) {
        if more {
            *self.counted.entry(user.clone()).or_default() += 1;
        } else if let Some(counted) = self.counted.get_mut(user) {
            *counted = counted.saturating_sub(1);
            if *counted == 0 {
                self.counted.remove(user);
            }
        }
    }
}

/// Room for a request's runs within its user's limit, held until they are registered (or
/// the request failed); dropping it gives the room back.
pub struct Reservation {
    registry: Arc<Mutex<Registry>>,
    user: UserId,
    runs: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut registry = self.registry.lock().expect("runs lock");
        if let Some(reserved) = registry.reserved.get_mut(&self.user) {
            *reserved = reserved.saturating_sub(self.runs);
            if *reserved == 0 {
                registry.reserved.remove(&self.user);
            }
        }
    }
}

impl Runs {
    /// Registers a run whose events start after seq `base` (0 for a new run) and returns it
    /// with the emitter that feeds it.
    pub fn register(
        &self,
        trace_id: TraceId,
        message_id: MessageId,
        conversation_id: ConversationId,
        user_id: &UserId,
        log: EventLog,
        base: u64,
    ) -> (Arc<LiveRun>, Emitter) {
        let run = Arc::new(LiveRun {
            trace_id,
            message_id,
            conversation_id,
            user_id: user_id.clone(),
            cancel: CancellationToken::new(),
            begins_after: base,
            hand_over: CancellationToken::new(),
            frames: Mutex::new(Frames { base, ..Frames::default() }),
            wakes: AtomicU64::new(0),
            state: watch::Sender::new(RunState { phase: Phase::Running, cancel_asked: false, logged: false }),
            registry: Arc::downgrade(&self.live),
        });
        let mut registry = self.live.lock().expect("runs lock");
        registry.count(user_id, true);
        // A run that goes on after a wait takes the place of its parked self.
        match registry.runs.insert(trace_id, run.clone()) {
            None => {
                registry.by_conversation.entry(conversation_id).or_default().push(trace_id);
                metrics::gauge!("chatd_active_runs").increment(1.0);
            }
            Some(parked) if parked.state.borrow().counts() => registry.count(&parked.user_id, false),
            Some(_) => {}
        }
        drop(registry);
        (
            run.clone(),
            Emitter { run, log, seq: base, holding: false, held: Vec::new(), text: Vec::new(), woken: Vec::new() },
        )
    }

    pub fn get(&self, trace_id: TraceId) -> Option<Arc<LiveRun>> {
        self.live.lock().expect("runs lock").runs.get(&trace_id).cloned()
    }

    /// Forgets a run once its log is written (unless its continuation after a wait took its
    /// place meanwhile); later listeners read the store, and whoever waits for the log to be
    /// written is woken.
    pub fn remove(&self, run: &Arc<LiveRun>) {
        {
            let mut registry = self.live.lock().expect("runs lock");
            if registry.holds(run) {
                registry.runs.remove(&run.trace_id);
                if let Some(here) = registry.by_conversation.get_mut(&run.conversation_id) {
                    here.retain(|id| *id != run.trace_id);
                    if here.is_empty() {
                        registry.by_conversation.remove(&run.conversation_id);
                    }
                }
                if run.state.borrow().counts() {
                    registry.count(&run.user_id, false);
                }
                metrics::gauge!("chatd_active_runs").decrement(1.0);
            }
        }
        run.state.send_modify(|state| state.logged = true);
    }

    pub fn len(&self) -> usize {
        self.live.lock().expect("runs lock").runs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reserves room for `runs` more of `user`'s runs, if the runs that have not sent
    /// `done` yet and those already reserved leave it under `limit`; else how many there are.
    pub fn reserve(&self, user: &UserId, runs: usize, limit: usize) -> Result<Reservation, usize> {
        let mut registry = self.live.lock().expect("runs lock");
        let running =
            registry.counted.get(user).copied().unwrap_or(0) + registry.reserved.get(user).copied().unwrap_or(0);
        if running + runs > limit {
            return Err(running);
        }
        *registry.reserved.entry(user.clone()).or_default() += runs;
        Ok(Reservation { registry: self.live.clone(), user: user.clone(), runs })
    }

    /// Every run in this process now.
    pub fn all(&self) -> Vec<Arc<LiveRun>> {
        self.live.lock().expect("runs lock").runs.values().cloned().collect()
    }

    /// The runs in this process now of one conversation.
    pub fn in_conversation(&self, conversation_id: ConversationId) -> Vec<Arc<LiveRun>> {
        let registry = self.live.lock().expect("runs lock");
        let Some(here) = registry.by_conversation.get(&conversation_id) else { return Vec::new() };
        here.iter().filter_map(|id| registry.runs.get(id).cloned()).collect()
    }
}

/// The only way events enter a run: numbers them, hands them to listeners and to the log.
///
/// While a turn reads what the provider has already sent, the emitter holds its events and
/// announces them together when the turn must wait for the network again: listeners then
/// wake once per burst instead of once per token, and write the burst as one frame batch.
pub struct Emitter {
    run: Arc<LiveRun>,
    log: EventLog,
    seq: u64,
    holding: bool,
    /// Events pushed to the run's frames but not yet announced to listeners nor handed to
    /// the log writer.
    held: Vec<NewEvent>,
    /// The buffer each event is serialized in.
    text: Vec<u8>,
    /// The listeners' wakers, taken from the frames to be woken outside their lock (a list
    /// kept, as the frames keep theirs: each wake-up allocated one).
    woken: Vec<Waker>,
}

/// Events held at most before they are announced anyway.
const MAX_HELD: usize = 256;

/// A NUL as serde_json writes it, looked for in every event's text with a searcher made once
/// (`str::contains` makes one for each text: a hundred instructions an event).
static ESCAPED_NUL: LazyLock<memchr::memmem::Finder<'static>> =
    LazyLock::new(|| memchr::memmem::Finder::new(b"\\u0000"));

/// Room for held events an emitter keeps between bursts (some 70 bytes an event).
const HELD_ROOM: usize = 64;

impl Emitter {
    pub fn emit(&mut self, mut event: Event) {
        self.seq += 1;
        // Serialized once: the same text goes to every listener and into the log. (Into a
        // buffer the emitter keeps: the text is copied once, into the frame.)
        let mut text = std::mem::take(&mut self.text);
        text.clear();
        event.write_json(&mut text);
        let kind = event.kind();
        let sent = match std::str::from_utf8(&text).expect("JSON is UTF-8") {
            json if ESCAPED_NUL.find(json.as_bytes()).is_some() => {
                // Postgres cannot store NUL in jsonb, and no client wants one: tool output is
                // the only text that may carry it this far.
                let mut value: serde_json::Value = serde_json::from_str(json).expect("just serialized");
                strip_nul(&mut value);
                let json = value.to_string();
                // The typed event says what the text says.
                event = serde_json::from_str(&json).expect("an event without NUL is still that event");
                Sent::new(Some(event), &json)
            }
            json => Sent::new(Some(event), json),
        };
        // A large event (a tool's output) does not keep its size for the rest of the run.
        if text.capacity() <= 64 * 1024 {
            self.text = text;
        }
        // Built before the lock: listeners wait on it only for the push.
        let frame = Frame::sent(self.seq, sent.clone());
        let last = frame.is_last();
        {
            let mut frames = self.run.frames.lock().expect("frames lock");
            frames.sent.push_back(frame);
            if last {
                self.run.move_phase(|state| {
                    state.phase = Phase::Ended;
                    true
                });
            }
        }
        // The events of a held burst are announced together: each carries the time of the
        // first (the clock read once a burst, not once a token: a calendar time made from it
        // was 1 % of a relayed event's instructions).
        let at = self.held.first().map_or_else(Utc::now, |first| first.at);
        self.held.push(NewEvent { trace_id: self.run.trace_id, seq: self.seq as i64, at, kind, data: sent });
        if !self.holding || last || self.held.len() >= MAX_HELD {
            self.publish();
        }
    }

    /// Hands a frame of an event that is already in the log (with this seq) to listeners.
    pub fn emit_logged(&mut self, event: Event) {
        self.seq += 1;
        let frame = Frame::new(self.seq, event);
        self.run.frames.lock().expect("frames lock").sent.push_back(frame);
        self.wake();
    }

    /// The run waits in the store from now on: its listeners here stop, and follow it on
    /// from the log.
    pub fn park(&mut self) {
        self.publish();
        {
            let _frames = self.run.frames.lock().expect("frames lock");
            self.run.move_phase(|state| {
                state.phase = Phase::Waiting;
                true
            });
        }
        self.wake();
    }

    fn wake(&mut self) {
        {
            let mut frames = self.run.frames.lock().expect("frames lock");
            self.woken.append(&mut frames.waiting);
            self.run.wakes.fetch_add(1, Ordering::Release);
        }
        self.woken.drain(..).for_each(Waker::wake);
    }

    /// The seq of the last event emitted.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Hands what was emitted to the log and returns once it is in the database.
    pub async fn flush(&mut self) -> Result<(), String> {
        self.publish();
        self.log.flush().await
    }

    /// Hands what was emitted to the log, and after it the run's checkpoint: both are
    /// written in one transaction (see [`EventLog::append_with`]).
    pub fn checkpoint(&mut self, checkpoint: &impl serde::Serialize) {
        if !self.held.is_empty() {
            self.wake();
        }
        let progress = crate::store::Progress::of(self.run.trace_id, checkpoint);
        self.log.append_with(&mut self.held, Some(progress));
        self.let_go_of_room();
    }

    /// Holds events from now on until [`publish`](Self::publish) (or `hold(false)`).
    pub fn hold(&mut self, on: bool) {
        self.holding = on;
        if !on {
            self.publish();
        }
    }

    /// Announces the held events to listeners and hands them to the log.
    pub fn publish(&mut self) {
        if !self.held.is_empty() {
            self.wake();
            self.log.append(&mut self.held);
            self.let_go_of_room();
        }
    }

    /// A burst past `HELD_ROOM` events (a fast model's many frames in one read) does not
    /// keep its room for the rest of the run: the room goes back to `HELD_ROOM` (the next
    /// burst grows from there, not from nothing).
    fn let_go_of_room(&mut self) {
        if self.held.capacity() > HELD_ROOM {
            self.held.shrink_to(HELD_ROOM);
        }
    }

    pub fn run(&self) -> &Arc<LiveRun> {
        &self.run
    }

    /// Once the run has sent `done`: waits until every event is in the database and the
    /// run's log is sealed.
    pub async fn seal(&mut self) -> Result<(), String> {
        self.publish();
        self.log.seal(self.run.trace_id).await
    }
}

impl Drop for Emitter {
    fn drop(&mut self) {
        self.publish();
    }
}

/// Removes NUL characters from every string in `value`.
pub fn strip_nul(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::String(s) => s.retain(|c| c != '\0'),
        serde_json::Value::Array(items) => items.iter_mut().for_each(strip_nul),
        serde_json::Value::Object(map) => map.values_mut().for_each(strip_nul),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A run registered in `runs`, its events logged every `interval` into a SQLite file
    /// in `dir`.
    async fn registered(dir: &tempfile::TempDir, runs: &Runs, interval: Duration) -> (Arc<LiveRun>, Emitter) {
        let store = crate::store::connect(&format!("sqlite://{}/runs.db", dir.path().display()), 2).await.unwrap();
        let log = EventLog::start(store, runs.clone(), interval, 1_000_000);
        let (trace_id, message_id, conversation_id) = (TraceId::new(), MessageId::new(), ConversationId::new());
        runs.register(trace_id, message_id, conversation_id, &UserId::new("ann"), log, 0)
    }

    #[tokio::test]
    async fn a_run_moves_forward_through_its_phases_and_tells_its_watchers() {
        let (dir, runs) = (tempfile::tempdir().unwrap(), Runs::default());
        let (run, mut emitter) = registered(&dir, &runs, Duration::from_millis(5)).await;
        let (trace_id, message_id, conversation_id) = (run.trace_id, run.message_id, run.conversation_id);
        let mut watched = run.state();
        assert_eq!(watched.borrow_and_update().phase, Phase::Running);
        run.set_queued(true);
        assert!(run.is_queued() && watched.has_changed().unwrap());
        run.set_queued(false);
        assert_eq!(watched.borrow_and_update().phase, Phase::Running);
        assert!(run.claim_cancel(), "the first cancel");
        assert!(!run.claim_cancel(), "not a second time");
        run.set_ending();
        run.set_queued(true);
        assert_eq!(run.state().borrow().phase, Phase::Ending, "an ending run does not go back");
        let finished = tokio::spawn({
            let run = run.clone();
            async move { run.finished().await }
        });
        emitter.emit(Event::Done { conversation_id, message_id, trace_id });
        tokio::time::timeout(Duration::from_secs(5), finished).await.expect("woken by done").unwrap();
        assert!(run.is_finished() && !run.state().borrow().logged);
        runs.remove(&run);
        tokio::time::timeout(Duration::from_secs(5), run.logged()).await.expect("woken once logged");
        assert!(runs.get(trace_id).is_none());
    }

    #[tokio::test]
    async fn a_users_runs_are_counted_as_their_phases_move() {
        let (dir, runs) = (tempfile::tempdir().unwrap(), Runs::default());
        let store = crate::store::connect(&format!("sqlite://{}/runs.db", dir.path().display()), 2).await.unwrap();
        let log = EventLog::start(store, runs.clone(), Duration::from_millis(5), 1_000_000);
        let (ann, bob) = (UserId::new("ann"), UserId::new("bob"));
        let register = |user: &UserId, trace_id: TraceId| {
            runs.register(trace_id, MessageId::new(), ConversationId::new(), user, log.clone(), 0)
        };
        // A limit of none: the refusal says how many count.
        let counted = |user: &UserId| runs.reserve(user, 1, 0).err().unwrap();
        let done = |emitter: &mut Emitter| {
            let run = emitter.run().clone();
            let (conversation_id, message_id, trace_id) = (run.conversation_id, run.message_id, run.trace_id);
            emitter.emit(Event::Done { conversation_id, message_id, trace_id });
        };

        let (a, mut a_emitter) = register(&ann, TraceId::new());
        assert_eq!(counted(&ann), 1);
        a.set_queued(true);
        assert_eq!(counted(&ann), 0, "a queued run does not count");
        a.set_queued(false);
        let (b, mut b_emitter) = register(&ann, TraceId::new());
        let (_c, _c_emitter) = register(&bob, TraceId::new());
        assert_eq!((counted(&ann), counted(&bob)), (2, 1));
        b.set_queued(true);
        b.set_ending();
        assert_eq!(counted(&ann), 2, "a queued run whose end is decided counts again");
        done(&mut a_emitter);
        assert_eq!(counted(&ann), 1, "an ended run does not count");
        runs.remove(&a);
        assert_eq!(counted(&ann), 1);
        // A run that waits counts; its continuation takes its place, once.
        b_emitter.park();
        assert_eq!(counted(&ann), 1);
        let (_b_again, mut b_again_emitter) = register(&ann, b.trace_id);
        assert_eq!(counted(&ann), 1);
        runs.remove(&b);
        assert_eq!(counted(&ann), 1, "the parked run is no longer the registered one");
        done(&mut b_again_emitter);
        assert_eq!((counted(&ann), counted(&bob)), (0, 1));
        // Reserved room counts with the runs.
        let reserved = runs.reserve(&bob, 2, 3).expect("room for two beside one");
        assert_eq!(counted(&bob), 3);
        drop(reserved);
        assert_eq!(counted(&bob), 1);
    }

    #[tokio::test]
    async fn a_conversations_runs_are_found_by_it_as_they_come_and_go() {
        let (dir, runs) = (tempfile::tempdir().unwrap(), Runs::default());
        let store = crate::store::connect(&format!("sqlite://{}/runs.db", dir.path().display()), 2).await.unwrap();
        let log = EventLog::start(store, runs.clone(), Duration::from_millis(5), 1_000_000);
        let (one, two) = (ConversationId::new(), ConversationId::new());
        let register = |conversation_id: ConversationId, trace_id: TraceId| {
            runs.register(trace_id, MessageId::new(), conversation_id, &UserId::new("ann"), log.clone(), 0)
        };
        let sorted = |mut ids: Vec<TraceId>| {
            ids.sort();
            ids
        };
        let found = |conversation_id: ConversationId| {
            sorted(runs.in_conversation(conversation_id).iter().map(|r| r.trace_id).collect())
        };
        let (a, mut a_emitter) = register(one, TraceId::new());
        let (b, _b_emitter) = register(one, TraceId::new());
        let (c, _c_emitter) = register(two, TraceId::new());
        assert_eq!(found(one), sorted(vec![a.trace_id, b.trace_id]));
        assert_eq!(found(two), vec![c.trace_id]);
        assert!(found(ConversationId::new()).is_empty());
        // A continuation after a wait takes its parked self's place, once; the parked one
        // leaving after it takes nothing away.
        a_emitter.park();
        let (a_again, _a_again_emitter) = register(one, a.trace_id);
        assert_eq!(found(one), sorted(vec![a.trace_id, b.trace_id]));
        runs.remove(&a);
        assert_eq!(found(one), sorted(vec![a.trace_id, b.trace_id]));
        assert!(runs.in_conversation(one).iter().any(|r| Arc::ptr_eq(r, &a_again)), "the continuation is found");
        runs.remove(&a_again);
        runs.remove(&b);
        assert!(found(one).is_empty());
        assert_eq!(found(two), vec![c.trace_id]);
        runs.remove(&c);
        assert!(runs.live.lock().unwrap().by_conversation.is_empty(), "nothing kept of conversations without runs");
    }

    /// Events held in one burst are announced together, and carry the time of its first; the
    /// next burst has its own.
    #[tokio::test]
    async fn a_bursts_events_carry_the_time_it_began_and_the_next_burst_its_own() {
        let (dir, runs) = (tempfile::tempdir().unwrap(), Runs::default());
        let (_run, mut emitter) = registered(&dir, &runs, Duration::from_secs(3600)).await;
        let text = |t: &str| Event::TextDelta { text: t.into() };
        emitter.hold(true);
        emitter.emit(text("one"));
        tokio::time::sleep(Duration::from_millis(3)).await;
        emitter.emit(text("two"));
        let first: Vec<_> = emitter.held.iter().map(|e| (e.seq, e.at)).collect();
        assert_eq!((first[0].0, first[1].0), (1, 2));
        assert_eq!(first[0].1, first[1].1, "one burst, one time");
        emitter.publish();
        tokio::time::sleep(Duration::from_millis(3)).await;
        emitter.emit(text("three"));
        let next = &emitter.held[0];
        assert_eq!(next.seq, 3);
        assert!(next.at - first[0].1 >= chrono::TimeDelta::milliseconds(3), "{} {}", next.at, first[0].1);
    }

    #[tokio::test]
    async fn a_bursts_room_goes_back_to_the_kept_room_once_it_is_announced() {
        let (dir, runs) = (tempfile::tempdir().unwrap(), Runs::default());
        let (_run, mut emitter) = registered(&dir, &runs, Duration::from_secs(3600)).await;
        emitter.hold(true);
        for _ in 0..200 {
            emitter.emit(Event::TextDelta { text: "t".into() });
        }
        assert!(emitter.held.capacity() >= 200);
        emitter.publish();
        assert!(emitter.held.is_empty());
        assert_eq!(emitter.held.capacity(), HELD_ROOM, "a burst keeps the kept room, not its own");
    }

    /// A NUL reaches the emitter only in a tool's output (the model's text is cleaned before):
    /// neither the listeners' frame nor the typed event keeps it (Postgres cannot store it).
    #[tokio::test]
    async fn a_nul_in_an_events_text_is_left_out_of_its_frame_and_its_event() {
        use futures_util::StreamExt;
        let (dir, runs) = (tempfile::tempdir().unwrap(), Runs::default());
        let (run, mut emitter) = registered(&dir, &runs, Duration::from_secs(3600)).await;
        emitter.emit(Event::TextDelta { text: "before\0after".into() });
        emitter.emit(Event::TextDelta { text: "a backslash and u0000: \\u0000".into() });
        let frames: Vec<Frame> = run.clone().follow(0).take(2).collect().await;
        assert_eq!(frames[0].data(), r#"{"type":"text_delta","text":"beforeafter"}"#);
        assert!(matches!(frames[0].event(), Some(Event::TextDelta { text }) if text == "beforeafter"));
        assert_eq!(
            frames[1].data(),
            r#"{"type":"text_delta","text":"a backslash and u0000: \\u0000"}"#,
            "a backslash before u0000 stays"
        );
    }

    #[tokio::test]
    async fn a_run_lets_go_of_what_its_log_holds_but_its_newest_frames() {
        use futures_util::StreamExt;
        // A writer that writes only when asked: the test says what the log holds.
        let (dir, runs) = (tempfile::tempdir().unwrap(), Runs::default());
        let (run, mut emitter) = registered(&dir, &runs, Duration::from_secs(3600)).await;
        let (trace_id, message_id, conversation_id) = (run.trace_id, run.message_id, run.conversation_id);
        let text = |n: u64| Event::TextDelta { text: format!("word {n} ").into() };
        for n in 1..=100 {
            emitter.emit(text(n));
        }
        // Nothing is let go before the log has it.
        run.let_go(0);
        assert_eq!((run.base(), run.last_seq()), (0, 100));
        // The log has 1–90: the run keeps the newest KEPT of them, and what it has not logged.
        run.let_go(90);
        assert_eq!((run.base(), run.last_seq()), (100 - KEPT as u64, 100));
        // A listener that needs a frame let go ends at once, without `done`: the rest is in
        // the log (the follower reads it there).
        let behind: Vec<Frame> = run.clone().follow(10).collect().await;
        assert!(behind.is_empty(), "{behind:?}");
        // One within the kept frames gets every frame after its own, then the live ones.
        let mut within = Box::pin(run.clone().follow(95));
        let seqs: Vec<u64> = (&mut within).take(5).map(|f| f.seq).collect().await;
        assert_eq!(seqs, [96, 97, 98, 99, 100]);
        emitter.emit(text(101));
        assert_eq!(within.next().await.map(|f| f.seq), Some(101));
        // The log has all of them, and the one listener took them: the last two stay.
        emitter.flush().await.unwrap();
        assert_eq!((run.base(), run.last_seq()), (99, 101));
        emitter.emit(Event::Done { conversation_id, message_id, trace_id });
        assert_eq!(within.next().await.map(|f| (f.seq, f.is_last())), Some((102, true)));
        drop(within);
        emitter.flush().await.unwrap();
        assert!(
            run.ending().is_some_and(|e| matches!(e.event(), Some(Event::TextDelta { .. }))),
            "the last two frames stay"
        );
    }

    #[tokio::test]
    async fn a_listener_takes_what_is_ready_at_once_and_keeps_room_for_a_few_after() {
        use futures_util::StreamExt;
        let (dir, runs) = (tempfile::tempdir().unwrap(), Runs::default());
        let (run, mut emitter) = registered(&dir, &runs, Duration::from_secs(3600)).await;
        let text = |n: u64| Event::TextDelta { text: format!("word {n} ").into() };
        let mut listener = run.clone().follow(0);
        (1..=100).for_each(|n| emitter.emit(text(n)));
        assert_eq!(listener.next().await.map(|f| f.seq), Some(1));
        assert_eq!(listener.taken.len(), 99, "the frames ready then, taken under one lock");
        assert_eq!(run.frames.lock().unwrap().listeners[0].1, 100, "the run knows they are taken");
        let rest: Vec<u64> = (&mut listener).take(99).map(|f| f.seq).collect().await;
        assert_eq!(rest, (2..=100).collect::<Vec<_>>());
        emitter.emit(text(101));
        assert_eq!(listener.next().await.map(|f| f.seq), Some(101));
        assert!(listener.taken.capacity() <= TAKEN_ROOM, "room for {} kept", listener.taken.capacity());
    }

    /// A waker that counts its wakes.
    struct Counted(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn a_listener_polled_before_it_is_woken_waits_where_it_left_its_waker() {
        let (dir, runs) = (tempfile::tempdir().unwrap(), Runs::default());
        let (run, mut emitter) = registered(&dir, &runs, Duration::from_secs(3600)).await;
        let text = |n: u64| Event::TextDelta { text: format!("word {n} ").into() };
        let mut listener = run.clone().follow(0);
        let counted = Arc::new(Counted(Default::default()));
        let waker = Waker::from(counted.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut listener).poll_next(&mut cx).is_pending(), "nothing yet: it leaves its waker");
        // A burst held back: its frames are in, not announced yet.
        emitter.hold(true);
        emitter.emit(text(1));
        emitter.emit(text(2));
        // Polled again by its task before it is woken (its connection woken by a write, a
        // timer): nothing was announced, and it waits without looking.
        assert!(Pin::new(&mut listener).poll_next(&mut cx).is_pending(), "the burst is not announced yet");
        assert_eq!(counted.0.load(Ordering::SeqCst), 0);
        emitter.hold(false);
        assert_eq!(counted.0.load(Ordering::SeqCst), 1, "woken by the announcement");
        let took: Vec<u64> = std::iter::from_fn(|| match Pin::new(&mut listener).poll_next(&mut cx) {
            Poll::Ready(frame) => frame.map(|f| f.seq),
            Poll::Pending => None,
        })
        .collect();
        assert_eq!(took, [1, 2]);
        // Another task's poll looks: its waker is not the one left there.
        emitter.hold(true);
        emitter.emit(text(3));
        let other = std::task::Waker::noop();
        let frame = Pin::new(&mut listener).poll_next(&mut Context::from_waker(other));
        assert!(matches!(frame, Poll::Ready(Some(ref f)) if f.seq == 3), "another task takes what is there");
        // Its own task again, waiting where it left its waker before: the wakes since tell it
        // to look, and it leaves its waker anew; a park wakes it, and it ends.
        emitter.hold(false);
        let woken = counted.0.load(Ordering::SeqCst);
        assert!(Pin::new(&mut listener).poll_next(&mut cx).is_pending());
        emitter.park();
        assert_eq!(counted.0.load(Ordering::SeqCst), woken + 1, "woken by the park");
        assert!(matches!(Pin::new(&mut listener).poll_next(&mut cx), Poll::Ready(None)));
    }

    #[tokio::test]
    async fn a_run_keeps_what_a_listener_here_has_not_taken() {
        use futures_util::StreamExt;
        let (dir, runs) = (tempfile::tempdir().unwrap(), Runs::default());
        let (run, mut emitter) = registered(&dir, &runs, Duration::from_secs(3600)).await;
        let text = |n: u64| Event::TextDelta { text: format!("word {n} ").into() };
        let emit =
            |emitter: &mut Emitter, seqs: std::ops::RangeInclusive<u64>| seqs.for_each(|n| emitter.emit(text(n)));
        // A listener that follows at the head: what it took and the log holds is let go, but
        // the last two frames.
        let mut head = Box::pin(run.clone().follow(0));
        emit(&mut emitter, 1..=10);
        let took: Vec<u64> = (&mut head).take(10).map(|f| f.seq).collect().await;
        assert_eq!(took, (1..=10).collect::<Vec<_>>());
        run.let_go(10);
        assert_eq!((run.base(), run.last_seq()), (8, 10));
        // One that joined and has not read yet (a response not yet polled) holds its frames,
        // as long as they are within KEPT of the newest.
        let mut idle = Box::pin(run.clone().follow(8));
        emit(&mut emitter, 11..=20);
        assert_eq!((&mut head).take(10).count().await, 10);
        run.let_go(20);
        assert_eq!(run.base(), 8, "the idle listener has taken nothing yet");
        let first: Vec<u64> = (&mut idle).take(3).map(|f| f.seq).collect().await;
        assert_eq!(first, [9, 10, 11]);
        run.let_go(20);
        assert_eq!(run.base(), 18, "it took all that was there at once");
        // One that stops reading falls off KEPT behind the newest: the rest is in the log.
        emit(&mut emitter, 21..=40);
        assert_eq!((&mut head).take(20).count().await, 20);
        run.let_go(40);
        assert_eq!(run.base(), 40 - KEPT as u64);
        let rest: Vec<u64> = idle.map(|f| f.seq).collect().await;
        assert_eq!(rest, (12..=20).collect::<Vec<_>>(), "what it took, then it ends, without done");
        // A listener that left holds nothing; with none here, the run keeps KEPT of what the
        // log has (for the one about to join).
        drop(head);
        emit(&mut emitter, 41..=50);
        run.let_go(50);
        assert_eq!(run.base(), 50 - KEPT as u64);
        let mut late = Box::pin(run.clone().follow(50 - KEPT as u64));
        assert_eq!(late.next().await.map(|f| f.seq), Some(50 - KEPT as u64 + 1));
    }
}
