//! Statements the concerns share: the rows a start writes (conversations, messages,
//! comparisons, traces, keys: a few multi-row statements for any number of starts), the
//! claim of a waiting run, following a question when its answer is gone, and a run's end as
//! one statement where a `with` query may write (Postgres).

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};
use uuid::Uuid;

use super::outbox::REPORTED_RUN;
use super::{Backend, Conn, Row};
use crate::domain::Role;
use crate::domain::{Comparison, Conversation, Message, Trace, Usage, now};
use crate::ids::{ComparisonId, MessageId, TraceId, UserId};
use crate::store::rows::*;
use crate::store::{Claim, RunFinish, RunStart, StoreError, Wait};

/// The columns of a message, in the order its values are given.
macro_rules! message_columns {
    () => {
        "id, conversation_id, user_id, parent_id, role, content, thinking, provider_state, tool_calls, \
         tool_history, payloads, suggested_values, suggested_actions, cancelled, model, trace_id, usage, \
         cost_usd, feedback, comparison_id, variant, client_id, attachments, created_at"
    };
}
/// See [`message_columns`].
pub(in crate::store) const MESSAGE_COLUMNS: &str = message_columns!();
/// The insert of [`Statements::push_messages`], its columns in their values' order.
const MESSAGE_INSERT: &str = concat!("insert into messages (", message_columns!(), ") ");

/// The insert of a run's spend into `run_usage`, a select of the trace's row and five
/// values after it (input, output, cache read and cache write tokens, cost), and the update
/// where the row is there (a reservation, or an earlier step's spend); what the update does
/// with the reservation follows it.
pub(in crate::store) const SPEND_INSERT: &str = "insert into run_usage (trace_id, user_id, profile, model, started_at, input_tokens, \
     output_tokens, cache_read_tokens, cache_write_tokens, cost_usd) ";
pub(in crate::store) const SPEND_UPDATE: &str = " on conflict (trace_id) do update set input_tokens = excluded.input_tokens, \
     output_tokens = excluded.output_tokens, cache_read_tokens = excluded.cache_read_tokens, \
     cache_write_tokens = excluded.cache_write_tokens, cost_usd = excluded.cost_usd";

/// A count of tokens as its column holds it.
pub(in crate::store) fn tokens(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The update that closes a run's trace, where it is its user's and still running or
/// queued, up to its `returning` (the caller's columns follow).
pub(super) fn push_close<'a, DB: Database>(query: &mut sqlx::QueryBuilder<'a, DB>, finish: &'a RunFinish)
where
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> DateTime<Utc>: Encode<'q, DB> + Type<DB>,
    for<'q> JsonText: Encode<'q, DB> + Type<DB>,
    for<'q> Option<JsonText>: Encode<'q, DB>,
    for<'q> Option<f64>: Encode<'q, DB>,
    f64: Type<DB>,
    for<'q> TraceId: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
{
    query.push("update traces set status = ").push_bind(finish.status.as_str());
    query.push(", ended_at = ").push_bind(finish.ended_at);
    query.push(", usage = ").push_bind(json(&finish.usage));
    query.push(", error = ").push_bind(finish.error.as_ref().map(json));
    query.push(", spans = ").push_bind(json(&finish.spans));
    query.push(", cost_usd = ").push_bind(finish.cost_usd);
    query.push(" where id = ").push_bind(finish.trace_id);
    query.push(" and user_id = ").push_bind(finish.user_id.as_str());
    query.push(" and status in ('running', 'queued') returning ");
}

/// A run's spend, its insert up to the select's `from` (the caller's): the trace's columns
/// and what it spent.
fn push_spent<'a, DB: Database>(query: &mut sqlx::QueryBuilder<'a, DB>, finish: &'a RunFinish)
where
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> Option<f64>: Encode<'q, DB>,
    f64: Type<DB>,
{
    let usage = &finish.usage;
    query.push(format_args!("{SPEND_INSERT}select id, user_id, profile, model, started_at, "));
    query
        .separated(", ")
        .push_bind(tokens(usage.input_tokens))
        .push_bind(tokens(usage.output_tokens))
        .push_bind(tokens(usage.cache_read_tokens.unwrap_or(0)))
        .push_bind(tokens(usage.cache_write_tokens.unwrap_or(0)))
        .push_bind(finish.cost_usd);
}

/// The statements several of the store's concerns write (implemented below for every backend
/// whose database binds and reads what they use).
pub(super) trait Statements: Backend {
    /// Makes a waiting run `running` on `replica_id` and hands over what it needs to go on.
    fn claim(
        conn: &mut Conn<Self>,
        trace_id: TraceId,
        replica_id: &str,
    ) -> impl Future<Output = Result<Option<Claim>, StoreError>> + Send;

    /// Takes the conversation's lock until the transaction ends (shared stores only: SQLite
    /// has one writer).
    fn lock_conversation(
        conn: &mut Conn<Self>,
        conversation: Uuid,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The `run_usage` rows of starts whose user has a budget, each run with its reservation
    /// (CONTRACT.md §18); false (and nothing pushed) where none has.
    fn push_reservations<'a>(query: &mut sqlx::QueryBuilder<'a, Self::Db>, starts: &'a [&'a RunStart]) -> bool;

    /// Writes what a run has spent so far to its row of `run_usage` (CONTRACT.md §18): the
    /// sums of `/api/usage` and the budgets read those rows, which outlive the conversation.
    /// A run that `ended` gives back what it held of its user's budgets; a going one keeps it.
    fn record_spend(
        conn: &mut Conn<Self>,
        trace_id: TraceId,
        usage: &Usage,
        cost_usd: Option<f64>,
        ended: bool,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    fn insert_conversation(
        conn: &mut Conn<Self>,
        c: &Conversation,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    fn insert_conversations(
        conn: &mut Conn<Self>,
        rows: &[Conversation],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    fn push_conversations<'a>(query: &mut sqlx::QueryBuilder<'a, Self::Db>, rows: &'a [Conversation]);

    /// Inserts messages, each `(owner, message)`, without touching their conversations.
    fn insert_messages(
        conn: &mut Conn<Self>,
        rows: &[(&UserId, &Message)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    fn push_messages<'a>(query: &mut sqlx::QueryBuilder<'a, Self::Db>, rows: &'a [(&'a UserId, &'a Message)]);

    /// The `values` list of [`push_messages`](Self::push_messages), in [`MESSAGE_INSERT`]'s order.
    fn push_message_values<'a>(
        query: &mut sqlx::QueryBuilder<'a, Self::Db>,
        rows: impl IntoIterator<Item = (&'a UserId, &'a Message)>,
    );

    /// The idempotency keys of the starts that have one, each naming its first trace.
    fn push_keys<'a>(query: &mut sqlx::QueryBuilder<'a, Self::Db>, starts: &'a [&'a RunStart]) -> bool;

    /// Whether any of the messages carries a file.
    fn use_files(rows: &[(&UserId, &Message)]) -> bool;

    /// The rows that say which files the messages use (some must: see [`use_files`]).
    fn push_message_files<'a>(query: &mut sqlx::QueryBuilder<'a, Self::Db>, rows: &'a [(&'a UserId, &'a Message)]);

    fn push_comparison<'a>(query: &mut sqlx::QueryBuilder<'a, Self::Db>, c: &'a Comparison);

    fn push_traces<'a>(
        query: &mut sqlx::QueryBuilder<'a, Self::Db>,
        rows: &'a [(&'a Trace, &'a str, Option<&'a Value>)],
    );

    /// Makes the messages that follow `answer` (queued behind it, CONTRACT.md §16) follow
    /// `question` instead: the answer never came, or is deleted.
    fn follow_question(
        conn: &mut Conn<Self>,
        conversation: Uuid,
        answer: MessageId,
        question: Option<MessageId>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes message `id` of `conversation` and uncounts it; where it was the active leaf,
    /// `parent` is.
    fn remove_message(
        conn: &mut Conn<Self>,
        conversation: Uuid,
        id: MessageId,
        parent: Option<MessageId>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Inserts a message and makes it the conversation's active leaf.
    fn append_message(
        conn: &mut Conn<Self>,
        user: &UserId,
        m: &Message,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// A run's end as one statement, where a `with` query may write (see
    /// [`Backend::WRITES_IN_WITH`]): its trace closed, where it is its user's and still
    /// running or queued, with what it spent, and its answer appended (or the messages queued
    /// behind the answer that never came moved to its question) only where the trace was.
    /// Returns the trace's [`REPORTED_RUN`](super::outbox::REPORTED_RUN) columns: no row
    /// where it had already ended. The answer's conversation is the trace's own (the
    /// message's foreign key refuses the statement where it is gone).
    fn push_end<'a>(query: &mut sqlx::QueryBuilder<'a, Self::Db>, finish: &'a RunFinish);

    /// The same end as statements in turn, the transaction included, for a backend that
    /// takes several statements as one query (SQLite): one round trip to its thread. Each
    /// write after the trace's is made only where the one before wrote its row, so nothing
    /// is written where the trace was not; the rows returned are the trace's
    /// [`REPORTED_RUN`](super::outbox::REPORTED_RUN) columns.
    fn push_end_in_turn<'a>(query: &mut sqlx::QueryBuilder<'a, Self::Db>, finish: &'a RunFinish);

    /// Counts a new message in its conversation and makes it the active leaf.
    fn touch_conversation(
        conn: &mut Conn<Self>,
        user: &UserId,
        m: &Message,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The update of [`touch_conversation`](<B as Statements>::touch_conversation). A new user message
    /// becomes the leaf. An answer does where the leaf is its question, or another answer to
    /// it (a regenerate): not where messages were queued behind it meanwhile (CONTRACT.md
    /// §16), nor where the user went to another branch. The second answer of a comparison
    /// does not take over the branch: A stays active until a vote says otherwise.
    /// Whether a start needs [`push_settle`](<B as Statements>::push_settle).
    fn settles(start: &RunStart) -> bool;

    /// What a start settles besides its rows. A regenerate makes its question the leaf (its
    /// answer takes it from there when it ends). A queued message whose answer-to-follow will
    /// never come (its run ended without one since the start looked) follows that run's
    /// question instead, as `finish_run` moves the messages already queued behind it.
    fn push_settle<'a>(query: &mut sqlx::QueryBuilder<'a, Self::Db>, start: &'a RunStart);

    fn push_touch<'a>(query: &mut sqlx::QueryBuilder<'a, Self::Db>, user: &'a UserId, m: &'a Message);

    /// The runs of a conversation that are going, each with its `started_at`, status and
    /// comparison: one select per status, for their partial indexes.
    fn push_going(query: &mut sqlx::QueryBuilder<'_, Self::Db>, conversation: Uuid);

    /// What a user's runs spent since `budgets.month_start` (and their tokens since its
    /// `day_start`), reservations apart: one read of the index on (user_id, started_at), as
    /// the columns of a [`SpendRow`](super::usage::SpendRow).
    fn push_spend<'a>(
        query: &mut sqlx::QueryBuilder<'a, Self::Db>,
        user: &'a str,
        budgets: &crate::domain::budget::Budgets,
    );
}

impl<B> Statements for B
where
    B: Backend,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> TraceRow: FromRow<'r, Row<B>>,
    for<'r> (i64,): FromRow<'r, Row<B>>,
    for<'r> (Json<Value>,): FromRow<'r, Row<B>>,
    for<'r> (Uuid, DateTime<Utc>, String, Option<Uuid>): FromRow<'r, Row<B>>,
    for<'r> WaitRow: FromRow<'r, Row<B>>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> JsonText: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<&'q str>: Encode<'q, B::Db>,
    for<'q> Option<ComparisonId>: Encode<'q, B::Db>,
    for<'q> Option<f64>: Encode<'q, B::Db>,
    f64: Type<B::Db>,
    for<'q> i64: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> TraceId: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> f64: Encode<'q, B::Db>,
    for<'q> bool: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<JsonText>: Encode<'q, B::Db>,
    for<'q> Option<MessageId>: Encode<'q, B::Db>,
    for<'q> Option<TraceId>: Encode<'q, B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> bool: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> i64: Encode<'q, B::Db> + Type<B::Db>,
{
    async fn claim(conn: &mut Conn<B>, trace_id: TraceId, replica_id: &str) -> Result<Option<Claim>, StoreError> {
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

    async fn lock_conversation(conn: &mut Conn<B>, conversation: Uuid) -> Result<(), StoreError> {
        if B::SHARED {
            sqlx::query("select pg_advisory_xact_lock(hashtextextended($1, 8))")
                .bind(conversation.to_string())
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }

    async fn insert_conversation(conn: &mut Conn<B>, c: &Conversation) -> Result<(), StoreError> {
        <B as Statements>::insert_conversations(conn, std::slice::from_ref(c)).await
    }

    async fn insert_conversations(conn: &mut Conn<B>, rows: &[Conversation]) -> Result<(), StoreError> {
        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
        <B as Statements>::push_conversations(&mut query, rows);
        B::execute(&mut *conn, query).await?;
        Ok(())
    }

    fn push_conversations<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, rows: &'a [Conversation]) {
        query.push(
            "insert into conversations (id, user_id, title, profile, system_prompt, metadata, \
             external_id, active_leaf_id, message_count, created_at, updated_at, last_message_at) ",
        );
        if B::push_conversation_arrays(query, rows) {
            return;
        }
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

    async fn insert_messages(conn: &mut Conn<B>, rows: &[(&UserId, &Message)]) -> Result<(), StoreError> {
        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
        <B as Statements>::push_messages(&mut query, rows);
        B::execute(&mut *conn, query).await?;
        Ok(())
    }

    fn push_messages<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, rows: &'a [(&'a UserId, &'a Message)]) {
        query.push(MESSAGE_INSERT);
        if !B::push_message_arrays(query, rows) {
            <B as Statements>::push_message_values(query, rows.iter().copied());
        }
    }

    fn push_message_values<'a>(
        query: &mut sqlx::QueryBuilder<'a, B::Db>,
        rows: impl IntoIterator<Item = (&'a UserId, &'a Message)>,
    ) {
        query.push_values(rows, |mut row, (user, m)| {
            row.push_bind(m.id)
                .push_bind(m.conversation_id)
                .push_bind(user)
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
                .push_bind(m.cost.cost_usd)
                .push_bind(m.feedback.as_ref().map(json))
                .push_bind(m.comparison_id)
                .push_bind(m.variant.as_deref())
                .push_bind(m.client_id.as_deref())
                .push_bind(json(&m.attachments))
                .push_bind(m.created_at);
        });
    }

    fn push_keys<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, starts: &'a [&'a RunStart]) -> bool {
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

    fn use_files(rows: &[(&UserId, &Message)]) -> bool {
        rows.iter().any(|(_, m)| !m.attachments.is_empty())
    }

    fn push_message_files<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, rows: &'a [(&'a UserId, &'a Message)]) {
        let uses =
            rows.iter().flat_map(|(_, m)| m.attachments.iter().enumerate().map(|(i, a)| (m.id, i as i64, a.file_id)));
        query.push("insert into message_files (message_id, position, file_id) ");
        query.push_values(uses, |mut row, (message, position, file)| {
            row.push_bind(message).push_bind(position).push_bind(file);
        });
    }

    fn push_comparison<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, c: &'a Comparison) {
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

    fn push_traces<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, rows: &'a [(&'a Trace, &'a str, Option<&'a Value>)]) {
        query.push(
            "insert into traces (id, conversation_id, user_id, user_message_id, message_id, status, \
             model, profile, started_at, spans, comparison_id, variant, replica_id, heartbeat_at, checkpoint, traceparent, metadata) ",
        );
        if B::push_trace_arrays(query, rows) {
            return;
        }
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
                .push_bind(queued.map(json))
                .push_bind(t.traceparent.as_deref())
                .push_bind(t.metadata.as_ref().map(json));
        });
    }

    async fn follow_question(
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

    async fn remove_message(
        conn: &mut Conn<B>,
        conversation: Uuid,
        id: MessageId,
        parent: Option<MessageId>,
    ) -> Result<(), StoreError> {
        sqlx::query("delete from messages where id = $1").bind(id).execute(&mut *conn).await?;
        sqlx::query(
            "update conversations set message_count = message_count - 1, \
             active_leaf_id = case when active_leaf_id = $2 then $3 else active_leaf_id end where id = $1",
        )
        .bind(conversation)
        .bind(id)
        .bind(parent)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }

    async fn append_message(conn: &mut Conn<B>, user: &UserId, m: &Message) -> Result<(), StoreError> {
        <B as Statements>::insert_messages(conn, &[(user, m)]).await?;
        <B as Statements>::touch_conversation(conn, user, m).await
    }

    fn push_reservations<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, starts: &'a [&'a RunStart]) -> bool {
        let held: Vec<(&Trace, &crate::store::BudgetHold)> = starts
            .iter()
            .filter_map(|s| Some((s, s.budget.as_ref()?)))
            .flat_map(|(s, h)| s.traces.iter().map(move |t| (t, h)))
            .collect();
        if held.is_empty() {
            return false;
        }
        query.push(
            "insert into run_usage (trace_id, user_id, profile, model, started_at, reserved_tokens, reserved_usd) ",
        );
        query.push_values(held, |mut row, (t, hold)| {
            row.push_bind(t.trace_id)
                .push_bind(t.user_id.as_str())
                .push_bind(t.profile.as_str())
                .push_bind(t.model.as_str())
                .push_bind(t.started_at)
                .push_bind(i64::try_from(hold.reserve_tokens).unwrap_or(i64::MAX))
                .push_bind(hold.reserve_usd);
        });
        true
    }

    async fn record_spend(
        conn: &mut Conn<B>,
        trace_id: TraceId,
        usage: &Usage,
        cost_usd: Option<f64>,
        ended: bool,
    ) -> Result<(), StoreError> {
        static RECORD: LazyLock<String> = LazyLock::new(|| {
            format!(
                "{SPEND_INSERT}select id, user_id, profile, model, started_at, $2, $3, $4, $5, $6 from traces \
                 where id = $1{SPEND_UPDATE}, reserved_tokens = case when $7 then 0 else run_usage.reserved_tokens end, \
                 reserved_usd = case when $7 then 0 else run_usage.reserved_usd end"
            )
        });
        sqlx::query(&RECORD)
            .bind(trace_id)
            .bind(tokens(usage.input_tokens))
            .bind(tokens(usage.output_tokens))
            .bind(tokens(usage.cache_read_tokens.unwrap_or(0)))
            .bind(tokens(usage.cache_write_tokens.unwrap_or(0)))
            .bind(cost_usd)
            .bind(ended)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    fn push_end<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, finish: &'a RunFinish) {
        query.push("with ended as (");
        push_close(query, finish);
        query.push(format_args!("id, started_at, {REPORTED_RUN}), spent as ("));
        push_spent(query, finish);
        query.push(format_args!(" from ended{SPEND_UPDATE}, reserved_tokens = 0, reserved_usd = 0)"));
        match &finish.assistant_message {
            Some(m) => {
                query.push(format_args!(", answer as ({MESSAGE_INSERT}select * from ("));
                <B as Statements>::push_message_values(query, [(&finish.user_id, m)]);
                query.push(") v where exists (select 1 from ended)), touched as (");
                <B as Statements>::push_touch(query, &finish.user_id, m);
                query.push(" and exists (select 1 from ended))");
            }
            // Messages queued behind an answer that never came follow its question.
            None => {
                query.push(
                    ", followed as (update messages m set parent_id = e.user_message_id from ended e \
                     where m.conversation_id = e.conversation_id and m.parent_id = e.message_id)",
                );
            }
        }
        query.push(format_args!(" select {REPORTED_RUN} from ended"));
    }

    fn push_end_in_turn<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, finish: &'a RunFinish) {
        // `changes()`: the rows the statement before wrote (each writes one where it writes).
        const WROTE: &str = " and changes() = 1";
        query.push(B::BEGIN_WRITE).push("; ");
        push_close(query, finish);
        query.push(REPORTED_RUN).push("; ");
        push_spent(query, finish);
        query.push(" from traces where id = ").push_bind(finish.trace_id);
        query.push(format_args!("{WROTE}{SPEND_UPDATE}, reserved_tokens = 0, reserved_usd = 0; "));
        match &finish.assistant_message {
            Some(m) => {
                query.push(format_args!("{MESSAGE_INSERT}select * from ("));
                <B as Statements>::push_message_values(query, [(&finish.user_id, m)]);
                query.push(format_args!(") where true{WROTE}; "));
                <B as Statements>::push_touch(query, &finish.user_id, m);
                query.push(WROTE);
            }
            // Messages queued behind an answer that never came follow its question.
            None => {
                let of_trace = |query: &mut sqlx::QueryBuilder<'a, B::Db>, column: &str| {
                    query.push(format_args!("(select {column} from traces where id = ")).push_bind(finish.trace_id);
                    query.push(")");
                };
                query.push("update messages set parent_id = ");
                of_trace(query, "user_message_id");
                query.push(" where conversation_id = ");
                of_trace(query, "conversation_id");
                query.push(" and parent_id = ");
                of_trace(query, "message_id");
                query.push(WROTE);
            }
        }
        query.push("; COMMIT");
    }

    async fn touch_conversation(conn: &mut Conn<B>, user: &UserId, m: &Message) -> Result<(), StoreError> {
        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
        <B as Statements>::push_touch(&mut query, user, m);
        if B::execute(&mut *conn, query).await? == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    fn settles(start: &RunStart) -> bool {
        let regenerate = !start.user_message_is_new && start.new_conversation.is_none();
        let queued_after = start.user_message_is_new && start.is_queued() && start.user_message.parent_id.is_some();
        regenerate || queued_after
    }

    fn push_settle<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, start: &'a RunStart) {
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

    fn push_touch<'a>(query: &mut sqlx::QueryBuilder<'a, B::Db>, user: &'a UserId, m: &'a Message) {
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

    fn push_going(query: &mut sqlx::QueryBuilder<'_, B::Db>, conversation: Uuid) {
        for (i, status) in ["running", "waiting", "queued"].into_iter().enumerate() {
            if i > 0 {
                query.push(" union all ");
            }
            query.push("select id, started_at, status, comparison_id from traces where conversation_id = ");
            query.push_bind(conversation).push(format_args!(" and status = '{status}'"));
        }
    }

    fn push_spend<'a>(
        query: &mut sqlx::QueryBuilder<'a, B::Db>,
        user: &'a str,
        budgets: &crate::domain::budget::Budgets,
    ) {
        query.push("select cast(coalesce(sum(case when started_at >= ").push_bind(budgets.day_start);
        query.push(" then input_tokens + output_tokens else 0 end), 0) as bigint) as tokens, ");
        query.push("cast(coalesce(sum(case when started_at >= ").push_bind(budgets.day_start);
        query.push(" then reserved_tokens else 0 end), 0) as bigint) as reserved_tokens, ");
        query.push("cast(coalesce(sum(coalesce(cost_usd, 0)), 0) as double precision) as usd, ");
        query.push("cast(coalesce(sum(reserved_usd), 0) as double precision) as reserved_usd ");
        query.push("from run_usage where user_id = ").push_bind(user);
        query.push(" and started_at >= ").push_bind(budgets.month_start);
    }
}
