//! Tools the model may call: built-ins, HTTP tools from config, and the tools of MCP servers.
//! Every kind implements [`Tool`]; the [`Registry`] decides which a request gets. Tools know
//! nothing of HTTP handlers, the store or the client's events.

pub mod builtin;
pub mod http;
pub mod mcp;

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::config::pages::PageScope;
pub use crate::providers::ToolSpec;

/// The MCP side of the registry: the tools of the servers that are ready now.
#[async_trait::async_trait]
pub trait McpTools: Send + Sync {
    /// (server id, tool) for every ready server's tools, under the servers' own names.
    fn tools(&self) -> Vec<(String, Arc<dyn Tool>)>;
    /// Whether a server is still making its first connection attempt (within the bounded
    /// start-up wait): chatd is not ready meanwhile.
    fn starting(&self) -> bool;
    /// Waits (bounded by the start-up wait) until no server is making its first attempt, so
    /// that a run started right after start-up is offered every server's tools.
    async fn wait_started(&self);
    /// Whether a server's tools are offered on every page.
    fn is_global(&self, server: &str) -> bool;
    /// Each server's state, for `GET /api/tools`.
    fn status(&self) -> Vec<mcp::McpServerStatus>;
}

/// No MCP servers (tests, or a build without them).
pub struct NoMcp;

#[async_trait::async_trait]
impl McpTools for NoMcp {
    fn tools(&self) -> Vec<(String, Arc<dyn Tool>)> {
        Vec::new()
    }

    fn starting(&self) -> bool {
        false
    }

    async fn wait_started(&self) {}

    fn is_global(&self, _server: &str) -> bool {
        false
    }

    fn status(&self) -> Vec<mcp::McpServerStatus> {
        Vec::new()
    }
}

/// What a tool reports while it runs (MCP `notifications/progress`, streaming HTTP tools).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolProgress {
    pub stage: Option<String>,
    pub message: Option<String>,
    /// From 0 to 1, when the tool knows its total.
    pub progress: Option<f64>,
    pub data: Option<Value>,
}

/// Handed to each call: where to report progress, and a token cancelled when the run is
/// cancelled or the call timed out (the tool should stop, and an MCP server be told).
#[derive(Debug, Clone)]
pub struct ToolCallContext {
    pub progress: mpsc::UnboundedSender<ToolProgress>,
    pub cancel: CancellationToken,
    /// The call's stable key, `<trace_id>:<tool_call_id>`, the same however often the call is
    /// made (CONTRACT.md §19): a tool that is run again can tell. HTTP tools send it as
    /// `Idempotency-Key`. `None` for a call of no run's (an executed action's tool).
    pub idempotency_key: Option<String>,
}

/// A tool's result: `text` goes to the model; `payload`, if any, to the client.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    pub text: String,
    pub payload: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ToolError {
    pub message: String,
    /// Whether calling again may succeed (a 5xx, a restarting server), so a retry is worth it.
    pub retryable: bool,
}

impl ToolError {
    pub fn new(message: impl Into<String>) -> Self {
        Self { message: message.into(), retryable: false }
    }

    pub fn retryable(message: impl Into<String>) -> Self {
        Self { message: message.into(), retryable: true }
    }
}

#[async_trait]
pub trait Tool: Send + Sync {
    /// The name the model calls it by, without building its [`spec`](Tool::spec) (a run
    /// looks tools up by name several times; a spec is its schema, built each time).
    fn name(&self) -> &str;
    fn spec(&self) -> ToolSpec;
    async fn call(&self, input: Value, ctx: ToolCallContext) -> Result<ToolOutput, ToolError>;
    /// Whether a call may run again after its process died while it ran (CONTRACT.md §19):
    /// running it twice does what running it once does. Else the model is told that the
    /// call was interrupted.
    fn idempotent(&self) -> bool {
        false
    }
}

/// A tool under another name (an MCP tool whose name another tool already has).
struct Renamed {
    name: String,
    inner: Arc<dyn Tool>,
}

#[async_trait]
impl Tool for Renamed {
    fn name(&self) -> &str {
        &self.name
    }

    fn spec(&self) -> ToolSpec {
        ToolSpec { name: self.name.clone(), ..self.inner.spec() }
    }

    async fn call(&self, input: Value, ctx: ToolCallContext) -> Result<ToolOutput, ToolError> {
        self.inner.call(input, ctx).await
    }

    fn idempotent(&self) -> bool {
        self.inner.idempotent()
    }
}

/// Where a tool comes from, for `GET /api/tools`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ToolSource {
    Builtin,
    Http,
    Mcp { server: String },
}

/// A tool as a request may get it: final (unique) name, origin, and whether it is global.
#[derive(Clone)]
pub struct Available {
    pub tool: Arc<dyn Tool>,
    pub source: ToolSource,
    pub global: bool,
}

/// Every tool chatd knows: built-ins and HTTP tools (fixed at start-up) and the tools of the
/// MCP servers that are ready now.
pub struct Registry {
    fixed: Vec<Available>,
    mcp: Arc<dyn McpTools>,
}

impl Registry {
    /// Builds the fixed tools; `mcp` supplies the MCP servers' tools as they come and go.
    pub fn new(settings: &Settings, mcp: Arc<dyn McpTools>) -> Result<Self, String> {
        let mut fixed = Vec::new();
        for name in &settings.tools.builtins {
            let tool =
                builtin::builtin(name).ok_or_else(|| format!("tools.builtins: unknown built-in tool '{name}'"))?;
            fixed.push(Available { tool, source: ToolSource::Builtin, global: true });
        }
        // No overall timeout here: the agent times every call and reports `timeout` itself.
        let client = reqwest::Client::builder()
            .http1_only()
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()
            .map_err(|e| e.to_string())?;
        for (name, http) in &settings.http_tools {
            if fixed.iter().any(|t| t.tool.name() == name) {
                return Err(format!("http_tools.{name}: a built-in tool has that name"));
            }
            let tool = Arc::new(http::HttpTool::new(name, http.clone(), client.clone()));
            fixed.push(Available { tool, source: ToolSource::Http, global: http.global });
        }
        Ok(Self { fixed, mcp })
    }

    pub fn mcp(&self) -> &Arc<dyn McpTools> {
        &self.mcp
    }

    /// Every tool available now, each under a unique name: an MCP tool whose name is taken
    /// gets its server id in front (`server_name`).
    pub fn all(&self) -> Vec<Available> {
        let mut tools = self.fixed.clone();
        let mcp = self.mcp.tools();
        if mcp.is_empty() {
            return tools;
        }
        let mut names: HashSet<String> = tools.iter().map(|t| t.tool.name().to_owned()).collect();
        for (server, tool) in mcp {
            let tool: Arc<dyn Tool> = if names.contains(tool.name()) {
                let name = format!("{server}_{}", tool.name());
                Arc::new(Renamed { name, inner: tool })
            } else {
                tool
            };
            names.insert(tool.name().to_owned());
            let global = self.mcp.is_global(&server);
            tools.push(Available { tool, source: ToolSource::Mcp { server }, global });
        }
        tools
    }

    /// Which of `tools` match one of `patterns` (CONTRACT.md §15): a tool's name, `*`, or
    /// `server_id:*` for every tool of an MCP server.
    pub fn matching(&self, tools: &[Arc<dyn Tool>], patterns: &[String]) -> Vec<String> {
        if patterns.is_empty() {
            return Vec::new();
        }
        let names: HashSet<&str> = tools.iter().map(|t| t.name()).collect();
        self.all()
            .into_iter()
            .filter_map(|t| {
                let name = t.tool.name();
                let server = match &t.source {
                    ToolSource::Mcp { server } => Some(server.as_str()),
                    _ => None,
                };
                let matches = patterns
                    .iter()
                    .any(|p| p == "*" || *p == name || p.strip_suffix(":*").is_some_and(|s| server == Some(s)));
                (matches && names.contains(name)).then(|| name.to_owned())
            })
            .collect()
    }

    /// The tools one request gets: the global ones plus those its page, tab and subtab name,
    /// kept only if the profile allows them (`*` allows all).
    pub fn for_request(&self, scope: &PageScope, allowed: &[String]) -> Vec<Arc<dyn Tool>> {
        let all_allowed = allowed.iter().any(|a| a == "*");
        self.all()
            .into_iter()
            .filter(|t| {
                let name = t.tool.name();
                (t.global || scope.tools.iter().any(|n| n == name))
                    && (all_allowed || allowed.iter().any(|n| n == name))
            })
            .map(|t| t.tool)
            .collect()
    }
}
