//! The SQL both backends share. SQLite and Postgres accept the same statements here (`$n`
//! parameters, `returning`, `on conflict`), and the row types in `rows.rs` decode on both, so
//! the [`Store`] methods are written once, as plain code generic over a [`Backend`]: what a
//! backend has of its own (connecting, migrations, its writer, its event log, notices) is in
//! its file, behind that trait. `runs.rs` writes the rows of runs starting and ending.
//!
//! The `where` clause of the generic code lists what the SQL binds and reads: sqlx's traits
//! do not carry it, so it is written out where the code is (here and in `runs.rs`).

mod runs;

use std::ops::DerefMut;

use chrono::{DateTime, Utc};
use futures_util::stream::BoxStream;
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Pool, QueryBuilder, Type};
use uuid::Uuid;

use self::runs::Rows;
use super::rows::*;
use super::{
    BytesLock, Claim, ConversationPatch, KeyedRun, NewEvent, Notice, PageCursor, QueueTurn, RunFinish, RunPark,
    RunStart, RunningTrace, Settled, Settlement, Store, StoreError, WaitKey,
};
use crate::domain::{Comparison, ContextState, Conversation, Feedback, Message, Preference, StoredFile, Trace, now};
use crate::events::LoggedEvent;
use crate::ids::{ComparisonId, ConversationId, FileId, MessageId, TraceId, UserId};

/// Rows in one multi-row insert, at most: 21 parameters a message row stays well under
/// SQLite's 32,766 and Postgres's 65,535 parameters a statement.
pub const ROWS_PER_INSERT: usize = 500;

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
    /// How a transaction that will write starts. SQLite needs `BEGIN IMMEDIATE`: a deferred
    /// transaction that reads first cannot wait for the write lock and fails at once.
    const BEGIN_WRITE: &'static str;
    /// Whether one query may hold several statements (sqlx runs SQLite's in turn; a
    /// Postgres prepared statement is one statement).
    const MANY_STATEMENTS_PER_QUERY: bool;

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

    /// Whether the database answers and takes writes.
    fn ping_database(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Added to the update that claims a waiting run to continue it: what the backend's log
    /// needs to find the run's later events (SQLite: read them after a new `log_from` too).
    const CLAIM_LOG: &'static str;
    /// Added to the read of a waiting run's trace in a decision's transaction: decisions on
    /// one run take turns (Postgres: `for update`; SQLite's writer is one at a time anyway).
    const LOCK_ROW: &'static str;
    /// Logs events within a write transaction on `conn` (a run that parks logs the requests
    /// it waits on with its state); [`logged_within`](Self::logged_within) is told what was
    /// written once the transaction commits.
    fn log_within(
        &self,
        conn: &mut Conn<Self>,
        events: &[NewEvent],
    ) -> impl Future<Output = Result<Vec<(TraceId, i64)>, StoreError>> + Send;
    fn logged_within(&self, chunks: Vec<(TraceId, i64)>);
    /// The event log: see [`Store::append_events`], [`Store::trace_events`],
    /// [`Store::seal_logs`].
    fn append_log(&self, events: &[NewEvent]) -> impl Future<Output = Result<(), StoreError>> + Send;
    fn read_log(
        &self,
        trace_id: TraceId,
        after: i64,
    ) -> impl Future<Output = Result<Vec<LoggedEvent>, StoreError>> + Send;
    fn seal_log(&self, traces: &[TraceId]) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// See [`Store::notify`] and [`Store::notices`].
    fn tell(&self, notice: Notice) -> impl Future<Output = Result<(), StoreError>> + Send;
    fn listen(&self) -> impl Future<Output = Result<Option<BoxStream<'static, Notice>>, StoreError>> + Send;
    /// See [`Store::hears_others`].
    fn listening(&self) -> bool;
    /// See [`Store::lock_bytes`].
    fn bytes_lock(&self, sha256: &str) -> impl Future<Output = Result<Box<dyn BytesLock + '_>, StoreError>> + Send;
}

/// Writes a file's row on `conn` (see [`BytesLock::insert_file`]).
pub(super) async fn insert_file<B: Backend>(conn: &mut Conn<B>, file: &StoredFile) -> Result<(), StoreError>
where
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> i64: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<i64>: Encode<'q, B::Db> + Type<B::Db>,
{
    sqlx::query(
        "insert into files (id, user_id, name, media_type, size, sha256, width, height, created_at) \
         values ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(file.id.0)
    .bind(file.user_id.as_str().to_owned())
    .bind(file.name.clone())
    .bind(file.media_type.clone())
    .bind(file.size as i64)
    .bind(file.sha256.clone())
    .bind(file.width.map(i64::from))
    .bind(file.height.map(i64::from))
    .bind(file.created_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Whether any file has the bytes with this sha256, read on `conn`.
pub(super) async fn bytes_used<B: Backend>(conn: &mut Conn<B>, sha256: &str) -> Result<bool, StoreError>
where
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'r> (bool,): FromRow<'r, Row<B>>,
{
    // `exists` is a boolean on both backends (a bare `select 1` is an int4 on Postgres).
    let (used,): (bool,) =
        sqlx::query_as("select exists (select 1 from files where sha256 = $1)").bind(sha256).fetch_one(conn).await?;
    Ok(used)
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
    if let Err(e) = B::execute(&mut *conn, query).await {
        let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
        return Err(e);
    }
    Ok(())
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

#[async_trait::async_trait]
impl<B> Store for B
where
    B: Backend,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> i64: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> bool: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> JsonText: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<&'q str>: Encode<'q, B::Db>,
    for<'q> Option<JsonText>: Encode<'q, B::Db>,
    for<'q> Option<MessageId>: Encode<'q, B::Db>,
    for<'q> Option<TraceId>: Encode<'q, B::Db>,
    for<'q> Option<ComparisonId>: Encode<'q, B::Db>,
    for<'q> Option<DateTime<Utc>>: Encode<'q, B::Db>,
    for<'q> Option<i64>: Encode<'q, B::Db>,
    for<'r> ConversationRow: FromRow<'r, Row<B>>,
    for<'r> MessageRow: FromRow<'r, Row<B>>,
    for<'r> TraceRow: FromRow<'r, Row<B>>,
    for<'r> RunningRow: FromRow<'r, Row<B>>,
    for<'r> ComparisonRow: FromRow<'r, Row<B>>,
    for<'r> (i64,): FromRow<'r, Row<B>>,
    for<'r> (UserId,): FromRow<'r, Row<B>>,
    for<'r> (Json<Value>,): FromRow<'r, Row<B>>,
    for<'r> (Option<Json<Value>>,): FromRow<'r, Row<B>>,
    for<'r> (Uuid, Option<Uuid>, String, DateTime<Utc>): FromRow<'r, Row<B>>,
    for<'r> (Uuid, DateTime<Utc>, String, Option<Uuid>): FromRow<'r, Row<B>>,
    for<'r> (UserId, Uuid, Uuid, Uuid): FromRow<'r, Row<B>>,
    for<'r> WaitRow: FromRow<'r, Row<B>>,
    for<'r> (Uuid,): FromRow<'r, Row<B>>,
    for<'r> (String,): FromRow<'r, Row<B>>,
    for<'r> FileRow: FromRow<'r, Row<B>>,
    for<'r> (String, TraceId, DateTime<Utc>): FromRow<'r, Row<B>>,
    for<'r> (Uuid, Option<Uuid>): FromRow<'r, Row<B>>,
    for<'q> Option<Uuid>: Encode<'q, B::Db>,
{
    fn is_shared(&self) -> bool {
        B::SHARED
    }

    fn hears_others(&self) -> bool {
        self.listening()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.ping_database().await
    }

    async fn create_conversation(&self, c: &Conversation) -> Result<(), StoreError> {
        write(self, async |conn| Rows::<B>::insert_conversation(conn, c).await).await
    }

    async fn list_conversations(
        &self,
        user: &UserId,
        limit: u32,
        cursor: Option<PageCursor>,
    ) -> Result<Vec<Conversation>, StoreError> {
        let rows: Vec<ConversationRow> = match cursor {
            None => {
                let sql = format!(
                    "select {CONVERSATION_COLUMNS} from conversations where user_id = $1 \
                     order by last_message_at desc, id desc limit $2"
                );
                sqlx::query_as(&sql).bind(user).bind(i64::from(limit)).fetch_all(self.pool()).await?
            }
            Some(cursor) => {
                let sql = format!(
                    "select {CONVERSATION_COLUMNS} from conversations where user_id = $1 \
                     and (last_message_at < $2 or (last_message_at = $2 and id < $3)) \
                     order by last_message_at desc, id desc limit $4"
                );
                sqlx::query_as(&sql)
                    .bind(user)
                    .bind(cursor.last_message_at)
                    .bind(cursor.id)
                    .bind(i64::from(limit))
                    .fetch_all(self.pool())
                    .await?
            }
        };
        Ok(rows.into_iter().map(Conversation::from).collect())
    }

    async fn get_conversation(&self, user: &UserId, id: ConversationId) -> Result<Conversation, StoreError> {
        let sql = format!("select {CONVERSATION_COLUMNS} from conversations where id = $1 and user_id = $2");
        let row: Option<ConversationRow> = sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(self.pool()).await?;
        row.map(Conversation::from).ok_or(StoreError::NotFound)
    }

    async fn conversation_by_external_id(&self, user: &UserId, external_id: &str) -> Result<Conversation, StoreError> {
        let sql = format!("select {CONVERSATION_COLUMNS} from conversations where user_id = $1 and external_id = $2");
        let row: Option<ConversationRow> =
            sqlx::query_as(&sql).bind(user).bind(external_id).fetch_optional(self.pool()).await?;
        row.map(Conversation::from).ok_or(StoreError::NotFound)
    }

    async fn update_conversation(
        &self,
        user: &UserId,
        id: ConversationId,
        patch: &ConversationPatch,
    ) -> Result<Conversation, StoreError> {
        let sql = format!(
            "update conversations set title = coalesce($3, title), \
             profile = coalesce($4, profile), system_prompt = coalesce($5, system_prompt), \
             metadata = coalesce($6, metadata), updated_at = $7 \
             where id = $1 and user_id = $2 returning {CONVERSATION_COLUMNS}"
        );
        let row: Option<ConversationRow> = write(self, async |conn| {
            Ok(sqlx::query_as(&sql)
                .bind(id)
                .bind(user)
                .bind(patch.title.as_deref())
                .bind(patch.profile.as_deref())
                .bind(patch.system_prompt.as_deref())
                .bind(patch.metadata.as_ref().map(json))
                .bind(now())
                .fetch_optional(conn)
                .await?)
        })
        .await?;
        row.map(Conversation::from).ok_or(StoreError::NotFound)
    }

    async fn delete_conversation(&self, user: &UserId, id: ConversationId) -> Result<Vec<String>, StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(&mut *conn, B::BEGIN_WRITE).await?;
            let carried: Vec<(Uuid,)> = sqlx::query_as(
                "select distinct f.file_id from message_files f join messages m on m.id = f.message_id \
                 where m.conversation_id = $1 and m.user_id = $2",
            )
            .bind(id)
            .bind(user)
            .fetch_all(&mut *tx)
            .await?;
            let done = sqlx::query("delete from conversations where id = $1 and user_id = $2")
                .bind(id)
                .bind(user)
                .execute(&mut *tx)
                .await?;
            if B::rows_affected(&done) == 0 {
                return Err(StoreError::NotFound);
            }
            let mut freed = Vec::new();
            let lock = format!("select id from files where id = $1 {}", B::LOCK_ROW);
            for (file,) in carried {
                // A start that attaches the file meanwhile (on Postgres) waits for this, or
                // this for it: its message's use is then seen.
                let _: Option<(Uuid,)> = sqlx::query_as(&lock).bind(file).fetch_optional(&mut *tx).await?;
                let gone: Option<(String,)> = sqlx::query_as(
                    "delete from files where id = $1 \
                     and not exists (select 1 from message_files where file_id = $1) returning sha256",
                )
                .bind(file)
                .fetch_optional(&mut *tx)
                .await?;
                freed.extend(gone.map(|(sha,)| sha));
            }
            tx.commit().await?;
            Ok(freed)
        })
        .await
    }

    async fn lock_bytes(&self, sha256: &str) -> Result<Box<dyn BytesLock + '_>, StoreError> {
        self.bytes_lock(sha256).await
    }

    async fn get_file(&self, user: &UserId, id: FileId) -> Result<StoredFile, StoreError> {
        let sql = format!("select {FILE_COLUMNS} from files where id = $1 and user_id = $2");
        let row: Option<FileRow> = sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(self.pool()).await?;
        row.map(StoredFile::from).ok_or(StoreError::NotFound)
    }

    async fn delete_file(&self, user: &UserId, id: FileId) -> Result<StoredFile, StoreError> {
        let sql = format!("delete from files where id = $1 and user_id = $2 returning {FILE_COLUMNS}");
        let row: Option<FileRow> =
            write(self, async |conn| Ok(sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(conn).await?)).await?;
        row.map(StoredFile::from).ok_or(StoreError::NotFound)
    }

    async fn keyed_run(&self, user: &UserId, key: &str) -> Result<Option<KeyedRun>, StoreError> {
        let row: Option<(String, TraceId, DateTime<Utc>)> = sqlx::query_as(
            "select request_hash, trace_id, created_at from idempotency_keys where user_id = $1 and key = $2",
        )
        .bind(user)
        .bind(key)
        .fetch_optional(self.pool())
        .await?;
        Ok(row.map(|(request_hash, trace_id, created_at)| KeyedRun { request_hash, trace_id, created_at }))
    }

    async fn forget_key(&self, user: &UserId, key: &str, trace_id: TraceId) -> Result<(), StoreError> {
        write(self, async |conn| {
            sqlx::query("delete from idempotency_keys where user_id = $1 and key = $2 and trace_id = $3")
                .bind(user)
                .bind(key)
                .bind(trace_id)
                .execute(conn)
                .await?;
            Ok(())
        })
        .await
    }

    async fn runs_started_since(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        since: DateTime<Utc>,
    ) -> Result<Vec<Trace>, StoreError> {
        let sql = format!(
            "select {TRACE_COLUMNS} from traces where conversation_id = $1 and user_id = $2 and started_at >= $3 \
             order by started_at, id"
        );
        let rows: Vec<TraceRow> =
            sqlx::query_as(&sql).bind(conversation_id).bind(user).bind(since).fetch_all(self.pool()).await?;
        rows.into_iter().map(Trace::try_from).collect()
    }

    async fn forget_keys_before(&self, before: DateTime<Utc>) -> Result<(), StoreError> {
        write(self, async |conn| {
            sqlx::query("delete from idempotency_keys where created_at < $1").bind(before).execute(conn).await?;
            Ok(())
        })
        .await
    }

    async fn messages(&self, user: &UserId, conversation_id: ConversationId) -> Result<Vec<Message>, StoreError> {
        let sql = format!(
            "select {MESSAGE_COLUMNS} from messages where conversation_id = $1 and user_id = $2 \
             order by created_at, id"
        );
        let rows: Vec<MessageRow> =
            sqlx::query_as(&sql).bind(conversation_id).bind(user).fetch_all(self.pool()).await?;
        rows.into_iter().map(Message::try_from).collect()
    }

    async fn set_feedback(
        &self,
        user: &UserId,
        message_id: MessageId,
        feedback: Option<Feedback>,
    ) -> Result<Message, StoreError> {
        let sql = format!(
            "update messages set feedback = $3 where id = $1 and user_id = $2 \
             returning {MESSAGE_COLUMNS}"
        );
        let row: Option<MessageRow> = write(self, async |conn| {
            Ok(sqlx::query_as(&sql)
                .bind(message_id)
                .bind(user)
                .bind(feedback.as_ref().map(json))
                .fetch_optional(conn)
                .await?)
        })
        .await?;
        row.ok_or(StoreError::NotFound)?.try_into()
    }

    async fn start_runs(&self, starts: &[&RunStart]) -> Result<(), StoreError> {
        Rows::start_runs(self, starts).await.map_err(|e| match e {
            // Every id a start writes is new; only a new conversation's external id can be
            // taken, by another start that made the same client chat a moment before.
            StoreError::Database(sqlx::Error::Database(db)) if db.is_unique_violation() => StoreError::ChatTaken,
            e => e,
        })
    }

    async fn append_events(&self, events: &[NewEvent]) -> Result<(), StoreError> {
        self.append_log(events).await
    }

    async fn finish_run(&self, finish: &RunFinish) -> Result<(), StoreError> {
        Rows::finish_run(self, finish).await
    }

    async fn get_trace(&self, user: &UserId, trace_id: TraceId) -> Result<Trace, StoreError> {
        let sql = format!("select {TRACE_COLUMNS} from traces where id = $1 and user_id = $2");
        let row: Option<TraceRow> = sqlx::query_as(&sql).bind(trace_id).bind(user).fetch_optional(self.pool()).await?;
        row.ok_or(StoreError::NotFound)?.try_into()
    }

    async fn running_in_conversation(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
    ) -> Result<Vec<Trace>, StoreError> {
        let sql = format!(
            "select {TRACE_COLUMNS} from traces where conversation_id = $1 and user_id = $2 \
             and status = 'running' union all select {TRACE_COLUMNS} from traces where conversation_id = $1 \
             and user_id = $2 and status = 'waiting' union all select {TRACE_COLUMNS} from traces \
             where conversation_id = $1 and user_id = $2 and status = 'queued' order by started_at, id"
        );
        let rows: Vec<TraceRow> = sqlx::query_as(&sql).bind(conversation_id).bind(user).fetch_all(self.pool()).await?;
        rows.into_iter().map(Trace::try_from).collect()
    }

    async fn trace_by_message(&self, user: &UserId, message_id: MessageId) -> Result<Trace, StoreError> {
        let sql = format!(
            "select {TRACE_COLUMNS} from traces where message_id = $1 and user_id = $2 \
             order by started_at desc limit 1"
        );
        let row: Option<TraceRow> =
            sqlx::query_as(&sql).bind(message_id).bind(user).fetch_optional(self.pool()).await?;
        row.ok_or(StoreError::NotFound)?.try_into()
    }

    async fn get_message(&self, user: &UserId, id: MessageId) -> Result<Message, StoreError> {
        let sql = format!("select {MESSAGE_COLUMNS} from messages where id = $1 and user_id = $2");
        let row: Option<MessageRow> = sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(self.pool()).await?;
        row.ok_or(StoreError::NotFound)?.try_into()
    }

    async fn delete_answer(&self, user: &UserId, id: MessageId) -> Result<(), StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(&mut *conn, B::BEGIN_WRITE).await?;
            let found: Option<(Uuid, Option<Uuid>)> = sqlx::query_as(
                "select conversation_id, parent_id from messages where id = $1 and user_id = $2 and role = 'assistant'",
            )
            .bind(id)
            .bind(user)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((conversation, parent)) = found else { return Err(StoreError::NotFound) };
            sqlx::query("delete from messages where id = $1").bind(id).execute(&mut *tx).await?;
            Rows::<B>::follow_question(&mut tx, conversation, id, parent.map(MessageId)).await?;
            sqlx::query(
                "update conversations set message_count = message_count - 1, \
                 active_leaf_id = case when active_leaf_id = $2 then $3 else active_leaf_id end where id = $1",
            )
            .bind(conversation)
            .bind(id)
            .bind(parent)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn set_active_leaf(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        leaf: MessageId,
    ) -> Result<(), StoreError> {
        let done = write(self, async |conn| {
            Ok(sqlx::query(
                "update conversations set active_leaf_id = $3, updated_at = $4 where id = $1 and user_id = $2 \
                     and exists (select 1 from messages where id = $3 and conversation_id = $1)",
            )
            .bind(conversation_id)
            .bind(user)
            .bind(leaf)
            .bind(now())
            .execute(conn)
            .await?)
        })
        .await?;
        if B::rows_affected(&done) == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    async fn get_comparison(&self, user: &UserId, id: ComparisonId) -> Result<Comparison, StoreError> {
        let sql = format!("select {COMPARISON_COLUMNS} from comparisons where id = $1 and user_id = $2");
        let row: Option<ComparisonRow> = sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(self.pool()).await?;
        row.ok_or(StoreError::NotFound)?.try_into()
    }

    async fn vote(
        &self,
        user: &UserId,
        id: ComparisonId,
        preference: Preference,
        change: bool,
    ) -> Result<Comparison, StoreError> {
        Rows::vote(self, user, id, preference, change).await
    }

    async fn voted_comparisons(&self) -> Result<Vec<Comparison>, StoreError> {
        let sql =
            format!("select {COMPARISON_COLUMNS} from comparisons where voted_at is not null order by voted_at, id");
        let rows: Vec<ComparisonRow> = sqlx::query_as(&sql).fetch_all(self.pool()).await?;
        rows.into_iter().map(Comparison::try_from).collect()
    }

    async fn context_state(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
    ) -> Result<Option<ContextState>, StoreError> {
        let row: Option<(Json<Value>,)> =
            sqlx::query_as("select state from context_states where conversation_id = $1 and user_id = $2")
                .bind(conversation_id)
                .bind(user)
                .fetch_optional(self.pool())
                .await?;
        Ok(row.and_then(|(state,)| crate::store::rows::context_state(state.0)))
    }

    async fn set_context_state(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        state: Option<&ContextState>,
    ) -> Result<(), StoreError> {
        write(self, async |conn| {
            match state {
                Some(state) => {
                    let strategy = state.strategy.as_str();
                    sqlx::query(
                        "insert into context_states (conversation_id, user_id, strategy, state, updated_at) \
                     values ($1, $2, $3, $4, $5) on conflict (conversation_id) do update \
                     set strategy = excluded.strategy, state = excluded.state, updated_at = excluded.updated_at",
                    )
                    .bind(conversation_id)
                    .bind(user)
                    .bind(strategy)
                    .bind(json(state))
                    .bind(now())
                    .execute(&mut *conn)
                    .await?;
                }
                None => {
                    sqlx::query("delete from context_states where conversation_id = $1 and user_id = $2")
                        .bind(conversation_id)
                        .bind(user)
                        .execute(&mut *conn)
                        .await?;
                }
            }
            Ok(())
        })
        .await
    }

    async fn park_run(&self, park: &RunPark) -> Result<(), StoreError> {
        Rows::park_run(self, park).await
    }

    async fn settle_wait(
        &self,
        key: WaitKey<'_>,
        user: Option<&UserId>,
        settlement: &Settlement,
        replica_id: &str,
    ) -> Result<Settled, StoreError> {
        Rows::settle_wait(self, key, user, settlement, replica_id).await
    }

    async fn claim_waiting(&self, trace_id: TraceId, replica_id: &str) -> Result<Option<Claim>, StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            let claim = Rows::<B>::claim(&mut tx, trace_id, replica_id).await?;
            tx.commit().await?;
            Ok(claim)
        })
        .await
    }

    async fn expired_waits(&self, at: DateTime<Utc>, limit: i64) -> Result<Vec<Uuid>, StoreError> {
        let rows: Vec<(Uuid,)> = sqlx::query_as(
            "select w.id from run_waits w join traces t on t.id = w.trace_id \
             where w.decided_at is null and w.expires_at <= $1 and t.status = 'waiting' \
             order by w.expires_at limit $2",
        )
        .bind(at)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    async fn running_traces(&self) -> Result<Vec<RunningTrace>, StoreError> {
        let sql = format!("select {TRACE_COLUMNS}, replica_id, heartbeat_at from traces where status = 'running'");
        let rows: Vec<RunningRow> = sqlx::query_as(&sql).fetch_all(self.pool()).await?;
        rows.into_iter().map(RunningTrace::try_from).collect()
    }

    async fn claim_queued(&self, trace_id: TraceId, replica_id: &str) -> Result<QueueTurn, StoreError> {
        Rows::claim_queued(self, trace_id, replica_id).await
    }

    async fn queued_traces(&self) -> Result<Vec<RunningTrace>, StoreError> {
        let sql = format!(
            "select {TRACE_COLUMNS}, replica_id, heartbeat_at from traces where status = 'queued' order by started_at, id"
        );
        let rows: Vec<RunningRow> = sqlx::query_as(&sql).fetch_all(self.pool()).await?;
        rows.into_iter().map(RunningTrace::try_from).collect()
    }

    async fn adopt_queued(&self, trace_id: TraceId, from: Option<&str>, replica_id: &str) -> Result<bool, StoreError> {
        Rows::adopt_queued(self, trace_id, from, replica_id).await
    }

    async fn heartbeat(&self, replica_id: &str, at: DateTime<Utc>, queued: &[TraceId]) -> Result<(), StoreError> {
        write(self, async |conn| {
            let mut query = QueryBuilder::<B::Db>::new("update traces set heartbeat_at = ");
            query.push_bind(at).push(" where replica_id = ").push_bind(replica_id);
            query.push(" and (status = 'running'");
            if !queued.is_empty() {
                query.push(" or (status = 'queued' and id in (");
                let mut ids = query.separated(", ");
                for id in queued {
                    ids.push_bind(*id);
                }
                query.push("))");
            }
            query.push(")");
            B::execute(conn, query).await?;
            Ok(())
        })
        .await
    }

    async fn notify(&self, notice: Notice) -> Result<(), StoreError> {
        self.tell(notice).await
    }

    async fn notices(&self) -> Result<Option<BoxStream<'static, Notice>>, StoreError> {
        self.listen().await
    }

    async fn trace_events(&self, trace_id: TraceId, after: i64) -> Result<Vec<LoggedEvent>, StoreError> {
        self.read_log(trace_id, after).await
    }

    async fn seal_logs(&self, traces: &[TraceId]) -> Result<(), StoreError> {
        self.seal_log(traces).await
    }
}
