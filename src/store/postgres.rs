//! The Postgres backend: native uuid, timestamptz and jsonb; several chatd replicas may share
//! one database. Writers take connections of the pool; replicas tell each other about runs
//! with NOTIFY.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgNotification, PgPoolOptions, PgQueryResult};
use sqlx::{PgPool, Postgres, QueryBuilder};

use super::rows::{json, provider_state};
use super::sql::{Backend, Ends, MESSAGE_COLUMNS, SPEND_INSERT, SPEND_UPDATE, bytes_used, insert_file, tokens};
use super::{BytesLock, NewEvent, Notice, Progress, RunFinish, StoreError};
use crate::domain::{Conversation, Message, StoredFile, Trace};
use crate::events::LoggedEvent;
use crate::ids::{ConversationId, TraceId, UserId};

pub struct PostgresStore {
    pool: PgPool,
    /// This store's mark on the starts it tells: the process that started a run has told
    /// itself already, and must not hear of it a second time, late.
    origin: String,
    /// Whether the notice listener is connected (see [`Store::hears_others`]); true until
    /// it is known not to be.
    listening: Arc<AtomicBool>,
    outbox: crate::store::OutboxState,
    /// Runs' ends take turns here, for half the pool at most: one turn for ends that go
    /// together, the others for ends alone (see [`Backend::ends`]).
    ends: Ends,
}

/// [`LOG_CHANNEL`], as a literal for the statements that tell it.
macro_rules! log_channel {
    () => {
        "chatd_log"
    };
}

/// [`PostgresStore::INSERT_CHUNKS`] with `$tail` after its insert.
macro_rules! insert_chunks {
    ($tail:literal) => {
        concat!(
            "with written as (insert into trace_event_chunks (trace_id, first_seq, last_seq, events) \
             select c.trace_id, c.first_seq, c.last_seq, c.events \
             from unnest($1::uuid[], $2::int8[], $3::int8[], $4::text[]) as c (trace_id, first_seq, last_seq, events) \
             where c.trace_id in \
             (select t.id from traces t join unnest($1::uuid[]) as k (id) on t.id = k.id for key share of t)",
            $tail,
            " returning trace_id) select pg_notify('",
            log_channel!(),
            "', trace_id::text) from written"
        )
    };
}

/// [`PostgresStore::INSERT_CHUNKS`] where a chunk may be written already (a batch tried
/// again after a failure whose commit went through, the log a run writes as it parks to
/// wait): those are skipped. `on conflict` is a quarter of the statement's time at
/// 1,000 rows (6.2–6.6 against 4.7–4.8 ms on an idle server), so a batch pays it only
/// when it meets a chunk written already.
const INSERT_CHUNKS_AGAIN: &str = insert_chunks!(" on conflict (trace_id, first_seq) do nothing");

impl PostgresStore {
    /// The statement that writes a batch of the event log: the trace ids, first seqs, last
    /// seqs and events of its chunks as four arrays, so that its text is the same whatever
    /// their number (Postgres prepares it once per connection, not once per row count).
    /// Its rows are checked against their traces as one join, each trace locked as a foreign
    /// key would (a trace deleted at the same time is either waited for and skipped, or
    /// waits): the key itself ran a query per row, half of the insert's time at 1,000 rows.
    /// The traces are joined with the batch's ids, not filtered with `id = any($1)`: where
    /// the table is small enough to scan, the plan Postgres keeps for a prepared statement
    /// compared each trace with each id (a million comparisons a flush at 1,000 runs).
    /// A chunk written already fails it (then `INSERT_CHUNKS_AGAIN` writes the batch).
    pub const INSERT_CHUNKS: &'static str = insert_chunks!("");

    /// Connects to `url` and runs the Postgres migrations.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let options = PgConnectOptions::from_str(url)?;
        // One connection first: its error says what is wrong at once. The pool retries for
        // its whole acquire timeout and then says only that it timed out.
        let first = <PgConnection as sqlx::Connection>::connect_with(&options).await.map_err(|e| {
            StoreError::Unavailable(format!(
                "cannot connect to Postgres at {}:{} (database {:?}): {e}; check that the server runs there, \
                 accepts this user, and that database.url is right",
                options.get_host(),
                options.get_port(),
                options.get_database().unwrap_or_default(),
            ))
        })?;
        sqlx::Connection::close(first).await?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        sqlx::migrate!("migrations/postgres").run(&pool).await?;
        Ok(Self {
            pool,
            origin: uuid::Uuid::new_v4().simple().to_string(),
            listening: Arc::new(AtomicBool::new(true)),
            outbox: Default::default(),
            // Half the pool for ends: one turn for those that go together, the rest alone.
            ends: Ends::new((max_connections as usize / 2).saturating_sub(1).max(1)),
        })
    }
}

/// Chunks of the event log written per transaction: each commit waits for the WAL to reach
/// the disk, and writers do not block each other.
const LOG_ROWS_PER_TRANSACTION: usize = 1000;

/// The channel on which replicas ask each other to cancel a run; the payload is its trace id.
const CANCEL_CHANNEL: &str = "chatd_cancel";
/// Where a run's log growing, or its end, is told.
const LOG_CHANNEL: &str = log_channel!();
/// A run started (CONTRACT.md §16): the payload is its conversation's id and its trace id.
const START_CHANNEL: &str = "chatd_start";
/// A conversation was deleted: the payload is its id.
const DELETED_CHANNEL: &str = "chatd_deleted";

impl Backend for PostgresStore {
    type Db = Postgres;
    type Writer<'a> = PoolConnection<Postgres>;
    const SHARED: bool = true;
    const DAY_STARTED: &'static str = "to_char(started_at at time zone 'UTC', 'YYYY-MM-DD')";
    const BEGIN_WRITE: &'static str = "BEGIN";
    const MANY_STATEMENTS_PER_QUERY: bool = false;
    const WRITES_IN_WITH: bool = true;
    /// Ends written together share one commit and one statement's trip and setup, most of
    /// an end's time on the server (docs/benchmarks.md); with one turn for such ends, those
    /// that come while a statement is written go together in the next.
    const ENDS_TOGETHER: usize = 32;
    const CLAIM_LOG: &'static str = "";
    const LOCK_ROW: &'static str = " for update";
    const SKIP_LOCKED: &'static str = " for update skip locked";

    fn outbox(&self) -> &crate::store::OutboxState {
        &self.outbox
    }

    fn ends(&self) -> &Ends {
        &self.ends
    }

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A connection of the pool: Postgres takes concurrent writers.
    async fn writer(&self) -> Result<PoolConnection<Postgres>, StoreError> {
        Ok(self.pool.acquire().await?)
    }

    /// A connection that a fault (or a transaction left open) made unfit is closed instead
    /// of going back to the pool.
    fn written<T>(&self, mut writer: PoolConnection<Postgres>, result: &Result<T, StoreError>) {
        if let Err(e) = result {
            if e.is_unavailable() || sqlx::Connection::is_in_transaction(&*writer) {
                writer.close_on_drop();
            }
        }
    }

    fn rows_affected(result: &PgQueryResult) -> u64 {
        result.rows_affected()
    }

    async fn execute<'c, 'q>(
        conn: &'c mut PgConnection,
        mut query: QueryBuilder<'q, Postgres>,
    ) -> Result<u64, sqlx::Error> {
        Ok(query.build().execute(conn).await?.rows_affected())
    }

    async fn fetch_all<'c, 'q, O>(
        conn: &'c mut PgConnection,
        mut query: QueryBuilder<'q, Postgres>,
    ) -> Result<Vec<O>, sqlx::Error>
    where
        O: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    {
        query.build_query_as().fetch_all(conn).await
    }

    async fn ping_database(&self) -> Result<(), StoreError> {
        sqlx::query("select 1").execute(&self.pool).await?;
        Ok(())
    }

    fn push_conversation_arrays<'a>(query: &mut QueryBuilder<'a, Postgres>, rows: &'a [Conversation]) -> bool {
        Arrays::new(query, rows)
            .column("uuid", |c| c.id)
            .column("text", |c| c.user_id.as_str())
            .column("text", |c| c.title.as_str())
            .column("text", |c| c.profile.as_deref())
            .column("text", |c| c.system_prompt.as_deref())
            .column("jsonb", |c| json(&c.metadata))
            .column("text", |c| c.external_id.as_deref())
            .column("uuid", |c| c.active_leaf_id)
            .column("int8", |c| c.message_count)
            .column("timestamptz", |c| c.created_at)
            .column("timestamptz", |c| c.updated_at)
            .column("timestamptz", |c| c.last_message_at)
            .end()
    }

    fn push_message_arrays<'a>(query: &mut QueryBuilder<'a, Postgres>, rows: &'a [(&'a UserId, &'a Message)]) -> bool {
        Arrays::new(query, rows)
            .column("uuid", |(_, m)| m.id)
            .column("uuid", |(_, m)| m.conversation_id)
            .column("text", |(user, _)| user.as_str())
            .column("uuid", |(_, m)| m.parent_id)
            .column("text", |(_, m)| m.role.as_str())
            .column("text", |(_, m)| m.content.as_str())
            .column("text", |(_, m)| m.thinking.as_deref())
            .column("jsonb", |(_, m)| provider_state(m))
            .column("jsonb", |(_, m)| json(&m.tool_calls))
            .column("jsonb", |(_, m)| json(&m.tool_history))
            .column("jsonb", |(_, m)| json(&m.payloads))
            .column("jsonb", |(_, m)| json(&m.suggested_values))
            .column("jsonb", |(_, m)| json(&m.suggested_actions))
            .column("bool", |(_, m)| m.cancelled)
            .column("text", |(_, m)| m.model.as_deref())
            .column("uuid", |(_, m)| m.trace_id)
            .column("jsonb", |(_, m)| m.usage.as_ref().map(json))
            .column("float8", |(_, m)| m.cost.cost_usd)
            .column("jsonb", |(_, m)| m.feedback.as_ref().map(json))
            .column("uuid", |(_, m)| m.comparison_id)
            .column("text", |(_, m)| m.variant.as_deref())
            .column("text", |(_, m)| m.client_id.as_deref())
            .column("jsonb", |(_, m)| json(&m.attachments))
            .column("timestamptz", |(_, m)| m.created_at)
            .end()
    }

    /// The ends' own values (`v`) and their answers (`a`) as arrays, joined by the answer's
    /// id: a trace closed by the update returns its end's answer, and only answers so
    /// returned are inserted and touch their conversations (each once: the ends are of
    /// different conversations).
    fn push_ends<'a>(
        query: &mut QueryBuilder<'a, Postgres>,
        ends: &'a [&'a RunFinish],
        answers: &'a [(&'a UserId, &'a Message)],
    ) {
        query.push("with v as (");
        Arrays::new(query, ends)
            .column("uuid", |f| f.trace_id)
            .column("text", |f| f.user_id.as_str())
            .column("uuid", |f| f.assistant_message.as_ref().map(|m| m.id))
            .column("text", |f| f.status.as_str())
            .column("timestamptz", |f| f.ended_at)
            .column("jsonb", |f| json(&f.usage))
            .column("jsonb", |f| f.error.as_ref().map(json))
            .column("jsonb", |f| json(&f.spans))
            .column("float8", |f| f.cost_usd)
            .column("int8", |f| tokens(f.usage.input_tokens))
            .column("int8", |f| tokens(f.usage.output_tokens))
            .column("int8", |f| tokens(f.usage.cache_read_tokens.unwrap_or(0)))
            .column("int8", |f| tokens(f.usage.cache_write_tokens.unwrap_or(0)))
            .end();
        query.push(
            " as v (id, user_id, answer, status, ended_at, usage, error, spans, cost_usd, input_tokens, \
             output_tokens, cache_read_tokens, cache_write_tokens)), a as (",
        );
        Self::push_message_arrays(query, answers);
        query.push(format_args!(
            " as a ({MESSAGE_COLUMNS})), ended as (update traces t set status = v.status, ended_at = v.ended_at, \
             usage = v.usage, error = v.error, spans = v.spans, cost_usd = v.cost_usd from v \
             where t.id = v.id and t.user_id = v.user_id and t.status in ('running', 'queued') \
             returning t.id, t.user_id, t.profile, t.model, t.started_at, v.answer), \
             spent as ({SPEND_INSERT}select e.id, e.user_id, e.profile, e.model, e.started_at, v.input_tokens, \
             v.output_tokens, v.cache_read_tokens, v.cache_write_tokens, v.cost_usd from ended e join v on v.id = e.id\
             {SPEND_UPDATE}, reserved_tokens = 0, reserved_usd = 0), \
             answer as (insert into messages ({MESSAGE_COLUMNS}) select a.* from a join ended e on e.answer = a.id), \
             touched as (update conversations c set active_leaf_id = case when a.variant = 'b' then c.active_leaf_id \
             when a.role = 'assistant' and a.parent_id is not null and c.active_leaf_id is not null \
             and c.active_leaf_id <> a.parent_id and not exists (select 1 from messages x \
             where x.id = c.active_leaf_id and x.parent_id = a.parent_id) then c.active_leaf_id else a.id end, \
             message_count = c.message_count + 1, last_message_at = a.created_at, updated_at = a.created_at \
             from a join ended e on e.answer = a.id where c.id = a.conversation_id and c.user_id = a.user_id) \
             select id from ended"
        ));
    }

    fn push_trace_arrays<'a>(
        query: &mut QueryBuilder<'a, Postgres>,
        rows: &'a [(&'a Trace, &'a str, Option<&'a Value>)],
    ) -> bool {
        Arrays::new(query, rows)
            .column("uuid", |(t, ..)| t.trace_id)
            .column("uuid", |(t, ..)| t.conversation_id)
            .column("text", |(t, ..)| t.user_id.as_str())
            .column("uuid", |(t, ..)| t.user_message_id)
            .column("uuid", |(t, ..)| t.message_id)
            .column("text", |(t, ..)| t.status.as_str())
            .column("text", |(t, ..)| t.model.as_str())
            .column("text", |(t, ..)| t.profile.as_str())
            .column("timestamptz", |(t, ..)| t.started_at)
            .column("jsonb", |(t, ..)| json(&t.spans))
            .column("uuid", |(t, ..)| t.comparison_id)
            .column("text", |(t, ..)| t.variant.as_deref())
            .column("text", |(_, replica, _)| *replica)
            // `heartbeat_at`: a run is alive from its start.
            .column("timestamptz", |(t, ..)| t.started_at)
            .column("jsonb", |(.., queued)| queued.map(json))
            .column("text", |(t, ..)| t.traceparent.as_deref())
            .column("jsonb", |(t, ..)| t.metadata.as_ref().map(json))
            .end()
    }

    fn push_hold_running<'a>(
        query: &mut QueryBuilder<'a, Postgres>,
        users: &[(&'a UserId, usize, usize)],
        ours: Vec<uuid::Uuid>,
    ) -> bool {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        query.push("select chatd_hold_running(");
        query.push_bind(users.iter().map(|(user, ..)| user.as_str()).collect::<Vec<&str>>());
        query.push("::text[], ").push_bind(users.iter().map(|&(_, _, adding)| count(adding)).collect::<Vec<i64>>());
        query.push("::int8[], ").push_bind(users.iter().map(|&(_, limit, _)| count(limit)).collect::<Vec<i64>>());
        query.push("::int8[], ").push_bind(ours).push("::uuid[])");
        true
    }

    /// The ids as one array: one statement, prepared once, however many runs a replica holds
    /// (a bind for each id would have failed past Postgres's 65,535).
    async fn running_elsewhere(&self, traces: &[TraceId], replica_id: &str) -> Result<Vec<TraceId>, StoreError> {
        let ids: Vec<uuid::Uuid> = traces.iter().map(|id| id.0).collect();
        let rows: Vec<(TraceId,)> = sqlx::query_as(
            "select id from traces where coalesce(replica_id, '') <> $1 and status = 'running' and id = any($2::uuid[])",
        )
        .bind(replica_id)
        .bind(ids)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    async fn log_within(
        &self,
        conn: &mut PgConnection,
        events: &[NewEvent],
    ) -> Result<Vec<(TraceId, i64)>, StoreError> {
        chunks_insert(&super::chunks::encode(events), INSERT_CHUNKS_AGAIN).execute(conn).await?;
        Ok(Vec::new())
    }

    /// The chunks, indexed by run, are the log: nothing to note.
    fn logged_within(&self, _chunks: Vec<(TraceId, i64)>) {}

    async fn read_log(&self, trace_id: TraceId, after: i64) -> Result<Vec<LoggedEvent>, StoreError> {
        let rows: Vec<(String,)> = sqlx::query_as(
            "select events from trace_event_chunks where trace_id = $1 and last_seq > $2 order by first_seq",
        )
        .bind(trace_id)
        .bind(after)
        .fetch_all(&self.pool)
        .await?;
        let mut events = Vec::new();
        for (text,) in rows {
            super::chunks::decode(&text, after, &mut events)?;
        }
        Ok(events)
    }

    /// One row per run per flush (see `chunks`), in transactions of a bounded size: a run's
    /// chunk is whole in one of them. Writing a chunk again is a no-op (the transaction that
    /// meets one is written again, skipping it), so a batch that failed halfway can be
    /// retried run by run.
    async fn append_log(&self, events: &[NewEvent], progress: &[Progress]) -> Result<(), StoreError> {
        let chunks = super::chunks::encode(events);
        for (rows, progress) in super::chunks::transactions(chunks, LOG_ROWS_PER_TRANSACTION, progress) {
            match append_log_once(&self.pool, &rows, &progress, Self::INSERT_CHUNKS).await {
                Err(e) if written_already(&e) => {
                    append_log_once(&self.pool, &rows, &progress, INSERT_CHUNKS_AGAIN).await?
                }
                written => written?,
            }
        }
        Ok(())
    }

    /// The chunks, indexed by run, are the log: whoever reads it finds the other's.
    async fn adopt_log(&self, _conn: &mut PgConnection, _trace_id: TraceId) -> Result<(), StoreError> {
        Ok(())
    }

    /// The chunks, indexed by run, are the log: nothing more to write.
    async fn seal_log(&self, _traces: &[TraceId]) -> Result<(), StoreError> {
        Ok(())
    }

    async fn tell(&self, notices: &[Notice]) -> Result<(), StoreError> {
        let (channels, payloads): (Vec<&str>, Vec<String>) = notices
            .iter()
            .filter_map(|notice| match *notice {
                Notice::Cancel(trace_id) => Some((CANCEL_CHANNEL, trace_id.to_string())),
                Notice::Logged(trace_id) => Some((LOG_CHANNEL, trace_id.to_string())),
                Notice::Started(conversation_id, trace_id) => {
                    Some((START_CHANNEL, format!("{conversation_id} {trace_id} {}", self.origin)))
                }
                Notice::Deleted(conversation_id) => Some((DELETED_CHANNEL, conversation_id.to_string())),
                Notice::Missed => None,
            })
            .unzip();
        if channels.is_empty() {
            return Ok(());
        }
        // One notification per notice, as one at a time sent them (a replica of the version
        // before reads each as it did), in their order.
        sqlx::query(
            "select pg_notify(n.channel, n.payload) from unnest($1::text[], $2::text[]) as n (channel, payload)",
        )
        .bind(&channels)
        .bind(&payloads)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// LISTENs on a connection of its own. When that connection is lost (a restart of the
    /// server, a killed backend), it connects and LISTENs on every channel anew, again and
    /// again with a growing pause, for as long as the store lives; notices sent meanwhile are
    /// lost, so once it listens again it tells [`Notice::Missed`]: every follower then reads
    /// the database again (a cancel asked meanwhile is answered by the caller's timeout).
    async fn listen(&self) -> Result<Option<BoxStream<'static, Notice>>, StoreError> {
        let (pool, origin, listening) = (self.pool.clone(), self.origin.clone(), self.listening.clone());
        let mut listener = match subscribe(&pool).await {
            Ok(listener) => Some(listener),
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for the other replicas' notices; trying again");
                listening.store(false, Ordering::Relaxed);
                None
            }
        };
        let notices = async_stream::stream! {
            let mut pause = RELISTEN_FIRST;
            loop {
                let Some(connected) = listener.as_mut() else {
                    tokio::time::sleep(pause).await;
                    match subscribe(&pool).await {
                        Ok(again) => {
                            tracing::info!("notice listener connected again");
                            listener = Some(again);
                            listening.store(true, Ordering::Relaxed);
                            pause = RELISTEN_FIRST;
                            yield Notice::Missed;
                        }
                        Err(e) => {
                            pause = (pause * 2).min(RELISTEN_MAX);
                            tracing::warn!(error = %e, retry_in = ?pause, "notice listener cannot connect again yet");
                        }
                    }
                    continue;
                };
                match connected.try_recv().await {
                    Ok(Some(notification)) => {
                        if let Some(notice) = notice(&notification, &origin) {
                            yield notice;
                        }
                    }
                    // `None`: the connection closed; an error: it broke. Either way a new
                    // one, subscribed anew (sqlx's own reconnect does not outlive an error).
                    lost => {
                        match lost {
                            Err(e) => tracing::warn!(error = %e, "notice listener lost its connection; reconnecting"),
                            Ok(_) => tracing::warn!("notice listener's connection closed; reconnecting"),
                        }
                        // Followers read again once it listens again: now the database
                        // may not answer.
                        listening.store(false, Ordering::Relaxed);
                        listener = None;
                    }
                }
            }
        };
        Ok(Some(notices.boxed()))
    }

    fn listening(&self) -> bool {
        self.listening.load(Ordering::Relaxed)
    }

    async fn bytes_lock(&self, sha256: &str) -> Result<Box<dyn BytesLock + '_>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        let lock = format!("select pg_advisory_lock({BYTES_LOCK})");
        if let Err(e) = sqlx::query(&lock).bind(sha256).execute(&mut *conn).await {
            conn.close_on_drop();
            return Err(e.into());
        }
        Ok(Box::new(PgBytesLock { conn, sha256: sha256.to_owned(), released: false }))
    }
}

/// The first pause before the notice listener connects again, and the longest.
const RELISTEN_FIRST: Duration = Duration::from_millis(100);
const RELISTEN_MAX: Duration = Duration::from_secs(5);

/// A listener on every channel replicas tell each other on.
async fn subscribe(pool: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen_all([CANCEL_CHANNEL, LOG_CHANNEL, START_CHANNEL, DELETED_CHANNEL]).await?;
    Ok(listener)
}

/// What a notification tells, if it is one to hear: a start this process told itself of when
/// it started the run is not heard again.
fn notice(notification: &PgNotification, origin: &str) -> Option<Notice> {
    match notification.channel() {
        CANCEL_CHANNEL => TraceId::parse(notification.payload()).ok().map(Notice::Cancel),
        LOG_CHANNEL => TraceId::parse(notification.payload()).ok().map(Notice::Logged),
        DELETED_CHANNEL => ConversationId::parse(notification.payload()).ok().map(Notice::Deleted),
        _ => {
            let mut fields = notification.payload().split(' ');
            let (conversation_id, trace_id) = (fields.next()?, fields.next()?);
            if fields.next() == Some(origin) {
                return None;
            }
            Some(Notice::Started(ConversationId::parse(conversation_id).ok()?, TraceId::parse(trace_id).ok()?))
        }
    }
}

/// A lock on one file's bytes: a session advisory lock, held on a connection of its own
/// that also does the lock's reads and writes (a second connection per holder could run the
/// pool dry under many uploads at once).
struct PgBytesLock {
    conn: PoolConnection<Postgres>,
    sha256: String,
    released: bool,
}

/// The advisory lock's key: the sha256 hashed by Postgres (seed 9: other locks use others).
const BYTES_LOCK: &str = "hashtextextended($1, 9)";

#[async_trait::async_trait]
impl BytesLock for PgBytesLock {
    async fn insert_file(&mut self, file: &StoredFile) -> Result<(), StoreError> {
        insert_file::<PostgresStore>(&mut self.conn, file).await
    }

    async fn used(&mut self) -> Result<bool, StoreError> {
        bytes_used::<PostgresStore>(&mut self.conn, &self.sha256).await
    }

    async fn release(mut self: Box<Self>) {
        let unlock = format!("select pg_advisory_unlock({BYTES_LOCK})");
        if sqlx::query(&unlock).bind(&self.sha256).execute(&mut *self.conn).await.is_ok() {
            self.released = true;
        }
    }
}

impl Drop for PgBytesLock {
    /// A lock not let go (its holder failed or was dropped midway) goes with its connection.
    fn drop(&mut self) {
        if !self.released {
            self.conn.close_on_drop();
        }
    }
}

/// `select * from unnest($1::uuid[], …)`: rows as one bound array per column, in the
/// insert's order (see [`Backend::push_conversation_arrays`]).
struct Arrays<'q, 'a, R> {
    query: &'q mut QueryBuilder<'a, Postgres>,
    rows: &'a [R],
    columns: usize,
}

impl<'q, 'a, R> Arrays<'q, 'a, R> {
    fn new(query: &'q mut QueryBuilder<'a, Postgres>, rows: &'a [R]) -> Self {
        query.push("select * from unnest(");
        Self { query, rows, columns: 0 }
    }

    /// The next column: the SQL type of one value, and each row's value.
    fn column<T>(self, element: &str, value: impl FnMut(&'a R) -> T) -> Self
    where
        Vec<T>: 'a + sqlx::Encode<'a, Postgres> + sqlx::Type<Postgres>,
    {
        if self.columns > 0 {
            self.query.push(", ");
        }
        let values: Vec<T> = self.rows.iter().map(value).collect();
        self.query.push_bind(values).push(format_args!("::{element}[]"));
        Self { columns: self.columns + 1, ..self }
    }

    fn end(self) -> bool {
        self.query.push(")");
        true
    }
}

/// One transaction of the log: its chunks (by `statement`) and its runs' checkpoints. Chunks
/// alone (most batches: a checkpoint comes at a step's end) are one statement, a transaction
/// of its own: no `BEGIN` or `COMMIT` of their own (the pool's ping before use stays).
async fn append_log_once(
    pool: &PgPool,
    rows: &[super::chunks::Chunk],
    progress: &[&Progress],
    statement: &'static str,
) -> Result<(), StoreError> {
    if progress.is_empty() {
        chunks_insert(rows, statement).execute(pool).await?;
        return Ok(());
    }
    let mut tx = pool.begin().await?;
    if !rows.is_empty() {
        chunks_insert(rows, statement).execute(&mut *tx).await?;
    }
    for p in progress {
        sqlx::query("update traces set checkpoint = $1 where id = $2 and status = 'running'")
            .bind(&p.checkpoint)
            .bind(p.trace_id)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Whether a write of the log failed for a chunk written already.
fn written_already(error: &StoreError) -> bool {
    let StoreError::Database(sqlx::Error::Database(db)) = error else { return false };
    db.is_unique_violation() && db.constraint() == Some("trace_event_chunks_pkey")
}

/// The insert of chunks of the log by `statement` ([`PostgresStore::INSERT_CHUNKS`] or
/// [`INSERT_CHUNKS_AGAIN`]); a chunk of a run whose trace is gone (its conversation deleted
/// meanwhile) is not written. Whoever follows the runs written from another process reads
/// again: the statement tells them, at its transaction's commit.
fn chunks_insert<'a>(
    rows: &'a [super::chunks::Chunk],
    statement: &'static str,
) -> sqlx::query::Query<'a, Postgres, sqlx::postgres::PgArguments> {
    let traces: Vec<TraceId> = rows.iter().map(|c| c.trace_id).collect();
    let firsts: Vec<i64> = rows.iter().map(|c| c.first_seq).collect();
    let lasts: Vec<i64> = rows.iter().map(|c| c.last_seq).collect();
    let events: Vec<&str> = rows.iter().map(|c| c.events.as_str()).collect();
    sqlx::query(statement).bind(traces).bind(firsts).bind(lasts).bind(events)
}
