//! The SQL both backends share. SQLite and Postgres accept the same statements here (`$n`
//! parameters, `returning`, `on conflict`), and the row types in `rows.rs` decode on both, so
//! the store's concerns are written once, as plain code generic over a [`Backend`]: what a
//! backend has of its own (connecting, migrations, its writer, its event log, notices, the
//! lock on a file's bytes) is in its file, behind that trait, and where the two differ in SQL
//! the difference is a named constant of it (`BEGIN_WRITE`, `LOCK_ROW`, `CLAIM_LOG`), a
//! branch on `SHARED` / `MANY_STATEMENTS_PER_QUERY` in the one place it matters, or, for the
//! rows of a multi-row insert, a method that binds them as arrays where the backend can
//! (`push_conversation_arrays` and its two siblings: Postgres).
//!
//! One file per concern of the [`Store`](super::Store): `conversations`, `runs`, `waits`,
//! `files`, `cluster`, `log`; what several of them write is `statements`, and a start's group
//! commit `starts`. Each implements its trait for every backend whose database binds and
//! reads what its SQL uses: Rust does not carry a trait's `where` clause to its users, so each
//! file's clause lists its own types, once (the concerns ask only for `Statements` or
//! `Starts` of each other).

mod cluster;
mod conversations;
mod ends;
mod files;
mod log;
mod outbox;
mod runs;
mod starts;
mod statements;
mod usage;
mod waits;

pub(crate) use ends::Ends;
pub(super) use files::{bytes_used, insert_file};
pub(super) use statements::{MESSAGE_COLUMNS, SPEND_INSERT, SPEND_UPDATE, tokens};

use std::ops::DerefMut;

use futures_util::stream::BoxStream;
use serde_json::Value;
use sqlx::{Database, Executor, IntoArguments, Pool, QueryBuilder};

use super::{BytesLock, NewEvent, Notice, Progress, RunFinish, StoreError};
use crate::domain::{Conversation, Message, Trace};
use crate::events::LoggedEvent;
use crate::ids::{TraceId, UserId};

/// Rows in one multi-row insert, at most: 21 parameters a message row stays well under
/// SQLite's 32,766 and Postgres's 65,535 parameters a statement.
pub const ROWS_PER_INSERT: usize = 500;

/// The SQLSTATE of a start refused in the database by its user's limit of running runs
/// ([`Backend::push_hold_running`]); its message ends with the runs counted.
pub(super) const OVER_LIMIT: &str = "CH429";

/// A backend's connection.
pub(super) type Conn<B> = <<B as Backend>::Db as Database>::Connection;
/// A row of a backend's database.
pub(super) type Row<B> = <<B as Backend>::Db as Database>::Row;
/// What a backend has of its own; [`Store`] is implemented over it.
pub(super) trait Backend: Send + Sync + 'static {
    type Db: Database;
    /// A connection lent for one write, given back with [`written`](Self::written).
    type Writer<'a>: DerefMut<Target = Conn<Self>> + Send
    where
        Self: 'a;
    /// Whether several chatd processes may share this database (Postgres), so that a
    /// running trace may belong to another live process.
    const SHARED: bool;
    /// The UTC day of the `started_at` column, `YYYY-MM-DD`, in this database's SQL.
    const DAY_STARTED: &'static str;
    /// How a transaction that will write starts. SQLite needs `BEGIN IMMEDIATE`: a deferred
    /// transaction that reads first cannot wait for the write lock and fails at once.
    const BEGIN_WRITE: &'static str;
    /// Whether one query may hold several statements (sqlx runs SQLite's in turn; a
    /// Postgres prepared statement is one statement).
    const MANY_STATEMENTS_PER_QUERY: bool;
    /// Whether a `with` query may write (Postgres's data-modifying `with`; SQLite's only
    /// reads): several writes as one statement.
    const WRITES_IN_WITH: bool;

    /// The rows of a multi-row insert of new conversations, messages or traces (their
    /// `insert into … (columns)` pushed before), as a `select` of one array per column
    /// where the backend binds arrays (Postgres: `unnest`): one text for any number of
    /// rows, which a connection prepares once, where a `values` list is a new text for
    /// every count of rows, parsed and planned afresh (a burst's groups, each a few
    /// hundred rows, were). `false` where the rows go as a `values` list.
    fn push_conversation_arrays<'a>(_query: &mut QueryBuilder<'a, Self::Db>, _rows: &'a [Conversation]) -> bool {
        false
    }
    /// See [`push_conversation_arrays`](Self::push_conversation_arrays), in `MESSAGE_INSERT`'s order.
    fn push_message_arrays<'a>(
        _query: &mut QueryBuilder<'a, Self::Db>,
        _rows: &'a [(&'a UserId, &'a Message)],
    ) -> bool {
        false
    }
    /// See [`push_conversation_arrays`](Self::push_conversation_arrays): each trace with the
    /// replica that runs it and, for a queued run, what it was asked.
    fn push_trace_arrays<'a>(
        _query: &mut QueryBuilder<'a, Self::Db>,
        _rows: &'a [(&'a Trace, &'a str, Option<&'a Value>)],
    ) -> bool {
        false
    }
    /// The main query of a statement that writes new chats (its writes each a `with`
    /// query), where the database makes their one check itself, under the users' locks:
    /// each user's running runs (not counting `ours`, the group's traces) and the runs the
    /// group adds within its limit, else the statement fails as
    /// [`OVER_LIMIT`](self::OVER_LIMIT) (Postgres: `chatd_hold_running`, migration 0016).
    /// `false` where the backend has no such function.
    fn push_hold_running<'a>(
        _query: &mut QueryBuilder<'a, Self::Db>,
        _users: &[(&'a UserId, usize, usize)],
        _ours: Vec<uuid::Uuid>,
    ) -> bool {
        false
    }

    /// How many runs' ends one statement writes at most ([`push_ends`](Self::push_ends)):
    /// an end that gets its turn takes the ends waiting then with it. 1 where each end is
    /// written on its own.
    const ENDS_TOGETHER: usize = 1;
    /// The statement that writes the ends of several runs, each with an answer and each of
    /// a different conversation (`answers`, each end's answer with its user), whole or not
    /// at all, as one run's end writes it: each trace closed where it is its user's and
    /// still running or queued, and only where it was, its spend, its answer and its
    /// conversation's update. Its rows are the ids of the traces it closed. Only a backend
    /// whose [`ENDS_TOGETHER`](Self::ENDS_TOGETHER) is more than 1 has one.
    fn push_ends<'a>(
        _query: &mut QueryBuilder<'a, Self::Db>,
        _ends: &'a [&'a RunFinish],
        _answers: &'a [(&'a UserId, &'a Message)],
    ) {
        unreachable!("a backend that writes ends one at a time has no statement for several")
    }

    /// The pool reads use.
    fn pool(&self) -> &Pool<Self::Db>;
    /// A connection to write on, when the writes before have had theirs.
    fn writer(&self) -> impl Future<Output = Result<Self::Writer<'_>, StoreError>> + Send;
    /// Takes the writer back after a write: a fault (or a transaction left open) makes it
    /// unfit, and the backend closes it.
    fn written<T>(&self, writer: Self::Writer<'_>, result: &Result<T, StoreError>);
    fn rows_affected(result: &<Self::Db as Database>::QueryResult) -> u64;
    /// Runs a built query; how many rows it changed. (Generic code cannot: the builder's
    /// arguments would have to outlive it.)
    fn execute<'c, 'q>(
        conn: &'c mut Conn<Self>,
        query: QueryBuilder<'q, Self::Db>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Runs a built query; the rows it returned, as `O`.
    fn fetch_all<'c, 'q, O>(
        conn: &'c mut Conn<Self>,
        query: QueryBuilder<'q, Self::Db>,
    ) -> impl Future<Output = Result<Vec<O>, sqlx::Error>> + Send
    where
        O: for<'r> sqlx::FromRow<'r, Row<Self>> + Send + Unpin;

    /// The places runs' ends take in the writers' queue at once, and the ends waiting for
    /// one (see [`RunStore::finish_run`](crate::store::RunStore::finish_run)'s implementation).
    fn ends(&self) -> &Ends;
    /// Whether the database answers and takes writes.
    fn ping_database(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Added to the update that claims a waiting run to continue it: what the backend's log
    /// needs to find the run's later events (SQLite: read them after a new `log_from` too).
    const CLAIM_LOG: &'static str;
    /// Added to the read of a waiting run's trace in a decision's transaction: decisions on
    /// one run take turns (Postgres: `for update`; SQLite's writer is one at a time anyway).
    const LOCK_ROW: &'static str;
    /// Added to the select of the webhook messages a process claims: replicas claim
    /// different ones (Postgres: `for update skip locked`; SQLite has one process).
    const SKIP_LOCKED: &'static str;
    /// Which endpoints take which reports (see [`OutboxStore::report_to`]).
    fn outbox(&self) -> &crate::store::OutboxState;
    /// Logs events within a write transaction on `conn` (a run that parks logs the requests
    /// it waits on with its state); [`logged_within`](Self::logged_within) is told what was
    /// written once the transaction commits.
    fn log_within(
        &self,
        conn: &mut Conn<Self>,
        events: &[NewEvent],
    ) -> impl Future<Output = Result<Vec<(TraceId, i64)>, StoreError>> + Send;
    fn logged_within(&self, chunks: Vec<(TraceId, i64)>);
    /// Within the transaction that takes a running run over from a process that is gone:
    /// what the backend's log needs for this process to seal the run's log with what the
    /// other logged (SQLite: the chunks it wrote, which only it knew).
    fn adopt_log(
        &self,
        conn: &mut Conn<Self>,
        trace_id: TraceId,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// The event log: see [`Store::append_events`], [`Store::trace_events`],
    /// [`Store::seal_logs`].
    fn append_log(
        &self,
        events: &[NewEvent],
        progress: &[Progress],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    fn read_log(
        &self,
        trace_id: TraceId,
        after: i64,
    ) -> impl Future<Output = Result<Vec<LoggedEvent>, StoreError>> + Send;
    fn seal_log(&self, traces: &[TraceId]) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// See [`Store::notify`] and [`Store::notices`].
    fn tell(&self, notices: &[Notice]) -> impl Future<Output = Result<(), StoreError>> + Send;
    fn listen(&self) -> impl Future<Output = Result<Option<BoxStream<'static, Notice>>, StoreError>> + Send;
    /// See [`Store::held_elsewhere`] (each backend binds the list of ids its own way, as one
    /// value: Postgres an array, SQLite a JSON array).
    fn running_elsewhere(
        &self,
        traces: &[TraceId],
        replica_id: &str,
    ) -> impl Future<Output = Result<Vec<TraceId>, StoreError>> + Send;
    /// See [`Store::hears_others`].
    fn listening(&self) -> bool;
    /// See [`Store::lock_bytes`].
    fn bytes_lock(&self, sha256: &str) -> impl Future<Output = Result<Box<dyn BytesLock + '_>, StoreError>> + Send;
}

/// Runs `query`, a whole transaction (`BEGIN …; …; COMMIT`) sent as one query, on `conn`;
/// when a statement fails, the statements stop there and the transaction they began is
/// rolled back.
pub(super) async fn transaction_as_one_query<B: Backend>(
    conn: &mut Conn<B>,
    query: QueryBuilder<'_, B::Db>,
) -> Result<(), sqlx::Error>
where
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
{
    let done = B::execute(&mut *conn, query).await;
    rolled_back_if_failed::<B, _>(conn, done).await.map(drop)
}

/// [`transaction_as_one_query`], for the rows its statements return.
pub(super) async fn rows_of_transaction_as_one_query<B: Backend, O>(
    conn: &mut Conn<B>,
    query: QueryBuilder<'_, B::Db>,
) -> Result<Vec<O>, sqlx::Error>
where
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    O: for<'r> sqlx::FromRow<'r, Row<B>> + Send + Unpin,
{
    let rows = B::fetch_all(&mut *conn, query).await;
    rolled_back_if_failed::<B, _>(conn, rows).await
}

/// `result` of a transaction sent as one query, after rolling back what it began where it failed.
pub(super) async fn rolled_back_if_failed<B: Backend, T>(
    conn: &mut Conn<B>,
    result: Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error>
where
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
{
    if result.is_err() {
        let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
    }
    result
}

/// Runs `f` on the backend's writer and gives the writer back with how it went.
pub(super) async fn write<B: Backend, T>(
    backend: &B,
    f: impl AsyncFnOnce(&mut Conn<B>) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let mut writer = backend.writer().await?;
    let result = f(&mut writer).await;
    // A refusal (a missing row, a conflict) returned from inside a transaction drops it, and
    // the rollback that asks for is only queued (SQLite's runs on the connection's thread):
    // one round trip lets it finish, so that the writer is not taken for one a fault left
    // mid-transaction and opened anew.
    if result.is_err() && sqlx::Connection::is_in_transaction(&*writer) {
        let _ = sqlx::Connection::ping(&mut *writer).await;
    }
    backend.written(writer, &result);
    result
}
