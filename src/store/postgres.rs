//! The Postgres backend: native uuid, timestamptz and jsonb; several chatd replicas may share
//! one database.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::types::Json;
use sqlx::{PgPool, Postgres};
use uuid::Uuid;

use super::rows::*;
use super::sql::impl_store;
use super::{ConversationPatch, NewEvent, PageCursor, RunFinish, RunStart, StoreError};
use crate::domain::{Conversation, Feedback, LoggedEvent, Message, Trace, now};

pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    /// Connects to `url` and runs the Postgres migrations.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect(url)
            .await?;
        sqlx::migrate!("migrations/postgres").run(&pool).await?;
        Ok(Self { pool })
    }
}

impl_store!(PostgresStore, Postgres);
