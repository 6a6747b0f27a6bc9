//! The SQLite backend: one file (created with its folder on first run), WAL journal, readers
//! in a pool and one writer connection: SQLite takes one writer at a time anyway, and writes
//! that queue here in order cost nothing, where writers racing for the file's lock sleep in
//! its busy handler (milliseconds each). Single-process only.
//!
//! The event log (migration 0005): a running run's chunks are appended to
//! `trace_event_chunks`, which has no index; its whole log is written as one row of
//! `trace_logs` when it ends ([`Store::seal_logs`](super::Store::seal_logs)), and the chunks
//! of ended runs are deleted from the front of the table as they age out.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::types::Json;
use sqlx::{Sqlite, SqlitePool};
use tokio_util::sync::{CancellationToken, DropGuard};
use uuid::Uuid;

use super::rows::*;
use super::sql::impl_store;
use super::{ConversationPatch, NewEvent, PageCursor, RunFinish, RunStart, RunningTrace, StoreError};
use chrono::{DateTime, Utc};
use futures_util::stream::BoxStream;

use serde_json::Value;

use crate::domain::{Comparison, Conversation, Feedback, LoggedEvent, Message, Preference, Trace, Vote, now};

pub struct SqliteStore {
    pool: SqlitePool,
    writer: SqlitePool,
    /// Stops the upkeep task with the store.
    _upkeep: DropGuard,
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
            // Checkpoints run beside the writer (see `upkeep`), not inside its commits.
            .pragma("wal_autocheckpoint", "0")
            .pragma("journal_size_limit", "67108864");
        if let Some(folder) = options.get_filename().parent() {
            if !folder.as_os_str().is_empty() {
                std::fs::create_dir_all(folder)
                    .map_err(|e| StoreError::Url(format!("cannot create {}: {e}", folder.display())))?;
            }
        }
        let writer = SqlitePoolOptions::new().max_connections(1).connect_with(options.clone()).await?;
        sqlx::migrate!("migrations/sqlite").run(&writer).await?;
        seal_left_over_logs(&writer).await?;
        let pool = SqlitePoolOptions::new().max_connections(max_connections).connect_with(options).await?;
        let stop = CancellationToken::new();
        tokio::spawn(upkeep(pool.clone(), writer.clone(), stop.clone()));
        Ok(Self { pool, writer, _upkeep: stop.drop_guard() })
    }

    fn writer(&self) -> &SqlitePool {
        &self.writer
    }
}

/// Chunks of ended runs deleted per statement, at most.
const CHUNKS_DELETED_PER_STATEMENT: i64 = 2000;

/// Every [`CHECKPOINT_EVERY`]: copies the WAL back into the database file, and deletes the
/// chunks of runs whose log is sealed.
///
/// The copy runs on a reading connection: SQLite's automatic checkpoint runs inside the
/// commit that crosses 1,000 pages, with an fsync, while that commit holds the one writer, and
/// a new chat's start queued behind it. A passive checkpoint waits for nobody; the WAL starts
/// over at the first write after one that caught up (writes come in batches, with pauses
/// between them), and `journal_size_limit` then gives back what a burst made it grow to. A
/// checkpoint on the writer to force the catch-up held it for up to a second (its fsync).
async fn upkeep(pool: SqlitePool, writer: SqlitePool, stop: CancellationToken) {
    let mut every = tokio::time::interval(CHECKPOINT_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        if let Err(e) = sqlx::query("pragma wal_checkpoint(passive)").execute(&pool).await {
            tracing::warn!(error = %e, "WAL checkpoint failed");
        }
        if let Err(e) = delete_sealed_chunks(&writer).await {
            tracing::warn!(error = %e, "could not delete the chunks of sealed logs");
        }
    }
}

/// Deletes the chunks written before the oldest run whose log is not sealed yet, a bounded
/// number per statement: a new chat's start waits for one statement at most.
async fn delete_sealed_chunks(writer: &SqlitePool) -> Result<(), sqlx::Error> {
    loop {
        let deleted = sqlx::query(
            "delete from trace_event_chunks where id <= min( \
                 coalesce((select min(log_from) from traces where log_sealed = 0), \
                          (select max(id) from trace_event_chunks)), \
                 (select min(id) from trace_event_chunks) + $1 - 1)",
        )
        .bind(CHUNKS_DELETED_PER_STATEMENT)
        .execute(writer)
        .await?
        .rows_affected();
        if i64::try_from(deleted).unwrap_or(i64::MAX) < CHUNKS_DELETED_PER_STATEMENT {
            return Ok(());
        }
    }
}

/// Seals the logs of runs that ended, or were running, when the process that ran them
/// stopped: from their chunks, in order (a chunk written twice by a retry is dropped when
/// read).
async fn seal_left_over_logs(writer: &SqlitePool) -> Result<(), StoreError> {
    let mut tx = writer.begin_with("BEGIN IMMEDIATE").await?;
    sqlx::query(
        "insert or replace into trace_logs (trace_id, events) \
         select t.id, '[' || group_concat(substr(c.events, 2, length(c.events) - 2), ',' order by c.id) || ']' \
         from traces t join trace_event_chunks c on c.id > t.log_from and c.trace_id = t.id \
         where t.log_sealed = 0 group by t.id",
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query("update traces set log_sealed = 1 where log_sealed = 0").execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

impl crate::store::Shared for SqliteStore {
    const BEGIN_WRITE: &'static str = "BEGIN IMMEDIATE";
    const SHARED: bool = false;
    const LOG_ROWS_PER_TRANSACTION: usize = 100;
    const LOG_INSERT_TAIL: &'static str = "";
    const MANY_STATEMENTS_PER_QUERY: bool = true;
}

impl_store!(SqliteStore, Sqlite);

/// Sealed logs written per transaction, at most.
const LOGS_PER_TRANSACTION: usize = 100;

impl SqliteStore {
    /// A sealed run's log is its row in `trace_logs`; a running one's, its chunks since
    /// `log_from`. Both are read in one transaction: a log sealed meanwhile loses its chunks.
    async fn trace_events_impl(&self, trace_id: Uuid, after: i64) -> Result<Vec<LoggedEvent>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let sealed: Option<(String,)> = sqlx::query_as("select events from trace_logs where trace_id = $1")
            .bind(trace_id)
            .fetch_optional(&mut *tx)
            .await?;
        let texts = match sealed {
            Some(text) => vec![text],
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
        // A chunk written again by a retried batch repeats its events.
        events.sort_by_key(|e| e.seq);
        events.dedup_by_key(|e| e.seq);
        Ok(events)
    }

    /// Each run's log as one row; a run deleted meanwhile is skipped.
    async fn seal_logs_impl(&self, logs: &[Vec<NewEvent>]) -> Result<(), StoreError> {
        let chunks: Vec<super::chunks::Chunk> = logs.iter().flat_map(|log| super::chunks::encode(log)).collect();
        for rows in chunks.chunks(LOGS_PER_TRANSACTION) {
            let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
            let mut insert = sqlx::QueryBuilder::<Sqlite>::new(
                "insert or replace into trace_logs (trace_id, events) select column1, column2 from (",
            );
            insert.push_values(rows, |mut row, c| {
                row.push_bind(c.trace_id).push_bind(&c.events);
            });
            insert.push(") where column1 in (select id from traces)");
            insert.build().execute(&mut *tx).await?;
            let mut mark = sqlx::QueryBuilder::<Sqlite>::new("update traces set log_sealed = 1 where id in (");
            let mut ids = mark.separated(", ");
            for c in rows {
                ids.push_bind(c.trace_id);
            }
            mark.push(")");
            mark.build().execute(&mut *tx).await?;
            tx.commit().await?;
        }
        Ok(())
    }

    /// One process per SQLite file: there is nobody else to tell.
    async fn notify_cancel_impl(&self, _trace_id: Uuid) -> Result<(), StoreError> {
        Ok(())
    }

    async fn cancel_requests_impl(&self) -> Result<Option<BoxStream<'static, Uuid>>, StoreError> {
        Ok(None)
    }
}
