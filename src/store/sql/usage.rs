//! The store's usage concern (see [`UsageStore`]): sums over `run_usage`, one row per run,
//! which outlives its conversation (CONTRACT.md §18).

use chrono::{DateTime, Utc};
use sqlx::{Database, Executor, FromRow, IntoArguments, Type};

use super::statements::Statements;
use super::{Conn, Row};
use crate::domain::Usage;
use crate::ids::{TraceId, UserId};
use crate::store::*;

#[derive(sqlx::FromRow)]
struct GroupRow {
    key: String,
    runs: i64,
    input_tokens: i64,
    output_tokens: i64,
    cache_read_tokens: i64,
    cache_write_tokens: i64,
    cost_usd: Option<f64>,
}

#[derive(sqlx::FromRow, Clone)]
pub(super) struct SpendRow {
    tokens: i64,
    reserved_tokens: i64,
    usd: f64,
    reserved_usd: f64,
}

impl From<SpendRow> for Spend {
    fn from(row: SpendRow) -> Self {
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        Spend {
            tokens: count(row.tokens),
            reserved_tokens: count(row.reserved_tokens),
            usd: row.usd,
            reserved_usd: row.reserved_usd,
        }
    }
}

#[async_trait::async_trait]
impl<B> UsageStore for B
where
    B: Statements,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> GroupRow: FromRow<'r, Row<B>>,
    for<'r> SpendRow: FromRow<'r, Row<B>>,
    for<'q> crate::ids::TraceId: sqlx::Encode<'q, B::Db> + Type<B::Db>,
    for<'q> i64: sqlx::Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<f64>: sqlx::Encode<'q, B::Db>,
    f64: Type<B::Db>,
    for<'q> &'q str: sqlx::Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: sqlx::Encode<'q, B::Db> + Type<B::Db>,
{
    async fn usage_sums(
        &self,
        user: Option<&UserId>,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        group_by: UsageGrouping,
    ) -> Result<Vec<UsageGroup>, StoreError> {
        let key = match group_by {
            UsageGrouping::Day => B::DAY_STARTED,
            UsageGrouping::Model => "model",
            UsageGrouping::Profile => "profile",
            UsageGrouping::User => "user_id",
        };
        // The period's rows by the index on (user_id, started_at), or on started_at for
        // every user's; the sums are the database's.
        let whose = if user.is_some() { "user_id = $3 and " } else { "" };
        let sql = format!(
            "select {key} as key, count(*) as runs, \
             cast(coalesce(sum(input_tokens), 0) as bigint) as input_tokens, \
             cast(coalesce(sum(output_tokens), 0) as bigint) as output_tokens, \
             cast(coalesce(sum(cache_read_tokens), 0) as bigint) as cache_read_tokens, \
             cast(coalesce(sum(cache_write_tokens), 0) as bigint) as cache_write_tokens, \
             sum(cost_usd) as cost_usd \
             from run_usage where {whose}started_at >= $1 and started_at < $2 group by 1 order by 1"
        );
        let query = sqlx::query_as::<_, GroupRow>(&sql).bind(from).bind(to);
        let query = match user {
            Some(user) => query.bind(user.as_str()),
            None => query,
        };
        let rows = query.fetch_all(self.pool()).await?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        Ok(rows
            .into_iter()
            .map(|r| UsageGroup {
                key: r.key,
                runs: count(r.runs),
                input_tokens: count(r.input_tokens),
                output_tokens: count(r.output_tokens),
                cache_read_tokens: count(r.cache_read_tokens),
                cache_write_tokens: count(r.cache_write_tokens),
                cost_usd: r.cost_usd,
            })
            .collect())
    }

    async fn spend(&self, user: &UserId, budgets: &Budgets) -> Result<Spend, StoreError> {
        // The month (which holds the day) bounds the read; each sum keeps to its own period.
        let mut query = sqlx::QueryBuilder::new("");
        <B as Statements>::push_spend(&mut query, user.as_str(), budgets);
        let mut conn = self.pool().acquire().await?;
        let rows: Vec<SpendRow> = B::fetch_all(&mut conn, query).await?;
        Ok(rows.into_iter().next().ok_or(StoreError::Corrupt("a sum without its row".into()))?.into())
    }

    async fn record_progress(&self, trace_id: TraceId, usage: &Usage, cost_usd: Option<f64>) -> Result<(), StoreError> {
        super::write(self, async |conn| <B as Statements>::record_spend(conn, trace_id, usage, cost_usd, false).await)
            .await
    }
}
