//! The tools' and pages' sections of the settings: built-ins and their limits, client
//! tools, MCP servers, HTTP tools, pages, payload types and actions.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Limits and built-ins shared by every tool.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSettings {
    /// Built-in tools to offer: `current_time`, `calculator`.
    pub builtins: Vec<String>,
    /// Seconds one tool call may take before it ends with status `timeout`.
    pub timeout_secs: f64,
    /// Characters of a tool's output sent in `tool_output` (the model gets all of it).
    pub max_output_chars: usize,
    /// Retries of a call that failed in a way worth retrying (a 5xx, a lost MCP server).
    pub max_retries: u32,
    /// Seconds, from start-up, that MCP servers still making their first connection hold
    /// back readiness and new runs (which then get their tools).
    pub mcp_start_wait_secs: f64,
    /// Tools whose calls wait for a person's approval (CONTRACT.md §15): names, or
    /// `server_id:*` for every tool of an MCP server.
    #[serde(default)]
    pub require_approval: Vec<String>,
    /// Seconds an approval may wait; then the call is denied as expired.
    #[serde(default = "default_approval_timeout")]
    pub approval_timeout_secs: f64,
}

pub(super) fn default_approval_timeout() -> f64 {
    86_400.0
}

/// A tool that runs in the frontend (CONTRACT.md §15): offered to the model like any other,
/// its call waits for `POST /api/runs/{trace_id}/tool_results`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientToolSettings {
    #[serde(default)]
    pub description: String,
    /// The JSON Schema of its input.
    #[serde(default = "object_schema")]
    pub parameters: serde_json::Value,
}

/// An MCP server: a child process over stdio (`command` + `args`), or streamable HTTP (`url`).
/// Started once at start-up and shared by all conversations; restarted with backoff.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct McpServerSettings {
    #[serde(default)]
    pub command: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment for the child process.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub url: Option<String>,
    /// Offered on every page (true), or only where a page lists its tools.
    #[serde(default = "yes")]
    pub global: bool,
    /// A call interrupted by its process's death may run again (CONTRACT.md §19): the
    /// server's tools do the same once or twice (they read, or honour
    /// `_meta.idempotency_key`).
    #[serde(default)]
    pub idempotent: bool,
}

/// A tool chatd calls by POSTing the model's arguments as JSON to `url`. The answer is the
/// result: any JSON or text, or `{"text": …, "payload": …}` to hand the client a payload.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HttpToolSettings {
    pub url: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "object_schema")]
    pub input_schema: serde_json::Value,
    #[serde(default = "yes")]
    pub global: bool,
    #[serde(default)]
    pub timeout_secs: Option<f64>,
    /// A call interrupted by its process's death may run again (CONTRACT.md §19): the tool
    /// does the same once or twice (it reads, or honours the `Idempotency-Key` header).
    #[serde(default)]
    pub idempotent: bool,
}

/// What a page (and its tabs, and their subtabs) adds to a request: who the assistant is
/// there, its tools and the payload types it may produce.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
#[serde(deny_unknown_fields)]
pub struct PageSettings {
    pub identity: Option<String>,
    pub instructions: Option<String>,
    pub tools: Vec<String>,
    pub payload_types: Vec<String>,
    pub tabs: BTreeMap<String, PageSettings>,
    pub subtabs: BTreeMap<String, PageSettings>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PayloadSource {
    Tool,
    Llm,
}

/// A structured payload: produced by a tool, or written by the model after `parse_marker`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PayloadTypeSettings {
    pub source: PayloadSource,
    #[serde(default)]
    pub parse_marker: Option<String>,
    #[serde(default)]
    pub llm_instructions: Option<String>,
    /// A JSON schema the payload's data must match.
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
    #[serde(default)]
    pub is_global: bool,
}

/// The server side of a `handler: "server"` action: an HTTP URL or a tool.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ActionSettings {
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub url: Option<String>,
    #[serde(default)]
    pub tool: Option<String>,
}

fn yes() -> bool {
    true
}

fn object_schema() -> serde_json::Value {
    serde_json::json!({"type": "object"})
}
