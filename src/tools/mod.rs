//! Tools the model may call: built-ins, HTTP tools from config, and the tools of MCP servers.
//! Every kind implements [`Tool`]; the [`Registry`] decides which a request gets. Tools know
//! nothing of HTTP handlers, the store or the client's events.

pub mod mcp;

use async_trait::async_trait;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use crate::providers::ToolSpec;

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
        Self {
            message: message.into(),
            retryable: false,
        }
    }

    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: true,
        }
    }
}

#[async_trait]
pub trait Tool: Send + Sync {
    fn spec(&self) -> ToolSpec;
    async fn call(&self, input: Value, ctx: ToolCallContext) -> Result<ToolOutput, ToolError>;
}
