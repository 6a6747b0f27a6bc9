//! MCP servers: chatd's client side of the Model Context Protocol, on the official `rmcp` SDK.
//! This module owns one session per configured server (a child process over stdio, or
//! streamable HTTP) shared by every conversation, keeps it alive (reconnecting with
//! exponential backoff when it dies, listing its tools again each time), and offers the
//! server's tools as [`Tool`]s that forward progress notifications and cancellation. Which
//! tools a request gets is the registry's business, not this module's.
//!
//! Here: the manager and what `GET /api/tools` shows of each server. `server.rs` keeps one
//! server's session alive; `tool.rs` makes its tools chatd tools.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::McpServerSettings;
use crate::tools::{McpTools, Tool};

mod server;
mod tool;

use server::{Server, supervise};
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
                    tools: inner.tools.iter().map(|t| t.name().to_owned()).collect(),
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
