//! The event log (see [`LogStore`]): each backend keeps its own (SQLite's in chunks with a writer of its own, Postgres's in a table).

use sqlx::{Database, Executor, IntoArguments};

use super::{Backend, Conn};
use crate::events::LoggedEvent;
use crate::ids::TraceId;
use crate::store::*;

#[async_trait::async_trait]
impl<B> LogStore for B
where
    B: Backend,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
{
    async fn append_events(&self, events: &[NewEvent], progress: &[Progress]) -> Result<(), StoreError> {
        self.append_log(events, progress).await
    }

    async fn trace_events(&self, trace_id: TraceId, after: i64) -> Result<Vec<LoggedEvent>, StoreError> {
        self.read_log(trace_id, after).await
    }

    async fn seal_logs(&self, traces: &[TraceId]) -> Result<(), StoreError> {
        self.seal_log(traces).await
    }
}
