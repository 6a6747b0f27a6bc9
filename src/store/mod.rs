//! Persistence behind one [`Store`] trait of domain methods (no SQL above this module), with
//! one implementation per backend, chosen once from the `database.url` scheme: SQLite
//! (`sqlite://…`) and Postgres (`postgres://…`). Each backend has its own migrations, run at
//! start-up. Every row carries the user it belongs to; user-scoped methods answer
//! [`StoreError::NotFound`] for another user's ids.

mod chunks;
mod outbox;
mod postgres;
mod rows;
mod sql;
mod sqlite;
mod waits;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::stream::BoxStream;
use serde_json::Value;
use std::sync::Arc;

use crate::domain::{
    Comparison, ContextState, Conversation, Feedback, Message, Preference, RunError, Span, StoredFile, Trace,
    TraceStatus, Usage,
};
use crate::events::LoggedEvent;
use crate::ids::{ComparisonId, ConversationId, FileId, MessageId, TraceId, UserId};

pub use outbox::{Attempted, Claimed, Delivery, DeliveryFilter, DeliveryStatus, OutboxState, OutboxStore};
pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;
pub use waits::{Claim, RunPark, Settled, Settlement, Wait, WaitKey, WaitKind};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("not found")]
    NotFound,
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    #[error("stored data: {0}")]
    Corrupt(String),
    #[error("database url: {0}")]
    Url(String),
    /// The database cannot be written just now (its writer could not be opened again, or
    /// its file is gone).
    #[error("database unavailable: {0}")]
    Unavailable(String),
}

impl StoreError {
    /// Whether this is a fault of the database, not of the request: it cannot be reached,
    /// or cannot take writes just now (disk full, I/O error, a lost connection, a server
    /// shutting down). Those answer 503 and are worth retrying later; a constraint, a missing
    /// row or a bug are not.
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Unavailable(_) => true,
            StoreError::Database(e) => is_fault(e),
            _ => false,
        }
    }
}

fn is_fault(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            let Some(code) = db.code() else { return false };
            match code.parse::<i32>() {
                // SQLite's (extended) result codes: the primary code is the low byte.
                // BUSY, LOCKED, NOMEM, READONLY, IOERR, CORRUPT, FULL, CANTOPEN, PROTOCOL, NOTADB.
                Ok(sqlite) => matches!(sqlite & 0xff, 5 | 6 | 7 | 8 | 10 | 11 | 13 | 14 | 15 | 26),
                // Postgres SQLSTATE classes: connection exception, transaction rollback
                // (serialization), insufficient resources (disk full), operator intervention
                // (shutdown), system error (I/O); and a read-only transaction (a standby).
                Err(_) => matches!(&code[..code.len().min(2)], "08" | "40" | "53" | "57" | "58") || code == "25006",
            }
        }
        _ => false,
    }
}

/// Keyset position in the conversation list: the last row of the previous page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCursor {
    pub last_message_at: DateTime<Utc>,
    pub id: ConversationId,
}

impl PageCursor {
    /// The opaque text form handed to clients as `next_cursor`.
    pub fn encode(&self) -> String {
        format!("{}_{}", self.last_message_at.timestamp_micros(), self.id.0.simple())
    }

    pub fn parse(text: &str) -> Option<Self> {
        let (micros, id) = text.split_once('_')?;
        Some(Self {
            last_message_at: DateTime::from_timestamp_micros(micros.parse().ok()?)?,
            id: ConversationId::parse(id).ok()?,
        })
    }
}

/// The fields a PATCH may change; `None` leaves one as it is.
#[derive(Debug, Clone, Default)]
pub struct ConversationPatch {
    pub title: Option<String>,
    pub profile: Option<String>,
    pub system_prompt: Option<String>,
    pub metadata: Option<Value>,
}

/// What a start into an existing conversation saw of it before it planned where its message
/// goes, checked again under the conversation's lock where other replicas start runs too:
/// a going run that is not among `going`, or a leaf that is neither `leaf` nor the answer of
/// one of `going` (a run started, and maybe ended, since the start looked), refuses the
/// start as [`StartOutcome::Moved`], to look again.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// The conversation's runs going (running, waiting, queued): each one's trace, and the
    /// answer it will write (which becomes the leaf as it is written).
    pub going: Vec<(TraceId, MessageId)>,
    /// The conversation's active leaf.
    pub leaf: Option<MessageId>,
}

/// Everything written when a run starts, in one transaction: a conversation that did not
/// exist yet, the user's message (which becomes the active branch's leaf) and the trace.
#[derive(Debug, Clone)]
pub struct RunStart {
    pub new_conversation: Option<Conversation>,
    pub user_message: Message,
    /// False when an answer is regenerated for a message already stored.
    pub user_message_is_new: bool,
    /// One trace, or two for an A/B comparison.
    pub traces: Vec<Trace>,
    pub comparison: Option<Comparison>,
    /// The chatd process that runs it; it keeps the trace's heartbeat fresh.
    pub replica_id: String,
    /// The most runs its user may have running, counted in the start's transaction on a
    /// shared store (where other replicas start runs too); `None`: not counted there.
    pub max_running: Option<usize>,
    /// The request's `Idempotency-Key`, recorded with its first trace (CONTRACT.md §16).
    pub idempotency_key: Option<crate::domain::IdempotencyKey>,
    /// What the request asked beside its message, kept with its traces where it is not all
    /// defaults: a queued run is planned from it when its turn comes (CONTRACT.md §16), a
    /// run continued before it completed a step too (§19).
    pub asked: Option<Value>,
    /// What the start saw of its conversation when it looked, checked again under the
    /// conversation's lock on a shared store; `None`: not checked.
    pub seen: Option<Seen>,
    /// What its runs hold of the user's budgets (CONTRACT.md §18); `None`: no budget.
    pub budget: Option<BudgetHold>,
}

impl RunStart {
    /// Whether its runs start `queued`, behind the conversation's going runs (CONTRACT.md
    /// §16).
    pub fn is_queued(&self) -> bool {
        self.traces.iter().any(|t| t.status == crate::domain::TraceStatus::Queued)
    }
}

/// Where a queued run stands (CONTRACT.md §16).
#[derive(Debug, Clone)]
pub enum QueueTurn {
    /// It was queued and is claimed for this replica now: it runs. Holds what it was
    /// queued with.
    Claimed(Option<Value>),
    /// Runs of its conversation go before it (running, waiting, or queued earlier).
    Behind(Vec<TraceId>),
    /// It is not queued (it ended, or runs already).
    Gone(TraceStatus),
}

/// What an idempotency key names: the request it came with (hashed) and the run it started.
#[derive(Debug, Clone)]
pub struct KeyedRun {
    pub request_hash: String,
    pub trace_id: TraceId,
    pub created_at: DateTime<Utc>,
}

/// A run found `running` in the store, with the last sign of life of its process.
#[derive(Debug, Clone)]
pub struct RunningTrace {
    pub trace: Trace,
    pub replica_id: Option<String>,
    pub heartbeat_at: Option<DateTime<Utc>>,
}

/// Everything written when a run ends, in one transaction.
#[derive(Debug, Clone)]
pub struct RunFinish {
    pub trace_id: TraceId,
    /// Whose run it is: a record for another user's trace is refused as ended.
    pub user_id: UserId,
    pub status: TraceStatus,
    pub ended_at: DateTime<Utc>,
    pub usage: Usage,
    /// What the run cost, where known (CONTRACT.md §18).
    pub cost_usd: Option<f64>,
    pub error: Option<RunError>,
    pub spans: Vec<Span>,
    /// The assistant's answer; none for a failed run.
    pub assistant_message: Option<Message>,
}

/// One event for the trace's log, already serialized as it was sent.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub trace_id: TraceId,
    pub seq: i64,
    pub at: DateTime<Utc>,
    pub kind: &'static str,
    /// The event's JSON text, exactly as it was sent (`Sent::json`); the log writes only that.
    pub data: crate::events::Sent,
}

/// A running run's checkpoint after a completed step, written with its events (see
/// [`LogStore::append_events`]).
#[derive(Debug, Clone)]
pub struct Progress {
    pub trace_id: TraceId,
    pub checkpoint: rows::JsonText,
}

impl Progress {
    pub fn of(trace_id: TraceId, checkpoint: &impl serde::Serialize) -> Self {
        Self { trace_id, checkpoint: rows::json(checkpoint) }
    }
}

/// How a start's write ended when the database could be written: its rows are in, or the
/// database refused it for a reason the chat service acts on. A refused start wrote nothing
/// (when several are written together, none of them: each is then tried on its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartOutcome {
    Started,
    /// The start would take its user past `max_running`: this many run already.
    OverLimit(usize),
    /// The start's idempotency key was recorded by another start meanwhile.
    KeyTaken,
    /// A run of the start's conversation began (on another replica) after the start looked:
    /// its message would not follow it. The start looks again.
    Moved,
    /// A new conversation's `external_id` is the user's already: another request made the
    /// same client chat meanwhile.
    ChatTaken,
    /// Its runs' reservations would take its user past a budget (CONTRACT.md §18): other
    /// replicas' runs spent or reserved it meanwhile.
    OverBudget,
}

/// What the processes sharing the store know of each other: whether the database answers, whether others share it and are heard, the runs going anywhere, heartbeats and notices.
#[async_trait]
pub trait ClusterStore: Send + Sync + 'static {
    /// Whether the database answers and takes writes (for `/readyz`). SQLite's writes are
    /// tried again here while they were failing.
    async fn ping(&self) -> Result<(), StoreError>;
    /// Whether several chatd processes may share this store (Postgres), so that a running
    /// trace may belong to another live process.
    fn is_shared(&self) -> bool;
    /// Whether this process hears the other replicas' notices now (for `/readyz`): false
    /// while the listener's connection is lost and not yet made anew. Always true where
    /// there are no others.
    fn hears_others(&self) -> bool;
    /// Every run still marked running, of any user and any process.
    async fn running_traces(&self) -> Result<Vec<RunningTrace>, StoreError>;
    /// The runs still marked running whose replica has not beaten since `quiet_since`
    /// (those of `replica_id` aside): left by a process that is gone.
    async fn left_running(&self, quiet_since: DateTime<Utc>, replica_id: &str)
    -> Result<Vec<RunningTrace>, StoreError>;
    /// Every queued run, of any user and any process.
    async fn queued_traces(&self) -> Result<Vec<RunningTrace>, StoreError>;
    /// Says this process is alive: one row per replica, whatever the number of runs it holds
    /// (running or queued); a run is held alive while its replica's row is fresh.
    async fn heartbeat(&self, replica_id: &str, at: DateTime<Utc>) -> Result<(), StoreError>;
    /// Of `traces` (running here), those another replica holds now: it took them over while
    /// this one seemed gone (its beats did not reach the database for
    /// `runs.takeover_after_secs`).
    async fn held_elsewhere(&self, traces: &[TraceId], replica_id: &str) -> Result<Vec<TraceId>, StoreError>;
    /// Whether a replica other than `replica_id` has beaten since `quiet_since`.
    async fn others_alive(&self, replica_id: &str, quiet_since: DateTime<Utc>) -> Result<bool, StoreError>;
    /// Leaves the running runs of `replica_id` to whichever replica takes them over first
    /// (at once: they are held by nobody, since long ago); how many.
    async fn release_running(&self, replica_id: &str) -> Result<u64, StoreError>;
    /// Deletes the rows of replicas quiet since `quiet_since` (long gone).
    async fn forget_replicas(&self, quiet_since: DateTime<Utc>) -> Result<(), StoreError>;
    /// Takes a running run over for `replica_id` if `from` still holds it (its process is
    /// gone; `None`: no replica): the run's checkpoint, `None` if another took it first or it
    /// is no longer running. Its log is this process's to seal from now on.
    async fn take_over(
        &self,
        trace_id: TraceId,
        from: Option<&str>,
        replica_id: &str,
    ) -> Result<Option<Option<serde_json::Value>>, StoreError>;
    /// Tells every chatd process on this database (Postgres NOTIFY, one notification for
    /// each notice, in order, in one statement; a no-op on SQLite, where there is only one
    /// process). Appending a run's events tells [`Notice::Logged`] itself.
    async fn notify(&self, notices: &[Notice]) -> Result<(), StoreError>;
    /// What processes tell each other, as it comes (`None` where there are no other
    /// processes).
    async fn notices(&self) -> Result<Option<BoxStream<'static, Notice>>, StoreError>;
}

/// Conversations and their messages, branches, comparisons and context state.
#[async_trait]
pub trait ConversationStore: Send + Sync + 'static {
    async fn create_conversation(&self, conversation: &Conversation) -> Result<(), StoreError>;
    /// The user's conversations, newest `last_message_at` first, after `cursor`.
    async fn list_conversations(
        &self,
        user: &UserId,
        limit: u32,
        cursor: Option<PageCursor>,
    ) -> Result<Vec<Conversation>, StoreError>;
    async fn get_conversation(&self, user: &UserId, id: ConversationId) -> Result<Conversation, StoreError>;
    /// The user's conversation that a client library named `external_id` (CONTRACT.md §13).
    async fn conversation_by_external_id(&self, user: &UserId, external_id: &str) -> Result<Conversation, StoreError>;
    async fn update_conversation(
        &self,
        user: &UserId,
        id: ConversationId,
        patch: &ConversationPatch,
    ) -> Result<Conversation, StoreError>;
    /// Deletes the conversation with its messages, traces, comparisons and context state,
    /// and the files its messages carried that no other message carries (CONTRACT.md §14).
    /// Returns the sha256 of each file deleted, whose bytes may now be unused.
    async fn delete_conversation(&self, user: &UserId, id: ConversationId) -> Result<Vec<String>, StoreError>;
    /// All messages of a conversation, every branch, oldest first.
    async fn messages(&self, user: &UserId, conversation_id: ConversationId) -> Result<Vec<Message>, StoreError>;
    async fn set_feedback(
        &self,
        user: &UserId,
        message_id: MessageId,
        feedback: Option<Feedback>,
    ) -> Result<Message, StoreError>;
    async fn get_message(&self, user: &UserId, id: MessageId) -> Result<Message, StoreError>;
    /// Deletes the user's answer `id` (a cancelled run's, rolled back: CONTRACT.md §16);
    /// where it was the active branch's end, its question is.
    async fn delete_answer(&self, user: &UserId, id: MessageId) -> Result<(), StoreError>;
    /// Adds `messages` to the end of the conversation's active branch, each after the one
    /// before (their `parent_id`s are set here, the first's to the branch's end then); the
    /// last becomes its end. Returns them as stored.
    async fn append_messages(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        messages: Vec<Message>,
    ) -> Result<Vec<Message>, StoreError>;
    /// Deletes the user's message `id`, one that no message follows (else `Conflict`); where
    /// it was the active branch's end, the message before it is.
    async fn delete_last_message(&self, user: &UserId, id: MessageId) -> Result<(), StoreError>;
    /// Makes `leaf` the end of the conversation's active branch.
    async fn set_active_leaf(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        leaf: MessageId,
    ) -> Result<(), StoreError>;
    async fn get_comparison(&self, user: &UserId, id: ComparisonId) -> Result<Comparison, StoreError>;
    /// Records a vote. Without `change`, a different vote than the one recorded is a
    /// conflict (the same one again is fine); with it, the vote is replaced and the
    /// history keeps the earlier ones. The preferred answer becomes the active branch.
    async fn vote(
        &self,
        user: &UserId,
        id: ComparisonId,
        preference: Preference,
        change: bool,
    ) -> Result<Comparison, StoreError>;
    /// Every comparison with a vote, oldest vote first, of all users (for the leaderboard).
    async fn voted_comparisons(&self) -> Result<Vec<Comparison>, StoreError>;
    /// The conversation's stored context state, if any.
    async fn context_state(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
    ) -> Result<Option<ContextState>, StoreError>;
    /// Stores (`Some`) or clears (`None`) the conversation's context state.
    async fn set_context_state(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        state: Option<&ContextState>,
    ) -> Result<(), StoreError>;
}

/// Attachments' rows, and the lock on their bytes (CONTRACT.md §14).
#[async_trait]
pub trait FileStore: Send + Sync + 'static {
    /// Takes the lock on the bytes with this sha256, held until
    /// [`release`](BytesLock::release): whoever adds a file with these bytes and whoever
    /// deletes them once unused take turns, in this process and across replicas.
    async fn lock_bytes(&self, sha256: &str) -> Result<Box<dyn BytesLock + '_>, StoreError>;
    async fn get_file(&self, user: &UserId, id: FileId) -> Result<StoredFile, StoreError>;
    /// Deletes the user's file. Messages that carried it keep what they showed of it.
    async fn delete_file(&self, user: &UserId, id: FileId) -> Result<StoredFile, StoreError>;
}

/// Runs starting and ending, their traces, and the idempotency keys that started them.
#[async_trait]
pub trait RunStore: Send + Sync + 'static {
    /// The run the user's idempotency key started, if it started one.
    async fn keyed_run(&self, user: &UserId, key: &str) -> Result<Option<KeyedRun>, StoreError>;
    /// Forgets the user's key if it still names `trace_id` (it expired, or its run is gone):
    /// a key another request took meanwhile stays.
    async fn forget_key(&self, user: &UserId, key: &str, trace_id: TraceId) -> Result<(), StoreError>;
    /// The user's runs of a conversation started at or after `since`, whatever their state,
    /// oldest first.
    async fn runs_started_since(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        since: DateTime<Utc>,
    ) -> Result<Vec<Trace>, StoreError>;
    /// Forgets every key recorded before `before`.
    async fn forget_keys_before(&self, before: DateTime<Utc>) -> Result<(), StoreError>;
    async fn start_run(&self, start: &RunStart) -> Result<StartOutcome, StoreError> {
        self.start_runs(&[start]).await
    }
    /// Writes several starts in one transaction: all of them, or none.
    async fn start_runs(&self, starts: &[&RunStart]) -> Result<StartOutcome, StoreError>;
    async fn finish_run(&self, finish: &RunFinish) -> Result<(), StoreError>;
    async fn get_trace(&self, user: &UserId, trace_id: TraceId) -> Result<Trace, StoreError>;
    /// The trace whose run produced (or is producing) `message_id`.
    async fn trace_by_message(&self, user: &UserId, message_id: MessageId) -> Result<Trace, StoreError>;
    /// The user's runs still going in a conversation (running, waiting or queued), oldest
    /// first.
    async fn running_in_conversation(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
    ) -> Result<Vec<Trace>, StoreError>;
}

/// Runs that wait: parked for decisions and client tools (CONTRACT.md §15), or queued for their turn (CONTRACT.md §16), and the claims that continue them.
#[async_trait]
pub trait WaitStore: Send + Sync + 'static {
    /// Parks a running run to wait (CONTRACT.md §15); [`StoreError::Conflict`] if it is not
    /// running.
    async fn park_run(&self, park: &RunPark) -> Result<(), StoreError>;
    /// Settles a waiting call, for `user` (or, with `None`, the expiry sweep). Not found:
    /// no such call of this user's, or of another kind. Conflict: settled already, expired,
    /// or its run ended. The last open call of a run claims the run for `replica_id`.
    async fn settle_wait(
        &self,
        key: WaitKey<'_>,
        user: Option<&UserId>,
        settlement: &Settlement,
        replica_id: &str,
    ) -> Result<Settled, StoreError>;
    /// Claims a waiting run whatever its calls wait for (to cancel it); `None` if it is not
    /// waiting.
    async fn claim_waiting(&self, trace_id: TraceId, replica_id: &str) -> Result<Option<Claim>, StoreError>;
    /// Undecided approvals whose time is up, at most `limit`.
    async fn expired_waits(&self, at: DateTime<Utc>, limit: i64) -> Result<Vec<uuid::Uuid>, StoreError>;
    /// Claims the queued run `trace_id` for `replica_id` if its turn has come: no run of its
    /// conversation is running or waiting, and none was queued before it (the other side of
    /// its comparison aside).
    async fn claim_queued(&self, trace_id: TraceId, replica_id: &str) -> Result<QueueTurn, StoreError>;
    /// Takes a queued run over for `replica_id` if `from` still holds it (its process
    /// stopped); false if another took it first, or it is no longer queued.
    async fn adopt_queued(&self, trace_id: TraceId, from: Option<&str>, replica_id: &str) -> Result<bool, StoreError>;
}

/// Runs' event logs: appended in batches, read back, sealed.
#[async_trait]
pub trait LogStore: Send + Sync + 'static {
    /// Appends a batch of log events (one statement per batch, never one per event), and
    /// the runs' checkpoints of completed steps in the same transactions as their events
    /// (CONTRACT.md §19): a run's log and its checkpoint never disagree.
    async fn append_events(&self, events: &[NewEvent], progress: &[Progress]) -> Result<(), StoreError>;
    /// The run's logged events with `seq > after`, in order.
    async fn trace_events(&self, trace_id: TraceId, after: i64) -> Result<Vec<LoggedEvent>, StoreError>;
    /// Closes the logs of runs that have ended, once their last events are appended. Where
    /// a run's chunks are found by an index (Postgres) there is nothing to write; SQLite's
    /// chunks have none, and a sealed run's row lists its chunks.
    async fn seal_logs(&self, traces: &[TraceId]) -> Result<(), StoreError>;
}

pub use crate::domain::budget::{Budgets, Spend};

/// What runs spent (CONTRACT.md §18), summed by the database from `run_usage`.
#[async_trait]
pub trait UsageStore: Send + Sync + 'static {
    /// The runs started in `[from, to)` by `user` (every user's where `None`), summed per
    /// group, in the order of their keys.
    async fn usage_sums(
        &self,
        user: Option<&UserId>,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        group_by: UsageGrouping,
    ) -> Result<Vec<UsageGroup>, StoreError>;
    /// `user`'s spend since the day's and the month's starts, reservations apart.
    async fn spend(&self, user: &UserId, budgets: &Budgets) -> Result<Spend, StoreError>;
    /// Writes what a going run has spent so far (its reservation stays for its next call).
    async fn record_progress(&self, trace_id: TraceId, usage: &Usage, cost_usd: Option<f64>) -> Result<(), StoreError>;
}

/// What a start holds of its user's budgets: each of its runs reserves what its next model
/// call may spend, until it ends. Where other replicas start runs too, the start checks the
/// budgets again in its transaction, under a lock per user.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetHold {
    pub budgets: Budgets,
    /// Per run.
    pub reserve_tokens: u64,
    pub reserve_usd: f64,
}

/// How `/api/usage` groups runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageGrouping {
    /// By the UTC day a run started, `YYYY-MM-DD`.
    Day,
    Model,
    Profile,
    User,
}

/// One group's sums.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct UsageGroup {
    pub key: String,
    pub runs: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
    /// The cost of the group's runs whose cost is known; absent where none is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
}

/// The whole store: each concern's methods (CONTRACT.md's data, as the chat service uses it).
pub trait Store:
    ClusterStore + ConversationStore + FileStore + RunStore + WaitStore + LogStore + UsageStore + OutboxStore
{
}

impl<T> Store for T where
    T: ClusterStore + ConversationStore + FileStore + RunStore + WaitStore + LogStore + UsageStore + OutboxStore
{
}

/// The lock on one file's bytes (see [`Store::lock_bytes`]): files are kept once per
/// content, so a new file's row and the deletion of bytes no row names any more must not
/// interleave, or one user's deletion takes the bytes another's upload just counted on.
#[async_trait]
pub trait BytesLock: Send {
    /// Writes a file's row; its bytes are in the file storage already.
    async fn insert_file(&mut self, file: &StoredFile) -> Result<(), StoreError>;
    /// Whether any file, of any user, has these bytes.
    async fn used(&mut self) -> Result<bool, StoreError>;
    /// Lets the next one in. A lock dropped without this is let go too, later.
    async fn release(self: Box<Self>);
}

/// What one chatd process tells the others about a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// Cancel this run, whoever runs it.
    Cancel(TraceId),
    /// The run's log grew, or the run ended: whoever follows it reads again.
    Logged(TraceId),
    /// A run of this conversation started: whoever follows the conversation follows it.
    Started(ConversationId, TraceId),
    /// The conversation was deleted: whoever follows it stops.
    Deleted(ConversationId),
    /// Notices may have been missed (the listener lost its connection, and is listening
    /// again): whoever waits on one reads what it follows from the database again.
    Missed,
}

/// Opens the store the URL names and runs its migrations.
pub async fn connect(url: &str, max_connections: u32) -> Result<Arc<dyn Store>, StoreError> {
    if url.starts_with("sqlite:") {
        Ok(Arc::new(SqliteStore::connect(url, max_connections).await?))
    } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        Ok(Arc::new(PostgresStore::connect(url, max_connections).await?))
    } else {
        Err(StoreError::Url("database.url must start with sqlite:// or postgres://".to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_round_trips_and_refuses_garbage() {
        let cursor = PageCursor { last_message_at: crate::domain::now(), id: ConversationId::new() };
        assert_eq!(PageCursor::parse(&cursor.encode()), Some(cursor));
        for bad in ["", "abc", "12_notauuid", "x_0192f0c1-7d7e-7cc5-8a5b-6c6f2d3b7a10"] {
            assert_eq!(PageCursor::parse(bad), None, "{bad}");
        }
    }
}
