//! The SQLite backend: one file (created with its folder on first run), WAL journal, readers
//! in a pool and one writer connection: SQLite takes one writer at a time anyway, and writes
//! that queue here in order cost nothing, where writers racing for the file's lock sleep in
//! its busy handler (milliseconds each). Single-process only.
//!
//! The writer is a connection behind a lock, not a pool of one: sqlx's pool tests every
//! connection given back to it with a ping, a trip to the connection's thread during which
//! the next write waits (at load, each trip waits for a worker too).
//!
//! The event log (migration 0005): chunks are appended to `trace_event_chunks`, which has no
//! index. A running run's chunks are those after its `log_from` with its trace id; when it
//! ends, the ids of its chunks (kept here meanwhile) become its row of `trace_logs`
//! ([`Store::seal_logs`](super::Store::seal_logs)), and the row's deletion takes them along.

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId, UserId};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::types::Json;
use sqlx::{ConnectOptions, Sqlite, SqliteConnection, SqlitePool};
use tokio_util::sync::{CancellationToken, DropGuard};

use super::rows::*;
use super::sql::impl_store;
use super::{ConversationPatch, NewEvent, Notice, PageCursor, RunFinish, RunStart, RunningTrace, StoreError};
use chrono::{DateTime, Utc};
use futures_util::stream::BoxStream;

use serde_json::Value;

use crate::domain::{Comparison, ContextState, Conversation, Feedback, Message, Preference, Trace, Vote, now};
use crate::events::LoggedEvent;

pub struct SqliteStore {
    pool: SqlitePool,
    /// The one connection that writes; `None` once a fault made it unfit (see [`Self::write`]),
    /// until the next write opens a new one.
    writer: tokio::sync::Mutex<Option<SqliteConnection>>,
    /// How the writer is opened again after a fault.
    options: SqliteConnectOptions,
    /// What tells whether writes work now, for readiness (shared with the checkpoint task).
    health: Arc<WriteHealth>,
    /// The ids of the chunks written for each run not sealed yet.
    chunk_ids: Mutex<HashMap<TraceId, Vec<i64>>>,
    /// The id the next chunk gets: above every id in the table, so a run's chunks are all
    /// after its `log_from` (taken only while holding the writer).
    next_chunk_id: AtomicI64,
    /// Stops the checkpoint task with the store.
    _checkpoints: DropGuard,
}

/// How often the WAL is copied back into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

impl SqliteStore {
    /// Opens (creating if needed) the database at `url` and runs the SQLite migrations.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // WAL makes NORMAL durable against application crashes; only a power cut can
            // lose the last transactions.
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true)
            // Checkpoints run beside the writer (see `checkpoints`), not inside its commits.
            .pragma("wal_autocheckpoint", "0")
            .pragma("journal_size_limit", "67108864");
        if let Some(folder) = options.get_filename().parent() {
            if !folder.as_os_str().is_empty() {
                std::fs::create_dir_all(folder)
                    .map_err(|e| StoreError::Url(format!("cannot create {}: {e}", folder.display())))?;
            }
        }
        let path = options.get_filename().to_owned();
        let mut writer = options.connect().await?;
        sqlx::migrate!("migrations/sqlite").run(&mut writer).await?;
        seal_left_over_logs(&mut writer).await?;
        let (last_chunk_id,): (i64,) =
            sqlx::query_as("select coalesce(max(id), 0) from trace_event_chunks").fetch_one(&mut writer).await?;
        // A connection to a local file does not go stale: no ping before each use (sqlx's
        // default), which cost every read a second trip to the connection's thread.
        let pool = SqlitePoolOptions::new()
            .test_before_acquire(false)
            .max_connections(max_connections)
            .connect_with(options.clone())
            .await?;
        let health = Arc::new(WriteHealth { failing: AtomicBool::new(false), file: FileIdentity::of(&path) });
        let stop = CancellationToken::new();
        tokio::spawn(checkpoints(pool.clone(), health.clone(), stop.clone()));
        Ok(Self {
            pool,
            writer: tokio::sync::Mutex::new(Some(writer)),
            options,
            health,
            chunk_ids: Mutex::default(),
            next_chunk_id: AtomicI64::new(last_chunk_id + 1),
            _checkpoints: stop.drop_guard(),
        })
    }

    /// Runs `f` on the writer, once the writes before this one are done (in the order they
    /// asked). A write that fails for a fault of the database (disk full, I/O error, the
    /// file gone) or that leaves a transaction open (its `ROLLBACK` may have failed too)
    /// takes the connection with it: closing it rolls back whatever it held, and the next
    /// write opens a new one. Without that, one failed `COMMIT` left sqlx's transaction depth
    /// at one and every later write failed until a restart. Until a write succeeds again,
    /// the store reports itself unwritable ([`Store::ping`](super::Store::ping)).
    async fn write<T>(
        &self,
        f: impl AsyncFnOnce(&mut SqliteConnection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut slot = self.writer.lock().await;
        self.health.file.check()?;
        let conn = match &mut *slot {
            Some(conn) => conn,
            empty => match self.options.connect().await {
                Ok(conn) => {
                    tracing::info!("opened a new SQLite writer connection");
                    empty.insert(conn)
                }
                Err(e) => {
                    self.health.failing.store(true, Ordering::Relaxed);
                    return Err(StoreError::Unavailable(format!("cannot open the database for writing: {e}")));
                }
            },
        };
        let result = f(conn).await;
        match &result {
            Ok(_) => {
                if self.health.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("the database takes writes again");
                }
            }
            Err(e) if e.is_unavailable() || sqlx::Connection::is_in_transaction(&*conn) => {
                if e.is_unavailable() {
                    self.health.failing.store(true, Ordering::Relaxed);
                }
                tracing::error!(error = %e, "a write failed; the writer connection is closed and opened anew for the next one");
                *slot = None;
            }
            Err(_) => {}
        }
        result
    }

    /// A write of 64 KiB, about what an answer and its log take: what readiness tries while
    /// writes fail (a tiny write can pass on a disk too full for an answer).
    async fn probe_write(&self) -> Result<(), StoreError> {
        self.write(async |conn| {
            sqlx::query(
                "insert into write_probe (id, at, payload) values (1, $1, zeroblob(65536)) \
                 on conflict (id) do update set at = excluded.at, payload = excluded.payload",
            )
            .bind(crate::domain::now())
            .execute(conn)
            .await?;
            Ok(())
        })
        .await
    }

    /// Reads answer, and writes work (tried again while they were failing).
    async fn ping_impl(&self) -> Result<(), StoreError> {
        sqlx::query("select 1").execute(&self.pool).await?;
        self.health.file.check()?;
        if self.health.failing.load(Ordering::Relaxed) {
            self.probe_write().await?;
        }
        Ok(())
    }
}

/// Whether writes work, as the last one found, and the file they go to.
struct WriteHealth {
    failing: AtomicBool,
    file: FileIdentity,
}

/// The database file as it was opened. A file deleted (or replaced) under a running chatd
/// still takes writes through the open descriptors, and all of them are lost at the next
/// start: the checkpoint task looks at the path every second, and from then on writes and
/// readiness fail, naming the file.
struct FileIdentity {
    path: PathBuf,
    /// (device, inode) at start; `None` for a database with no file (`sqlite::memory:`).
    opened: Option<(u64, u64)>,
    lost: AtomicBool,
}

impl FileIdentity {
    fn of(path: &std::path::Path) -> Self {
        Self { path: path.to_owned(), opened: Self::identity(path).ok(), lost: AtomicBool::new(false) }
    }

    fn identity(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path)?;
        Ok((meta.dev(), meta.ino()))
    }

    /// Looks at the path again; true while it is still the file chatd opened.
    fn look(&self) -> bool {
        if self.lost.load(Ordering::Relaxed) {
            return false;
        }
        let Some(opened) = self.opened else { return true };
        if Self::identity(&self.path).is_ok_and(|now| now == opened) {
            return true;
        }
        tracing::error!(
            path = %self.path.display(),
            "the database file was deleted or replaced while chatd runs; writes are refused (they would be lost): restore it or restart chatd"
        );
        self.lost.store(true, Ordering::Relaxed);
        false
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.lost.load(Ordering::Relaxed) {
            return Err(StoreError::Unavailable(format!(
                "the database file {} was deleted or replaced; restart chatd",
                self.path.display()
            )));
        }
        Ok(())
    }
}

/// Every [`CHECKPOINT_EVERY`], copies the WAL back into the database file, on a reading
/// connection. SQLite's automatic checkpoint runs inside the commit that crosses 1,000 pages,
/// with an fsync, while that commit holds the one writer, and a new chat's start queued
/// behind it. A passive checkpoint waits for nobody; the WAL starts over at the first write
/// after one that caught up (writes come in batches, with pauses between them), and
/// `journal_size_limit` then gives back what a burst made it grow to. (A checkpoint on the
/// writer, to force the catch-up, held it for up to a second: its fsync.)
async fn checkpoints(pool: SqlitePool, health: Arc<WriteHealth>, stop: CancellationToken) {
    let mut every = tokio::time::interval(CHECKPOINT_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        if !health.file.look() {
            continue;
        }
        if let Err(e) = sqlx::query("pragma wal_checkpoint(passive)").execute(&pool).await {
            tracing::warn!(error = %e, "WAL checkpoint failed");
        }
    }
}

/// Seals the logs of runs that ended, or were running, when the process that ran them
/// stopped: from their chunks after `log_from`.
async fn seal_left_over_logs(writer: &mut SqliteConnection) -> Result<(), StoreError> {
    let mut tx = sqlx::Connection::begin_with(writer, "BEGIN IMMEDIATE").await?;
    sqlx::query(
        "insert into trace_logs (trace_id, chunk_ids) \
         select t.id, json_group_array(c.id) \
         from traces t join trace_event_chunks c on c.id > t.log_from and c.trace_id = t.id \
         where t.log_sealed = 0 group by t.id \
         on conflict (trace_id) do update set chunk_ids = excluded.chunk_ids",
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query("update traces set log_sealed = 1 where log_sealed = 0").execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// Chunks of the event log written per transaction. SQLite has one writer: a flush of a
/// thousand runs in one transaction held it for milliseconds, and a new chat's start waited
/// behind it; in smaller transactions, starts get the writer in between.
const LOG_ROWS_PER_TRANSACTION: usize = 100;

impl crate::store::Shared for SqliteStore {
    const BEGIN_WRITE: &'static str = "BEGIN IMMEDIATE";
    const SHARED: bool = false;
    const MANY_STATEMENTS_PER_QUERY: bool = true;
}

impl_store!(SqliteStore, Sqlite);

/// Runs and their lists of chunk ids as a `values` table (`column1`, `column2`).
fn lists_as_values<'a>(query: &mut sqlx::QueryBuilder<'a, Sqlite>, lists: &'a [(TraceId, String)]) {
    query.push_values(lists, |mut row, (trace_id, ids)| {
        row.push_bind(*trace_id).push_bind(ids.as_str());
    });
}

/// Sealed logs written per transaction, at most.
const LOGS_PER_TRANSACTION: usize = 500;

impl SqliteStore {
    /// One row per run per flush (see `chunks`), in transactions of a bounded size (a new
    /// chat's start waits for one of them, not for a whole flush), each sent as one query
    /// (`BEGIN IMMEDIATE; insert …; COMMIT`): one trip to the connection's thread instead of
    /// three, each of which, at load, waits in the runtime's queue on its way back while the
    /// transaction holds the writer. The rows' ids are given here, under the writer's lock,
    /// and kept for sealing: read back with `returning`, they came through sqlx's channel one
    /// row at a time, its thread blocking whenever the channel was full.
    async fn append_events_impl(&self, events: &[NewEvent]) -> Result<(), StoreError> {
        let chunks = super::chunks::encode(events);
        for rows in chunks.chunks(LOG_ROWS_PER_TRANSACTION) {
            let ids = self
                .write(async |conn| {
                    let first_id = self.next_chunk_id.fetch_add(rows.len() as i64, Ordering::Relaxed);
                    let ids = first_id..;
                    let mut query = sqlx::QueryBuilder::<Sqlite>::new(
                        "BEGIN IMMEDIATE; insert into trace_event_chunks (id, trace_id, first_seq, last_seq, events) ",
                    );
                    query.push_values(rows.iter().zip(ids.clone()), |mut row, (c, id)| {
                        row.push_bind(id)
                            .push_bind(c.trace_id)
                            .push_bind(c.first_seq)
                            .push_bind(c.last_seq)
                            .push_bind(&c.events);
                    });
                    query.push("; COMMIT");
                    Self::transaction_as_one_query(conn, query).await?;
                    Ok(ids)
                })
                .await?;
            let mut kept = self.chunk_ids.lock().expect("chunk ids lock");
            for (c, id) in rows.iter().zip(ids) {
                kept.entry(c.trace_id).or_default().push(id);
            }
        }
        Ok(())
    }

    /// A sealed run's chunks are those its row lists; a running one's, those after its
    /// `log_from`. Both are read in one transaction. A chunk written twice (a batch retried
    /// run by run after it failed halfway) is read once.
    async fn trace_events_impl(&self, trace_id: TraceId, after: i64) -> Result<Vec<LoggedEvent>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let sealed: Option<(String,)> = sqlx::query_as("select chunk_ids from trace_logs where trace_id = $1")
            .bind(trace_id)
            .fetch_optional(&mut *tx)
            .await?;
        let texts: Vec<(String,)> = match sealed {
            Some((ids,)) => {
                sqlx::query_as(
                    "select events from trace_event_chunks \
                     where id in (select value from json_each($1)) and last_seq > $2 order by id",
                )
                .bind(ids)
                .bind(after)
                .fetch_all(&mut *tx)
                .await?
            }
            None => {
                sqlx::query_as(
                    "select events from trace_event_chunks \
                     where id > (select log_from from traces where id = $1) and trace_id = $1 and last_seq > $2 \
                     order by id",
                )
                .bind(trace_id)
                .bind(after)
                .fetch_all(&mut *tx)
                .await?
            }
        };
        tx.commit().await?;
        let mut events = Vec::new();
        for (text,) in texts {
            super::chunks::decode(&text, after, &mut events)?;
        }
        events.sort_by_key(|e| e.seq);
        events.dedup_by_key(|e| e.seq);
        Ok(events)
    }

    /// Writes each run's list of chunks as its row of `trace_logs`. The chunks of a run
    /// deleted meanwhile have no row to go with: they are deleted here. Each group of runs is
    /// one query, as for appends.
    async fn seal_logs_impl(&self, traces: &[TraceId]) -> Result<(), StoreError> {
        for traces in traces.chunks(LOGS_PER_TRANSACTION) {
            let lists: Vec<(TraceId, String)> = {
                let kept = self.chunk_ids.lock().expect("chunk ids lock");
                traces
                    .iter()
                    .map(|t| {
                        let ids = kept.get(t).map(Vec::as_slice).unwrap_or_default();
                        (*t, serde_json::to_string(ids).expect("ids serialize"))
                    })
                    .collect()
            };
            // (The `where` tells SQLite that `on conflict` belongs to the insert.)
            let mut query = sqlx::QueryBuilder::<Sqlite>::new(
                "BEGIN IMMEDIATE; insert into trace_logs (trace_id, chunk_ids) select column1, column2 from (",
            );
            lists_as_values(&mut query, &lists);
            query.push(
                ") where column1 in (select id from traces) \
                 on conflict (trace_id) do update set chunk_ids = excluded.chunk_ids; \
                 update traces set log_sealed = 1 where id in (",
            );
            let mut ids = query.separated(", ");
            for t in traces {
                ids.push_bind(*t);
            }
            query.push("); delete from trace_event_chunks where id in (select chunk.value from (");
            lists_as_values(&mut query, &lists);
            query.push(") as list, json_each(list.column2) as chunk where list.column1 not in (select id from traces)); COMMIT");
            self.write(async |conn| Ok(Self::transaction_as_one_query(conn, query).await?)).await?;
            let mut kept = self.chunk_ids.lock().expect("chunk ids lock");
            for t in traces {
                kept.remove(t);
            }
        }
        Ok(())
    }

    /// One process per SQLite file: there is nobody else to tell.
    async fn notify_impl(&self, _notice: Notice) -> Result<(), StoreError> {
        Ok(())
    }

    async fn notices_impl(&self) -> Result<Option<BoxStream<'static, Notice>>, StoreError> {
        Ok(None)
    }
}
