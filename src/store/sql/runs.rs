//! Writing runs: the rows of runs starting (conversations, messages, comparisons, traces,
//! a few multi-row statements for any number of starts), the answer of a run ending, and a
//! vote that makes one answer of a comparison the active branch.

use std::marker::PhantomData;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};
use uuid::Uuid;

use super::{Backend, Conn, ROWS_PER_INSERT, Row, transaction_as_one_query, write};
use crate::domain::{Comparison, Conversation, Message, Preference, Trace, Vote, now};
use crate::domain::{Role, TraceStatus};
use crate::ids::{ComparisonId, MessageId, TraceId, UserId};
use crate::store::rows::*;
use crate::store::{
    Claim, QueueTurn, RunFinish, RunPark, RunStart, Settled, Settlement, StoreError, Wait, WaitKey, WaitKind,
};

/// The run-writing statements of backend `B`.
pub(super) struct Rows<B>(PhantomData<B>);

impl<B> Rows<B>
where
    B: Backend,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> i64: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> bool: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> JsonText: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<&'q str>: Encode<'q, B::Db>,
    for<'q> Option<JsonText>: Encode<'q, B::Db>,
    for<'q> Option<MessageId>: Encode<'q, B::Db>,
    for<'q> Option<TraceId>: Encode<'q, B::Db>,
    for<'q> Option<ComparisonId>: Encode<'q, B::Db>,
    for<'q> Option<DateTime<Utc>>: Encode<'q, B::Db>,
    for<'r> ConversationRow: FromRow<'r, Row<B>>,
    for<'r> MessageRow: FromRow<'r, Row<B>>,
    for<'r> TraceRow: FromRow<'r, Row<B>>,
    for<'r> RunningRow: FromRow<'r, Row<B>>,
    for<'r> ComparisonRow: FromRow<'r, Row<B>>,
    for<'r> (i64,): FromRow<'r, Row<B>>,
    for<'r> (UserId,): FromRow<'r, Row<B>>,
    for<'r> (Json<Value>,): FromRow<'r, Row<B>>,
    for<'r> (Option<Json<Value>>,): FromRow<'r, Row<B>>,
    for<'r> (Uuid, Option<Uuid>, String, DateTime<Utc>): FromRow<'r, Row<B>>,
    for<'r> (Uuid, DateTime<Utc>, String, Option<Uuid>): FromRow<'r, Row<B>>,
    for<'r> (UserId, Uuid, Uuid, Uuid): FromRow<'r, Row<B>>,
    for<'r> WaitRow: FromRow<'r, Row<B>>,
    for<'r> (Uuid,): FromRow<'r, Row<B>>,
    for<'r> (String,): FromRow<'r, Row<B>>,
{
    pub(super) async fn start_runs(backend: &B, starts: &[&RunStart]) -> Result<(), StoreError> {
        // A few statements for any number of starts: new conversations, messages and
        // traces go in as one multi-row insert each (a statement is a round trip to
        // the database, and these come in bursts). A new conversation is inserted as
        // it stands after its first message; an existing one is updated per message.
        let mut conversations = Vec::new();
        let mut messages = Vec::new();
        let mut traces = Vec::new();
        for start in starts {
            let first = start.traces.first().ok_or(StoreError::Conflict("a run needs a trace".into()))?;
            if let Some(c) = &start.new_conversation {
                let mut c = c.clone();
                if start.user_message_is_new {
                    let m = &start.user_message;
                    c.active_leaf_id = Some(m.id);
                    c.message_count += 1;
                    (c.last_message_at, c.updated_at) = (m.created_at, m.created_at);
                }
                conversations.push(c);
            }
            if start.user_message_is_new {
                messages.push((&first.user_id, &start.user_message));
            }
            traces.extend(start.traces.iter().map(|t| (t, start.replica_id.as_str(), start.queued.as_ref())));
        }
        if B::MANY_STATEMENTS_PER_QUERY {
            return Rows::<B>::start_runs_in_one_query(backend, &conversations, &messages, starts, &traces).await;
        }
        write(backend, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            let lasts = if B::SHARED {
                Rows::<B>::check_running_limits(&mut *tx, starts).await?;
                Rows::<B>::check_going(&mut *tx, starts).await?
            } else {
                Vec::new()
            };
            for rows in conversations.chunks(ROWS_PER_INSERT) {
                Rows::<B>::insert_conversations(&mut *tx, rows).await?;
            }
            for rows in messages.chunks(ROWS_PER_INSERT) {
                Rows::<B>::insert_messages(&mut *tx, rows).await?;
                if Rows::<B>::use_files(rows) {
                    let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                    Rows::<B>::push_message_files(&mut query, rows);
                    // A file deleted since the request was checked.
                    B::execute(&mut *tx, query).await.map_err(|e| match e.as_database_error() {
                        Some(db) if db.is_foreign_key_violation() => StoreError::NotFound,
                        _ => e.into(),
                    })?;
                }
            }
            for start in starts {
                if start.user_message_is_new && start.new_conversation.is_none() {
                    let user = &start.traces[0].user_id;
                    Rows::<B>::touch_conversation(&mut *tx, user, &start.user_message).await?;
                }
                if Rows::<B>::settles(start) {
                    let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                    Rows::<B>::push_settle(&mut query, start);
                    B::execute(&mut *tx, query).await?;
                }
                if let Some(c) = &start.comparison {
                    let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                    Rows::<B>::push_comparison(&mut query, c);
                    B::execute(&mut *tx, query).await?;
                }
            }
            for rows in traces.chunks(ROWS_PER_INSERT) {
                let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                Rows::<B>::push_traces(&mut query, rows);
                B::execute(&mut *tx, query).await?;
            }
            Rows::<B>::place_queued(&mut tx, starts, &lasts).await?;
            let mut query = sqlx::QueryBuilder::<B::Db>::new("");
            if Rows::<B>::push_keys(&mut query, starts) {
                B::execute(&mut *tx, query).await.map_err(key_taken)?;
            }
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    pub(super) async fn finish_run(backend: &B, finish: &RunFinish) -> Result<(), StoreError> {
        write(backend, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            // Only a running trace ends: if another process already closed it (marked it
            // interrupted), this result is refused whole instead of overwriting that.
            let owner: Option<(UserId, Uuid, Uuid, Uuid)> = sqlx::query_as(
                "update traces set status = $2, ended_at = $3, usage = $4, error = $5, spans = $6 \
                 where id = $1 and status in ('running', 'queued') \
                 returning user_id, user_message_id, message_id, conversation_id",
            )
            .bind(finish.trace_id)
            .bind(finish.status.as_str())
            .bind(finish.ended_at)
            .bind(json(&finish.usage))
            .bind(finish.error.as_ref().map(json))
            .bind(json(&finish.spans))
            .fetch_optional(&mut *tx)
            .await?;
            let Some((user, question, answer, conversation)) = owner else {
                return Err(StoreError::Conflict("the run has already ended".into()));
            };
            match &finish.assistant_message {
                Some(message) => Rows::<B>::append_message(&mut *tx, &user, message).await?,
                // Messages queued behind an answer that never came follow its question.
                None => {
                    let (answer, question) = (MessageId(answer), Some(MessageId(question)));
                    Rows::<B>::follow_question(&mut tx, conversation, answer, question).await?;
                }
            }
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    /// Parks a running run (CONTRACT.md §15): `waiting`, its checkpoint, its waits, and the
    /// events that announce them, in one transaction.
    pub(super) async fn park_run(backend: &B, park: &RunPark) -> Result<(), StoreError> {
        let chunks = write(backend, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            let parked = sqlx::query(
                "update traces set status = 'waiting', checkpoint = $2, usage = $3, spans = $4 \
                 where id = $1 and status = 'running'",
            )
            .bind(park.trace_id)
            .bind(json(&park.checkpoint))
            .bind(json(&park.usage))
            .bind(json(&park.spans))
            .execute(&mut *tx)
            .await?;
            if B::rows_affected(&parked) == 0 {
                return Err(StoreError::Conflict("the run has already ended".into()));
            }
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
            let chunks = backend.log_within(&mut tx, &park.events).await?;
            tx.commit().await?;
            Ok(chunks)
        })
        .await?;
        backend.logged_within(chunks);
        Ok(())
    }

    /// Settles one waiting call; the last open call of its run claims the run. Decisions on
    /// one run take turns (the trace's row is locked first), so exactly one of them, on
    /// whichever replica, sees no call left open.
    pub(super) async fn settle_wait(
        backend: &B,
        key: WaitKey<'_>,
        user: Option<&UserId>,
        settlement: &Settlement,
        replica_id: &str,
    ) -> Result<Settled, StoreError> {
        write(backend, async |conn| {
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
            let claimed = if open == 0 { Rows::<B>::claim(&mut tx, wait.trace_id, replica_id).await? } else { None };
            tx.commit().await?;
            wait.settled = Some(settlement.clone());
            Ok(Settled { wait, claimed })
        })
        .await
    }

    /// Makes a waiting run `running` on `replica_id` and hands over what it needs to go on.
    pub(super) async fn claim(
        conn: &mut Conn<B>,
        trace_id: TraceId,
        replica_id: &str,
    ) -> Result<Option<Claim>, StoreError> {
        let sql = format!(
            "update traces set status = 'running', replica_id = $2, heartbeat_at = $3{} \
             where id = $1 and status = 'waiting' returning {TRACE_COLUMNS}",
            B::CLAIM_LOG
        );
        let row: Option<TraceRow> =
            sqlx::query_as(&sql).bind(trace_id).bind(replica_id).bind(now()).fetch_optional(&mut *conn).await?;
        let Some(row) = row else { return Ok(None) };
        let (checkpoint,): (Json<Value>,) =
            sqlx::query_as("select checkpoint from traces where id = $1").bind(trace_id).fetch_one(&mut *conn).await?;
        // The waits of its last park (an earlier park's calls are settled and in its turns).
        let sql = format!(
            "select {WAIT_COLUMNS} from run_waits where trace_id = $1 \
             and created_at = (select max(created_at) from run_waits where trace_id = $1) order by tool_call_id"
        );
        let waits: Vec<WaitRow> = sqlx::query_as(&sql).bind(trace_id).fetch_all(&mut *conn).await?;
        Ok(Some(Claim {
            trace: row.try_into()?,
            checkpoint: checkpoint.0,
            waits: waits.into_iter().map(Wait::try_from).collect::<Result<_, _>>()?,
        }))
    }

    pub(super) async fn vote(
        backend: &B,
        user: &UserId,
        id: ComparisonId,
        preference: Preference,
        change: bool,
    ) -> Result<Comparison, StoreError> {
        write(backend, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            let sql = format!("select {COMPARISON_COLUMNS} from comparisons where id = $1 and user_id = $2");
            let row: Option<ComparisonRow> =
                sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(&mut *tx).await?;
            let mut comparison: Comparison = row.ok_or(StoreError::NotFound)?.try_into()?;
            match comparison.preference {
                Some(current) if current == preference => return Ok(comparison),
                Some(_) if !change => {
                    return Err(StoreError::Conflict("This comparison has another vote; change it with PUT".into()));
                }
                _ => {}
            }
            let at = now();
            comparison.preference = Some(preference);
            comparison.voted_at = Some(at);
            comparison.vote_history.push(Vote { preference, at });
            sqlx::query("update comparisons set preference = $2, voted_at = $3, vote_history = $4 where id = $1")
                .bind(id)
                .bind(preference.as_str())
                .bind(at)
                .bind(json(&comparison.vote_history))
                .execute(&mut *tx)
                .await?;
            // The preferred answer (A for a tie or both bad) becomes the active branch.
            let trace = if preference == Preference::B { comparison.trace_b } else { comparison.trace_a };
            sqlx::query(
                "update conversations set active_leaf_id = (select message_id from traces where id = $2) \
                 where id = $1 and exists (select 1 from messages where id = (select message_id from traces where id = $2))",
            )
            .bind(comparison.conversation_id)
            .bind(trace)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(comparison)
        })
        .await
    }

    /// Counts each user's running runs, with the starts' new ones, against the starts'
    /// `max_running`, holding a lock per user until the transaction ends: replicas
    /// that start runs for one user at once take turns here, and each sees the runs
    /// the others committed.
    pub(super) async fn check_running_limits(conn: &mut Conn<B>, starts: &[&RunStart]) -> Result<(), StoreError> {
        let mut users: Vec<(&UserId, usize, usize)> = Vec::new();
        for start in starts {
            let (Some(limit), Some(first)) = (start.max_running, start.traces.first()) else { continue };
            match users.iter_mut().find(|(user, _, _)| *user == &first.user_id) {
                Some((_, _, adding)) => *adding += start.traces.len(),
                None => users.push((&first.user_id, limit, start.traces.len())),
            }
        }
        users.sort_unstable();
        for (user, limit, adding) in users {
            sqlx::query("select pg_advisory_xact_lock(hashtextextended($1, 7))").bind(user).execute(&mut *conn).await?;
            let (running,): (i64,) =
                sqlx::query_as("select count(*) from traces where user_id = $1 and status = 'running'")
                    .bind(user)
                    .fetch_one(&mut *conn)
                    .await?;
            let running = usize::try_from(running).unwrap_or(usize::MAX);
            if running + adding > limit {
                return Err(StoreError::TooManyRuns(running));
            }
        }
        Ok(())
    }

    /// Fails with [`StoreError::Moved`] where a run of a start's conversation is going that
    /// the start did not see (another replica started it since): its message would not follow
    /// that run. Starts into one conversation take turns here.
    pub(super) async fn check_going(
        conn: &mut Conn<B>,
        starts: &[&RunStart],
    ) -> Result<Vec<(Uuid, DateTime<Utc>)>, StoreError> {
        let mut seen: Vec<(Uuid, &[TraceId])> =
            starts.iter().filter_map(|s| Some((s.user_message.conversation_id.0, s.going_seen.as_deref()?))).collect();
        seen.sort_unstable_by_key(|(conversation, _)| *conversation);
        let mut lasts = Vec::new();
        for (conversation, seen) in seen {
            Rows::<B>::lock_conversation(conn, conversation).await?;
            let going: Vec<(Uuid, DateTime<Utc>, String, Option<Uuid>)> =
                sqlx::query_as(GOING_IN_CONVERSATION).bind(conversation).fetch_all(&mut *conn).await?;
            if going.iter().any(|(id, ..)| !seen.iter().any(|s| s.0 == *id)) {
                return Err(StoreError::Moved);
            }
            if let Some(last) = going.iter().map(|(_, at, ..)| *at).max() {
                lasts.push((conversation, last));
            }
        }
        Ok(lasts)
    }

    /// Places the queued traces of `starts` after the runs going in their conversations
    /// (`lasts`: the latest `started_at` of those, from [`check_going`](Rows::<B>::check_going)):
    /// the queue's order is the database's, not the clocks of the replicas that planned them.
    pub(super) async fn place_queued(
        conn: &mut Conn<B>,
        starts: &[&RunStart],
        lasts: &[(Uuid, DateTime<Utc>)],
    ) -> Result<(), StoreError> {
        for start in starts.iter().filter(|s| s.queued.is_some()) {
            let conversation = start.user_message.conversation_id.0;
            let Some((_, last)) = lasts.iter().find(|(c, _)| *c == conversation) else { continue };
            for trace in &start.traces {
                sqlx::query("update traces set started_at = $2 where id = $1 and started_at <= $3")
                    .bind(trace.trace_id)
                    .bind(*last + chrono::Duration::microseconds(1))
                    .bind(*last)
                    .execute(&mut *conn)
                    .await?;
            }
        }
        Ok(())
    }

    /// Takes the conversation's lock until the transaction ends (shared stores only: SQLite
    /// has one writer).
    pub(super) async fn lock_conversation(conn: &mut Conn<B>, conversation: Uuid) -> Result<(), StoreError> {
        if B::SHARED {
            sqlx::query("select pg_advisory_xact_lock(hashtextextended($1, 8))")
                .bind(conversation.to_string())
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }

    /// Claims a queued run if its turn has come (see [`Store::claim_queued`]).
    pub(super) async fn claim_queued(
        backend: &B,
        trace_id: TraceId,
        replica_id: &str,
    ) -> Result<QueueTurn, StoreError> {
        write(backend, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            const TRACE: &str = "select conversation_id, comparison_id, status, started_at from traces where id = $1";
            let found: Option<(Uuid, Option<Uuid>, String, DateTime<Utc>)> =
                sqlx::query_as(TRACE).bind(trace_id).fetch_optional(&mut *tx).await?;
            let Some((conversation, ..)) = found else { return Err(StoreError::NotFound) };
            Rows::<B>::lock_conversation(&mut tx, conversation).await?;
            // Read again under the lock.
            let (_, comparison, status, started_at): (Uuid, Option<Uuid>, String, DateTime<Utc>) =
                sqlx::query_as(TRACE).bind(trace_id).fetch_one(&mut *tx).await?;
            if status != "queued" {
                let status = TraceStatus::parse(&status).map_err(|e| StoreError::Corrupt(e.to_string()))?;
                return Ok(QueueTurn::Gone(status));
            }
            // Every run running or waiting, and every one queued before it, goes first (the
            // other side of its comparison aside).
            let going: Vec<(Uuid, DateTime<Utc>, String, Option<Uuid>)> =
                sqlx::query_as(GOING_IN_CONVERSATION).bind(conversation).fetch_all(&mut *tx).await?;
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

    /// Takes a queued run over from the process `from` that held it (see
    /// [`Store::adopt_queued`]).
    pub(super) async fn adopt_queued(
        backend: &B,
        trace_id: TraceId,
        from: Option<&str>,
        replica_id: &str,
    ) -> Result<bool, StoreError> {
        write(backend, async |conn| {
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

    pub(super) async fn insert_conversation(conn: &mut Conn<B>, c: &Conversation) -> Result<(), StoreError> {
        Rows::<B>::insert_conversations(conn, std::slice::from_ref(c)).await
    }

    pub(super) async fn insert_conversations(conn: &mut Conn<B>, rows: &[Conversation]) -> Result<(), StoreError> {
        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
        Rows::<B>::push_conversations(&mut query, rows);
        B::execute(&mut *conn, query).await?;
        Ok(())
    }

    pub(super) fn push_conversations<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, rows: &'a [Conversation]) {
        query.push(
            "insert into conversations (id, user_id, title, profile, system_prompt, metadata, \
             external_id, active_leaf_id, message_count, created_at, updated_at, last_message_at) ",
        );
        query.push_values(rows, |mut row, c| {
            row.push_bind(c.id)
                .push_bind(&c.user_id)
                .push_bind(&c.title)
                .push_bind(c.profile.as_deref())
                .push_bind(c.system_prompt.as_deref())
                .push_bind(json(&c.metadata))
                .push_bind(c.external_id.as_deref())
                .push_bind(c.active_leaf_id)
                .push_bind(c.message_count)
                .push_bind(c.created_at)
                .push_bind(c.updated_at)
                .push_bind(c.last_message_at);
        });
    }

    /// Inserts messages, each `(owner, message)`, without touching their conversations.
    pub(super) async fn insert_messages(conn: &mut Conn<B>, rows: &[(&UserId, &Message)]) -> Result<(), StoreError> {
        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
        Rows::<B>::push_messages(&mut query, rows);
        B::execute(&mut *conn, query).await?;
        Ok(())
    }

    pub(super) fn push_messages<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, rows: &'a [(&'a UserId, &'a Message)]) {
        query.push(
            "insert into messages (id, conversation_id, user_id, parent_id, role, content, \
             thinking, provider_state, tool_calls, tool_history, payloads, suggested_values, \
             suggested_actions, cancelled, model, trace_id, usage, feedback, comparison_id, \
             variant, client_id, attachments, created_at) ",
        );
        query.push_values(rows, |mut row, (user, m)| {
            row.push_bind(m.id)
                .push_bind(m.conversation_id)
                .push_bind(*user)
                .push_bind(m.parent_id)
                .push_bind(m.role.as_str())
                .push_bind(&m.content)
                .push_bind(m.thinking.as_deref())
                .push_bind(provider_state(m))
                .push_bind(json(&m.tool_calls))
                .push_bind(json(&m.tool_history))
                .push_bind(json(&m.payloads))
                .push_bind(json(&m.suggested_values))
                .push_bind(json(&m.suggested_actions))
                .push_bind(m.cancelled)
                .push_bind(m.model.as_deref())
                .push_bind(m.trace_id)
                .push_bind(m.usage.as_ref().map(json))
                .push_bind(m.feedback.as_ref().map(json))
                .push_bind(m.comparison_id)
                .push_bind(m.variant.as_deref())
                .push_bind(m.client_id.as_deref())
                .push_bind(json(&m.attachments))
                .push_bind(m.created_at);
        });
    }

    /// The idempotency keys of the starts that have one, each naming its first trace.
    pub(super) fn push_keys<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, starts: &'a [&'a RunStart]) -> bool {
        let keyed: Vec<(&RunStart, &crate::domain::IdempotencyKey)> =
            starts.iter().filter_map(|s| s.idempotency_key.as_ref().map(|k| (*s, k))).collect();
        if keyed.is_empty() {
            return false;
        }
        query.push("insert into idempotency_keys (user_id, key, request_hash, trace_id, created_at) ");
        query.push_values(keyed, |mut row, (start, key)| {
            let trace = &start.traces[0];
            row.push_bind(&trace.user_id)
                .push_bind(&key.key)
                .push_bind(&key.request_hash)
                .push_bind(trace.trace_id)
                .push_bind(trace.started_at);
        });
        true
    }

    /// Whether any of the messages carries a file.
    pub(super) fn use_files(rows: &[(&UserId, &Message)]) -> bool {
        rows.iter().any(|(_, m)| !m.attachments.is_empty())
    }

    /// The rows that say which files the messages use (some must: see [`use_files`]).
    pub(super) fn push_message_files<'a>(
        query: &mut sqlx::QueryBuilder<'a, B::Db>,
        rows: &'a [(&'a UserId, &'a Message)],
    ) {
        let uses =
            rows.iter().flat_map(|(_, m)| m.attachments.iter().enumerate().map(|(i, a)| (m.id, i as i64, a.file_id)));
        query.push("insert into message_files (message_id, position, file_id) ");
        query.push_values(uses, |mut row, (message, position, file)| {
            row.push_bind(message).push_bind(position).push_bind(file);
        });
    }

    pub(super) fn push_comparison<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, c: &'a Comparison) {
        query.push(
            "insert into comparisons (id, conversation_id, user_id, user_message_id, trace_a, trace_b, \
             profile_a, profile_b, model_a, model_b, created_at) ",
        );
        query.push_values([c], |mut row, c| {
            row.push_bind(c.comparison_id)
                .push_bind(c.conversation_id)
                .push_bind(&c.user_id)
                .push_bind(c.user_message_id)
                .push_bind(c.trace_a)
                .push_bind(c.trace_b)
                .push_bind(&c.profile_a)
                .push_bind(&c.profile_b)
                .push_bind(&c.model_a)
                .push_bind(&c.model_b)
                .push_bind(c.created_at);
        });
    }

    pub(super) fn push_traces<'a>(
        query: &mut sqlx::QueryBuilder<'a, B::Db>,
        rows: &'a [(&'a Trace, &'a str, Option<&'a Value>)],
    ) {
        query.push(
            "insert into traces (id, conversation_id, user_id, user_message_id, message_id, status, \
             model, profile, started_at, spans, comparison_id, variant, replica_id, heartbeat_at, checkpoint) ",
        );
        query.push_values(rows, |mut row, (t, replica_id, queued)| {
            row.push_bind(t.trace_id)
                .push_bind(t.conversation_id)
                .push_bind(&t.user_id)
                .push_bind(t.user_message_id)
                .push_bind(t.message_id)
                .push_bind(t.status.as_str())
                .push_bind(&t.model)
                .push_bind(&t.profile)
                .push_bind(t.started_at)
                .push_bind(json(&t.spans))
                .push_bind(t.comparison_id)
                .push_bind(t.variant.as_deref())
                .push_bind(*replica_id)
                .push_bind(t.started_at)
                .push_bind(queued.map(json));
        });
    }

    /// The whole group of starts as one query of several statements, the transaction
    /// included: one round trip to the database instead of one per statement (SQLite
    /// runs each on its own thread; under load, every trip back waited its turn on a
    /// busy runtime). A conversation deleted meanwhile fails its message's or trace's
    /// foreign key, and reads as not found, as a conversation that no update touched
    /// does on the other path.
    pub(super) async fn start_runs_in_one_query(
        backend: &B,
        conversations: &[Conversation],
        messages: &[(&UserId, &Message)],
        starts: &[&RunStart],
        traces: &[(&Trace, &str, Option<&Value>)],
    ) -> Result<(), StoreError> {
        let mut query = sqlx::QueryBuilder::<B::Db>::new(B::BEGIN_WRITE);
        for rows in conversations.chunks(ROWS_PER_INSERT) {
            query.push("; ");
            Rows::<B>::push_conversations(&mut query, rows);
        }
        for rows in messages.chunks(ROWS_PER_INSERT) {
            query.push("; ");
            Rows::<B>::push_messages(&mut query, rows);
            if Rows::<B>::use_files(rows) {
                query.push("; ");
                Rows::<B>::push_message_files(&mut query, rows);
            }
        }
        for start in starts {
            if start.user_message_is_new && start.new_conversation.is_none() {
                query.push("; ");
                Rows::<B>::push_touch(&mut query, &start.traces[0].user_id, &start.user_message);
            }
            if Rows::<B>::settles(start) {
                query.push("; ");
                Rows::<B>::push_settle(&mut query, start);
            }
            if let Some(c) = &start.comparison {
                query.push("; ");
                Rows::<B>::push_comparison(&mut query, c);
            }
        }
        for rows in traces.chunks(ROWS_PER_INSERT) {
            query.push("; ");
            Rows::<B>::push_traces(&mut query, rows);
        }
        if starts.iter().any(|s| s.idempotency_key.is_some()) {
            query.push("; ");
            Rows::<B>::push_keys(&mut query, starts);
        }
        query.push("; COMMIT");
        write(backend, async |conn| {
            transaction_as_one_query::<B>(conn, query).await.map_err(|e| match e.as_database_error() {
                Some(db) if db.is_foreign_key_violation() => StoreError::NotFound,
                _ => key_taken(e),
            })
        })
        .await
    }

    /// Makes the messages that follow `answer` (queued behind it, CONTRACT.md §16) follow
    /// `question` instead: the answer never came, or is deleted.
    pub(super) async fn follow_question(
        conn: &mut Conn<B>,
        conversation: Uuid,
        answer: MessageId,
        question: Option<MessageId>,
    ) -> Result<(), StoreError> {
        sqlx::query("update messages set parent_id = $3 where conversation_id = $1 and parent_id = $2")
            .bind(conversation)
            .bind(answer)
            .bind(question)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Inserts a message and makes it the conversation's active leaf.
    pub(super) async fn append_message(conn: &mut Conn<B>, user: &UserId, m: &Message) -> Result<(), StoreError> {
        Rows::<B>::insert_messages(conn, &[(user, m)]).await?;
        Rows::<B>::touch_conversation(conn, user, m).await
    }

    /// Counts a new message in its conversation and makes it the active leaf.
    pub(super) async fn touch_conversation(conn: &mut Conn<B>, user: &UserId, m: &Message) -> Result<(), StoreError> {
        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
        Rows::<B>::push_touch(&mut query, user, m);
        if B::execute(&mut *conn, query).await? == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    /// The update of [`touch_conversation`](Rows::<B>::touch_conversation). A new user message
    /// becomes the leaf. An answer does where the leaf is its question, or another answer to
    /// it (a regenerate): not where messages were queued behind it meanwhile (CONTRACT.md
    /// §16), nor where the user went to another branch. The second answer of a comparison
    /// does not take over the branch: A stays active until a vote says otherwise.
    /// Whether a start needs [`push_settle`](Rows::<B>::push_settle).
    pub(super) fn settles(start: &RunStart) -> bool {
        let regenerate = !start.user_message_is_new && start.new_conversation.is_none();
        let queued_after =
            start.user_message_is_new && start.queued.is_some() && start.user_message.parent_id.is_some();
        regenerate || queued_after
    }

    /// What a start settles besides its rows. A regenerate makes its question the leaf (its
    /// answer takes it from there when it ends). A queued message whose answer-to-follow will
    /// never come (its run ended without one since the start looked) follows that run's
    /// question instead, as `finish_run` moves the messages already queued behind it.
    pub(super) fn push_settle<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, start: &'a RunStart) {
        let m = &start.user_message;
        if !start.user_message_is_new {
            query.push("update conversations set active_leaf_id = ").push_bind(m.id);
            query.push(" where id = ").push_bind(m.conversation_id);
            query.push(" and user_id = ").push_bind(&start.traces[0].user_id);
            return;
        }
        const ENDED: &str = " and t.status not in ('running', 'waiting', 'queued')";
        query.push("update messages set parent_id = (select t.user_message_id from traces t where t.message_id = ");
        query.push_bind(m.parent_id).push(ENDED).push(" limit 1) where id = ").push_bind(m.id);
        query.push(" and not exists (select 1 from messages p where p.id = ").push_bind(m.parent_id);
        query.push(") and exists (select 1 from traces t where t.message_id = ").push_bind(m.parent_id).push(ENDED);
        query.push(")");
    }

    pub(super) fn push_touch<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, user: &'a UserId, m: &'a Message) {
        query.push("update conversations set active_leaf_id = case when ");
        query.push_bind(m.variant.as_deref() == Some("b"));
        query.push(" then active_leaf_id");
        if let (Role::Assistant, Some(question)) = (m.role, m.parent_id) {
            query.push(" when active_leaf_id is not null and active_leaf_id <> ").push_bind(question);
            query.push(" and not exists (select 1 from messages x where x.id = conversations.active_leaf_id");
            query.push(" and x.parent_id = ").push_bind(question);
            query.push(") then active_leaf_id");
        }
        query.push(" else ").push_bind(m.id);
        query.push(" end, message_count = message_count + 1, last_message_at = ").push_bind(m.created_at);
        query.push(", updated_at = ").push_bind(m.created_at);
        query.push(" where id = ").push_bind(m.conversation_id);
        query.push(" and user_id = ").push_bind(user);
    }
}

/// The runs of a conversation (`$1`) that are going, each with its `started_at`, status and
/// comparison: one select per status, for their partial indexes.
const GOING_IN_CONVERSATION: &str = "select id, started_at, status, comparison_id from traces \
     where conversation_id = $1 and status = 'running' \
     union all select id, started_at, status, comparison_id from traces where conversation_id = $1 and status = 'waiting' \
     union all select id, started_at, status, comparison_id from traces where conversation_id = $1 and status = 'queued'";

/// A unique violation of `idempotency_keys`: another start recorded the key first.
fn key_taken(error: sqlx::Error) -> StoreError {
    match error.as_database_error() {
        Some(db)
            if db.is_unique_violation()
                && (db.constraint().is_some_and(|c| c.starts_with("idempotency_keys"))
                    || db.message().contains("idempotency_keys")) =>
        {
            StoreError::KeyTaken
        }
        _ => error.into(),
    }
}
