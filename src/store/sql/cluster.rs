//! The store's cluster concern (see [`ClusterStore`]).

use chrono::{DateTime, Utc};
use futures_util::stream::BoxStream;
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};
use uuid::Uuid;

use super::{Backend, Conn, Row, write};
use crate::domain::now;
use crate::ids::TraceId;
use crate::store::rows::*;
use crate::store::*;

/// A running or queued trace with its replica's last beat (or its own, from its start, where
/// the replica has not beaten yet).
const BEAT_COLUMNS: &str = "replica_id, coalesce(beat_at, heartbeat_at) as heartbeat_at";
/// What joins a trace to its replica's beat.
const BEATS: &str = "left join replicas on replica = replica_id";

#[async_trait::async_trait]
impl<B> ClusterStore for B
where
    B: Backend,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> RunningRow: FromRow<'r, Row<B>>,
    for<'r> (Option<Json<Value>>,): FromRow<'r, Row<B>>,
    for<'r> (String,): FromRow<'r, Row<B>>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
{
    async fn ping(&self) -> Result<(), StoreError> {
        self.ping_database().await
    }

    fn is_shared(&self) -> bool {
        B::SHARED
    }

    fn hears_others(&self) -> bool {
        self.listening()
    }

    async fn running_traces(&self) -> Result<Vec<RunningTrace>, StoreError> {
        let sql = format!("select {TRACE_COLUMNS}, {BEAT_COLUMNS} from traces {BEATS} where status = 'running'");
        let rows: Vec<RunningRow> = sqlx::query_as(&sql).fetch_all(self.pool()).await?;
        rows.into_iter().map(RunningTrace::try_from).collect()
    }

    async fn left_running(
        &self,
        quiet_since: DateTime<Utc>,
        replica_id: &str,
    ) -> Result<Vec<RunningTrace>, StoreError> {
        let sql = format!(
            "select {TRACE_COLUMNS}, {BEAT_COLUMNS} from traces {BEATS} where status = 'running' \
             and coalesce(replica_id, '') <> $2 and coalesce(beat_at, heartbeat_at) < $1"
        );
        let rows: Vec<RunningRow> =
            sqlx::query_as(&sql).bind(quiet_since).bind(replica_id).fetch_all(self.pool()).await?;
        rows.into_iter().map(RunningTrace::try_from).collect()
    }

    async fn queued_traces(&self) -> Result<Vec<RunningTrace>, StoreError> {
        let sql = format!(
            "select {TRACE_COLUMNS}, {BEAT_COLUMNS} from traces {BEATS} where status = 'queued' order by started_at, id"
        );
        let rows: Vec<RunningRow> = sqlx::query_as(&sql).fetch_all(self.pool()).await?;
        rows.into_iter().map(RunningTrace::try_from).collect()
    }

    async fn heartbeat(&self, replica_id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        write(self, async |conn| {
            let beat = sqlx::query(
                "insert into replicas (replica, beat_at) values ($1, $2) \
                 on conflict (replica) do update set beat_at = excluded.beat_at",
            );
            beat.bind(replica_id).bind(at).execute(conn).await?;
            Ok(())
        })
        .await
    }

    async fn held_elsewhere(&self, traces: &[TraceId], replica_id: &str) -> Result<Vec<TraceId>, StoreError> {
        if traces.is_empty() {
            return Ok(Vec::new());
        }
        self.running_elsewhere(traces, replica_id).await
    }

    async fn others_alive(&self, replica_id: &str, quiet_since: DateTime<Utc>) -> Result<bool, StoreError> {
        let alive: Vec<(String,)> =
            sqlx::query_as("select replica from replicas where replica <> $1 and beat_at >= $2 limit 1")
                .bind(replica_id)
                .bind(quiet_since)
                .fetch_all(self.pool())
                .await?;
        Ok(!alive.is_empty())
    }

    async fn release_running(&self, replica_id: &str) -> Result<u64, StoreError> {
        write(self, async |conn| {
            let released = sqlx::query(
                "update traces set replica_id = '', heartbeat_at = $2 where replica_id = $1 and status = 'running'",
            )
            .bind(replica_id)
            .bind(DateTime::<Utc>::UNIX_EPOCH)
            .execute(conn)
            .await?;
            Ok(B::rows_affected(&released))
        })
        .await
    }

    async fn forget_replicas(&self, quiet_since: DateTime<Utc>) -> Result<(), StoreError> {
        write(self, async |conn| {
            sqlx::query("delete from replicas where beat_at < $1").bind(quiet_since).execute(conn).await?;
            Ok(())
        })
        .await
    }

    async fn take_over(
        &self,
        trace_id: TraceId,
        from: Option<&str>,
        replica_id: &str,
    ) -> Result<Option<Option<Value>>, StoreError> {
        write(self, async |conn| {
            let claimed: Option<(Option<Json<Value>>,)> = sqlx::query_as(
                "update traces set replica_id = $2, heartbeat_at = $3 \
                 where id = $1 and status = 'running' and coalesce(replica_id, '') = $4 returning checkpoint",
            )
            .bind(trace_id)
            .bind(replica_id)
            .bind(now())
            .bind(from.unwrap_or(""))
            .fetch_optional(&mut *conn)
            .await?;
            let Some((checkpoint,)) = claimed else { return Ok(None) };
            self.adopt_log(conn, trace_id).await?;
            Ok(Some(checkpoint.map(|c| c.0)))
        })
        .await
    }

    async fn notify(&self, notices: &[Notice]) -> Result<(), StoreError> {
        self.tell(notices).await
    }

    async fn notices(&self) -> Result<Option<BoxStream<'static, Notice>>, StoreError> {
        self.listen().await
    }
}
