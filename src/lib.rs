//! chatd: a chat backend for LLM apps. [`App`] wires configuration, the store, the providers
//! and the HTTP routers together, binds the listener and owns shutdown.

pub mod chat;
pub mod config;
pub mod domain;
pub mod events;
pub mod files;
pub mod http;
pub mod ids;
pub mod outlive;
pub mod pricing;
pub mod providers;
pub mod report;
pub mod store;
pub mod tools;
pub mod wake;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::chat::{ChatService, EventLog, Runs};
use crate::config::{MOCK_ID, ProviderKind, Settings};
use crate::http::AppState;
use crate::http::auth::Authenticator;
use crate::providers::Providers;
use crate::tools::Registry;
use crate::tools::mcp::McpManager;

/// A built server: bound, migrated, ready to [`run`](App::run).
pub struct App {
    listener: TcpListener,
    state: AppState,
}

impl App {
    /// Opens the store (running migrations), starts the event log writer and binds
    /// `server.host:server.port` (port 0 picks a free one).
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let settings = Arc::new(settings);
        report::metrics::handle();
        let store = store::connect(settings.database.url.expose(), settings.database.max_connections).await?;
        let runs = Runs::default();
        let log = EventLog::start(
            store.clone(),
            runs.clone(),
            Duration::from_millis(settings.stream.flush_interval_ms),
            settings.stream.flush_max_events,
        );
        let providers = Providers::from_settings(&settings);
        let default = &settings.profiles[&settings.chat.default_profile];
        if settings.providers.get(&default.provider).is_some_and(|p| p.kind == ProviderKind::Mock) {
            tracing::info!(
                provider = MOCK_ID,
                "the default profile uses the built-in mock model; configure [providers] and [profiles] for a real one"
            );
        }
        let shutdown = CancellationToken::new();
        crate::report::metrics::spawn_upkeep(shutdown.clone());
        // Runs are exported as OTLP traces where an endpoint is configured (CONTRACT.md §18).
        report::otlp::start(&settings);
        // What runs, votes and feedback report is written to the webhook outbox from here on.
        report::webhooks::start(store.clone(), &settings.webhooks, shutdown.clone());
        let mcp_wait =
            Duration::try_from_secs_f64(settings.tools.mcp_start_wait_secs.max(0.0)).unwrap_or(Duration::MAX);
        let mcp = McpManager::start(&settings.mcp_servers, mcp_wait, shutdown.clone());
        let tools = Arc::new(Registry::new(&settings, mcp).map_err(anyhow::Error::msg)?);
        let files = files::Files::open(&settings.files, store.clone()).map_err(anyhow::Error::msg)?;
        let chat = ChatService::new(
            settings.clone(),
            store.clone(),
            providers,
            tools.clone(),
            runs.clone(),
            log,
            files.clone(),
        );
        // Before this process starts runs of its own: whatever is left `running` here lost
        // its process (on a shared store, only those whose replica went quiet), and goes on
        // here from its last completed step (CONTRACT.md §19).
        chat.beat().await;
        chat.recover_left_runs().await;
        // Approvals expire on time whoever was running when they were asked (CONTRACT.md §15).
        chat.spawn_expiry(shutdown.clone());
        // Queued runs whose process stopped are taken up (CONTRACT.md §16): before the first
        // request, so that a client that follows one finds it here.
        chat.adopt_queued().await;
        chat.spawn_keeper(shutdown.clone());
        chat.spawn_background(shutdown.clone());
        let (host, port) = (&settings.server.host, settings.server.port);
        let listener = listen(host, port).await.map_err(|e| {
            let next = if e.kind() == std::io::ErrorKind::AddrInUse {
                "another process (another chatd?) listens there: stop it, or choose another port"
            } else {
                "check the address"
            };
            anyhow::anyhow!(
                "cannot listen on {host}:{port} (server.host, server.port; CHATD_SERVER__PORT): {e}; {next}"
            )
        })?;
        let auth = Arc::new(Authenticator::new(&settings).map_err(anyhow::Error::msg)?);
        let state = AppState { settings, store, chat, tools, auth, files, shutdown };
        Ok(Self { listener, state })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// Cancelling this token stops the server: streams end, then the listener closes.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.state.shutdown.clone()
    }

    /// The event log writer shared by all runs.
    pub fn event_log(&self) -> EventLog {
        self.state.chat.event_log().clone()
    }

    /// Stops the server gracefully: see [`Shutdown::graceful`].
    pub fn shutdown_handle(&self) -> Shutdown {
        Shutdown { state: self.state.clone() }
    }

    /// Serves until the shutdown token is cancelled, then until open connections end.
    pub async fn run(self) -> std::io::Result<()> {
        let shutdown = self.state.shutdown.clone();
        let settings = self.state.settings.clone();
        let router = http::router(self.state);
        tracing::info!(addr = %self.listener.local_addr()?, "chatd listening");
        http::server::serve(self.listener, router, &settings.server, shutdown).await;
        // The server stops as the drain ends, before the task that drained has sent the last
        // traces; the process ends with this function, so they go from here.
        report::otlp::flush().await;
        Ok(())
    }
}

/// Stops a running [`App`] the way SIGTERM does.
#[derive(Clone)]
pub struct Shutdown {
    state: AppState,
}

impl Shutdown {
    /// Refuses new runs, gives running ones `server.shutdown_grace_secs` to finish, hands the
    /// rest over to another replica (where one is alive) or cancels (and persists) them,
    /// then ends every stream and stops the listener.
    pub async fn graceful(&self) {
        let grace = Duration::from_secs(self.state.settings.server.shutdown_grace_secs);
        self.state.chat.start_draining();
        self.state.chat.drain(grace).await;
        self.state.shutdown.cancel();
        report::otlp::flush().await;
    }
}

/// Pending connections the listener queues: a burst of new clients waits here instead of
/// having its connections dropped and retried a second later (the kernel caps it at
/// `net.core.somaxconn`; tokio's own default is 1,024).
const LISTEN_BACKLOG: u32 = 4096;

/// Binds `host:port` (the first address it resolves to) with [`LISTEN_BACKLOG`].
pub async fn listen(host: &str, port: u16) -> std::io::Result<TcpListener> {
    let addr = tokio::net::lookup_host((host, port))
        .await?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{host} resolves to nothing")))?;
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}
