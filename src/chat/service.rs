//! The chat service: what the http layer and the server's start-up call. It holds the rooms,
//! each built once from the [`Shared`] parts, and hands each call to the room whose job it is:
//! starting runs ([`Starter`]), following them ([`Follower`]), stopping them
//! ([`Canceller`]), settling their waits ([`Waits`]) and taking up queued ones ([`Queue`]).

use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use tokio_util::sync::CancellationToken;

use super::control::cancel::{CancelTarget, Cancelled, Canceller};
use super::control::queue::Queue;
use super::control::takeover::Takeover;
use super::control::waits::{Answered, WaitAnswer, Waits};
use super::errors::{ChatError, ControlError};
use super::live::cluster::{self, Cluster};
use super::live::log::EventLog;
use super::live::news::RunNews;
use super::live::replay::{Follower, Resumed};
use super::live::runs::{Frame, LiveRun, Runs};
use super::request::ChatRequest;
use super::shared::Shared;
use super::start::idempotency::Started;
use super::start::starter::Starter;
use super::start::starts::StartWriter;
use crate::config::Settings;
use crate::domain::{Comparison, Conversation, Trace};
use crate::files::Files;
use crate::ids::{ConversationId, TraceId, UserId};
use crate::providers::Providers;
use crate::store::{Settled, Store, StoreError};
use crate::tools::Registry;

/// Starts, follows and stops runs. Cheap to clone (every request's state holds one): the
/// rooms are shared.
#[derive(Clone)]
pub struct ChatService {
    rooms: Arc<Rooms>,
}

/// The chat service's rooms, each built once from the shared parts.
struct Rooms {
    shared: Shared,
    starter: Arc<Starter>,
    follower: Follower,
    canceller: Canceller,
    waits: Waits,
    queue: Queue,
    takeover: Takeover,
}

impl ChatService {
    pub fn new(
        settings: Arc<Settings>,
        store: Arc<dyn Store>,
        providers: Providers,
        tools: Arc<Registry>,
        runs: Runs,
        log: EventLog,
        files: Files,
    ) -> Self {
        let http = reqwest::Client::builder()
            .http1_only()
            .timeout(Duration::from_secs_f64(settings.tools.timeout_secs.max(0.001)))
            .build()
            .expect("the TLS backend initialises");
        let news = RunNews::default();
        let shared = Shared {
            starts: StartWriter::start(store.clone()),
            cluster: cluster::for_store(store.clone(), news.clone(), settings.runs.takeover_after()),
            prices: Arc::new(crate::pricing::Prices::from_settings(&settings)),
            settings,
            store,
            providers,
            tools,
            runs,
            log,
            http,
            replica_id: uuid::Uuid::now_v7().to_string().into(),
            drain: Default::default(),
            news,
            files,
            key_turns: Default::default(),
            conversation_turns: Default::default(),
        };
        let rooms = Rooms {
            starter: Arc::new(Starter::new(&shared)),
            follower: Follower::new(&shared),
            canceller: Canceller::new(&shared),
            waits: Waits::new(&shared),
            queue: Queue::new(&shared),
            takeover: Takeover::new(&shared),
            shared,
        };
        Self { rooms: Arc::new(rooms) }
    }
}

/// Starting runs (see [`Starter`]).
impl ChatService {
    /// Validates and persists the request, then starts its run, once per `Idempotency-Key`
    /// (CONTRACT.md §16): a request whose key started a run already gets that run's trace, to
    /// follow from its first event.
    pub async fn start_once(&self, user: &UserId, request: ChatRequest) -> Result<Started<Arc<LiveRun>>, ChatError> {
        self.rooms.starter.start_once(user, request).await
    }

    /// One message answered by two profiles side by side (CONTRACT.md §10), once per
    /// `Idempotency-Key`: a repeat gets the comparison's first trace.
    pub async fn start_comparison_once(
        &self,
        user: &UserId,
        request: &ChatRequest,
        profile_a: &str,
        profile_b: &str,
    ) -> Result<Started<(Comparison, Arc<LiveRun>, Arc<LiveRun>)>, ChatError> {
        self.rooms.starter.start_comparison_once(user, request, profile_a, profile_b).await
    }

    /// Starts the run a client library's turn asks for (CONTRACT.md §13), once per
    /// `Idempotency-Key`.
    pub async fn start_for_client(
        &self,
        user: &UserId,
        turn: super::start::clients::ClientTurn,
        key: Option<super::start::idempotency::IdempotencyKey>,
    ) -> Result<Started<Arc<LiveRun>>, ChatError> {
        self.rooms.starter.start_for_client(user, turn, key).await
    }

    /// The conversation a client library's chat id names, if it is one.
    pub async fn find_chat(&self, user: &UserId, chat_id: &str) -> Result<Option<Conversation>, StoreError> {
        self.rooms.starter.find_chat(user, chat_id).await
    }

    /// The run going in the conversation a client library's chat id names.
    pub async fn running_in_chat(&self, user: &UserId, chat_id: &str) -> Result<Option<TraceId>, StoreError> {
        self.rooms.starter.running_in_chat(user, chat_id).await
    }
}

/// Following runs (see [`Follower`]).
impl ChatService {
    /// A run to follow after `after`, live or from its log (`Last-Event-ID`).
    pub async fn resume(
        &self,
        user: &UserId,
        trace_id: TraceId,
        after: u64,
        through_waits: bool,
    ) -> Result<Resumed, ControlError> {
        self.rooms.follower.resume(user, trace_id, after, through_waits).await
    }

    /// A run just started, from its first event; `cancel_on_drop`: a client that leaves
    /// cancels it.
    pub fn follow_from_the_start(
        &self,
        run: Arc<LiveRun>,
        cancel_on_drop: bool,
        through_waits: bool,
    ) -> impl Stream<Item = Frame> + Send + 'static {
        self.rooms.follower.follow_from_the_start(run, cancel_on_drop, through_waits)
    }

    /// A run after `after`, live or from its log.
    pub fn follow(&self, trace: Trace, after: u64, through_waits: bool) -> impl Stream<Item = Frame> + Send + 'static {
        self.rooms.follower.follow(trace, after, through_waits)
    }

    /// Every run of a conversation as it happens (CONTRACT.md §16).
    pub fn follow_conversation(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
    ) -> impl Stream<Item = (TraceId, Frame)> + Send + 'static {
        self.rooms.follower.follow_conversation(user, conversation_id)
    }

    /// A conversation's going runs, each with its last seq.
    pub async fn active_runs(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
    ) -> Result<Vec<(Trace, u64)>, StoreError> {
        self.rooms.follower.active_runs(user, conversation_id).await
    }

    /// Waits until a run of this process has its log written whole.
    pub async fn logged(&self, trace_id: TraceId) {
        self.rooms.follower.logged(trace_id).await
    }

    /// A run's trace and log, whole where it ended moments ago, on any replica.
    pub async fn whole_log(&self, trace: Trace) -> Result<(Trace, Vec<crate::events::LoggedEvent>), StoreError> {
        self.rooms.follower.whole_log(trace).await
    }

    /// The active branch of a conversation, across the answers of its going runs.
    pub async fn active_branch(
        &self,
        user: &UserId,
        conversation: &Conversation,
        history: &[crate::domain::Message],
    ) -> Result<Vec<crate::domain::Message>, StoreError> {
        super::control::queue::active_branch(&*self.rooms.shared.store, user, conversation, history).await
    }
}

/// Controlling runs (see [`Canceller`], [`Waits`], [`Queue`]).
impl ChatService {
    /// Cancels what `target` names, wherever it runs, and waits (bounded) to learn how it
    /// ended.
    pub async fn cancel(&self, user: &UserId, target: CancelTarget) -> Result<Cancelled, ControlError> {
        self.rooms.canceller.cancel(user, target).await
    }

    /// Stops a conversation's runs before it is deleted.
    pub async fn stop_runs_in(&self, user: &UserId, conversation_id: ConversationId) {
        self.rooms.canceller.stop_runs_in(user, conversation_id).await
    }

    /// Tells whoever follows a conversation, here and on the other replicas, that it was
    /// deleted: their streams end.
    pub async fn conversation_deleted(&self, conversation_id: ConversationId) {
        self.rooms.canceller.conversation_deleted(conversation_id).await
    }

    /// Answers the waits of a message's run (the client libraries' decisions and results).
    pub async fn answer_waits(
        &self,
        user: &UserId,
        message_id: crate::ids::MessageId,
        answers: Vec<WaitAnswer>,
    ) -> Result<Option<Answered>, ControlError> {
        self.rooms.waits.answer_waits(user, message_id, answers).await
    }

    /// Decides an approval (CONTRACT.md §15).
    pub async fn decide(
        &self,
        user: &UserId,
        approval_id: uuid::Uuid,
        approved: bool,
        reason: Option<String>,
    ) -> Result<Settled, ControlError> {
        self.rooms.waits.decide(user, approval_id, approved, reason).await
    }

    /// Gives a client tool's result (CONTRACT.md §15).
    pub async fn tool_result(
        &self,
        user: &UserId,
        trace_id: TraceId,
        tool_call_id: &str,
        output: String,
        is_error: bool,
    ) -> Result<Settled, ControlError> {
        self.rooms.waits.tool_result(user, trace_id, tool_call_id, output, is_error).await
    }

    /// Takes up the queued runs whose process stopped; how many.
    pub async fn adopt_queued(&self) -> usize {
        self.rooms.queue.adopt_queued().await
    }

    /// Approvals expire on time whoever was running when they were asked (CONTRACT.md §15);
    /// Idempotency keys name their runs for a day (CONTRACT.md §16), older ones go hourly.
    pub fn spawn_expiry(&self, shutdown: CancellationToken) {
        super::control::waits::spawn_expiry(self.rooms.waits.clone(), shutdown.clone());
        super::start::idempotency::spawn_expiry(self.rooms.shared.store.clone(), shutdown);
    }

    /// Queued runs whose process stopped are taken up, and this process's beat.
    pub fn spawn_keeper(&self, shutdown: CancellationToken) {
        super::control::queue::spawn_keeper(self.rooms.queue.clone(), shutdown);
    }

    /// Says this process is alive, first at once: the runs it starts from now on are held
    /// alive by its beat (CONTRACT.md §19).
    pub async fn beat(&self) {
        let shared = &self.rooms.shared;
        shared.cluster.heartbeat(&shared.replica_id).await;
    }

    /// Continues (or, `runs.continue_after_restart` off, marks interrupted) the runs whose
    /// process is gone: at start-up, every one no live process holds. Returns how many.
    pub async fn recover_left_runs(&self) -> usize {
        self.rooms.takeover.recover(true).await
    }

    /// This process's heartbeat, the take-over of runs whose replica went quiet, and what
    /// the other replicas tell; until `shutdown`.
    pub fn spawn_background(&self, shutdown: CancellationToken) {
        let shared = &self.rooms.shared;
        super::control::lifecycle::spawn_background(
            self.rooms.takeover.clone(),
            shared.cluster.clone(),
            shared.runs.clone(),
            shared.news.clone(),
            shared.replica_id.clone(),
            shared.settings.runs.heartbeat(),
            shutdown,
        );
    }
}

/// The shared parts the server's start-up and health read.
impl ChatService {
    pub fn runs(&self) -> &Runs {
        &self.rooms.shared.runs
    }

    /// The event log writer (its batch count shows how often runs write).
    pub fn event_log(&self) -> &EventLog {
        &self.rooms.shared.log
    }

    /// Where this process hears what the others tell of their runs.
    pub fn news(&self) -> &RunNews {
        &self.rooms.shared.news
    }

    pub fn replica_id(&self) -> &str {
        &self.rooms.shared.replica_id
    }

    /// The processes that share the store.
    pub fn cluster(&self) -> &Arc<dyn Cluster> {
        &self.rooms.shared.cluster
    }

    /// Drains for shutdown (see [`lifecycle::drain`](super::control::lifecycle::drain)):
    /// running runs get `grace` to finish, then are handed over to another replica where one
    /// is alive (CONTRACT.md §19), else cancelled.
    pub async fn drain(&self, grace: Duration) {
        super::control::lifecycle::drain(&self.rooms.shared.runs, grace, &self.rooms.takeover).await;
    }

    /// Refuses new runs from now on (shutdown).
    pub fn start_draining(&self) {
        self.rooms.shared.drain.start();
    }

    /// Whether the server is shutting down (readiness says no meanwhile).
    pub fn is_draining(&self) -> bool {
        self.rooms.shared.drain.is_on()
    }
}
