//! Runs starting and ending, their traces and idempotency keys (see [`RunStore`]); the statements a start writes are in `statements.rs`.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};
use uuid::Uuid;

use super::ends::{self, Told, Turn};
use super::outbox::{REPORTED_RUN, ReportedRun};
use super::starts::Starts;
use super::statements::Statements;
use super::{Conn, Row, write};
use crate::domain::Trace;
use crate::domain::webhook::{Report, ReportedError, RunReport};
use crate::ids::{ConversationId, MessageId, TraceId, UserId};
use crate::store::rows::*;
use crate::store::*;

#[async_trait::async_trait]
impl<B> RunStore for B
where
    B: Starts,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> TraceRow: FromRow<'r, Row<B>>,
    for<'r> ReportedRun: FromRow<'r, Row<B>>,
    for<'r> (TraceId,): FromRow<'r, Row<B>>,
    for<'r> (String, TraceId, DateTime<Utc>): FromRow<'r, Row<B>>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> JsonText: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<JsonText>: Encode<'q, B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<f64>: Encode<'q, B::Db>,
    f64: Type<B::Db>,
    for<'q> i64: Encode<'q, B::Db> + Type<B::Db>,
{
    async fn keyed_run(&self, user: &UserId, key: &str) -> Result<Option<KeyedRun>, StoreError> {
        let row: Option<(String, TraceId, DateTime<Utc>)> = sqlx::query_as(
            "select request_hash, trace_id, created_at from idempotency_keys where user_id = $1 and key = $2",
        )
        .bind(user)
        .bind(key)
        .fetch_optional(self.pool())
        .await?;
        Ok(row.map(|(request_hash, trace_id, created_at)| KeyedRun { request_hash, trace_id, created_at }))
    }

    async fn forget_key(&self, user: &UserId, key: &str, trace_id: TraceId) -> Result<(), StoreError> {
        write(self, async |conn| {
            sqlx::query("delete from idempotency_keys where user_id = $1 and key = $2 and trace_id = $3")
                .bind(user)
                .bind(key)
                .bind(trace_id)
                .execute(conn)
                .await?;
            Ok(())
        })
        .await
    }

    async fn runs_started_since(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        since: DateTime<Utc>,
    ) -> Result<Vec<Trace>, StoreError> {
        let sql = format!(
            "select {TRACE_COLUMNS} from traces where conversation_id = $1 and user_id = $2 and started_at >= $3 \
             order by started_at, id"
        );
        let rows: Vec<TraceRow> =
            sqlx::query_as(&sql).bind(conversation_id).bind(user).bind(since).fetch_all(self.pool()).await?;
        rows.into_iter().map(Trace::try_from).collect()
    }

    async fn forget_keys_before(&self, before: DateTime<Utc>) -> Result<(), StoreError> {
        write(self, async |conn| {
            sqlx::query("delete from idempotency_keys where created_at < $1").bind(before).execute(conn).await?;
            Ok(())
        })
        .await
    }

    async fn start_runs(&self, starts: &[&RunStart]) -> Result<StartOutcome, StoreError> {
        <B as Starts>::start_runs(self, starts).await
    }

    async fn finish_run(&self, finish: &RunFinish) -> Result<(), StoreError> {
        let written = async {
            let ended = || StoreError::Conflict("the run has already ended".into());
            let reports = super::outbox::taken(self, Report::run_event(finish.status));
            // Ends take turns among themselves for a few places in the writers' queue (SQLite:
            // one, for its one writer; Postgres: half the pool): a burst of runs ending together
            // (a thousand answers finishing in the same second) holds those places only, and a
            // start, a log write or a decision waits behind a few ends at most instead of
            // behind all of them. Where the backend writes several ends as one statement
            // (Postgres), ends with an answer take one of those places for themselves, and the
            // end that gets it takes those waiting with it (an end with a webhook message goes alone, its
            // message written in its transaction, as does an end without an answer).
            let ends = self.ends();
            // The turn, where this end is written on its own below.
            let _turn = 'alone: {
                let Some(conversation) = ends::conversation(finish).filter(|_| B::ENDS_TOGETHER > 1 && !reports) else {
                    break 'alone ends.turn().await?;
                };
                let turn = match ends.turn_or_taken(finish).await? {
                    Turn::Held(turn) => turn,
                    Turn::Told(Told::Written) => return Ok(()),
                    Turn::Told(Told::Ended) => return Err(ended()),
                    Turn::Told(Told::Alone) => break 'alone ends.turn().await?,
                };
                let others = ends.take(HashSet::from([conversation]), B::ENDS_TOGETHER - 1);
                if others.is_empty() {
                    break 'alone turn;
                }
                let group: Vec<&RunFinish> = std::iter::once(finish).chain(others.iter().map(|w| &*w.finish)).collect();
                match end_together(self, &group).await {
                    Ok(closed) => {
                        for end in others {
                            let told = if closed.contains(&end.finish.trace_id) { Told::Written } else { Told::Ended };
                            end.tell(told);
                        }
                        return closed.contains(&finish.trace_id).then_some(()).ok_or_else(ended);
                    }
                    // Nothing of the group was written: each end is written again on its own,
                    // and the one that failed it fails alone.
                    Err(e) => {
                        // One end's row refused (a conversation deleted meanwhile) is to be
                        // expected; any other failure of the statement is worth a look.
                        match &e {
                            StoreError::Database(sqlx::Error::Database(db))
                                if db.kind() != sqlx::error::ErrorKind::Other =>
                            {
                                tracing::debug!(error = %e, ends = group.len(), "runs' ends written together were refused; each goes alone")
                            }
                            _ => {
                                tracing::warn!(error = %e, ends = group.len(), "runs' ends written together failed; each goes alone")
                            }
                        }
                        others.into_iter().for_each(|end| end.tell(Told::Alone));
                        turn
                    }
                }
            };
            write(self, async |conn| {
                // One round trip where no webhook message has to join the end: one statement is a
                // transaction of its own (Postgres), or the transaction goes as one query (SQLite).
                if !reports {
                    let run = match B::WRITES_IN_WITH {
                        true => end_in_one_statement::<B>(conn, finish).await?,
                        false => end_in_one_query::<B>(conn, finish).await?,
                    };
                    return run.map(drop).ok_or_else(ended);
                }
                let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
                let run = match B::WRITES_IN_WITH {
                    true => end_in_one_statement::<B>(&mut tx, finish).await?,
                    false => end_in_turn::<B>(&mut tx, finish).await?,
                };
                let run = run.ok_or_else(ended)?;
                let answered_by = finish.assistant_message.as_ref().and_then(|m| m.model.clone());
                let report = run.report(finish.trace_id, finish.status, finish.usage, finish.cost_usd, answered_by);
                let error = finish.error.as_ref().map(ReportedError::from);
                let reported = super::outbox::report(self, &mut *tx, &Report::Run(RunReport { error, ..report })).await?;
                tx.commit().await?;
                super::outbox::written(self, reported);
                Ok(())
            })
            .await
        }
        .await;
        // A run found ended may have been ended by this very record: by a statement of ends
        // written together whose taker was dropped before it told this end (`Told::Alone`),
        // or by an earlier try whose answer was lost with its connection (`chat/live/ending.rs`
        // tries again while the database is unavailable). Its end was written: the trace's
        // status and end time are the record's. (A run ended by anything else, a cancel or
        // another replica that took it over, has its own.)
        let Err(StoreError::Conflict(refused)) = written else { return written };
        match self.get_trace(&finish.user_id, finish.trace_id).await {
            Ok(trace) if trace.status == finish.status && trace.ended_at == Some(finish.ended_at) => Ok(()),
            Ok(_) | Err(StoreError::NotFound) => Err(StoreError::Conflict(refused)),
            Err(e) => Err(e),
        }
    }

    async fn get_trace(&self, user: &UserId, trace_id: TraceId) -> Result<Trace, StoreError> {
        let sql = format!("select {TRACE_COLUMNS} from traces where id = $1 and user_id = $2");
        let row: Option<TraceRow> = sqlx::query_as(&sql).bind(trace_id).bind(user).fetch_optional(self.pool()).await?;
        row.ok_or(StoreError::NotFound)?.try_into()
    }

    async fn trace_by_message(&self, user: &UserId, message_id: MessageId) -> Result<Trace, StoreError> {
        let sql = format!(
            "select {TRACE_COLUMNS} from traces where message_id = $1 and user_id = $2 \
             order by started_at desc limit 1"
        );
        let row: Option<TraceRow> =
            sqlx::query_as(&sql).bind(message_id).bind(user).fetch_optional(self.pool()).await?;
        row.ok_or(StoreError::NotFound)?.try_into()
    }

    async fn running_in_conversation(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
    ) -> Result<Vec<Trace>, StoreError> {
        let sql = format!(
            "select {TRACE_COLUMNS} from traces where conversation_id = $1 and user_id = $2 \
             and status = 'running' union all select {TRACE_COLUMNS} from traces where conversation_id = $1 \
             and user_id = $2 and status = 'waiting' union all select {TRACE_COLUMNS} from traces \
             where conversation_id = $1 and user_id = $2 and status = 'queued' order by started_at, id"
        );
        let rows: Vec<TraceRow> = sqlx::query_as(&sql).bind(conversation_id).bind(user).fetch_all(self.pool()).await?;
        rows.into_iter().map(Trace::try_from).collect()
    }
}

/// Several runs' ends as [`Backend::push_ends`](super::Backend::push_ends) writes them, as
/// one statement; the ids of the traces it closed (the others had ended already).
async fn end_together<B>(store: &B, group: &[&RunFinish]) -> Result<Vec<TraceId>, StoreError>
where
    B: Statements,
    for<'r> (TraceId,): FromRow<'r, Row<B>>,
{
    let answers: Vec<(&UserId, &Message)> =
        group.iter().filter_map(|f| Some((&f.user_id, f.assistant_message.as_ref()?))).collect();
    write(store, async |conn| {
        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
        B::push_ends(&mut query, group, &answers);
        let closed: Vec<(TraceId,)> = B::fetch_all(conn, query).await?;
        Ok(closed.into_iter().map(|(id,)| id).collect())
    })
    .await
}

/// A run's end as [`Statements::push_end`] writes it; the run's report columns, none where
/// it had already ended.
async fn end_in_one_statement<B>(conn: &mut Conn<B>, finish: &RunFinish) -> Result<Option<ReportedRun>, StoreError>
where
    B: Statements,
    for<'r> ReportedRun: FromRow<'r, Row<B>>,
{
    let mut query = sqlx::QueryBuilder::<B::Db>::new("");
    <B as Statements>::push_end(&mut query, finish);
    Ok(B::fetch_all::<ReportedRun>(conn, query).await?.pop())
}

/// A run's end as [`Statements::push_end_in_turn`] writes it, its transaction with it; the
/// run's report columns, none where it had already ended.
async fn end_in_one_query<B>(conn: &mut Conn<B>, finish: &RunFinish) -> Result<Option<ReportedRun>, StoreError>
where
    B: Statements,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> ReportedRun: FromRow<'r, Row<B>>,
{
    let mut query = sqlx::QueryBuilder::<B::Db>::new("");
    <B as Statements>::push_end_in_turn(&mut query, finish);
    Ok(super::rows_of_transaction_as_one_query::<B, ReportedRun>(conn, query).await?.pop())
}

/// A run's end a statement at a time, within the caller's transaction: its trace closed
/// first, and the rest written only where it was still running or queued (if another
/// process already closed it, marked it interrupted, this result is refused whole instead
/// of overwriting that).
async fn end_in_turn<B>(conn: &mut Conn<B>, finish: &RunFinish) -> Result<Option<ReportedRun>, StoreError>
where
    B: Statements,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> ReportedRun: FromRow<'r, Row<B>>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> JsonText: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<JsonText>: Encode<'q, B::Db>,
    for<'q> TraceId: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<f64>: Encode<'q, B::Db>,
    f64: Type<B::Db>,
{
    let mut query = sqlx::QueryBuilder::<B::Db>::new("");
    super::statements::push_close(&mut query, finish);
    query.push(REPORTED_RUN);
    let Some(run) = B::fetch_all::<ReportedRun>(&mut *conn, query).await?.pop() else { return Ok(None) };
    <B as Statements>::record_spend(&mut *conn, finish.trace_id, &finish.usage, finish.cost_usd, true).await?;
    match &finish.assistant_message {
        Some(message) => <B as Statements>::append_message(&mut *conn, &finish.user_id, message).await?,
        // Messages queued behind an answer that never came follow its question.
        None => {
            let (answer, question) = (MessageId(run.message_id), Some(MessageId(run.user_message_id)));
            <B as Statements>::follow_question(&mut *conn, run.conversation_id, answer, question).await?;
        }
    }
    Ok(Some(run))
}
