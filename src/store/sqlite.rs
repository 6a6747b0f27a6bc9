//! The SQLite backend: one file (created with its folder on first run), WAL journal, readers
//! in a pool and one writer connection: SQLite takes one writer at a time anyway, and writes
//! that queue here in order cost nothing, where writers racing for the file's lock sleep in
//! its busy handler (milliseconds each). Single-process only.

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
            .pragma("wal_autocheckpoint", "0");
        if let Some(folder) = options.get_filename().parent() {
            if !folder.as_os_str().is_empty() {
                std::fs::create_dir_all(folder)
                    .map_err(|e| StoreError::Url(format!("cannot create {}: {e}", folder.display())))?;
            }
        }
        let writer = SqlitePoolOptions::new().max_connections(1).connect_with(options.clone()).await?;
        sqlx::migrate!("migrations/sqlite").run(&writer).await?;
        let pool = SqlitePoolOptions::new().max_connections(max_connections).connect_with(options).await?;
        let stop = CancellationToken::new();
        tokio::spawn(checkpoints(pool.clone(), stop.clone()));
        Ok(Self { pool, writer, _checkpoints: stop.drop_guard() })
    }

    fn writer(&self) -> &SqlitePool {
        &self.writer
    }
}

/// Copies the WAL back into the database file every [`CHECKPOINT_EVERY`], on a reading
/// connection. SQLite's automatic checkpoint runs inside the commit that crosses 1,000 pages,
/// with an fsync, while that commit holds the one writer: a new chat's start queued behind it
/// for a tenth of a second at a time. A passive checkpoint waits for no reader or writer.
async fn checkpoints(pool: SqlitePool, stop: CancellationToken) {
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
    }
}

impl crate::store::Shared for SqliteStore {
    const BEGIN_WRITE: &'static str = "BEGIN IMMEDIATE";
    const SHARED: bool = false;
    const LOG_ROWS_PER_TRANSACTION: usize = 100;
}

impl_store!(SqliteStore, Sqlite);

impl SqliteStore {
    /// One process per SQLite file: there is nobody else to tell.
    async fn notify_cancel_impl(&self, _trace_id: Uuid) -> Result<(), StoreError> {
        Ok(())
    }

    async fn cancel_requests_impl(&self) -> Result<Option<BoxStream<'static, Uuid>>, StoreError> {
        Ok(None)
    }
}
