//! SQLite's event log (migration 0005): chunks are appended to `trace_event_chunks`, which
//! has no index. A running run's chunks are those after its `log_from` with its trace id;
//! when it ends, the ids of its chunks (kept meanwhile) become its row of `trace_logs`
//! ([`Store::seal_logs`](crate::store::Store::seal_logs)), and the row's deletion takes them
//! along.

use std::borrow::Cow;
use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use sqlx::sqlite::SqliteArguments;
use sqlx::{Arguments, Sqlite, SqliteConnection};

use super::SqliteStore;
use crate::events::LoggedEvent;
use crate::ids::TraceId;
use crate::store::chunks::Chunk;
use crate::store::sql::{rolled_back_if_failed, transaction_as_one_query, write};
use crate::store::{NewEvent, Progress, StoreError};

/// A sealed log's chunk ids with the new ones of a run that went on after it waited
/// (CONTRACT.md §15): a second seal adds to the first.
const MERGED_CHUNK_IDS: &str = "(select json_group_array(value) from (select value from json_each(trace_logs.chunk_ids) \
     union select value from json_each(excluded.chunk_ids)))";

/// Seals the logs of runs that ended, or were running, when the process that ran them
/// stopped: from their chunks after `log_from`.
pub(super) async fn seal_left_over_logs(writer: &mut SqliteConnection) -> Result<(), StoreError> {
    let mut tx = sqlx::Connection::begin_with(writer, "BEGIN IMMEDIATE").await?;
    sqlx::query(&format!(
        "insert into trace_logs (trace_id, chunk_ids) \
         select t.id, json_group_array(c.id) \
         from traces t join trace_event_chunks c on c.id > t.log_from and c.trace_id = t.id \
         where t.log_sealed = 0 group by t.id \
         on conflict (trace_id) do update set chunk_ids = {MERGED_CHUNK_IDS}",
    ))
    .execute(&mut *tx)
    .await?;
    sqlx::query("update traces set log_sealed = 1 where log_sealed = 0").execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// Chunks of the event log written per transaction. SQLite has one writer: a flush of a
/// thousand runs in one transaction held it for milliseconds, and a new chat's start waited
/// behind it; in smaller transactions, starts get the writer in between.
const LOG_ROWS_PER_TRANSACTION: usize = 100;

/// The insert of `rows` chunks, alone and as a whole transaction, for [`bind_chunks`]: made
/// once for each row count, so that it is not formatted anew at every flush. (sqlx keeps a
/// connection's prepared statements by their text, as many as its cache holds: a count
/// seen before is not prepared again while its statement is there.)
struct InsertText {
    alone: String,
    transaction: String,
}

static INSERT_TEXTS: [OnceLock<InsertText>; LOG_ROWS_PER_TRANSACTION] =
    [const { OnceLock::new() }; LOG_ROWS_PER_TRANSACTION];

/// [`InsertText`] for `rows` rows, 1 to [`LOG_ROWS_PER_TRANSACTION`].
fn insert_text(rows: usize) -> &'static InsertText {
    assert!(
        (1..=LOG_ROWS_PER_TRANSACTION).contains(&rows),
        "an insert holds 1 to {LOG_ROWS_PER_TRANSACTION} rows, not {rows}"
    );
    INSERT_TEXTS[rows - 1].get_or_init(|| {
        let mut alone =
            String::from("insert into trace_event_chunks (id, trace_id, first_seq, last_seq, events) values ");
        for n in 0..rows {
            alone.push_str(if n == 0 { "(?, ?, ?, ?, ?)" } else { ", (?, ?, ?, ?, ?)" });
        }
        let transaction = format!("BEGIN IMMEDIATE; {alone}; COMMIT");
        InsertText { alone, transaction }
    })
}

/// Binds `rows` as chunks with ids from `first_id` on, for [`insert_text`]. (Their
/// texts are moved into the arguments: sqlx gives SQLite's thread its own copy of what is
/// bound by reference.)
fn bind_chunks(args: &mut SqliteArguments<'_>, rows: Vec<Chunk>, first_id: i64) {
    const BINDS: &str = "an integer, a uuid or a text binds";
    for (c, id) in rows.into_iter().zip(first_id..) {
        args.add(id).expect(BINDS);
        args.add(c.trace_id).expect(BINDS);
        args.add(c.first_seq).expect(BINDS);
        args.add(c.last_seq).expect(BINDS);
        args.add(c.events).expect(BINDS);
    }
}

/// Runs and their lists of chunk ids as a `values` table (`column1`, `column2`).
fn lists_as_values<'a>(query: &mut sqlx::QueryBuilder<'a, Sqlite>, lists: &'a [(TraceId, String)]) {
    query.push_values(lists, |mut row, (trace_id, ids)| {
        row.push_bind(*trace_id).push_bind(ids.as_str());
    });
}

/// Sealed logs written per transaction, at most.
const LOGS_PER_TRANSACTION: usize = 500;

impl SqliteStore {
    /// One row per run per flush (see `chunks`), in transactions of a bounded size (a new
    /// chat's start waits for one of them, not for a whole flush), each sent as one query
    /// (`BEGIN IMMEDIATE; insert …; COMMIT`): one trip to the connection's thread instead of
    /// three, each of which, at load, waits in the runtime's queue on its way back while the
    /// transaction holds the writer. The rows' ids are given here, under the writer's lock,
    /// and kept for sealing: read back with `returning`, they came through sqlx's channel one
    /// row at a time, its thread blocking whenever the channel was full.
    pub(super) async fn append_events(&self, events: &[NewEvent], progress: &[Progress]) -> Result<(), StoreError> {
        let chunks = crate::store::chunks::encode(events);
        for (rows, progress) in crate::store::chunks::transactions(chunks, LOG_ROWS_PER_TRANSACTION, progress) {
            let traces: Vec<TraceId> = rows.iter().map(|c| c.trace_id).collect();
            let ids = write(self, async |conn| {
                let first_id = self.next_chunk_id.fetch_add(rows.len() as i64, Ordering::Relaxed);
                let ids = first_id..first_id + rows.len() as i64;
                let mut args = SqliteArguments::default();
                let text = match (rows.len(), progress.is_empty()) {
                    (0, _) | (_, false) => {
                        let mut text = String::from("BEGIN IMMEDIATE; ");
                        if !rows.is_empty() {
                            text.push_str(&insert_text(rows.len()).alone);
                            text.push_str("; ");
                        }
                        for _ in &progress {
                            text.push_str("update traces set checkpoint = ? where id = ? and status = 'running'; ");
                        }
                        text.push_str("COMMIT");
                        Cow::Owned(text)
                    }
                    (rows, true) => Cow::Borrowed(insert_text(rows).transaction.as_str()),
                };
                bind_chunks(&mut args, rows, first_id);
                for p in &progress {
                    args.add(&p.checkpoint).expect("a checkpoint binds");
                    args.add(p.trace_id).expect("a uuid binds");
                }
                let done = sqlx::query_with(&text, args).execute(&mut *conn).await.map(drop);
                rolled_back_if_failed::<Self, _>(conn, done).await?;
                Ok(ids)
            })
            .await?;
            self.keep_chunk_ids(traces.into_iter().zip(ids));
        }
        Ok(())
    }

    /// Inserts `events` as chunks within the transaction open on `conn`; the chunks' ids,
    /// to [keep](Self::keep_chunk_ids) once it commits.
    pub(super) async fn insert_chunks(
        &self,
        conn: &mut SqliteConnection,
        events: &[NewEvent],
    ) -> Result<Vec<(TraceId, i64)>, StoreError> {
        let chunks = crate::store::chunks::encode(events);
        if chunks.is_empty() {
            return Ok(Vec::new());
        }
        let first_id = self.next_chunk_id.fetch_add(chunks.len() as i64, Ordering::Relaxed);
        let written = chunks.iter().map(|c| c.trace_id).zip(first_id..).collect();
        let mut id = first_id;
        for (chunks, _) in crate::store::chunks::transactions(chunks, LOG_ROWS_PER_TRANSACTION, &[]) {
            let (text, count) = (&insert_text(chunks.len()).alone, chunks.len() as i64);
            let mut args = SqliteArguments::default();
            bind_chunks(&mut args, chunks, id);
            sqlx::query_with(text, args).execute(&mut *conn).await?;
            id += count;
        }
        Ok(written)
    }

    /// Notes written chunks for the seal of their runs' logs.
    pub(super) fn keep_chunk_ids(&self, chunks: impl IntoIterator<Item = (TraceId, i64)>) {
        let mut kept = self.chunk_ids.lock().expect("chunk ids lock");
        for (trace_id, id) in chunks {
            kept.entry(trace_id).or_default().push(id);
        }
    }

    /// A sealed run's chunks are those its row lists; a running one's, those after its
    /// `log_from`; a run that went on after it waited (CONTRACT.md §15), both. All are read
    /// in one transaction. A chunk written twice (a batch retried run by run after it failed
    /// halfway) is read once.
    pub(super) async fn trace_events(&self, trace_id: TraceId, after: i64) -> Result<Vec<LoggedEvent>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let sealed: Option<(String,)> = sqlx::query_as("select chunk_ids from trace_logs where trace_id = $1")
            .bind(trace_id)
            .fetch_optional(&mut *tx)
            .await?;
        let mut texts: Vec<(String,)> = Vec::new();
        if let Some((ids,)) = sealed {
            texts = sqlx::query_as(
                "select events from trace_event_chunks \
                 where id in (select value from json_each($1)) and last_seq > $2 order by id",
            )
            .bind(ids)
            .bind(after)
            .fetch_all(&mut *tx)
            .await?;
        }
        let unsealed: Option<(i64,)> = sqlx::query_as("select log_from from traces where id = $1 and log_sealed = 0")
            .bind(trace_id)
            .fetch_optional(&mut *tx)
            .await?;
        if let Some((log_from,)) = unsealed {
            texts.extend(
                sqlx::query_as::<_, (String,)>(
                    "select events from trace_event_chunks \
                     where id > $1 and trace_id = $2 and last_seq > $3 order by id",
                )
                .bind(log_from)
                .bind(trace_id)
                .bind(after)
                .fetch_all(&mut *tx)
                .await?,
            );
        }
        tx.commit().await?;
        let mut events = Vec::new();
        for (text,) in texts {
            crate::store::chunks::decode(&text, after, &mut events)?;
        }
        events.sort_by_key(|e| e.seq);
        events.dedup_by_key(|e| e.seq);
        Ok(events)
    }

    /// Writes each run's list of chunks as its row of `trace_logs`. The chunks of a run
    /// deleted meanwhile have no row to go with: they are deleted here. Each group of runs is
    /// one query, as for appends.
    pub(super) async fn seal_logs(&self, traces: &[TraceId]) -> Result<(), StoreError> {
        for traces in traces.chunks(LOGS_PER_TRANSACTION) {
            let lists: Vec<(TraceId, String)> = {
                let kept = self.chunk_ids.lock().expect("chunk ids lock");
                traces
                    .iter()
                    .map(|t| {
                        let ids = kept.get(t).map(Vec::as_slice).unwrap_or_default();
                        (*t, serde_json::to_string(ids).expect("ids serialize"))
                    })
                    .collect()
            };
            // (The `where` tells SQLite that `on conflict` belongs to the insert.)
            let mut query = sqlx::QueryBuilder::<Sqlite>::new(
                "BEGIN IMMEDIATE; insert into trace_logs (trace_id, chunk_ids) select column1, column2 from (",
            );
            lists_as_values(&mut query, &lists);
            query.push(
                ") where column1 in (select id from traces) \
                 on conflict (trace_id) do update set chunk_ids = ",
            );
            query.push(MERGED_CHUNK_IDS);
            // A run that went on after it waited, claimed before its parked part was sealed,
            // stays unsealed: its later chunks are read after its new log_from.
            query.push("; update traces set log_sealed = 1 where status <> 'running' and id in (");
            let mut ids = query.separated(", ");
            for t in traces {
                ids.push_bind(*t);
            }
            query.push("); delete from trace_event_chunks where id in (select chunk.value from (");
            lists_as_values(&mut query, &lists);
            query.push(") as list, json_each(list.column2) as chunk where list.column1 not in (select id from traces)); COMMIT");
            write(self, async |conn| Ok(transaction_as_one_query::<Self>(conn, query).await?)).await?;
            let mut kept = self.chunk_ids.lock().expect("chunk ids lock");
            for t in traces {
                kept.remove(t);
            }
        }
        Ok(())
    }
}
