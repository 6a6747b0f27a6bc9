//! An MCP server's tools as chatd [`Tool`]s: the client handler that routes progress
//! notifications to the call that asked for them, and the call itself.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CallToolResult, ClientCapabilities, ClientInfo, ClientRequest,
    Implementation, JsonRpcMessage, LoggingMessageNotificationParam, Meta, NumberOrString, ProgressNotificationParam,
    ProgressToken, ProtocolVersion, ServerNotification, ServerResult,
};
use rmcp::service::{NotificationContext, PeerRequestOptions};
use rmcp::transport::Transport;
use rmcp::{ClientHandler, Peer, RoleClient, ServiceError};
use serde_json::Value;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use crate::tools::{Tool, ToolCallContext, ToolError, ToolOutput, ToolProgress, ToolSpec};

/// What a server's tools call through: its current session, if it has one. Kept apart from
/// [`Server`] so tools do not own their server (no reference cycle), and so a tool a request
/// picked before a restart uses the new session after it.
pub(super) struct Link {
    pub(super) server_id: String,
    /// The server's tools may run a call again (`idempotent` in its config).
    pub(super) idempotent: bool,
    pub(super) session: Mutex<Option<Session>>,
}

impl Link {
    pub(super) fn get(&self) -> Option<Session> {
        self.session.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(super) fn set(&self, session: Option<Session>) {
        *self.session.lock().unwrap_or_else(PoisonError::into_inner) = session;
    }
}

/// A live session with a server.
#[derive(Clone)]
pub(super) struct Session {
    pub(super) peer: Peer<RoleClient>,
    pub(super) progress: Arc<ProgressRoutes>,
    /// Cancelled by a call that found the transport broken, so the supervisor reconnects
    /// even if rmcp has not noticed yet.
    pub(super) broken: CancellationToken,
}

/// chatd's side of a session: answers the server's requests and notifications.
pub(super) struct Handler {
    pub(super) server_id: Arc<str>,
    pub(super) tools_changed: Arc<Notify>,
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
pub(super) struct Tapped<T> {
    pub(super) inner: T,
    pub(super) progress: Arc<ProgressRoutes>,
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
pub(super) struct ProgressRoutes {
    pub(super) routes: Mutex<HashMap<ProgressToken, mpsc::UnboundedSender<ToolProgress>>>,
}

impl ProgressRoutes {
    pub(super) fn lock(&self) -> MutexGuard<'_, HashMap<ProgressToken, mpsc::UnboundedSender<ToolProgress>>> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn register(self: &Arc<Self>, token: ProgressToken, to: mpsc::UnboundedSender<ToolProgress>) -> Route {
        self.lock().insert(token.clone(), to);
        Route { routes: self.clone(), token }
    }

    pub(super) fn deliver(&self, params: &ProgressNotificationParam) {
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
pub(super) struct Route {
    pub(super) routes: Arc<ProgressRoutes>,
    pub(super) token: ProgressToken,
}

impl Drop for Route {
    fn drop(&mut self) {
        self.routes.lock().remove(&self.token);
    }
}

/// Tokens unique across sessions, so a late notification can never reach another call.
static NEXT_PROGRESS_TOKEN: AtomicU64 = AtomicU64::new(1);

/// One tool of an MCP server, called through the server's current session.
pub(super) struct McpTool {
    pub(super) link: Arc<Link>,
    pub(super) spec: ToolSpec,
}

impl McpTool {
    /// A transport failure: the call may succeed once the server is reconnected, which the
    /// supervisor is told to do now rather than when rmcp notices.
    pub(super) fn lost(&self, session: &Session, error: &ServiceError) -> ToolError {
        tracing::warn!(server = %self.link.server_id, tool = %self.spec.name, %error, "MCP call lost its connection");
        session.broken.cancel();
        ToolError::retryable(format!("MCP server '{}' lost its connection", self.link.server_id))
    }
}

#[async_trait]
impl Tool for McpTool {
    fn name(&self) -> &str {
        &self.spec.name
    }

    fn spec(&self) -> ToolSpec {
        self.spec.clone()
    }

    fn idempotent(&self) -> bool {
        self.link.idempotent
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
        // The call's stable key (CONTRACT.md §19): a server told the same key twice can tell.
        let mut meta = Meta::with_progress_token(token);
        if let Some(key) = &ctx.idempotency_key {
            meta.0.insert("idempotency_key".to_owned(), Value::String(key.clone()));
        }
        let options = PeerRequestOptions { timeout: None, meta: Some(meta) };
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
pub(super) fn into_output(result: CallToolResult) -> Result<ToolOutput, ToolError> {
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
