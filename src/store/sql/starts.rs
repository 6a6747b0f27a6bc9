//! What a start writes, for any number of starts at once (the start writer's group commit):
//! new conversations, messages and traces as a few multi-row statements, in one transaction;
//! where other replicas start runs too (Postgres), the users' limits and the conversations'
//! going runs checked under locks first; where one query may hold a whole transaction
//! (SQLite), one round trip.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};
use uuid::Uuid;

use super::statements::{GOING_IN_CONVERSATION, Statements};
use super::{Conn, ROWS_PER_INSERT, Row, transaction_as_one_query, write};
use crate::domain::{Conversation, Message, Trace};
use crate::ids::{TraceId, UserId};
use crate::store::{BudgetHold, RunStart, StartOutcome, StoreError};

/// A start's statements (see the module's doc).
pub(super) trait Starts: Statements {
    fn start_runs(
        backend: &Self,
        starts: &[&RunStart],
    ) -> impl Future<Output = Result<StartOutcome, StoreError>> + Send;

    /// Counts each user's running runs, with the starts' new ones, against the starts'
    /// `max_running`, holding a lock per user until the transaction ends: replicas
    /// that start runs for one user at once take turns here, and each sees the runs
    /// the others committed.
    fn check_running_limits(
        conn: &mut Conn<Self>,
        starts: &[&RunStart],
    ) -> impl Future<Output = Result<(), Stop>> + Send;

    /// Refuses the starts as [`StartOutcome::OverBudget`] where their runs' reservations
    /// would take their user past a budget, counting what every replica's runs spent and
    /// hold, under a lock per user: a burst of starts on several replicas takes turns here.
    fn check_budgets(conn: &mut Conn<Self>, starts: &[&RunStart]) -> impl Future<Output = Result<(), Stop>> + Send;

    /// Refuses the starts as [`StartOutcome::Moved`] where a run of a start's conversation is going that
    /// the start did not see (another replica started it since): its message would not follow
    /// that run. Starts into one conversation take turns here.
    fn check_going(
        conn: &mut Conn<Self>,
        starts: &[&RunStart],
    ) -> impl Future<Output = Result<Vec<(Uuid, DateTime<Utc>)>, Stop>> + Send;

    /// Places the queued traces of `starts` after the runs going in their conversations
    /// (`lasts`: the latest `started_at` of those, from [`check_going`](<B as Starts>::check_going)):
    /// the queue's order is the database's, not the clocks of the replicas that planned them.
    fn place_queued(
        conn: &mut Conn<Self>,
        starts: &[&RunStart],
        lasts: &[(Uuid, DateTime<Utc>)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The whole group of starts as one query of several statements, the transaction
    /// included: one round trip to the database instead of one per statement (SQLite
    /// runs each on its own thread; under load, every trip back waited its turn on a
    /// busy runtime). A conversation deleted meanwhile fails its message's or trace's
    /// foreign key, and reads as not found, as a conversation that no update touched
    /// does on the other path.
    fn start_runs_in_one_query(
        backend: &Self,
        conversations: &[Conversation],
        messages: &[(&UserId, &Message)],
        starts: &[&RunStart],
        traces: &[(&Trace, &str, Option<&Value>)],
    ) -> impl Future<Output = Result<StartOutcome, StoreError>> + Send;
}

impl<B> Starts for B
where
    B: Statements,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> (i64,): FromRow<'r, Row<B>>,
    for<'r> (Uuid, DateTime<Utc>, String, Option<Uuid>): FromRow<'r, Row<B>>,
    for<'r> super::usage::SpendRow: FromRow<'r, Row<B>>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
{
    async fn start_runs(backend: &B, starts: &[&RunStart]) -> Result<StartOutcome, StoreError> {
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
            traces.extend(start.traces.iter().map(|t| (t, start.replica_id.as_str(), start.asked.as_ref())));
        }
        if B::MANY_STATEMENTS_PER_QUERY {
            return <B as Starts>::start_runs_in_one_query(backend, &conversations, &messages, starts, &traces).await;
        }
        write(backend, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, B::BEGIN_WRITE).await?;
            let written: Result<(), Stop> = async {
                let lasts = if B::SHARED {
                    <B as Starts>::check_running_limits(&mut *tx, starts).await?;
                    <B as Starts>::check_budgets(&mut *tx, starts).await?;
                    <B as Starts>::check_going(&mut *tx, starts).await?
                } else {
                    Vec::new()
                };
                for rows in conversations.chunks(ROWS_PER_INSERT) {
                    <B as Statements>::insert_conversations(&mut *tx, rows).await.map_err(Stop::from_insert)?;
                }
                for rows in messages.chunks(ROWS_PER_INSERT) {
                    <B as Statements>::insert_messages(&mut *tx, rows).await?;
                    if <B as Statements>::use_files(rows) {
                        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                        <B as Statements>::push_message_files(&mut query, rows);
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
                        <B as Statements>::touch_conversation(&mut *tx, user, &start.user_message).await?;
                    }
                    if <B as Statements>::settles(start) {
                        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                        <B as Statements>::push_settle(&mut query, start);
                        B::execute(&mut *tx, query).await?;
                    }
                    if let Some(c) = &start.comparison {
                        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                        <B as Statements>::push_comparison(&mut query, c);
                        B::execute(&mut *tx, query).await?;
                    }
                }
                for rows in traces.chunks(ROWS_PER_INSERT) {
                    let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                    <B as Statements>::push_traces(&mut query, rows);
                    B::execute(&mut *tx, query).await?;
                }
                <B as Starts>::place_queued(&mut tx, starts, &lasts).await?;
                let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                if <B as Statements>::push_reservations(&mut query, starts) {
                    B::execute(&mut *tx, query).await?;
                }
                let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                if <B as Statements>::push_keys(&mut query, starts) {
                    B::execute(&mut *tx, query).await.map_err(Stop::from_insert)?;
                }
                Ok(())
            }
            .await;
            match written {
                Ok(()) => {
                    tx.commit().await?;
                    Ok(StartOutcome::Started)
                }
                Err(Stop::Refused(outcome)) => {
                    tx.rollback().await?;
                    Ok(outcome)
                }
                Err(Stop::Fault(e)) => Err(e),
            }
        })
        .await
    }

    async fn check_running_limits(conn: &mut Conn<B>, starts: &[&RunStart]) -> Result<(), Stop> {
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
                return Err(Stop::Refused(StartOutcome::OverLimit(running)));
            }
        }
        Ok(())
    }

    async fn check_budgets(conn: &mut Conn<B>, starts: &[&RunStart]) -> Result<(), Stop> {
        let mut users: Vec<(&UserId, BudgetHold, u64)> = Vec::new();
        for start in starts {
            let (Some(hold), Some(first)) = (start.budget, start.traces.first()) else { continue };
            match users.iter_mut().find(|(user, ..)| *user == &first.user_id) {
                Some((_, _, runs)) => *runs += start.traces.len() as u64,
                None => users.push((&first.user_id, hold, start.traces.len() as u64)),
            }
        }
        users.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (user, hold, runs) in users {
            sqlx::query("select pg_advisory_xact_lock(hashtextextended($1, 9))").bind(user).execute(&mut *conn).await?;
            let budgets = hold.budgets;
            let row: super::usage::SpendRow = sqlx::query_as(super::usage::SPEND)
                .bind(user)
                .bind(budgets.day_start)
                .bind(budgets.month_start)
                .fetch_one(&mut *conn)
                .await?;
            if budgets.passed_with(&row.into(), hold.reserve_tokens * runs, hold.reserve_usd * runs as f64) {
                return Err(Stop::Refused(StartOutcome::OverBudget));
            }
        }
        Ok(())
    }

    async fn check_going(conn: &mut Conn<B>, starts: &[&RunStart]) -> Result<Vec<(Uuid, DateTime<Utc>)>, Stop> {
        let mut seen: Vec<(Uuid, &[TraceId])> =
            starts.iter().filter_map(|s| Some((s.user_message.conversation_id.0, s.going_seen.as_deref()?))).collect();
        seen.sort_unstable_by_key(|(conversation, _)| *conversation);
        let mut lasts = Vec::new();
        for (conversation, seen) in seen {
            <B as Statements>::lock_conversation(conn, conversation).await?;
            let going: Vec<(Uuid, DateTime<Utc>, String, Option<Uuid>)> =
                sqlx::query_as(GOING_IN_CONVERSATION).bind(conversation).fetch_all(&mut *conn).await?;
            if going.iter().any(|(id, ..)| !seen.iter().any(|s| s.0 == *id)) {
                return Err(Stop::Refused(StartOutcome::Moved));
            }
            if let Some(last) = going.iter().map(|(_, at, ..)| *at).max() {
                lasts.push((conversation, last));
            }
        }
        Ok(lasts)
    }

    async fn place_queued(
        conn: &mut Conn<B>,
        starts: &[&RunStart],
        lasts: &[(Uuid, DateTime<Utc>)],
    ) -> Result<(), StoreError> {
        for start in starts.iter().filter(|s| s.is_queued()) {
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

    async fn start_runs_in_one_query(
        backend: &B,
        conversations: &[Conversation],
        messages: &[(&UserId, &Message)],
        starts: &[&RunStart],
        traces: &[(&Trace, &str, Option<&Value>)],
    ) -> Result<StartOutcome, StoreError> {
        let mut query = sqlx::QueryBuilder::<B::Db>::new(B::BEGIN_WRITE);
        for rows in conversations.chunks(ROWS_PER_INSERT) {
            query.push("; ");
            <B as Statements>::push_conversations(&mut query, rows);
        }
        for rows in messages.chunks(ROWS_PER_INSERT) {
            query.push("; ");
            <B as Statements>::push_messages(&mut query, rows);
            if <B as Statements>::use_files(rows) {
                query.push("; ");
                <B as Statements>::push_message_files(&mut query, rows);
            }
        }
        for start in starts {
            if start.user_message_is_new && start.new_conversation.is_none() {
                query.push("; ");
                <B as Statements>::push_touch(&mut query, &start.traces[0].user_id, &start.user_message);
            }
            if <B as Statements>::settles(start) {
                query.push("; ");
                <B as Statements>::push_settle(&mut query, start);
            }
            if let Some(c) = &start.comparison {
                query.push("; ");
                <B as Statements>::push_comparison(&mut query, c);
            }
        }
        for rows in traces.chunks(ROWS_PER_INSERT) {
            query.push("; ");
            <B as Statements>::push_traces(&mut query, rows);
        }
        if starts.iter().any(|s| s.idempotency_key.is_some()) {
            query.push("; ");
            <B as Statements>::push_keys(&mut query, starts);
        }
        if starts.iter().any(|s| s.budget.is_some()) {
            query.push("; ");
            <B as Statements>::push_reservations(&mut query, starts);
        }
        query.push("; COMMIT");
        write(backend, async |conn| match transaction_as_one_query::<B>(conn, query).await {
            Ok(()) => Ok(StartOutcome::Started),
            Err(e) => match Stop::from_insert(e) {
                Stop::Refused(outcome) => Ok(outcome),
                Stop::Fault(e) => Err(e),
            },
        })
        .await
    }
}

/// Why a start's transaction stopped short: a refusal (rolled back, and answered as the
/// start's outcome) or a fault.
pub(super) enum Stop {
    Refused(StartOutcome),
    Fault(StoreError),
}

impl Stop {
    /// What a failed insert of a start's rows means: a unique violation of
    /// `idempotency_keys` is another start that recorded the key first; of a conversation's
    /// external id (`conversations_by_external_id`), another start that made the same client
    /// chat; a foreign key violation is a conversation or file deleted since the request was
    /// checked. (SQLite names the columns where Postgres names the constraint.)
    fn from_insert(error: impl Into<StoreError>) -> Self {
        let error = error.into();
        let StoreError::Database(sqlx::Error::Database(db)) = &error else { return Stop::Fault(error) };
        let violates = |constraint: &str, columns: &str| {
            db.constraint().is_some_and(|c| c.starts_with(constraint)) || db.message().contains(columns)
        };
        if db.is_unique_violation() && violates("idempotency_keys", "idempotency_keys.") {
            Stop::Refused(StartOutcome::KeyTaken)
        } else if db.is_unique_violation() && violates("conversations_by_external_id", "conversations.external_id") {
            Stop::Refused(StartOutcome::ChatTaken)
        } else if db.is_foreign_key_violation() {
            Stop::Fault(StoreError::NotFound)
        } else {
            Stop::Fault(error)
        }
    }
}

impl<E: Into<StoreError>> From<E> for Stop {
    fn from(error: E) -> Self {
        Stop::Fault(error.into())
    }
}
