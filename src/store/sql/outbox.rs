//! The store's outbox concern (see [`OutboxStore`]), and [`report`], which the other
//! concerns call inside the transaction of what they report.

use chrono::{DateTime, Utc};
use sqlx::{Database, Executor, FromRow, IntoArguments, Type};

use super::{Backend, Conn, Row, write};
use uuid::Uuid;

use crate::config::WebhookEvent;
use crate::domain::webhook::{Outbox, Report, RunReport};
use crate::domain::{TraceStatus, Usage};
use crate::ids::{ConversationId, MessageId, TraceId, UserId};
use crate::store::*;

/// Writes the messages `report` makes (one per endpoint that takes it) on `conn`, within
/// the caller's transaction: none where no endpoint takes it. Whether it wrote any: the
/// caller tells the delivery task once its transaction committed ([`written`]).
pub(super) async fn report<B>(backend: &B, conn: &mut Conn<B>, report: &Report) -> Result<bool, StoreError>
where
    B: Backend,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> String: sqlx::Encode<'q, B::Db> + Type<B::Db>,
    for<'q> &'q str: sqlx::Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: sqlx::Encode<'q, B::Db> + Type<B::Db>,
{
    let Some(outbox) = backend.outbox().takers.get().filter(|o| o.takes(report.event())) else { return Ok(false) };
    let at = crate::domain::now();
    let messages = outbox.messages(report, at);
    let mut query = sqlx::QueryBuilder::<B::Db>::new(
        "insert into webhook_outbox (id, endpoint, event_type, body, next_attempt_at, created_at) ",
    );
    query.push_values(&messages, |mut row, m| {
        row.push_bind(m.id.clone())
            .push_bind(m.endpoint.clone())
            .push_bind(m.event)
            .push_bind(m.body.clone())
            .push_bind(m.created_at)
            .push_bind(m.created_at);
    });
    B::execute(conn, query).await?;
    Ok(true)
}

/// Whether some endpoint takes `event`: a report of it writes messages.
pub(super) fn taken<B: Backend>(backend: &B, event: WebhookEvent) -> bool {
    backend.outbox().takers.get().is_some_and(|o| o.takes(event))
}

/// Tells this process's delivery task that messages were written (after their commit).
pub(super) fn written<B: Backend>(backend: &B, reported: bool) {
    if reported {
        backend.outbox().written.notify_one();
    }
}

/// The columns of a trace that a report of its run needs ([`ReportedRun`]).
pub(super) const REPORTED_RUN: &str = "user_id, user_message_id, message_id, conversation_id, profile, model";

/// Who a run belongs to and what it ran: what a webhook says of it beside its outcome.
#[derive(Clone, sqlx::FromRow)]
pub(super) struct ReportedRun {
    pub user_id: UserId,
    pub user_message_id: Uuid,
    pub message_id: Uuid,
    pub conversation_id: Uuid,
    pub profile: String,
    pub model: String,
}

impl ReportedRun {
    /// The run's report; `answered_by`: the model that answered, where it was not the
    /// profile's (a fallback).
    pub fn report(
        self,
        trace_id: TraceId,
        status: TraceStatus,
        usage: Usage,
        cost_usd: Option<f64>,
        answered_by: Option<String>,
    ) -> RunReport {
        RunReport {
            trace_id,
            conversation_id: ConversationId(self.conversation_id),
            message_id: MessageId(self.message_id),
            user_id: self.user_id,
            status,
            profile: self.profile,
            model: answered_by.unwrap_or(self.model),
            usage,
            cost_usd,
            error: None,
            waiting_for: Vec::new(),
        }
    }
}

/// Marks an endpoint's (`$1`) pending messages `disabled`, at `$2`.
const DROP_PENDING: &str = "update webhook_outbox set status = 'disabled', next_attempt_at = $2, \
     last_error = 'the endpoint is disabled (it answered 410 Gone)' where endpoint = $1 and status = 'pending'";

#[derive(sqlx::FromRow)]
struct ClaimedRow {
    id: String,
    endpoint: String,
    body: String,
    attempts: i32,
}

#[derive(sqlx::FromRow)]
struct DeliveryRow {
    id: String,
    endpoint: String,
    event_type: String,
    status: String,
    attempts: i32,
    last_status: Option<i32>,
    last_error: Option<String>,
    created_at: DateTime<Utc>,
    next_attempt_at: DateTime<Utc>,
    delivered_at: Option<DateTime<Utc>>,
}

impl TryFrom<DeliveryRow> for Delivery {
    type Error = StoreError;

    fn try_from(r: DeliveryRow) -> Result<Self, StoreError> {
        let status = DeliveryStatus::parse(&r.status)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown delivery status '{}'", r.status)))?;
        Ok(Delivery {
            id: r.id,
            endpoint: r.endpoint,
            event: r.event_type,
            status,
            attempts: u32::try_from(r.attempts).unwrap_or(0),
            last_status: r.last_status.and_then(|s| u16::try_from(s).ok()),
            last_error: r.last_error,
            created_at: r.created_at,
            next_attempt_at: (status == DeliveryStatus::Pending).then_some(r.next_attempt_at),
            delivered_at: r.delivered_at,
        })
    }
}

#[async_trait::async_trait]
impl<B> OutboxStore for B
where
    B: Backend,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> ClaimedRow: FromRow<'r, Row<B>>,
    for<'r> DeliveryRow: FromRow<'r, Row<B>>,
    for<'r> (String, String): FromRow<'r, Row<B>>,
    for<'r> (i64,): FromRow<'r, Row<B>>,
    for<'q> &'q str: sqlx::Encode<'q, B::Db> + Type<B::Db>,
    for<'q> i64: sqlx::Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<i32>: sqlx::Encode<'q, B::Db>,
    i32: Type<B::Db>,
    for<'q> Option<String>: sqlx::Encode<'q, B::Db>,
    String: Type<B::Db>,
    for<'q> DateTime<Utc>: sqlx::Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<DateTime<Utc>>: sqlx::Encode<'q, B::Db>,
{
    fn report_to(&self, outbox: Outbox) {
        if self.outbox().takers.set(outbox).is_err() {
            tracing::warn!("the webhook outbox was set twice; the first setting stays");
        }
    }

    async fn outbox_written(&self) {
        self.outbox().written.notified().await;
    }

    async fn claim_deliveries(
        &self,
        now: DateTime<Utc>,
        held_until: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<Claimed>, StoreError> {
        let sql = format!(
            "update webhook_outbox set next_attempt_at = $2, attempts = attempts + 1 where id in \
             (select id from webhook_outbox where status = 'pending' and next_attempt_at <= $1 \
             order by next_attempt_at limit $3{}) returning id, endpoint, body, attempts",
            B::SKIP_LOCKED
        );
        let rows: Vec<ClaimedRow> = write(self, async |conn| {
            Ok(sqlx::query_as(&sql).bind(now).bind(held_until).bind(i64::from(limit)).fetch_all(conn).await?)
        })
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| Claimed {
                id: r.id,
                endpoint: r.endpoint,
                body: r.body,
                attempts: u32::try_from(r.attempts).unwrap_or(0),
            })
            .collect())
    }

    async fn record_attempt(&self, id: &str, attempted: &Attempted) -> Result<(), StoreError> {
        let delivered_at = (attempted.status == DeliveryStatus::Delivered).then_some(attempted.at);
        write(self, async |conn| {
            sqlx::query(
                "update webhook_outbox set status = $2, next_attempt_at = $3, last_status = $4, last_error = $5, \
                 delivered_at = $6 where id = $1 and status = 'pending'",
            )
            .bind(id)
            .bind(attempted.status.as_str())
            .bind(attempted.next_attempt_at)
            .bind(attempted.http_status.map(i32::from))
            .bind(attempted.error.clone())
            .bind(delivered_at)
            .execute(conn)
            .await?;
            Ok(())
        })
        .await
    }

    async fn disable_endpoint(&self, endpoint: &str, fingerprint: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            sqlx::query(
                "insert into webhook_endpoints_disabled (endpoint, fingerprint, disabled_at) values ($1, $2, $3) \
                 on conflict (endpoint) do update set fingerprint = excluded.fingerprint, disabled_at = excluded.disabled_at",
            )
            .bind(endpoint)
            .bind(fingerprint)
            .bind(at)
            .execute(&mut *tx)
            .await?;
            sqlx::query(DROP_PENDING).bind(endpoint).bind(at).execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn disabled_endpoints(&self) -> Result<Vec<(String, String)>, StoreError> {
        Ok(sqlx::query_as("select endpoint, fingerprint from webhook_endpoints_disabled")
            .fetch_all(self.pool())
            .await?)
    }

    async fn enable_endpoint(&self, endpoint: &str) -> Result<(), StoreError> {
        write(self, async |conn| {
            sqlx::query("delete from webhook_endpoints_disabled where endpoint = $1")
                .bind(endpoint)
                .execute(conn)
                .await?;
            Ok(())
        })
        .await
    }

    async fn drop_pending(&self, endpoint: &str, at: DateTime<Utc>) -> Result<u64, StoreError> {
        let done =
            write(self, async |conn| Ok(sqlx::query(DROP_PENDING).bind(endpoint).bind(at).execute(conn).await?))
                .await?;
        Ok(B::rows_affected(&done))
    }

    async fn deliveries(&self, filter: &DeliveryFilter) -> Result<Vec<Delivery>, StoreError> {
        let mut sql = String::from(
            "select id, endpoint, event_type, status, attempts, last_status, last_error, created_at, \
             next_attempt_at, delivered_at from webhook_outbox where 1 = 1",
        );
        if filter.status.is_some() {
            sql.push_str(" and status = $2");
        }
        if filter.endpoint.is_some() {
            sql.push_str(if filter.status.is_some() { " and endpoint = $3" } else { " and endpoint = $2" });
        }
        sql.push_str(" order by created_at desc, id desc limit $1");
        let mut query = sqlx::query_as::<_, DeliveryRow>(&sql).bind(i64::from(filter.limit));
        if let Some(status) = filter.status {
            query = query.bind(status.as_str());
        }
        if let Some(endpoint) = &filter.endpoint {
            query = query.bind(endpoint.as_str());
        }
        query.fetch_all(self.pool()).await?.into_iter().map(Delivery::try_from).collect()
    }

    async fn outbox_depth(&self) -> Result<u64, StoreError> {
        let (n,): (i64,) = sqlx::query_as("select count(*) from webhook_outbox where status = 'pending'")
            .fetch_one(self.pool())
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn prune_outbox(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        let done = write(self, async |conn| {
            Ok(sqlx::query("delete from webhook_outbox where status <> 'pending' and created_at < $1")
                .bind(before)
                .execute(conn)
                .await?)
        })
        .await?;
        Ok(B::rows_affected(&done))
    }
}
