//! The store's cluster concern (see [`ClusterStore`]).

use chrono::{DateTime, Utc};
use futures_util::stream::BoxStream;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, QueryBuilder, Type};
use uuid::Uuid;

use super::{Backend, Conn, Row, write};
use crate::ids::TraceId;
use crate::store::rows::*;
use crate::store::*;

#[async_trait::async_trait]
impl<B> ClusterStore for B
where
    B: Backend,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> RunningRow: FromRow<'r, Row<B>>,
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
        let sql = format!("select {TRACE_COLUMNS}, replica_id, heartbeat_at from traces where status = 'running'");
        let rows: Vec<RunningRow> = sqlx::query_as(&sql).fetch_all(self.pool()).await?;
        rows.into_iter().map(RunningTrace::try_from).collect()
    }

    async fn queued_traces(&self) -> Result<Vec<RunningTrace>, StoreError> {
        let sql = format!(
            "select {TRACE_COLUMNS}, replica_id, heartbeat_at from traces where status = 'queued' order by started_at, id"
        );
        let rows: Vec<RunningRow> = sqlx::query_as(&sql).fetch_all(self.pool()).await?;
        rows.into_iter().map(RunningTrace::try_from).collect()
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
}
