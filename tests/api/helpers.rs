//! Test harness: a real chatd on port 0 over a fresh database (a temporary SQLite file, or a
//! uniquely named Postgres database dropped afterwards), a real HTTP client, and SSE parsed
//! with eventsource-stream.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chatd::App;
use chatd::config::Settings;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use reqwest::{Method, StatusCode};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// A database for one test; removed when dropped, even if the test panicked.
pub struct TestDb {
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    postgres: Option<(String, String)>,
}

/// Every write to a Postgres database's run logs, held back (by a lock on the log's table:
/// reads go on) until [`LogHold::release_after`].
pub struct LogHold(sqlx::PgConnection);

impl LogHold {
    /// Lets the held writes through `wait` from now.
    pub fn release_after(mut self, wait: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            sqlx::query("commit").execute(&mut self.0).await.unwrap();
        })
    }
}

impl TestDb {
    /// Holds back the writes to this (Postgres) database's run logs.
    pub async fn hold_logs(&self) -> LogHold {
        let mut lock = <sqlx::PgConnection as sqlx::Connection>::connect(&self.url).await.unwrap();
        sqlx::query("begin").execute(&mut lock).await.unwrap();
        sqlx::query("lock table trace_event_chunks in exclusive mode").execute(&mut lock).await.unwrap();
        LogHold(lock)
    }

    pub async fn new(backend: Backend) -> Self {
        match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                // A folder that does not exist yet: chatd must create it.
                let url = format!("sqlite://{}/nested/chatd.db", dir.path().display());
                Self { url, _dir: Some(dir), postgres: None }
            }
            Backend::Postgres => {
                let admin = std::env::var("CHATD_TEST_POSTGRES_URL")
                    .expect("Postgres tests run only with CHATD_TEST_POSTGRES_URL set");
                let name = format!("chatd_test_{}", uuid::Uuid::now_v7().simple());
                let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&admin)
                    .await
                    .expect("CHATD_TEST_POSTGRES_URL must reach a Postgres server");
                sqlx::query(&format!("create database {name}")).execute(&mut conn).await.expect("create database");
                let url = replace_database(&admin, &name);
                Self { url, _dir: None, postgres: Some((admin, name)) }
            }
        }
    }
}

/// The same server URL with another database name.
fn replace_database(url: &str, name: &str) -> String {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let root = match base.rfind('/') {
        Some(slash) if slash > "postgres://".len() => &base[..slash],
        _ => base,
    };
    match query {
        Some(q) => format!("{root}/{name}?{q}"),
        None => format!("{root}/{name}"),
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let Some((admin, name)) = self.postgres.take() else {
            return;
        };
        // Drop runs inside the test's runtime, which cannot block: use a thread of its own.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            runtime.block_on(async {
                let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&admin).await?;
                sqlx::query(&format!("drop database if exists {name} with (force)")).execute(&mut conn).await?;
                Ok::<_, sqlx::Error>(())
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop test database: {dropped:?}");
        }
    }
}

/// Test config: a mock model without delays, so tests run fast and know every word.
pub const FAST_MOCK: &str = r#"
[providers.mock]
kind = "mock"
delay_ms = 0
chunk_chars = 5
[profiles.default]
provider = "mock"
model = "mock-1"
system_prompt = "You are a test assistant."
[profiles.other]
provider = "mock"
model = "mock-2"
"#;

pub struct TestApp {
    pub base: String,
    pub db_url: String,
    pub client: reqwest::Client,
    pub log: chatd::chat::EventLog,
    pub stop: chatd::Shutdown,
    shutdown: CancellationToken,
    /// Where this app keeps files: its own folder unless the overrides name a `files.url`.
    pub files_dir: std::path::PathBuf,
    _files: Option<tempfile::TempDir>,
    _db: Option<TestDb>,
}

impl TestApp {
    /// Starts chatd on `backend` with `FAST_MOCK` and `overrides` (TOML) on the defaults.
    pub async fn spawn(backend: Backend, overrides: &str) -> Self {
        let db = TestDb::new(backend).await;
        let mut app = Self::on(&db.url, overrides).await;
        app._db = Some(db);
        app
    }

    /// Starts chatd on an existing database (several replicas may share one).
    pub async fn on(url: &str, overrides: &str) -> Self {
        let mut settings = Settings::from_layers(&[FAST_MOCK, overrides]).expect("test config");
        settings.database.url = chatd::config::Secret::new(url);
        // Files in a folder of the test's own, never in the working directory.
        let mut own_files = None;
        if !overrides.contains("[files]") || !overrides.contains("url") {
            let dir = tempfile::tempdir().expect("temp dir");
            settings.files.url = format!("file://{}", dir.path().display());
            own_files = Some(dir);
        }
        let files_dir = std::path::PathBuf::from(settings.files.url.trim_start_matches("file://"));
        settings.server.port = 0;
        let app = App::build(settings).await.expect("app builds");
        let base = format!("http://{}", app.local_addr());
        let (shutdown, stop, log) = (app.shutdown_token(), app.shutdown_handle(), app.event_log());
        // The listener is bound already: requests queue until `run` accepts them.
        tokio::spawn(app.run());
        let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
        Self { base, db_url: url.to_owned(), client, log, stop, shutdown, files_dir, _files: own_files, _db: None }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends a request as `user` (auth mode none: the X-Client-Id header).
    pub async fn call(&self, method: Method, path: &str, user: &str, body: Option<Value>) -> (StatusCode, Value) {
        let mut request = self.client.request(method, self.url(path)).header("x-client-id", user);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("request sent");
        let status = response.status();
        let text = response.text().await.expect("body");
        let value = if text.is_empty() { Value::Null } else { serde_json::from_str(&text).expect("JSON body") };
        (status, value)
    }

    pub async fn get(&self, path: &str, user: &str) -> (StatusCode, Value) {
        self.call(Method::GET, path, user, None).await
    }

    pub async fn post(&self, path: &str, user: &str, body: Value) -> (StatusCode, Value) {
        self.call(Method::POST, path, user, Some(body)).await
    }

    /// Posts a chat message and reads the whole SSE stream.
    pub async fn chat(&self, user: &str, body: Value) -> Vec<Frame> {
        let response = self
            .client
            .post(self.url("/api/chat/stream"))
            .header("x-client-id", user)
            .json(&body)
            .send()
            .await
            .expect("request sent");
        assert_eq!(response.status(), StatusCode::OK, "chat stream refused");
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        read_frames(response).await
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// One SSE frame: its `id:` and its JSON data.
#[derive(Debug, Clone)]
pub struct Frame {
    pub id: u64,
    pub data: Value,
}

impl Frame {
    pub fn kind(&self) -> &str {
        self.data["type"].as_str().expect("every event has a type")
    }
}

pub async fn read_frames(response: reqwest::Response) -> Vec<Frame> {
    let mut events = response.bytes_stream().eventsource();
    let mut frames = Vec::new();
    while let Some(event) = events.next().await {
        let event = event.expect("well-formed SSE");
        frames.push(Frame {
            id: event.id.parse().expect("numeric id"),
            data: serde_json::from_str(&event.data).expect("JSON data"),
        });
    }
    frames
}

/// The concatenated `text` of all events of one type.
/// The answer as a client assembles it (CONTRACT.md §19): the text of every `text_delta`,
/// less what a `step_reset` voided (the text since that step's `step_start`).
pub fn surviving_text(frames: &[Frame]) -> String {
    let (mut text, mut starts) = (String::new(), std::collections::HashMap::new());
    for frame in frames {
        match frame.kind() {
            "step_start" => {
                starts.insert(frame.data["step"].as_u64().unwrap(), text.len());
            }
            // A reset of a step whose start this client never saw voids nothing.
            "step_reset" => {
                if let Some(&at) = starts.get(&frame.data["step"].as_u64().unwrap()) {
                    text.truncate(at);
                }
            }
            "text_delta" => text.push_str(frame.data["text"].as_str().unwrap()),
            _ => {}
        }
    }
    text
}

pub fn joined(frames: &[Frame], kind: &str) -> String {
    frames.iter().filter(|f| f.kind() == kind).map(|f| f.data["text"].as_str().unwrap_or_default()).collect()
}

/// Declares an async test once per backend: `name::sqlite` and `name::postgres`. The
/// Postgres one is reported ignored unless `CHATD_TEST_POSTGRES_URL` was set at build time.
macro_rules! both_backends {
    ($($(#[$meta:meta])* async fn $name:ident($backend:ident: Backend) $body:block)+) => {
        $(
            $(#[$meta])*
            mod $name {
                #[allow(unused_imports)]
                use super::*;

                async fn run($backend: Backend) $body

                #[tokio::test]
                async fn sqlite() {
                    run(Backend::Sqlite).await
                }

                #[tokio::test]
                #[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
                async fn postgres() {
                    run(Backend::Postgres).await
                }
            }
        )+
    };
}

pub(crate) use both_backends;

/// The value of the `/metrics` line that begins with `name` (its labels included).
pub fn metric(metrics: &str, name: &str) -> f64 {
    let line = metrics.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {metrics}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// A port free now, for a server that binds it later (a chatd process, a peer the tests
/// start). It comes from below the range the kernel gives out ports from itself (32768–60999
/// on Linux), where the other tests' listeners (bound to port 0) and every outgoing
/// connection get theirs: a port from that range, let go of for another process to bind,
/// could be taken meanwhile, and a test then spoke to another server than its own.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static TRIED: AtomicU32 = AtomicU32::new(0);
    let kernels_first = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let first = kernels_first.saturating_sub(17_000).max(1_024);
    let ports = kernels_first.saturating_sub(first).max(1);
    // Test processes that run at once start at different places (the step, a prime, is
    // prime to `ports`: every port comes once in `ports` tries).
    let from = std::process::id().wrapping_mul(7_919);
    loop {
        let n = TRIED.fetch_add(1, Ordering::Relaxed);
        let port = (first + from.wrapping_add(n.wrapping_mul(104_729)) % ports) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A chatd process of its own (the binary), on `database_url`, with `extra` config.
pub struct Replica {
    pub child: Child,
    pub base: String,
    /// What it logged (warnings and errors), printed when the test fails while it runs.
    log: std::path::PathBuf,
}

impl Replica {
    pub async fn start(database_url: &str, extra: &str) -> Self {
        Self::start_with_env(database_url, extra, &[]).await
    }

    /// The same, with environment variables of its own.
    pub async fn start_with_env(database_url: &str, extra: &str, env: &[(&str, &str)]) -> Self {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap().keep();
        let config = dir.join("chatd.toml");
        let text = format!(
            "[server]\nport = {port}\n[database]\nurl = \"{database_url}\"\n[stream]\nflush_interval_ms = 20\n{extra}"
        );
        std::fs::write(&config, text).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_chatd"))
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .envs(env.iter().copied())
            .stdout(std::fs::File::create(dir.join("chatd.log")).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        let log = dir.join("chatd.log");
        // Its own answer: a process that exits (a port taken after all) answers nothing.
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("chatd exited as it started ({status}): {}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            if reqwest::get(format!("{base}/healthz")).await.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            assert!(Instant::now() < deadline, "chatd did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self { child, base, log }
    }

    pub fn kill_9(mut self) {
        let status = Command::new("kill").arg("-KILL").arg(self.child.id().to_string()).status().unwrap();
        assert!(status.success());
        let _ = self.child.wait();
    }

    pub async fn get(&self, path: &str) -> Value {
        reqwest::get(format!("{}{path}", self.base)).await.unwrap().json().await.unwrap()
    }

    pub async fn post_stream(&self, body: Value) -> crate::runs::Live {
        let client = reqwest::Client::new();
        let response = client.post(format!("{}/api/chat/stream", self.base)).json(&body).send().await.unwrap();
        crate::runs::Live::open(response).await
    }

    pub async fn resume(&self, trace_id: &str, last_event_id: u64) -> Vec<Frame> {
        let client = reqwest::Client::new();
        let response = client
            .get(format!("{}/api/chat/stream/{trace_id}", self.base))
            .header("last-event-id", last_event_id.to_string())
            .send()
            .await
            .unwrap();
        if response.status() != reqwest::StatusCode::OK {
            let status = response.status();
            panic!("the resume is not a stream: {status} {}", response.text().await.unwrap_or_default());
        }
        read_frames(response).await
    }

    /// Waits (bounded) until the run's log holds an event `logged` says yes to.
    pub async fn until_logged(&self, trace_id: &str, logged: impl Fn(&Value) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let trace = self.get(&format!("/api/trace/{trace_id}")).await;
            if trace["events"].as_array().is_some_and(|events| events.iter().any(&logged)) {
                return;
            }
            assert!(Instant::now() < deadline, "never logged: {trace}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Replica {
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill").arg(signal).arg(self.child.id().to_string()).status().unwrap();
        assert!(status.success());
    }

    /// Waits (off the runtime) for the process to end; how it ended.
    pub async fn exited(self) -> std::process::ExitStatus {
        let waiting = move || {
            let mut replica = self;
            replica.child.wait()
        };
        tokio::task::spawn_blocking(waiting).await.unwrap().unwrap()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("chatd at {} said (last lines):", self.base);
            for line in tail.iter().rev() {
                eprintln!("  {line}");
            }
        }
    }
}
