//! Runs parked to wait and queued runs, and the claims that continue them (see [`WaitStore`]).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};
use uuid::Uuid;

use super::outbox::{REPORTED_RUN, ReportedRun};
use super::statements::Statements;
use super::{Conn, Row, write};
use crate::domain::TraceStatus;
use crate::domain::now;
use crate::domain::webhook::{Report, RunReport};
use crate::ids::{TraceId, UserId};
use crate::store::rows::*;
use crate::store::*;

#[async_trait::async_trait]
impl<B> WaitStore for B
where
    B: Statements,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> (i64,): FromRow<'r, Row<B>>,
    for<'r> (Option<Json<Value>>,): FromRow<'r, Row<B>>,
    for<'r> (Uuid, Option<Uuid>, String, DateTime<Utc>): FromRow<'r, Row<B>>,
    for<'r> (Uuid, DateTime<Utc>, String, Option<Uuid>): FromRow<'r, Row<B>>,
    for<'r> WaitRow: FromRow<'r, Row<B>>,
    for<'r> ReportedRun: FromRow<'r, Row<B>>,
    for<'r> (Uuid,): FromRow<'r, Row<B>>,
    for<'r> (String,): FromRow<'r, Row<B>>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> JsonText: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<&'q str>: Encode<'q, B::Db>,
    for<'q> Option<DateTime<Utc>>: Encode<'q, B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> bool: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> i64: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<f64>: Encode<'q, B::Db>,
    f64: Type<B::Db>,
{
    async fn park_run(&self, park: &RunPark) -> Result<(), StoreError> {
        let chunks = write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            let sql = format!(
                "update traces set status = 'waiting', checkpoint = $2, usage = $3, spans = $4, cost_usd = $5 \
                 where id = $1 and status = 'running' returning {REPORTED_RUN}"
            );
            let parked: Option<ReportedRun> = sqlx::query_as(&sql)
                .bind(park.trace_id)
                .bind(json(&park.checkpoint))
                .bind(json(&park.usage))
                .bind(json(&park.spans))
                .bind(park.cost_usd)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(parked) = parked else {
                return Err(StoreError::Conflict("the run has already ended".into()));
            };
            let mut query = sqlx::QueryBuilder::<B::Db>::new(
                "insert into run_waits (id, trace_id, user_id, kind, tool_call_id, tool, input, created_at, expires_at) ",
            );
            query.push_values(&park.waits, |mut row, w| {
                row.push_bind(w.id)
                    .push_bind(w.trace_id)
                    .push_bind(&w.user_id)
                    .push_bind(w.kind.as_str())
                    .push_bind(w.tool_call_id.as_str())
                    .push_bind(w.tool.as_str())
                    .push_bind(json(&w.input))
                    .push_bind(w.created_at)
                    .push_bind(w.expires_at);
            });
            B::execute(&mut *tx, query).await?;
            let chunks = self.log_within(&mut tx, &park.events).await?;
            let report = parked.report(park.trace_id, TraceStatus::Waiting, park.usage, park.cost_usd, None);
            let waiting_for = park.waits.iter().map(|w| w.kind.as_str()).collect();
            let reported = super::outbox::report(self, &mut *tx, &Report::Run(RunReport { waiting_for, ..report })).await?;
            tx.commit().await?;
            super::outbox::written(self, reported);
            Ok(chunks)
        })
        .await?;
        self.logged_within(chunks);
        Ok(())
    }

    async fn settle_wait(
        &self,
        key: WaitKey<'_>,
        user: Option<&UserId>,
        settlement: &Settlement,
        replica_id: &str,
    ) -> Result<Settled, StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            let row: Option<WaitRow> = match key {
                WaitKey::Approval(id) => {
                    let sql = format!("select {WAIT_COLUMNS} from run_waits where id = $1");
                    sqlx::query_as(&sql).bind(id).fetch_optional(&mut *tx).await?
                }
                WaitKey::Call(trace_id, call_id) => {
                    let sql = format!(
                        "select {WAIT_COLUMNS} from run_waits where trace_id = $1 and tool_call_id = $2 \
                         order by created_at desc limit 1"
                    );
                    sqlx::query_as(&sql).bind(trace_id).bind(call_id).fetch_optional(&mut *tx).await?
                }
            };
            let mut wait: Wait = row.ok_or(StoreError::NotFound)?.try_into()?;
            let kind = match key {
                WaitKey::Approval(_) => WaitKind::Approval,
                WaitKey::Call(..) => WaitKind::ClientTool,
            };
            if wait.kind != kind || user.is_some_and(|u| *u != wait.user_id) {
                return Err(StoreError::NotFound);
            }
            let sql = format!("select status from traces where id = $1{}", B::LOCK_ROW);
            let (status,): (String,) = sqlx::query_as(&sql).bind(wait.trace_id).fetch_one(&mut *tx).await?;
            let at = now();
            let conflict = if let Some(settled) = &wait.settled {
                Some(match (kind, settled) {
                    (WaitKind::Approval, Settlement::Expired) => "This approval has expired",
                    (WaitKind::Approval, _) => "This approval has been decided already",
                    (WaitKind::ClientTool, _) => "This tool call has its result already",
                })
            } else if status != "waiting" {
                Some("The run has ended")
            } else if *settlement != Settlement::Expired && wait.expires_at.is_some_and(|t| t <= at) {
                Some("This approval has expired")
            } else {
                None
            };
            if let Some(conflict) = conflict {
                return Err(StoreError::Conflict(conflict.into()));
            }
            let (reason, output, is_error) = match settlement {
                Settlement::Denied { reason } => (reason.as_deref(), None, false),
                Settlement::Result { output, is_error } => (None, Some(output.as_str()), *is_error),
                Settlement::Approved | Settlement::Expired => (None, None, false),
            };
            let updated = sqlx::query(
                "update run_waits set outcome = $2, decided_at = $3, reason = $4, output = $5, is_error = $6 \
                 where id = $1 and decided_at is null",
            )
            .bind(wait.id)
            .bind(settlement.outcome())
            .bind(at)
            .bind(reason)
            .bind(output)
            .bind(is_error)
            .execute(&mut *tx)
            .await?;
            // Read before the trace's lock: another decision may have come in between.
            if B::rows_affected(&updated) == 0 {
                return Err(StoreError::Conflict("This call has been settled already".into()));
            }
            let (open,): (i64,) =
                sqlx::query_as("select count(*) from run_waits where trace_id = $1 and decided_at is null")
                    .bind(wait.trace_id)
                    .fetch_one(&mut *tx)
                    .await?;
            let claimed =
                if open == 0 { <B as Statements>::claim(&mut tx, wait.trace_id, replica_id).await? } else { None };
            tx.commit().await?;
            wait.settled = Some(settlement.clone());
            Ok(Settled { wait, claimed })
        })
        .await
    }

    async fn claim_waiting(&self, trace_id: TraceId, replica_id: &str) -> Result<Option<Claim>, StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            let claim = <B as Statements>::claim(&mut tx, trace_id, replica_id).await?;
            tx.commit().await?;
            Ok(claim)
        })
        .await
    }

    async fn expired_waits(&self, at: DateTime<Utc>, limit: i64) -> Result<Vec<Uuid>, StoreError> {
        let rows: Vec<(Uuid,)> = sqlx::query_as(
            "select w.id from run_waits w join traces t on t.id = w.trace_id \
             where w.decided_at is null and w.expires_at <= $1 and t.status = 'waiting' \
             order by w.expires_at limit $2",
        )
        .bind(at)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    async fn claim_queued(&self, trace_id: TraceId, replica_id: &str) -> Result<QueueTurn, StoreError> {
        write(self, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            const TRACE: &str = "select conversation_id, comparison_id, status, started_at from traces where id = $1";
            let found: Option<(Uuid, Option<Uuid>, String, DateTime<Utc>)> =
                sqlx::query_as(TRACE).bind(trace_id).fetch_optional(&mut *tx).await?;
            let Some((conversation, ..)) = found else { return Err(StoreError::NotFound) };
            <B as Statements>::lock_conversation(&mut tx, conversation).await?;
            // Read again under the lock.
            let (_, comparison, status, started_at): (Uuid, Option<Uuid>, String, DateTime<Utc>) =
                sqlx::query_as(TRACE).bind(trace_id).fetch_one(&mut *tx).await?;
            if status != "queued" {
                let status = TraceStatus::parse(&status).map_err(|e| StoreError::Corrupt(e.to_string()))?;
                return Ok(QueueTurn::Gone(status));
            }
            // Every run running or waiting, and every one queued before it, goes first (the
            // other side of its comparison aside).
            let mut query = sqlx::QueryBuilder::new("");
            <B as Statements>::push_going(&mut query, conversation);
            let going: Vec<(Uuid, DateTime<Utc>, String, Option<Uuid>)> = B::fetch_all(&mut *tx, query).await?;
            let mut ahead: Vec<(DateTime<Utc>, Uuid)> = going
                .into_iter()
                .filter(|(id, at, status, side)| {
                    *id != trace_id.0
                        && (comparison.is_none() || *side != comparison)
                        && (status != "queued" || (*at, *id) < (started_at, trace_id.0))
                })
                .map(|(id, at, ..)| (at, id))
                .collect();
            if !ahead.is_empty() {
                ahead.sort_unstable();
                return Ok(QueueTurn::Behind(ahead.into_iter().map(|(_, id)| TraceId(id)).collect()));
            }
            let (checkpoint,): (Option<Json<Value>>,) = sqlx::query_as(
                "update traces set status = 'running', replica_id = $2, heartbeat_at = $3 \
                 where id = $1 and status = 'queued' returning checkpoint",
            )
            .bind(trace_id)
            .bind(replica_id)
            .bind(now())
            .fetch_one(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(QueueTurn::Claimed(checkpoint.map(|c| c.0)))
        })
        .await
    }

    async fn adopt_queued(&self, trace_id: TraceId, from: Option<&str>, replica_id: &str) -> Result<bool, StoreError> {
        write(self, async |conn| {
            let sql = format!(
                "update traces set replica_id = $2, heartbeat_at = $3{} \
                 where id = $1 and status = 'queued' and coalesce(replica_id, '') = $4",
                B::CLAIM_LOG
            );
            let adopted = sqlx::query(&sql)
                .bind(trace_id)
                .bind(replica_id)
                .bind(now())
                .bind(from.unwrap_or(""))
                .execute(conn)
                .await?;
            Ok(B::rows_affected(&adopted) == 1)
        })
        .await
    }
}
