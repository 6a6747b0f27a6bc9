//! The SQLite backend: one file (created with its folder on first run), WAL journal, readers
//! in a pool and one writer connection: SQLite takes one writer at a time anyway, and writes
//! that queue here in order cost nothing, where writers racing for the file's lock sleep in
//! its busy handler (milliseconds each). Single-process only.
//!
//! The writer is a connection behind a lock, not a pool of one: sqlx's pool tests every
//! connection given back to it with a ping, a trip to the connection's thread during which
//! the next write waits (at load, each trip waits for a worker too).
//!
//! Its event log is in `log.rs`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::stream::BoxStream;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteQueryResult, SqliteSynchronous};
use sqlx::{ConnectOptions, QueryBuilder, Sqlite, SqliteConnection, SqlitePool};
use tokio::sync::MutexGuard;
use tokio_util::sync::{CancellationToken, DropGuard};

mod log;

use super::sql::{Backend, bytes_used, insert_file, write};
use super::{BytesLock, NewEvent, Notice, Progress, StoreError};
use crate::domain::StoredFile;
use crate::events::LoggedEvent;
use crate::ids::TraceId;

pub struct SqliteStore {
    pool: SqlitePool,
    /// The one connection that writes; `None` once a fault made it unfit (see [`Self::write`]),
    /// until the next write opens a new one.
    writer: Arc<WriterSlot>,
    /// How the writer is opened again after a fault.
    options: SqliteConnectOptions,
    /// Writers opened since the first: each one a write that failed for a fault.
    reopened: AtomicU64,
    /// What tells whether writes work now, for readiness (shared with the checkpoint task).
    health: Arc<WriteHealth>,
    /// The ids of the chunks written for each run not sealed yet.
    chunk_ids: Mutex<HashMap<TraceId, Vec<i64>>>,
    /// The id the next chunk gets: above every id in the table, so a run's chunks are all
    /// after its `log_from` (taken only while holding the writer).
    next_chunk_id: AtomicI64,
    outbox: crate::store::OutboxState,
    /// Runs' ends take turns here before they wait for the writer: one at a time in its
    /// queue (see [`Backend::ends`]).
    ends: crate::store::sql::Ends,
    /// The locks on files' bytes (see [`Store::lock_bytes`](super::Store::lock_bytes)),
    /// one per stripe of sha256s: one process has the file, so a lock in memory is enough.
    bytes_locks: Vec<Arc<tokio::sync::Mutex<()>>>,
    /// Stops the checkpoint task with the store.
    _checkpoints: DropGuard,
}

/// Stripes of [`SqliteStore::bytes_locks`]: sha256s that share one wait for each other,
/// which costs only a short wait.
const BYTES_LOCK_STRIPES: usize = 64;

/// The one writer connection, `None` between a fault and the next write.
type WriterSlot = tokio::sync::Mutex<Option<SqliteConnection>>;

/// How often the WAL is copied back into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// How long a connection waits for a lock another holds before it gives up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Past this much WAL written since it last started over, the checkpoint task makes it start
/// over (see [`Checkpoints::start_over`]); also what a WAL that grew is cut back to.
const WAL_START_OVER_PAST: u64 = 64 << 20;

impl SqliteStore {
    /// Opens (creating if needed) the database at `url` and runs the SQLite migrations.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        Self::open(url, max_connections, WAL_START_OVER_PAST).await
    }

    async fn open(url: &str, max_connections: u32, wal_start_over_past: u64) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // WAL makes NORMAL durable against application crashes; only a power cut can
            // lose the last transactions.
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true)
            // Checkpoints run beside the writer (see [`Checkpoints`]), not inside its commits.
            .pragma("wal_autocheckpoint", "0")
            .pragma("journal_size_limit", std::borrow::Cow::Owned(WAL_START_OVER_PAST.to_string()));
        if let Some(folder) = options.get_filename().parent() {
            if !folder.as_os_str().is_empty() {
                std::fs::create_dir_all(folder)
                    .map_err(|e| StoreError::Url(format!("cannot create {}: {e}", folder.display())))?;
            }
        }
        let path = options.get_filename().to_owned();
        let mut writer = options.connect().await?;
        sqlx::migrate!("migrations/sqlite").run(&mut writer).await?;
        log::seal_left_over_logs(&mut writer).await?;
        let (last_chunk_id,): (i64,) =
            sqlx::query_as("select coalesce(max(id), 0) from trace_event_chunks").fetch_one(&mut writer).await?;
        // A connection to a local file does not go stale: no ping before each use (sqlx's
        // default), which cost every read a second trip to the connection's thread.
        let pool = SqlitePoolOptions::new()
            .test_before_acquire(false)
            .max_connections(max_connections)
            .connect_with(options.clone())
            .await?;
        let health = Arc::new(WriteHealth { failing: AtomicBool::new(false), file: FileIdentity::of(&path) });
        let writer = Arc::new(WriterSlot::new(Some(writer)));
        let stop = CancellationToken::new();
        let task =
            Checkpoints { pool: pool.clone(), writer: writer.clone(), health: health.clone(), wal_start_over_past };
        tokio::spawn(task.run(stop.clone()));
        Ok(Self {
            pool,
            writer,
            options,
            reopened: AtomicU64::new(0),
            health,
            chunk_ids: Mutex::default(),
            next_chunk_id: AtomicI64::new(last_chunk_id + 1),
            outbox: Default::default(),
            ends: crate::store::sql::Ends::new(1),
            bytes_locks: (0..BYTES_LOCK_STRIPES).map(|_| Arc::default()).collect(),
            _checkpoints: stop.drop_guard(),
        })
    }

    /// How many times the writer was opened anew after a write that failed for a fault of
    /// the database (a refused request is no fault: its transaction is rolled back and the
    /// writer kept).
    pub fn writers_reopened(&self) -> u64 {
        self.reopened.load(Ordering::Relaxed)
    }

    /// A write of 64 KiB, about what an answer and its log take: what readiness tries while
    /// writes fail (a tiny write can pass on a disk too full for an answer).
    async fn probe_write(&self) -> Result<(), StoreError> {
        write(self, async |conn| {
            sqlx::query(
                "insert into write_probe (id, at, payload) values (1, $1, zeroblob(65536)) \
                 on conflict (id) do update set at = excluded.at, payload = excluded.payload",
            )
            .bind(crate::domain::now())
            .execute(conn)
            .await?;
            Ok(())
        })
        .await
    }
}

/// The writer, lent for one write (see [`SqliteStore::written`](Backend::written)).
pub struct Writer<'a> {
    slot: MutexGuard<'a, Option<SqliteConnection>>,
}

impl std::ops::Deref for Writer<'_> {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        self.slot.as_ref().expect("a writer holds its connection")
    }
}

impl std::ops::DerefMut for Writer<'_> {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        self.slot.as_mut().expect("a writer holds its connection")
    }
}

impl Backend for SqliteStore {
    type Db = Sqlite;
    type Writer<'a> = Writer<'a>;
    const SHARED: bool = false;
    /// Times are RFC 3339 text in UTC: the day is its first ten characters.
    const DAY_STARTED: &'static str = "substr(started_at, 1, 10)";
    const BEGIN_WRITE: &'static str = "BEGIN IMMEDIATE";
    const MANY_STATEMENTS_PER_QUERY: bool = true;
    const WRITES_IN_WITH: bool = false;
    const CLAIM_LOG: &'static str =
        ", log_sealed = 0, log_from = (select coalesce(max(id), 0) from trace_event_chunks)";
    const LOCK_ROW: &'static str = "";
    const SKIP_LOCKED: &'static str = "";

    fn outbox(&self) -> &crate::store::OutboxState {
        &self.outbox
    }

    fn ends(&self) -> &crate::store::sql::Ends {
        &self.ends
    }

    fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The writer, once the writes before this one are done (in the order they asked); a
    /// new connection if a fault closed the last one.
    async fn writer(&self) -> Result<Writer<'_>, StoreError> {
        let mut slot = self.writer.lock().await;
        self.health.file.check()?;
        if slot.is_none() {
            match self.options.connect().await {
                Ok(conn) => {
                    tracing::info!("opened a new SQLite writer connection");
                    self.reopened.fetch_add(1, Ordering::Relaxed);
                    *slot = Some(conn);
                }
                Err(e) => {
                    self.health.failing.store(true, Ordering::Relaxed);
                    return Err(StoreError::Unavailable(format!("cannot open the database for writing: {e}")));
                }
            }
        }
        Ok(Writer { slot })
    }

    /// A write that failed for a fault of the database (disk full, I/O error, the file
    /// gone) or that left a transaction open (its `ROLLBACK` may have failed too) takes the
    /// connection with it: closing it rolls back whatever it held, and the next write opens
    /// a new one. Without that, one failed `COMMIT` left sqlx's transaction depth at one and
    /// every later write failed until a restart. Until a write succeeds again, the store
    /// reports itself unwritable ([`Store::ping`](super::Store::ping)).
    fn written<T>(&self, mut writer: Writer<'_>, result: &Result<T, StoreError>) {
        match result {
            Ok(_) => {
                if self.health.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("the database takes writes again");
                }
            }
            Err(e) if e.is_unavailable() || sqlx::Connection::is_in_transaction(&*writer) => {
                if e.is_unavailable() {
                    self.health.failing.store(true, Ordering::Relaxed);
                }
                tracing::error!(error = %e, "a write failed; the writer connection is closed and opened anew for the next one");
                *writer.slot = None;
            }
            Err(_) => {}
        }
    }

    fn rows_affected(result: &SqliteQueryResult) -> u64 {
        result.rows_affected()
    }

    async fn execute<'c, 'q>(
        conn: &'c mut SqliteConnection,
        mut query: QueryBuilder<'q, Sqlite>,
    ) -> Result<u64, sqlx::Error> {
        Ok(query.build().execute(conn).await?.rows_affected())
    }

    async fn fetch_all<'c, 'q, O>(
        conn: &'c mut SqliteConnection,
        mut query: QueryBuilder<'q, Sqlite>,
    ) -> Result<Vec<O>, sqlx::Error>
    where
        O: for<'r> sqlx::FromRow<'r, sqlx::sqlite::SqliteRow> + Send + Unpin,
    {
        query.build_query_as().fetch_all(conn).await
    }

    /// Reads answer, and writes work (tried again while they were failing).
    async fn ping_database(&self) -> Result<(), StoreError> {
        sqlx::query("select 1").execute(&self.pool).await?;
        self.health.file.check()?;
        if self.health.failing.load(Ordering::Relaxed) {
            self.probe_write().await?;
        }
        Ok(())
    }

    /// The ids as one JSON array of their bytes in hex (SQLite takes at most 32,766 binds).
    async fn running_elsewhere(&self, traces: &[TraceId], replica_id: &str) -> Result<Vec<TraceId>, StoreError> {
        let ids: Vec<String> = traces.iter().map(|id| id.0.simple().to_string()).collect();
        let rows: Vec<(TraceId,)> = sqlx::query_as(
            "select id from traces where coalesce(replica_id, '') <> $1 and status = 'running' \
             and id in (select unhex(value) from json_each($2))",
        )
        .bind(replica_id)
        .bind(serde_json::to_string(&ids).expect("ids serialize"))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    async fn log_within(
        &self,
        conn: &mut SqliteConnection,
        events: &[NewEvent],
    ) -> Result<Vec<(TraceId, i64)>, StoreError> {
        self.insert_chunks(conn, events).await
    }

    fn logged_within(&self, chunks: Vec<(TraceId, i64)>) {
        self.keep_chunk_ids(chunks);
    }

    async fn adopt_log(&self, conn: &mut SqliteConnection, trace_id: TraceId) -> Result<(), StoreError> {
        let ids: Vec<(i64,)> = sqlx::query_as(
            "select id from trace_event_chunks where trace_id = $1 \
             and id > (select log_from from traces where id = $1) order by id",
        )
        .bind(trace_id)
        .fetch_all(&mut *conn)
        .await?;
        self.keep_chunk_ids(ids.into_iter().map(|(id,)| (trace_id, id)));
        // Its log was sealed at start-up with what the other wrote; while it goes on here its
        // new chunks are read too (its followers read what the run lets go of from the log),
        // and its seal at the end merges both.
        sqlx::query("update traces set log_sealed = 0 where id = $1").bind(trace_id).execute(&mut *conn).await?;
        Ok(())
    }

    async fn append_log(&self, events: &[NewEvent], progress: &[Progress]) -> Result<(), StoreError> {
        self.append_events(events, progress).await
    }

    async fn read_log(&self, trace_id: TraceId, after: i64) -> Result<Vec<LoggedEvent>, StoreError> {
        self.trace_events(trace_id, after).await
    }

    async fn seal_log(&self, traces: &[TraceId]) -> Result<(), StoreError> {
        self.seal_logs(traces).await
    }

    /// One process per SQLite file: there is nobody else to tell.
    async fn tell(&self, _notices: &[Notice]) -> Result<(), StoreError> {
        Ok(())
    }

    async fn listen(&self) -> Result<Option<BoxStream<'static, Notice>>, StoreError> {
        Ok(None)
    }

    /// One process: nobody else to hear.
    fn listening(&self) -> bool {
        true
    }

    async fn bytes_lock(&self, sha256: &str) -> Result<Box<dyn BytesLock + '_>, StoreError> {
        let stripe = sha256.bytes().fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(usize::from(b)));
        let guard = self.bytes_locks[stripe % BYTES_LOCK_STRIPES].clone().lock_owned().await;
        Ok(Box::new(SqliteBytesLock { store: self, sha256: sha256.to_owned(), _guard: guard }))
    }
}

/// Whether writes work, as the last one found, and the file they go to.
struct WriteHealth {
    failing: AtomicBool,
    file: FileIdentity,
}

/// The database file as it was opened. A file deleted (or replaced) under a running chatd
/// still takes writes through the open descriptors, and all of them are lost at the next
/// start: the checkpoint task looks at the path every second, and from then on writes and
/// readiness fail, naming the file.
struct FileIdentity {
    path: PathBuf,
    /// (device, inode) at start; `None` for a database with no file (`sqlite::memory:`).
    opened: Option<(u64, u64)>,
    lost: AtomicBool,
}

impl FileIdentity {
    fn of(path: &std::path::Path) -> Self {
        Self { path: path.to_owned(), opened: Self::identity(path).ok(), lost: AtomicBool::new(false) }
    }

    fn identity(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path)?;
        Ok((meta.dev(), meta.ino()))
    }

    /// Looks at the path again; true while it is still the file chatd opened.
    fn look(&self) -> bool {
        if self.lost.load(Ordering::Relaxed) {
            return false;
        }
        let Some(opened) = self.opened else { return true };
        if Self::identity(&self.path).is_ok_and(|now| now == opened) {
            return true;
        }
        tracing::error!(
            path = %self.path.display(),
            "the database file was deleted or replaced while chatd runs; writes are refused (they would be lost): restore it or restart chatd"
        );
        self.lost.store(true, Ordering::Relaxed);
        false
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.lost.load(Ordering::Relaxed) {
            return Err(StoreError::Unavailable(format!(
                "the database file {} was deleted or replaced; restart chatd",
                self.path.display()
            )));
        }
        Ok(())
    }
}

/// The task that copies the WAL back into the database file and keeps it from growing.
struct Checkpoints {
    pool: SqlitePool,
    writer: Arc<WriterSlot>,
    health: Arc<WriteHealth>,
    wal_start_over_past: u64,
}

/// How long a checkpoint that makes the WAL start over waits for the readers still in it,
/// holding the writer.
const START_OVER_WAIT: Duration = Duration::from_millis(100);

/// A start-over that failed (a reader stayed in the WAL) is tried again at the next tick, this
/// many times in a row; then after 1, 2, 4 … [`START_OVER_BACK_OFF_MAX`] ticks let go by, so
/// that readers that always stay cost writes at most a wait every so often.
const START_OVER_TRIES_AT_ONCE: u32 = 3;
const START_OVER_BACK_OFF_MAX: u32 = 32;

impl Checkpoints {
    /// Every [`CHECKPOINT_EVERY`], copies the WAL back into the database file, on a reading
    /// connection. SQLite's automatic checkpoint runs inside the commit that crosses 1,000
    /// pages, with an fsync, while that commit holds the one writer, and a new chat's start
    /// queued behind it. A passive checkpoint waits for nobody; the WAL starts over at the
    /// first write after one that caught up (writes come in batches, with pauses between
    /// them), and `journal_size_limit` then gives back what a burst made it grow to.
    ///
    /// Under writes without a pause that never comes: a passive checkpoint copies only what is
    /// older than the oldest reader's snapshot, and some reader always holds one from before
    /// the last write, so the WAL grew by every write (4.4 GB in six minutes at 50,000
    /// streams) and every read looked its pages up through all of it. Past
    /// [`WAL_START_OVER_PAST`] the WAL is made to start over ([`Self::start_over`]).
    async fn run(self, stop: CancellationToken) {
        let mut every = tokio::time::interval(CHECKPOINT_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let page_size: i64 = sqlx::query_scalar("pragma page_size").fetch_one(&self.pool).await.unwrap_or(4096);
        // Start-overs that failed in a row, and ticks to let go by before the next try.
        let (mut failed, mut wait) = (0u32, 0u32);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = every.tick() => {}
            }
            if !self.health.file.look() {
                continue;
            }
            // (blocked, frames in the WAL since it started over, frames copied back)
            let frames = match sqlx::query_as::<_, (i64, i64, i64)>("pragma wal_checkpoint(passive)")
                .fetch_one(&self.pool)
                .await
            {
                Ok((_, frames, _)) => frames,
                Err(e) => {
                    tracing::warn!(error = %e, "WAL checkpoint failed");
                    continue;
                }
            };
            if u64::try_from(frames.saturating_mul(page_size)).unwrap_or(0) <= self.wal_start_over_past {
                (failed, wait) = (0, 0);
                continue;
            }
            if wait > 0 {
                wait -= 1;
                continue;
            }
            if self.start_over().await {
                failed = 0;
            } else {
                failed += 1;
                wait = match failed.checked_sub(START_OVER_TRIES_AT_ONCE) {
                    None => 0,
                    Some(more) => START_OVER_BACK_OFF_MAX.min(1 << more.min(5)),
                };
            }
        }
    }

    /// Makes the WAL start over: holding the writer (chatd's writes wait in their queue), a
    /// checkpoint in `restart` mode copies the rest of the WAL back, then waits for the readers
    /// still in it (reads are short; those that begin meanwhile read the database file), up to
    /// [`START_OVER_WAIT`], and the next write starts the WAL from its top. Writes wait for the
    /// copy of what the passive checkpoint just before could not copy, its fsync, and the
    /// readers. False when a reader stayed longer (what it could copy is copied all the same).
    async fn start_over(&self) -> bool {
        let mut slot = self.writer.lock().await;
        let Some(conn) = slot.as_mut() else { return false };
        let began = std::time::Instant::now();
        let checkpoint = async {
            // SQLite's busy handler looks again after 1, 2, 5, 10, 15 … ms: the checkpoint
            // looks every millisecond itself, so that writes wait no longer than the readers
            // (the copy is done once; a checkpoint with nothing left to copy only looks).
            sqlx::query("pragma busy_timeout = 0").execute(&mut *conn).await?;
            let done = loop {
                let done =
                    sqlx::query_as::<_, (i64, i64, i64)>("pragma wal_checkpoint(restart)").fetch_one(&mut *conn).await;
                if !matches!(done, Ok((1, _, _))) || began.elapsed() >= START_OVER_WAIT {
                    break done;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            };
            sqlx::query(&format!("pragma busy_timeout = {}", BUSY_TIMEOUT.as_millis())).execute(&mut *conn).await?;
            done
        };
        let done = checkpoint.await;
        let writes_waited_ms = (began.elapsed().as_secs_f64() * 1e4).round() / 10.0;
        match done {
            Ok((0, frames, _)) => {
                tracing::info!(
                    frames,
                    writes_waited_ms,
                    "the WAL grew under writes without a pause and was made to start over"
                );
                true
            }
            Ok((_, frames, copied)) => {
                tracing::info!(
                    frames,
                    copied,
                    writes_waited_ms,
                    "the WAL grew under writes without a pause; a reader kept it from starting over, tried again later"
                );
                false
            }
            Err(e) => {
                // The writer may be left waiting for locks less than it should: the next write
                // opens a new one.
                tracing::warn!(error = %e, "WAL checkpoint failed; the writer connection is opened anew");
                *slot = None;
                false
            }
        }
    }
}

/// A lock on one file's bytes, held in memory.
struct SqliteBytesLock<'a> {
    store: &'a SqliteStore,
    sha256: String,
    _guard: tokio::sync::OwnedMutexGuard<()>,
}

#[async_trait::async_trait]
impl BytesLock for SqliteBytesLock<'_> {
    async fn insert_file(&mut self, file: &StoredFile) -> Result<(), StoreError> {
        write(self.store, async |conn| insert_file::<SqliteStore>(conn, file).await).await
    }

    async fn used(&mut self) -> Result<bool, StoreError> {
        let mut conn = self.store.pool.acquire().await?;
        bytes_used::<SqliteStore>(&mut conn, &self.sha256).await
    }

    async fn release(self: Box<Self>) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The WAL header's checkpoint sequence number: one more each time the WAL starts over.
    fn wal_started_over(database: &std::path::Path) -> u32 {
        use std::io::Read;
        let mut path = database.as_os_str().to_owned();
        path.push("-wal");
        let mut header = [0u8; 16];
        std::fs::File::open(path).and_then(|mut wal| wal.read_exact(&mut header)).expect("the WAL has its header");
        u32::from_be_bytes([header[12], header[13], header[14], header[15]])
    }

    /// Writes without a pause while some reader always holds a snapshot from before the last
    /// write: no passive checkpoint can copy the whole WAL back, and without being made to
    /// start over it grew by every write (its header's count of starts never moved).
    #[tokio::test]
    async fn the_wal_starts_over_under_writes_without_a_pause_and_readers_always_in_it() {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let database = dir.path().join("chatd.db");
        let store =
            SqliteStore::open(&format!("sqlite://{}", database.display()), 4, 1 << 20).await.expect("store opens");
        let stop = CancellationToken::new();
        // Three readers, each holding its snapshot 20 ms, a new one every 7 ms or so.
        let readers: Vec<_> = (0..3u64)
            .map(|i| {
                let (pool, stop) = (store.pool.clone(), stop.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(7 * i)).await;
                    while !stop.is_cancelled() {
                        let mut read = pool.begin().await.expect("a read begins");
                        let _: i64 = sqlx::query_scalar("select count(*) from write_probe")
                            .fetch_one(&mut *read)
                            .await
                            .expect("a read");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        read.commit().await.expect("a read ends");
                    }
                })
            })
            .collect();
        // The first write starts the WAL over: nothing was in it that the first checkpoint did
        // not copy.
        store.probe_write().await.expect("a write passes");
        let before = wal_started_over(&database);
        let until = std::time::Instant::now() + Duration::from_secs(10);
        let mut writes = 0;
        while wal_started_over(&database) - before < 2 && std::time::Instant::now() < until {
            store.probe_write().await.expect("every write passes");
            writes += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let started_over = wal_started_over(&database) - before;
        stop.cancel();
        for reader in readers {
            reader.await.expect("a reader ends");
        }
        assert!(started_over >= 2, "the WAL started over {started_over} times in {writes} writes of 64 KiB");
        assert_eq!(store.writers_reopened(), 0, "the checkpoints closed the writer");
    }
}
