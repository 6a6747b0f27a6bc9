//! The SQLite backend: one file (created with its folder on first run), WAL journal, readers
//! in a pool and one writer connection: SQLite takes one writer at a time anyway, and writes
//! that queue here in order cost nothing, where writers racing for the file's lock sleep in
//! its busy handler (milliseconds each). Single-process only.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::types::Json;
use sqlx::{Sqlite, SqlitePool};
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
}

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
            .foreign_keys(true);
        if let Some(folder) = options.get_filename().parent() {
            if !folder.as_os_str().is_empty() {
                std::fs::create_dir_all(folder)
                    .map_err(|e| StoreError::Url(format!("cannot create {}: {e}", folder.display())))?;
            }
        }
        let writer = SqlitePoolOptions::new().max_connections(1).connect_with(options.clone()).await?;
        sqlx::migrate!("migrations/sqlite").run(&writer).await?;
        let pool = SqlitePoolOptions::new().max_connections(max_connections).connect_with(options).await?;
        Ok(Self { pool, writer })
    }

    fn writer(&self) -> &SqlitePool {
        &self.writer
    }
}

impl crate::store::Shared for SqliteStore {
    const BEGIN_WRITE: &'static str = "BEGIN IMMEDIATE";
    const SHARED: bool = false;
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
