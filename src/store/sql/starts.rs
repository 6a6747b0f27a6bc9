//! What a start writes, for any number of starts at once (the start writer's group commit):
//! new conversations, messages and traces as a few multi-row statements, in one transaction;
//! where other replicas start runs too (Postgres), the users' limits, budgets and what the
//! start saw of its conversation (its going runs, its leaf) checked under locks, in three
//! round trips, or in one where the starts only open new chats and the database checks
//! their users' limits itself; where one query may hold a whole transaction (SQLite), one
//! round trip.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};
use uuid::Uuid;

use super::statements::Statements;
use super::usage::SpendRow;
use super::{Backend, Conn, OVER_LIMIT, ROWS_PER_INSERT, Row, transaction_as_one_query, write};
use crate::domain::{Conversation, Message, Trace};
use crate::ids::UserId;
use crate::store::{BudgetHold, RunStart, Seen, StartOutcome, StoreError};

/// A start's statements (see the module's doc).
pub(super) trait Starts: Statements {
    fn start_runs(
        backend: &Self,
        starts: &[&RunStart],
    ) -> impl Future<Output = Result<StartOutcome, StoreError>> + Send;

    /// The group of starts where other replicas start runs too (Postgres), in three round
    /// trips: `BEGIN` with the locks of the starts' users and conversations (taken in one
    /// order by every replica); one statement that writes every row (each a data-modifying
    /// `with` query) and reads, with the snapshot taken under those locks, what the checks
    /// need ([`Checks`]); then `COMMIT`, or `ROLLBACK` where a check refuses. Replicas that
    /// start runs for one user or conversation at once take turns at the locks, and each
    /// sees the runs the others committed. The few writes one statement cannot hold (a
    /// second update of a row it updates; a queued message's settle, which updates the
    /// message it inserts) follow it, before the commit.
    fn start_runs_under_locks(
        backend: &Self,
        conversations: &[Conversation],
        messages: &[(&UserId, &Message)],
        starts: &[&RunStart],
        traces: &[(&Trace, &str, Option<&Value>)],
    ) -> impl Future<Output = Result<StartOutcome, StoreError>> + Send;

    /// A group of starts that each open a new chat ([`opens_a_chat`]) in one round trip:
    /// one statement that writes every row and, as its main query, checks the users'
    /// running runs under their locks in the database ([`Backend::push_hold_running`]),
    /// committed with its answer; a refusal fails the statement, and nothing of it is
    /// written. `None` where the backend cannot check in SQL.
    fn start_new_chats(
        backend: &Self,
        conversations: &[Conversation],
        messages: &[(&UserId, &Message)],
        starts: &[&RunStart],
        traces: &[(&Trace, &str, Option<&Value>)],
    ) -> impl Future<Output = Option<Result<StartOutcome, StoreError>>> + Send;

    /// Places the queued traces of `starts` after the runs going in their conversations
    /// (`lasts`: the latest `started_at` of those, from [`Checks::judge`]):
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
    for<'r> CheckRow: FromRow<'r, Row<B>>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
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
        if starts.iter().all(|s| opens_a_chat(s)) {
            let started = <B as Starts>::start_new_chats(backend, &conversations, &messages, starts, &traces).await;
            if let Some(outcome) = started {
                return outcome;
            }
        }
        <B as Starts>::start_runs_under_locks(backend, &conversations, &messages, starts, &traces).await
    }

    async fn start_new_chats(
        backend: &B,
        conversations: &[Conversation],
        messages: &[(&UserId, &Message)],
        starts: &[&RunStart],
        traces: &[(&Trace, &str, Option<&Value>)],
    ) -> Option<Result<StartOutcome, StoreError>> {
        let checks = Checks::of(starts);
        let mut query = Writes::<B>::default();
        push_rows(&mut query, conversations, messages, starts, traces);
        let mut query = query.finish();
        let ours = traces.iter().map(|(t, ..)| t.trace_id.0).collect();
        if !B::push_hold_running(&mut query, &checks.running, ours) {
            return None;
        }
        Some(write(backend, async |conn| Stop::outcome(B::execute(conn, query).await)).await)
    }

    async fn start_runs_under_locks(
        backend: &B,
        conversations: &[Conversation],
        messages: &[(&UserId, &Message)],
        starts: &[&RunStart],
        traces: &[(&Trace, &str, Option<&Value>)],
    ) -> Result<StartOutcome, StoreError> {
        let checks = Checks::of(starts);
        write(backend, async |conn| {
            let mut tx = sqlx::Connection::begin_with(conn, checks.begin_and_lock::<B>()).await?;
            let written: Result<(), Stop> = async {
                // Updates of a row the statement inserts or updates already wait for it to end.
                let mut updated: Vec<Uuid> = conversations.iter().map(|c| c.id.0).collect();
                let mut after: Vec<&RunStart> = Vec::new();
                let mut query = Writes::<B>::default();
                push_rows(&mut query, conversations, messages, starts, traces);
                let mut touches = Vec::new();
                for start in starts {
                    let conversation = start.user_message.conversation_id.0;
                    let touches_row = start.user_message_is_new && start.new_conversation.is_none();
                    let settles = <B as Statements>::settles(start);
                    if !touches_row && !settles {
                        continue;
                    }
                    // A queued message's settle updates the message this statement inserts.
                    if updated.contains(&conversation) || start.user_message_is_new && settles {
                        after.push(start);
                    } else {
                        if touches_row {
                            <B as Statements>::push_touch(query.next(), &start.traces[0].user_id, &start.user_message);
                            touches.push(query.end_returning());
                        }
                        if settles {
                            <B as Statements>::push_settle(query.next(), start);
                            query.end();
                        }
                    }
                    updated.push(conversation);
                }
                if starts.iter().any(|s| s.budget.is_some()) {
                    <B as Statements>::push_reservations(query.next(), starts);
                    query.end();
                }
                let mut query = query.finish();
                checks.push_reads::<B>(&mut query, &touches);
                let rows: Vec<CheckRow> = B::fetch_all(&mut *tx, query).await.map_err(Stop::from_insert)?;
                let lasts = checks.judge(&rows, touches.len())?;
                for start in after {
                    if start.user_message_is_new && start.new_conversation.is_none() {
                        let user = &start.traces[0].user_id;
                        <B as Statements>::touch_conversation(&mut *tx, user, &start.user_message).await?;
                    }
                    if <B as Statements>::settles(start) {
                        let mut query = sqlx::QueryBuilder::<B::Db>::new("");
                        <B as Statements>::push_settle(&mut query, start);
                        B::execute(&mut *tx, query).await?;
                    }
                }
                <B as Starts>::place_queued(&mut tx, starts, &lasts).await?;
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
        write(backend, async |conn| Stop::outcome(transaction_as_one_query::<B>(conn, query).await)).await
    }
}

/// Whether a start only opens a new chat: nothing of an existing conversation to check or
/// update, no budget to reserve, nothing queued; a group of such starts is written in one
/// round trip where the database checks the users' running runs itself
/// ([`Starts::start_new_chats`]).
fn opens_a_chat(start: &RunStart) -> bool {
    start.new_conversation.is_some() && start.seen.is_none() && start.budget.is_none() && !start.is_queued()
}

/// The rows a group of starts inserts, each kind as multi-row inserts, each a write of
/// `query`: conversations, messages and their files, comparisons, traces, idempotency keys.
fn push_rows<'a, B: Statements>(
    query: &mut Writes<'a, B>,
    conversations: &'a [Conversation],
    messages: &'a [(&'a UserId, &'a Message)],
    starts: &'a [&'a RunStart],
    traces: &'a [(&'a Trace, &'a str, Option<&'a Value>)],
) {
    for rows in conversations.chunks(ROWS_PER_INSERT) {
        <B as Statements>::push_conversations(query.next(), rows);
        query.end();
    }
    for rows in messages.chunks(ROWS_PER_INSERT) {
        <B as Statements>::push_messages(query.next(), rows);
        query.end();
        if <B as Statements>::use_files(rows) {
            <B as Statements>::push_message_files(query.next(), rows);
            query.end();
        }
    }
    for comparison in starts.iter().filter_map(|s| s.comparison.as_ref()) {
        <B as Statements>::push_comparison(query.next(), comparison);
        query.end();
    }
    for rows in traces.chunks(ROWS_PER_INSERT) {
        <B as Statements>::push_traces(query.next(), rows);
        query.end();
    }
    if starts.iter().any(|s| s.idempotency_key.is_some()) {
        <B as Statements>::push_keys(query.next(), starts);
        query.end();
    }
}

/// Why a start's transaction stopped short: a refusal (rolled back, and answered as the
/// start's outcome) or a fault.
pub(super) enum Stop {
    Refused(StartOutcome),
    Fault(StoreError),
}

impl Stop {
    /// What a start written as one query comes to: started, refused by the database (see
    /// [`from_insert`](Self::from_insert)), or a fault.
    fn outcome<T>(written: Result<T, sqlx::Error>) -> Result<StartOutcome, StoreError> {
        match written.map_err(Stop::from_insert) {
            Ok(_) => Ok(StartOutcome::Started),
            Err(Stop::Refused(outcome)) => Ok(outcome),
            Err(Stop::Fault(e)) => Err(e),
        }
    }

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
        } else if db.code().as_deref() == Some(OVER_LIMIT) {
            let running = db.message().rsplit(' ').next().and_then(|n| n.parse().ok());
            Stop::Refused(StartOutcome::OverLimit(running.unwrap_or(usize::MAX)))
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

/// One statement of many writes, each a data-modifying `with` query (`w0`, `w1`, …), which
/// the checks' reads end.
struct Writes<'a, B: Backend> {
    query: sqlx::QueryBuilder<'a, B::Db>,
    count: usize,
}

impl<B: Backend> Default for Writes<'_, B> {
    fn default() -> Self {
        Self { query: sqlx::QueryBuilder::new(""), count: 0 }
    }
}

impl<'a, B: Backend> Writes<'a, B> {
    /// Opens the next write, for a statement to be pushed.
    fn next(&mut self) -> &mut sqlx::QueryBuilder<'a, B::Db> {
        self.query.push(if self.count == 0 { "with " } else { ", " });
        self.query.push(format_args!("w{} as (", self.count));
        &mut self.query
    }

    fn end(&mut self) {
        self.query.push(")");
        self.count += 1;
    }

    /// Ends an update whose rows are counted ([`Checks::push_reads`]); returns its number.
    fn end_returning(&mut self) -> usize {
        self.query.push(" returning 1)");
        self.count += 1;
        self.count - 1
    }

    fn finish(mut self) -> sqlx::QueryBuilder<'a, B::Db> {
        self.query.push(" ");
        self.query
    }
}

/// One row of what the checks read (a union of kinds, each with its slot: the user's,
/// conversation's or update's index).
#[derive(sqlx::FromRow)]
pub(super) struct CheckRow {
    kind: i32,
    slot: i32,
    n: i64,
    id: Option<Uuid>,
    at: Option<DateTime<Utc>>,
    #[sqlx(flatten)]
    spend: SpendRow,
}

const RUNNING: i32 = 0;
const SPENT: i32 = 1;
const GOING: i32 = 2;
const TOUCHED: i32 = 3;
const LEAF: i32 = 4;

/// What the starts of a group must be checked against, by user and conversation.
struct Checks<'a> {
    /// Users with a limit of running runs: the limit, and the runs the group adds.
    running: Vec<(&'a UserId, usize, usize)>,
    /// Users with a budget: its hold, and the runs the group adds.
    budgets: Vec<(&'a UserId, BudgetHold, u64)>,
    /// Existing conversations, with what their start saw of them.
    going: Vec<(Uuid, &'a Seen)>,
}

impl<'a> Checks<'a> {
    fn of(starts: &[&'a RunStart]) -> Self {
        let mut running: Vec<(&UserId, usize, usize)> = Vec::new();
        let mut budgets: Vec<(&UserId, BudgetHold, u64)> = Vec::new();
        for start in starts {
            let Some(first) = start.traces.first() else { continue };
            let runs = start.traces.len();
            if let Some(limit) = start.max_running {
                match running.iter_mut().find(|(user, ..)| *user == &first.user_id) {
                    Some((_, _, adding)) => *adding += runs,
                    None => running.push((&first.user_id, limit, runs)),
                }
            }
            if let Some(hold) = start.budget {
                match budgets.iter_mut().find(|(user, ..)| *user == &first.user_id) {
                    Some((_, _, adding)) => *adding += runs as u64,
                    None => budgets.push((&first.user_id, hold, runs as u64)),
                }
            }
        }
        running.sort_unstable_by(|a, b| a.0.cmp(b.0));
        budgets.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut going: Vec<(Uuid, &Seen)> =
            starts.iter().filter_map(|s| Some((s.user_message.conversation_id.0, s.seen.as_ref()?))).collect();
        going.sort_unstable_by_key(|(conversation, _)| *conversation);
        going.dedup_by_key(|(conversation, _)| *conversation);
        Self { running, budgets, going }
    }

    /// `BEGIN` and the locks, one simple query: the users' for their running runs (7) and
    /// budgets (9), then the conversations' (8), each kind in order. Its texts go in as hex
    /// digits (nothing a user sends is read as SQL); the keys are those the store's other
    /// statements take with a bound parameter.
    fn begin_and_lock<B: Backend>(&self) -> String {
        let mut sql = B::BEGIN_WRITE.to_owned();
        if !B::SHARED {
            return sql;
        }
        let mut lock = |text: &str, kind: u8| {
            let hex: String = text.bytes().map(|b| format!("{b:02x}")).collect();
            sql.push_str(&format!(
                "; select pg_advisory_xact_lock(hashtextextended(convert_from(decode('{hex}', 'hex'), 'UTF8'), {kind}))"
            ));
        };
        for (user, ..) in &self.running {
            lock(user.as_str(), 7);
        }
        for (user, ..) in &self.budgets {
            lock(user.as_str(), 9);
        }
        for (conversation, _) in &self.going {
            lock(&conversation.to_string(), 8);
        }
        sql
    }

    /// Ends the statement with what the checks read, and how many rows each counted
    /// update (`touches`, by write number) found: one row of each kind per slot, after a
    /// first that sets the columns' types.
    fn push_reads<B: Statements>(&self, query: &mut sqlx::QueryBuilder<'a, B::Db>, touches: &[usize])
    where
        for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
        for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
        for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    {
        const NO_RUN: &str = "cast(null as uuid) as id, cast(null as timestamptz) as at";
        const NO_SPEND: &str = "cast(0 as bigint) as tokens, cast(0 as bigint) as reserved_tokens, \
             cast(0 as double precision) as usd, cast(0 as double precision) as reserved_usd";
        let row = |query: &mut sqlx::QueryBuilder<'a, B::Db>, kind: i32, slot: usize| {
            query.push(format_args!(" union all select cast({kind} as integer), cast({slot} as integer), "));
        };
        query.push(format_args!(
            "select cast(-1 as integer) as kind, cast(0 as integer) as slot, cast(0 as bigint) as n, {NO_RUN}, {NO_SPEND}"
        ));
        for (slot, (user, ..)) in self.running.iter().enumerate() {
            row(query, RUNNING, slot);
            query.push(format_args!("count(*), {NO_RUN}, {NO_SPEND} from traces where user_id = "));
            query.push_bind(user.as_str()).push(" and status = 'running'");
        }
        for (slot, (user, hold, _)) in self.budgets.iter().enumerate() {
            row(query, SPENT, slot);
            query.push(format_args!(
                "cast(0 as bigint), {NO_RUN}, s.tokens, s.reserved_tokens, s.usd, s.reserved_usd from ("
            ));
            <B as Statements>::push_spend(query, user.as_str(), &hold.budgets);
            query.push(") s");
        }
        for (slot, (conversation, _)) in self.going.iter().enumerate() {
            row(query, GOING, slot);
            query.push(format_args!("cast(0 as bigint), g.id, g.started_at, {NO_SPEND} from ("));
            <B as Statements>::push_going(query, *conversation);
            query.push(") g");
            // As the other replicas left it (the statement does not see its own writes).
            row(query, LEAF, slot);
            query.push(format_args!(
                "cast(0 as bigint), active_leaf_id, cast(null as timestamptz), {NO_SPEND} from conversations where id = "
            ));
            query.push_bind(*conversation);
        }
        for (slot, write) in touches.iter().enumerate() {
            row(query, TOUCHED, slot);
            query.push(format_args!("count(*), {NO_RUN}, {NO_SPEND} from w{write}"));
        }
    }

    /// Judges the starts by what [`push_reads`](Self::push_reads) read, in the order the
    /// refusals take: a user's running runs, a user's budget, a conversation's going runs
    /// and leaf; an update that found no conversation (deleted meanwhile) is not found.
    /// Returns the latest `started_at` of each conversation's going runs.
    fn judge(&self, rows: &[CheckRow], touches: usize) -> Result<Vec<(Uuid, DateTime<Utc>)>, Stop> {
        let of = |kind: i32| rows.iter().filter(move |r| r.kind == kind);
        let count = |kind: i32, slot: usize| of(kind).find(|r| r.slot as usize == slot).map_or(0, |r| r.n);
        for (slot, (_, limit, adding)) in self.running.iter().enumerate() {
            let running = usize::try_from(count(RUNNING, slot)).unwrap_or(usize::MAX);
            if running + adding > *limit {
                return Err(Stop::Refused(StartOutcome::OverLimit(running)));
            }
        }
        for (slot, (_, hold, runs)) in self.budgets.iter().enumerate() {
            let Some(row) = of(SPENT).find(|r| r.slot as usize == slot) else { continue };
            let spent = row.spend.clone().into();
            if hold.budgets.passed_with(&spent, hold.reserve_tokens * runs, hold.reserve_usd * *runs as f64) {
                return Err(Stop::Refused(StartOutcome::OverBudget));
            }
        }
        let mut lasts = Vec::new();
        for (slot, (conversation, seen)) in self.going.iter().enumerate() {
            let going: Vec<&CheckRow> = of(GOING).filter(|r| r.slot as usize == slot).collect();
            if going.iter().any(|r| !seen.going.iter().any(|(s, _)| Some(s.0) == r.id)) {
                return Err(Stop::Refused(StartOutcome::Moved));
            }
            // A run that started and ended since the start looked is going no more, but
            // its messages moved the leaf.
            if let Some(leaf) = of(LEAF).find(|r| r.slot as usize == slot) {
                let expected = seen.leaf.map(|m| m.0) == leaf.id;
                if !expected && !seen.going.iter().any(|(_, answer)| Some(answer.0) == leaf.id) {
                    return Err(Stop::Refused(StartOutcome::Moved));
                }
            }
            if let Some(last) = going.iter().filter_map(|r| r.at).max() {
                lasts.push((*conversation, last));
            }
        }
        if (0..touches).any(|slot| count(TOUCHED, slot) == 0) {
            return Err(Stop::Fault(StoreError::NotFound));
        }
        Ok(lasts)
    }
}
