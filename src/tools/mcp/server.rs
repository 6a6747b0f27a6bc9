//! One MCP server's session: how to reach it, connecting with a handshake, keeping it alive
//! (reconnecting with backoff) and the tail of its stderr for error messages.

use std::collections::{BTreeMap, VecDeque};
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rmcp::service::{QuitReason, RunningService};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess, Transport};
use rmcp::{RoleClient, ServiceExt};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{ChildStderr, Command};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::McpServerSettings;
use crate::tools::{Tool, ToolSpec};

use super::McpState;
use super::tool::{Handler, Link, McpTool, ProgressRoutes, Session, Tapped};

/// The first wait before reconnecting; it doubles after each failure up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A session that lived this long was healthy: its loss starts the backoff afresh.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);
/// How long the handshake, and then `tools/list`, may take before the attempt has failed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long closing a session may take (rmcp gives a child 3 s to exit, then kills it).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long to wait for a dead child's last stderr lines, which usually say why it died.
const STDERR_GRACE: Duration = Duration::from_millis(300);
/// Lines of a child's stderr kept to explain a failure.
const STDERR_LINES: usize = 3;
/// The variables of chatd's environment a child inherits: the official SDKs' list (which
/// leaves secrets out) plus locale, time zone and temp dir.
const INHERITED_ENV: [&str; 10] =
    ["HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR"];

/// How to reach a server, from its settings.
#[derive(Debug, Clone)]
pub(super) enum Target {
    Stdio { command: String, args: Vec<String>, env: BTreeMap<String, String> },
    Http { url: String },
}

impl Target {
    pub(super) fn from_settings(settings: &McpServerSettings) -> Result<Self, String> {
        match (&settings.command, &settings.url) {
            (Some(command), None) => {
                Ok(Self::Stdio { command: command.clone(), args: settings.args.clone(), env: settings.env.clone() })
            }
            (None, Some(url)) => Ok(Self::Http { url: url.clone() }),
            (Some(_), Some(_)) => Err("set either `command` or `url`, not both".into()),
            (None, None) => Err("set `command` (stdio) or `url` (streamable HTTP)".into()),
        }
    }
}

/// One configured server: its settings, its state, and the slot its tools call through.
pub(super) struct Server {
    pub(super) id: String,
    pub(super) transport: &'static str,
    pub(super) global: bool,
    pub(super) target: Result<Target, String>,
    pub(super) link: Arc<Link>,
    pub(super) inner: Mutex<Inner>,
    pub(super) changed: Arc<Notify>,
}

pub(super) struct Inner {
    pub(super) state: McpState,
    pub(super) tools: Vec<Arc<dyn Tool>>,
    pub(super) restarts: u32,
    pub(super) last_error: Option<String>,
    pub(super) pid: Option<u32>,
}

impl Server {
    pub(super) fn new(id: &str, settings: &McpServerSettings, changed: Arc<Notify>) -> Self {
        Self {
            id: id.to_owned(),
            transport: if settings.url.is_some() && settings.command.is_none() { "http" } else { "stdio" },
            global: settings.global,
            target: Target::from_settings(settings),
            link: Arc::new(Link {
                server_id: id.to_owned(),
                idempotent: settings.idempotent,
                session: Mutex::new(None),
            }),
            inner: Mutex::new(Inner {
                state: McpState::Starting,
                tools: Vec::new(),
                restarts: 0,
                last_error: None,
                pid: None,
            }),
            changed,
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing panics while holding it; if something did, the state is still usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn update(&self, change: impl FnOnce(&mut Inner)) {
        change(&mut self.lock());
        self.changed.notify_waiters();
    }

    pub(super) fn ready(&self, session: Session, tools: &[rmcp::model::Tool], pid: Option<u32>) {
        self.link.set(Some(session));
        let tools = self.tools_from(tools);
        tracing::info!(tools = tools.len(), ?pid, "MCP server ready");
        self.update(|inner| {
            inner.state = McpState::Ready;
            inner.tools = tools;
            inner.pid = pid;
        });
    }

    pub(super) fn set_tools(&self, tools: &[rmcp::model::Tool]) {
        let tools = self.tools_from(tools);
        tracing::info!(tools = tools.len(), "MCP server's tools changed");
        self.update(|inner| inner.tools = tools);
    }

    pub(super) fn tools_from(&self, tools: &[rmcp::model::Tool]) -> Vec<Arc<dyn Tool>> {
        tools
            .iter()
            .map(|tool| {
                let spec = ToolSpec {
                    name: tool.name.to_string(),
                    description: tool.description.as_deref().or(tool.title.as_deref()).unwrap_or_default().to_owned(),
                    input_schema: Value::Object((*tool.input_schema).clone()),
                };
                Arc::new(McpTool { link: self.link.clone(), spec }) as Arc<dyn Tool>
            })
            .collect()
    }

    /// The session ended: no new calls go to it, and its tools are withdrawn.
    pub(super) fn lost(&self, reason: String) {
        self.link.set(None);
        tracing::warn!(error = %reason, "MCP server lost; restarting it");
        self.update(|inner| {
            inner.state = McpState::Restarting;
            inner.tools.clear();
            inner.pid = None;
            inner.last_error = Some(reason);
        });
    }

    pub(super) fn failed(&self, error: String, retry_in: Option<Duration>) {
        match retry_in {
            Some(wait) => tracing::warn!(%error, ?wait, "MCP server failed to start; retrying"),
            None => tracing::error!(%error, "MCP server cannot be started"),
        }
        self.update(|inner| {
            inner.state = McpState::Failed;
            inner.last_error = Some(error);
        });
    }

    pub(super) fn stopped(&self) {
        self.link.set(None);
        self.update(|inner| {
            inner.tools.clear();
            inner.pid = None;
        });
    }
}

/// Keeps one server connected until shutdown.
pub(super) async fn supervise(server: Arc<Server>, shutdown: CancellationToken) {
    let target = match &server.target {
        Ok(target) => target.clone(),
        Err(error) => return server.failed(error.clone(), None),
    };
    let mut backoff = BACKOFF_MIN;
    let mut first = true;
    loop {
        if !first {
            server.update(|inner| inner.restarts += 1);
        }
        first = false;
        let connected = tokio::select! {
            biased;
            () = shutdown.cancelled() => return server.stopped(),
            connected = connect(&server.id, &target) => connected,
        };
        match connected {
            Ok(connection) => {
                let since = Instant::now();
                if !run(&server, connection, &shutdown).await {
                    return server.stopped();
                }
                if since.elapsed() >= HEALTHY_AFTER {
                    backoff = BACKOFF_MIN;
                }
            }
            Err(error) => server.failed(error, Some(backoff)),
        }
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return server.stopped(),
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// A session that has done its handshake and listed its tools.
pub(super) struct Connection {
    pub(super) service: RunningService<RoleClient, Handler>,
    pub(super) tools: Vec<rmcp::model::Tool>,
    pub(super) pid: Option<u32>,
    pub(super) progress: Arc<ProgressRoutes>,
    pub(super) tools_changed: Arc<Notify>,
    pub(super) stderr: Option<StderrTail>,
}

/// Starts a session: spawns the child or opens the HTTP transport, does the MCP handshake
/// and lists the tools.
pub(super) async fn connect(id: &str, target: &Target) -> Result<Connection, String> {
    let progress = Arc::new(ProgressRoutes::default());
    let tools_changed = Arc::new(Notify::new());
    let handler = Handler { server_id: id.into(), tools_changed: tools_changed.clone() };
    let (service, pid, mut stderr) = match target {
        Target::Stdio { command, args, env } => {
            let mut cmd = Command::new(command);
            // Like the official SDKs, a child gets only a few harmless variables of chatd's
            // environment (never its API keys) plus the `env` of its settings.
            cmd.args(args).env_clear();
            for name in INHERITED_ENV {
                if let Some(value) = std::env::var_os(name) {
                    cmd.env(name, value);
                }
            }
            // kill_on_drop: however the session ends, even with the runtime going away, the
            // child does not outlive it.
            cmd.envs(env).kill_on_drop(true);
            let (child, stderr) = TokioChildProcess::builder(cmd)
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot start `{command}`: {e}"))?;
            let pid = child.id();
            let mut stderr = stderr.map(|s| StderrTail::spawn(id, s));
            let transport = Tapped { inner: child, progress: progress.clone() };
            match handshake(handler, transport).await {
                Ok(service) => (service, pid, stderr),
                Err(error) => return Err(with_stderr(error, stderr.as_mut()).await),
            }
        }
        Target::Http { url } => {
            let transport =
                Tapped { inner: StreamableHttpClientTransport::from_uri(url.as_str()), progress: progress.clone() };
            (handshake(handler, transport).await?, None, None)
        }
    };
    let listed = tokio::time::timeout(CONNECT_TIMEOUT, service.peer().list_all_tools()).await;
    let error = match listed {
        Ok(Ok(tools)) => {
            return Ok(Connection { service, tools, pid, progress, tools_changed, stderr });
        }
        Ok(Err(e)) => format!("tools/list failed: {e}"),
        Err(_) => format!("tools/list took longer than {CONNECT_TIMEOUT:?}"),
    };
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, service.cancel()).await;
    Err(with_stderr(error, stderr.as_mut()).await)
}

pub(super) async fn handshake<T>(handler: Handler, transport: T) -> Result<RunningService<RoleClient, Handler>, String>
where
    T: Transport<RoleClient> + 'static,
{
    match tokio::time::timeout(CONNECT_TIMEOUT, handler.serve(transport)).await {
        Ok(Ok(service)) => Ok(service),
        Ok(Err(e)) => Err(format!("MCP initialization failed: {e}")),
        Err(_) => Err(format!("MCP initialization took longer than {CONNECT_TIMEOUT:?}")),
    }
}

/// Serves a connected session until it ends. Returns false when it ended for shutdown.
pub(super) async fn run(server: &Server, connection: Connection, shutdown: &CancellationToken) -> bool {
    enum End {
        Quit(String),
        Broken,
        Shutdown,
    }
    let Connection { service, tools, pid, progress, tools_changed, mut stderr } = connection;
    let peer = service.peer().clone();
    let broken = CancellationToken::new();
    server.ready(Session { peer: peer.clone(), progress, broken: broken.clone() }, &tools, pid);
    let stop = service.cancellation_token();
    let waiting = service.waiting();
    tokio::pin!(waiting);
    let end = loop {
        tokio::select! {
            quit = &mut waiting => break End::Quit(describe_quit(quit)),
            () = broken.cancelled() => break End::Broken,
            () = shutdown.cancelled() => break End::Shutdown,
            () = tools_changed.notified() => {
                match tokio::time::timeout(CONNECT_TIMEOUT, peer.list_all_tools()).await {
                    Ok(Ok(tools)) => server.set_tools(&tools),
                    Ok(Err(error)) => tracing::warn!(%error, "could not list the changed tools"),
                    Err(_) => tracing::warn!("listing the changed tools timed out"),
                }
            }
        }
    };
    // Withdraw the session before closing it, so no new call starts on it.
    server.link.set(None);
    let reason = match end {
        End::Quit(reason) => reason,
        End::Broken | End::Shutdown => {
            stop.cancel();
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, &mut waiting).await;
            if matches!(end, End::Shutdown) {
                tracing::info!("MCP server stopped");
                return false;
            }
            "a call found the connection broken".to_owned()
        }
    };
    server.lost(with_stderr(reason, stderr.as_mut()).await);
    true
}

pub(super) fn describe_quit(quit: Result<QuitReason, tokio::task::JoinError>) -> String {
    match quit {
        Ok(QuitReason::Closed) => "the server closed the connection".to_owned(),
        Ok(QuitReason::Cancelled) => "the session was cancelled".to_owned(),
        Ok(QuitReason::JoinError(e)) | Err(e) => format!("the session's task failed: {e}"),
    }
}

/// Logs the child's last stderr lines with an error: that is where a server says why it
/// died. They stay out of the error itself, which `GET /api/tools` shows to any user, since
/// a server's stderr may hold its own secrets.
pub(super) async fn with_stderr(error: String, stderr: Option<&mut StderrTail>) -> String {
    if let Some(stderr) = stderr {
        let tail = stderr.tail().await;
        if !tail.is_empty() {
            tracing::warn!(%error, stderr = %tail, "MCP server failed");
        }
    }
    error
}

/// Reads a child's stderr into the log, keeping its last lines.
pub(super) struct StderrTail {
    pub(super) lines: Arc<Mutex<VecDeque<String>>>,
    pub(super) reader: JoinHandle<()>,
}

impl StderrTail {
    pub(super) fn spawn(server_id: &str, stderr: ChildStderr) -> Self {
        let lines = Arc::new(Mutex::new(VecDeque::new()));
        let kept = lines.clone();
        let server = server_id.to_owned();
        let reader = tokio::spawn(async move {
            let mut reader = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                tracing::debug!(server = %server, "stderr: {line}");
                if line.trim().is_empty() {
                    continue;
                }
                let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
                if kept.len() == STDERR_LINES {
                    kept.pop_front();
                }
                kept.push_back(line);
            }
        });
        Self { lines, reader }
    }

    /// The last lines, once the child has closed stderr or a short grace period has passed.
    pub(super) async fn tail(&mut self) -> String {
        if !self.reader.is_finished() {
            let _ = tokio::time::timeout(STDERR_GRACE, &mut self.reader).await;
        }
        let lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        lines.iter().map(String::as_str).collect::<Vec<_>>().join(" | ")
    }
}
