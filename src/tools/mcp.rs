//! MCP servers: chatd's client side of the Model Context Protocol, on the official `rmcp` SDK.
//! This module owns one session per configured server (a child process over stdio, or
//! streamable HTTP) shared by every conversation, keeps it alive (reconnecting with
//! exponential backoff when it dies, listing its tools again each time), and offers the
//! server's tools as [`Tool`]s that forward progress notifications and cancellation. Which
//! tools a request gets is the registry's business, not this module's.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CallToolResult, ClientCapabilities, ClientInfo, ClientRequest,
    Implementation, JsonRpcMessage, LoggingMessageNotificationParam, Meta, NumberOrString, ProgressNotificationParam,
    ProgressToken, ProtocolVersion, ServerNotification, ServerResult,
};
use rmcp::service::{NotificationContext, PeerRequestOptions, QuitReason, RunningService};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess, Transport};
use rmcp::{ClientHandler, Peer, RoleClient, ServiceError, ServiceExt};
use serde::Serialize;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{ChildStderr, Command};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{McpTools, Tool, ToolCallContext, ToolError, ToolOutput, ToolProgress, ToolSpec};
use crate::config::McpServerSettings;

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

/// Where a server is in its life, as `GET /api/tools` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpState {
    /// The first connection attempt is under way.
    Starting,
    /// Connected and its tools listed; they are offered.
    Ready,
    /// Its session was lost and it is being reconnected; its tools are not offered.
    Restarting,
    /// The latest attempt failed (`last_error` says why). It is retried with backoff, unless
    /// its settings are unusable.
    Failed,
}

/// One configured server, for `GET /api/tools`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct McpServerStatus {
    pub id: String,
    /// `stdio` or `http`.
    pub transport: &'static str,
    pub state: McpState,
    /// The names of the tools offered now (none unless `ready`).
    pub tools: Vec<String>,
    /// Connection attempts after the first one.
    pub restarts: u32,
    pub last_error: Option<String>,
}

/// Every configured MCP server, each kept connected by its own background task.
pub struct McpManager {
    servers: Vec<Arc<Server>>,
    /// Woken on every state change, for [`McpManager::wait_ready`].
    changed: Arc<Notify>,
    /// Until when a server still making its first attempt holds back readiness and runs.
    start_deadline: tokio::time::Instant,
}

impl McpManager {
    /// Starts every configured server in the background (start-up must not wait for them) and
    /// keeps them alive until `shutdown` is cancelled, which stops their child processes.
    /// For up to `start_wait`, servers still making their first attempt hold back readiness
    /// and new runs ([`McpTools::wait_started`]). Must be called within a Tokio runtime.
    pub fn start(
        servers: &BTreeMap<String, McpServerSettings>,
        start_wait: Duration,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let changed = Arc::new(Notify::new());
        let servers = servers
            .iter()
            .map(|(id, settings)| {
                let server = Arc::new(Server::new(id, settings, changed.clone()));
                let span = tracing::info_span!("mcp", server = %id);
                tokio::spawn(supervise(server.clone(), shutdown.clone()).instrument(span));
                server
            })
            .collect();
        let start_deadline = tokio::time::Instant::now() + start_wait;
        Arc::new(Self { servers, changed, start_deadline })
    }

    /// The tools of every server that is ready now: (server id, tool). Tool names are the
    /// server's own names.
    pub fn tools(&self) -> Vec<(String, Arc<dyn Tool>)> {
        let mut tools = Vec::new();
        for server in &self.servers {
            let inner = server.lock();
            if inner.state == McpState::Ready {
                tools.extend(inner.tools.iter().map(|t| (server.id.clone(), t.clone())));
            }
        }
        tools
    }

    /// Whether the server's tools are offered on every page (`global` in its settings).
    pub fn is_global(&self, server_id: &str) -> bool {
        self.server(server_id).is_some_and(|s| s.global)
    }

    /// One entry per configured server, for GET /api/tools.
    pub fn status(&self) -> Vec<McpServerStatus> {
        self.servers
            .iter()
            .map(|server| {
                let inner = server.lock();
                McpServerStatus {
                    id: server.id.clone(),
                    transport: server.transport,
                    state: inner.state,
                    tools: inner.tools.iter().map(|t| t.spec().name).collect(),
                    restarts: inner.restarts,
                    last_error: inner.last_error.clone(),
                }
            })
            .collect()
    }

    /// Waits until every server is ready or failed, or `timeout` passes (tests use it instead
    /// of sleeping).
    pub async fn wait_ready(&self, timeout: Duration) {
        self.wait_until(tokio::time::Instant::now() + timeout, |state| {
            matches!(state, McpState::Ready | McpState::Failed)
        })
        .await;
    }

    /// Whether a server is still making its first attempt, within the start-up wait.
    pub fn starting(&self) -> bool {
        tokio::time::Instant::now() < self.start_deadline
            && self.servers.iter().any(|s| s.lock().state == McpState::Starting)
    }

    /// Waits until every server's state is `settled`, or `deadline`.
    async fn wait_until(&self, deadline: tokio::time::Instant, settled: impl Fn(McpState) -> bool) {
        loop {
            // Registered before the check, so a change between the check and the wait is
            // not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let settled = self.servers.iter().all(|s| settled(s.lock().state));
            if settled || tokio::time::timeout_at(deadline, changed).await.is_err() {
                return;
            }
        }
    }

    /// The process id of a stdio server's current child, while it is ready (diagnostics and
    /// tests).
    pub fn pid(&self, server_id: &str) -> Option<u32> {
        self.server(server_id).and_then(|s| s.lock().pid)
    }

    fn server(&self, id: &str) -> Option<&Arc<Server>> {
        self.servers.iter().find(|s| s.id == id)
    }
}

#[async_trait::async_trait]
impl McpTools for McpManager {
    fn tools(&self) -> Vec<(String, Arc<dyn Tool>)> {
        McpManager::tools(self)
    }

    fn starting(&self) -> bool {
        McpManager::starting(self)
    }

    async fn wait_started(&self) {
        if McpManager::starting(self) {
            self.wait_until(self.start_deadline, |state| state != McpState::Starting).await;
        }
    }

    fn is_global(&self, server: &str) -> bool {
        McpManager::is_global(self, server)
    }

    fn status(&self) -> Vec<McpServerStatus> {
        McpManager::status(self)
    }
}

/// How to reach a server, from its settings.
#[derive(Debug, Clone)]
enum Target {
    Stdio { command: String, args: Vec<String>, env: BTreeMap<String, String> },
    Http { url: String },
}

impl Target {
    fn from_settings(settings: &McpServerSettings) -> Result<Self, String> {
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
struct Server {
    id: String,
    transport: &'static str,
    global: bool,
    target: Result<Target, String>,
    link: Arc<Link>,
    inner: Mutex<Inner>,
    changed: Arc<Notify>,
}

struct Inner {
    state: McpState,
    tools: Vec<Arc<dyn Tool>>,
    restarts: u32,
    last_error: Option<String>,
    pid: Option<u32>,
}

impl Server {
    fn new(id: &str, settings: &McpServerSettings, changed: Arc<Notify>) -> Self {
        Self {
            id: id.to_owned(),
            transport: if settings.url.is_some() && settings.command.is_none() { "http" } else { "stdio" },
            global: settings.global,
            target: Target::from_settings(settings),
            link: Arc::new(Link { server_id: id.to_owned(), session: Mutex::new(None) }),
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

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing panics while holding it; if something did, the state is still usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn update(&self, change: impl FnOnce(&mut Inner)) {
        change(&mut self.lock());
        self.changed.notify_waiters();
    }

    fn ready(&self, session: Session, tools: &[rmcp::model::Tool], pid: Option<u32>) {
        self.link.set(Some(session));
        let tools = self.tools_from(tools);
        tracing::info!(tools = tools.len(), ?pid, "MCP server ready");
        self.update(|inner| {
            inner.state = McpState::Ready;
            inner.tools = tools;
            inner.pid = pid;
        });
    }

    fn set_tools(&self, tools: &[rmcp::model::Tool]) {
        let tools = self.tools_from(tools);
        tracing::info!(tools = tools.len(), "MCP server's tools changed");
        self.update(|inner| inner.tools = tools);
    }

    fn tools_from(&self, tools: &[rmcp::model::Tool]) -> Vec<Arc<dyn Tool>> {
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
    fn lost(&self, reason: String) {
        self.link.set(None);
        tracing::warn!(error = %reason, "MCP server lost; restarting it");
        self.update(|inner| {
            inner.state = McpState::Restarting;
            inner.tools.clear();
            inner.pid = None;
            inner.last_error = Some(reason);
        });
    }

    fn failed(&self, error: String, retry_in: Option<Duration>) {
        match retry_in {
            Some(wait) => tracing::warn!(%error, ?wait, "MCP server failed to start; retrying"),
            None => tracing::error!(%error, "MCP server cannot be started"),
        }
        self.update(|inner| {
            inner.state = McpState::Failed;
            inner.last_error = Some(error);
        });
    }

    fn stopped(&self) {
        self.link.set(None);
        self.update(|inner| {
            inner.tools.clear();
            inner.pid = None;
        });
    }
}

/// What a server's tools call through: its current session, if it has one. Kept apart from
/// [`Server`] so tools do not own their server (no reference cycle), and so a tool a request
/// picked before a restart uses the new session after it.
struct Link {
    server_id: String,
    session: Mutex<Option<Session>>,
}

impl Link {
    fn get(&self) -> Option<Session> {
        self.session.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn set(&self, session: Option<Session>) {
        *self.session.lock().unwrap_or_else(PoisonError::into_inner) = session;
    }
}

/// A live session with a server.
#[derive(Clone)]
struct Session {
    peer: Peer<RoleClient>,
    progress: Arc<ProgressRoutes>,
    /// Cancelled by a call that found the transport broken, so the supervisor reconnects
    /// even if rmcp has not noticed yet.
    broken: CancellationToken,
}

/// Keeps one server connected until shutdown.
async fn supervise(server: Arc<Server>, shutdown: CancellationToken) {
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
struct Connection {
    service: RunningService<RoleClient, Handler>,
    tools: Vec<rmcp::model::Tool>,
    pid: Option<u32>,
    progress: Arc<ProgressRoutes>,
    tools_changed: Arc<Notify>,
    stderr: Option<StderrTail>,
}

/// Starts a session: spawns the child or opens the HTTP transport, does the MCP handshake
/// and lists the tools.
async fn connect(id: &str, target: &Target) -> Result<Connection, String> {
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

async fn handshake<T>(handler: Handler, transport: T) -> Result<RunningService<RoleClient, Handler>, String>
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
async fn run(server: &Server, connection: Connection, shutdown: &CancellationToken) -> bool {
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

fn describe_quit(quit: Result<QuitReason, tokio::task::JoinError>) -> String {
    match quit {
        Ok(QuitReason::Closed) => "the server closed the connection".to_owned(),
        Ok(QuitReason::Cancelled) => "the session was cancelled".to_owned(),
        Ok(QuitReason::JoinError(e)) | Err(e) => format!("the session's task failed: {e}"),
    }
}

/// Logs the child's last stderr lines with an error: that is where a server says why it
/// died. They stay out of the error itself, which `GET /api/tools` shows to any user, since
/// a server's stderr may hold its own secrets.
async fn with_stderr(error: String, stderr: Option<&mut StderrTail>) -> String {
    if let Some(stderr) = stderr {
        let tail = stderr.tail().await;
        if !tail.is_empty() {
            tracing::warn!(%error, stderr = %tail, "MCP server failed");
        }
    }
    error
}

/// Reads a child's stderr into the log, keeping its last lines.
struct StderrTail {
    lines: Arc<Mutex<VecDeque<String>>>,
    reader: JoinHandle<()>,
}

impl StderrTail {
    fn spawn(server_id: &str, stderr: ChildStderr) -> Self {
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
    async fn tail(&mut self) -> String {
        if !self.reader.is_finished() {
            let _ = tokio::time::timeout(STDERR_GRACE, &mut self.reader).await;
        }
        let lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        lines.iter().map(String::as_str).collect::<Vec<_>>().join(" | ")
    }
}

/// chatd's side of a session: answers the server's requests and notifications.
struct Handler {
    server_id: Arc<str>,
    tools_changed: Arc<Notify>,
}

impl ClientHandler for Handler {
    fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) -> impl Future<Output = ()> + Send + '_ {
        // notify_one keeps a permit, so a change during a listing is listed again after it.
        self.tools_changed.notify_one();
        std::future::ready(())
    }

    fn on_logging_message(
        &self,
        params: LoggingMessageNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        tracing::debug!(server = %self.server_id, level = ?params.level, logger = ?params.logger, data = %params.data, "MCP server log");
        std::future::ready(())
    }

    fn get_info(&self) -> ClientInfo {
        ClientInfo {
            meta: None,
            protocol_version: ProtocolVersion::default(),
            capabilities: ClientCapabilities::default(),
            client_info: Implementation {
                name: "chatd".to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
                ..Implementation::from_build_env()
            },
        }
    }
}

/// A transport that routes `notifications/progress` to the calls waiting for them as each
/// message is read. rmcp hands notifications to its handler on a task each, so two of them,
/// or the last one and the call's result, could arrive out of order; read here they cannot.
struct Tapped<T> {
    inner: T,
    progress: Arc<ProgressRoutes>,
}

impl<T: Transport<RoleClient>> Transport<RoleClient> for Tapped<T> {
    type Error = T::Error;

    fn send(
        &mut self,
        item: rmcp::service::TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.inner.send(item)
    }

    fn receive(&mut self) -> impl Future<Output = Option<rmcp::service::RxJsonRpcMessage<RoleClient>>> + Send {
        let Self { inner, progress } = self;
        async move {
            let message = inner.receive().await;
            if let Some(JsonRpcMessage::Notification(notification)) = &message {
                if let ServerNotification::ProgressNotification(progress_notification) = &notification.notification {
                    progress.deliver(&progress_notification.params);
                }
            }
            message
        }
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.close()
    }
}

/// Progress tokens of the calls in flight on one session, and where their progress goes.
#[derive(Default)]
struct ProgressRoutes {
    routes: Mutex<HashMap<ProgressToken, mpsc::UnboundedSender<ToolProgress>>>,
}

impl ProgressRoutes {
    fn lock(&self) -> MutexGuard<'_, HashMap<ProgressToken, mpsc::UnboundedSender<ToolProgress>>> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn register(self: &Arc<Self>, token: ProgressToken, to: mpsc::UnboundedSender<ToolProgress>) -> Route {
        self.lock().insert(token.clone(), to);
        Route { routes: self.clone(), token }
    }

    fn deliver(&self, params: &ProgressNotificationParam) {
        let routes = self.lock();
        let Some(to) = routes.get(&params.progress_token) else {
            return;
        };
        let progress = params.total.filter(|total| *total > 0.0).map(|total| (params.progress / total).clamp(0.0, 1.0));
        // The caller may have stopped listening; that is not the server's problem.
        let _ = to.send(ToolProgress { progress, message: params.message.clone(), ..ToolProgress::default() });
    }
}

/// A registered progress token; dropping it unregisters the token.
struct Route {
    routes: Arc<ProgressRoutes>,
    token: ProgressToken,
}

impl Drop for Route {
    fn drop(&mut self) {
        self.routes.lock().remove(&self.token);
    }
}

/// Tokens unique across sessions, so a late notification can never reach another call.
static NEXT_PROGRESS_TOKEN: AtomicU64 = AtomicU64::new(1);

/// One tool of an MCP server, called through the server's current session.
struct McpTool {
    link: Arc<Link>,
    spec: ToolSpec,
}

impl McpTool {
    /// A transport failure: the call may succeed once the server is reconnected, which the
    /// supervisor is told to do now rather than when rmcp notices.
    fn lost(&self, session: &Session, error: &ServiceError) -> ToolError {
        tracing::warn!(server = %self.link.server_id, tool = %self.spec.name, %error, "MCP call lost its connection");
        session.broken.cancel();
        ToolError::retryable(format!("MCP server '{}' lost its connection", self.link.server_id))
    }
}

#[async_trait]
impl Tool for McpTool {
    fn spec(&self) -> ToolSpec {
        self.spec.clone()
    }

    async fn call(&self, input: Value, ctx: ToolCallContext) -> Result<ToolOutput, ToolError> {
        if ctx.cancel.is_cancelled() {
            return Err(ToolError::new("cancelled"));
        }
        let arguments = match input {
            Value::Object(arguments) => Some(arguments),
            Value::Null => None,
            other => {
                return Err(ToolError::new(format!(
                    "the arguments of {} must be a JSON object, not {other}",
                    self.spec.name
                )));
            }
        };
        let Some(session) = self.link.get() else {
            return Err(ToolError::retryable(format!("MCP server '{}' is not connected", self.link.server_id)));
        };
        let token = ProgressToken(NumberOrString::String(
            format!("chatd-{}", NEXT_PROGRESS_TOKEN.fetch_add(1, Ordering::Relaxed)).into(),
        ));
        // Registered before the request goes out, so not even the first notification is missed.
        let _route = session.progress.register(token.clone(), ctx.progress.clone());
        let request = ClientRequest::CallToolRequest(CallToolRequest::new(CallToolRequestParams {
            meta: None,
            name: Cow::Owned(self.spec.name.clone()),
            arguments,
            task: None,
        }));
        // rmcp sets a progress token of its own, then applies `meta`: ours replaces it.
        let options = PeerRequestOptions { timeout: None, meta: Some(Meta::with_progress_token(token)) };
        let mut handle = match session.peer.send_cancellable_request(request, options).await {
            Ok(handle) => handle,
            Err(error) => return Err(self.lost(&session, &error)),
        };
        let response = tokio::select! {
            biased;
            () = ctx.cancel.cancelled() => None,
            response = &mut handle.rx => Some(response),
        };
        let Some(response) = response else {
            // The caller has moved on: tell the server (`notifications/cancelled`) without
            // waiting for the message to go out.
            let server = self.link.server_id.clone();
            tokio::spawn(async move {
                if let Err(error) = handle.cancel(Some("cancelled by chatd".to_owned())).await {
                    tracing::debug!(%server, %error, "could not send notifications/cancelled");
                }
            });
            return Err(ToolError::new("cancelled"));
        };
        match response {
            Ok(Ok(ServerResult::CallToolResult(result))) => into_output(result),
            Ok(Ok(_)) => Err(ToolError::new(format!(
                "MCP server '{}' answered tools/call with something else",
                self.link.server_id
            ))),
            // rmcp dropped the request: its session ended while the call was in flight.
            Err(_) => Err(self.lost(&session, &ServiceError::TransportClosed)),
            Ok(Err(error)) => Err(match error {
                ServiceError::TransportClosed | ServiceError::TransportSend(_) => self.lost(&session, &error),
                ServiceError::Cancelled { .. } => ToolError::new("cancelled"),
                ServiceError::McpError(error) => ToolError::new(error.message.into_owned()),
                ServiceError::Timeout { .. } => ToolError::retryable(error.to_string()),
                other => ToolError::new(other.to_string()),
            }),
        }
    }
}

/// The model gets the text items, one per line; the client gets `structuredContent`.
fn into_output(result: CallToolResult) -> Result<ToolOutput, ToolError> {
    let mut text = String::new();
    for item in &result.content {
        if let Some(item) = item.as_text() {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&item.text);
        }
    }
    if result.is_error == Some(true) {
        if text.is_empty() {
            text = "the tool failed without saying why".to_owned();
        }
        return Err(ToolError::new(text));
    }
    if text.is_empty() {
        if let Some(structured) = &result.structured_content {
            text = structured.to_string();
        }
    }
    Ok(ToolOutput { text, payload: result.structured_content })
}
