//! Typed settings: `config/default.toml` (embedded in the binary), then `config/local.toml`,
//! then the file named by `--config` / `CHATD_CONFIG`, then `CHATD_*` environment variables
//! with `__` between levels. Secrets live in [`Secret`], whose `Debug` prints `***`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::{Deserialize, Serialize};

/// The defaults shipped in the repository, compiled in so the binary runs from any folder.
const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// Name of the provider and profile chatd adds when none is configured.
pub const MOCK_ID: &str = "mock";

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Settings {
    pub server: ServerSettings,
    pub database: DatabaseSettings,
    pub auth: AuthSettings,
    pub limits: Limits,
    pub stream: StreamSettings,
    pub chat: ChatSettings,
    #[serde(default)]
    pub providers: BTreeMap<String, ProviderSettings>,
    #[serde(default)]
    pub profiles: BTreeMap<String, ProfileSettings>,
    pub tools: ToolSettings,
    #[serde(default)]
    pub mcp_servers: BTreeMap<String, McpServerSettings>,
    #[serde(default)]
    pub http_tools: BTreeMap<String, HttpToolSettings>,
    #[serde(default)]
    pub pages: BTreeMap<String, PageSettings>,
    #[serde(default)]
    pub payload_types: BTreeMap<String, PayloadTypeSettings>,
    #[serde(default)]
    pub actions: BTreeMap<String, ActionSettings>,
}

/// Limits and built-ins shared by every tool.
#[derive(Debug, Clone, Deserialize, Serialize)]
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
}

/// An MCP server: a child process over stdio (`command` + `args`), or streamable HTTP (`url`).
/// Started once at start-up and shared by all conversations; restarted with backoff.
#[derive(Debug, Clone, Deserialize, Serialize)]
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
}

/// A tool chatd calls by POSTing the model's arguments as JSON to `url`. The answer is the
/// result: any JSON or text, or `{"text": …, "payload": …}` to hand the client a payload.
#[derive(Debug, Clone, Deserialize, Serialize)]
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
}

/// What a page (and its tabs, and their subtabs) adds to a request: who the assistant is
/// there, its tools and the payload types it may produce.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
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

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ServerSettings {
    pub host: String,
    pub port: u16,
    pub shutdown_grace_secs: u64,
    /// Origins a browser may call chatd from (`"*"` for any); empty: no CORS headers.
    #[serde(default)]
    pub cors_origins: Vec<String>,
    /// Log lines as JSON (for log collectors) instead of text.
    #[serde(default)]
    pub json_logs: bool,
    /// Seconds a client has to send a request's headers, counted from the connection's
    /// opening or the end of its previous response: it also closes idle keep-alive
    /// connections.
    pub header_read_timeout_secs: u64,
    /// Seconds a request body may pause before the request fails.
    pub request_body_timeout_secs: u64,
    /// Connections served at once (lowered to what the descriptor limit allows); more wait
    /// in the listen backlog.
    pub max_connections: usize,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct DatabaseSettings {
    pub url: Secret,
    pub max_connections: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    None,
    Token,
    Jwt,
}

#[derive(Clone, Deserialize, Serialize)]
pub struct AuthSettings {
    pub mode: AuthMode,
    /// Bearer token → user id. Tokens are secrets: prefer `tokens_file`.
    #[serde(default, skip_serializing)]
    pub tokens: BTreeMap<String, String>,
    /// A file of `token user` lines, read at start-up.
    #[serde(default)]
    pub tokens_file: Option<PathBuf>,
    #[serde(default)]
    pub jwt: JwtSettings,
}

/// Mode `jwt`: bearer JWTs signed with HS256 (a shared secret) or RS256 (a public key);
/// the user is `sub`; `exp` is required; `aud` and `iss` are checked when configured.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct JwtSettings {
    /// Environment variable holding the HS256 secret.
    pub secret_env: Option<String>,
    /// File holding the HS256 secret.
    pub secret_file: Option<PathBuf>,
    /// PEM file of the RS256 public key.
    pub public_key_file: Option<PathBuf>,
    pub audience: Option<String>,
    pub issuer: Option<String>,
    /// Seconds of clock skew allowed on `exp` and `nbf`.
    pub leeway_secs: u64,
    /// Filled at load time from `secret_env` / `secret_file`.
    #[serde(skip)]
    pub secret: Option<Secret>,
    /// Filled at load time from `public_key_file`.
    #[serde(skip)]
    pub public_key_pem: Option<String>,
}

impl fmt::Debug for AuthSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthSettings")
            .field("mode", &self.mode)
            .field("tokens", &format_args!("<{} hidden>", self.tokens.len()))
            .field("tokens_file", &self.tokens_file)
            .finish()
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Limits {
    pub max_body_bytes: usize,
    pub max_message_chars: usize,
    pub default_page_size: u32,
    pub max_page_size: u32,
    /// Runs one user may have going at once; one more is refused with 429.
    pub max_concurrent_runs_per_user: usize,
    /// Requests per minute per user (a token bucket, so short bursts are fine); 0: no limit.
    pub requests_per_minute: u32,
    /// Failed authentications per minute per client address (modes `token` and `jwt`);
    /// past them the address gets 429, whatever it sends, until its budget refills. 0: no
    /// limit.
    pub failed_auth_per_minute: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnDisconnect {
    Continue,
    Cancel,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct StreamSettings {
    pub keepalive_secs: u64,
    pub flush_interval_ms: u64,
    pub flush_max_events: usize,
    pub on_disconnect: OnDisconnect,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ChatSettings {
    pub default_profile: String,
    pub title_max_chars: usize,
    /// Whether a request's `diagnostics: true` is honoured (system prompt, messages, tools
    /// and the raw model output in `complete`).
    pub allow_diagnostics: bool,
    /// After a new conversation's first answer, ask the default profile's model for a
    /// short title (in the background; the stream never waits for it).
    pub refine_titles: bool,
    /// When context trimming drops history, have the model summarise it (once per trim)
    /// and give the summary to the model in the system prompt.
    pub summarize_dropped: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    Anthropic,
    Openai,
    Google,
    OpenaiCompatible,
    Mock,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ProviderSettings {
    pub kind: ProviderKind,
    #[serde(default)]
    pub base_url: Option<String>,
    /// Name of the environment variable holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// A file holding the API key (e.g. a mounted secret).
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// Filled at load time from `api_key_env` / `api_key_file`; never read from config text.
    #[serde(skip)]
    pub api_key: Option<Secret>,
    /// Seconds to establish the connection.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_secs: f64,
    /// Seconds from sending a request to its answer and first frame.
    #[serde(default = "default_stream_timeout")]
    pub first_byte_timeout_secs: f64,
    /// Seconds allowed between two frames before the stream counts as stalled.
    #[serde(default = "default_stream_timeout")]
    pub idle_timeout_secs: f64,
    /// Retries of a failed request (connect error, 408, 429, 5xx) before any output.
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    /// First backoff, doubled each retry, with jitter.
    #[serde(default = "default_retry_base")]
    pub retry_base_secs: f64,
    /// The longest wait between two tries, `Retry-After` included.
    #[serde(default = "default_retry_max")]
    pub retry_max_secs: f64,
    /// Speak HTTP/2 to this provider: its streams share connections instead of holding one
    /// each (negotiated by ALPN over `https`, with prior knowledge over plain `http`). Off by
    /// default: one HTTP/2 connection carries only as many streams at once as the server
    /// allows (often 100 to 250), and further requests wait for a free one.
    #[serde(default)]
    pub http2: bool,
    /// Options of the built-in mock model (`kind = "mock"` only).
    #[serde(flatten)]
    pub mock: MockSettings,
}

/// The scripted mock model: deterministic, so tests and demos can rely on what it says.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default)]
pub struct MockSettings {
    /// Characters per streamed text or thinking chunk.
    pub chunk_chars: usize,
    /// Pause between chunks, in milliseconds.
    pub delay_ms: u64,
    /// Whether the default answer starts with a thinking section.
    pub thinking: bool,
    /// Scripted answers, first match wins; the default answer echoes the message.
    pub rules: Vec<MockRule>,
}

impl Default for MockSettings {
    fn default() -> Self {
        Self { chunk_chars: 12, delay_ms: 15, thinking: true, rules: Vec::new() }
    }
}

/// One scripted answer: used when the user's message contains `when`.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct MockRule {
    pub when: String,
    #[serde(default)]
    pub text: String,
    #[serde(default)]
    pub thinking: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ProfileSettings {
    pub provider: String,
    pub model: String,
    #[serde(default)]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub enable_thinking: bool,
    #[serde(default)]
    pub thinking_budget: Option<u32>,
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    #[serde(default)]
    pub context_limit: Option<u32>,
    #[serde(default = "default_max_iterations")]
    pub max_iterations: u32,
    #[serde(default = "all_tools")]
    pub tools: Vec<String>,
}

fn default_connect_timeout() -> f64 {
    10.0
}

fn default_stream_timeout() -> f64 {
    120.0
}

fn default_max_retries() -> u32 {
    2
}

fn default_retry_base() -> f64 {
    0.5
}

fn default_retry_max() -> f64 {
    20.0
}

fn default_max_iterations() -> u32 {
    5
}

fn all_tools() -> Vec<String> {
    vec!["*".to_owned()]
}

/// A secret string: deserialized as is, printed and serialized as `***`.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("***")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config: {0}")]
    Parse(#[from] Box<figment::Error>),
    #[error("config: {0}")]
    Invalid(String),
}

impl Settings {
    /// Loads the layered configuration; `file` is `--config` / `CHATD_CONFIG`.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut figment = Figment::new().merge(Toml::string(DEFAULT_TOML)).merge(Toml::file("config/local.toml"));
        if let Some(file) = file {
            if !file.exists() {
                return Err(ConfigError::Invalid(format!("config file {} does not exist", file.display())));
            }
            figment = figment.merge(Toml::file(file));
        }
        Self::from_figment(figment.merge(Env::prefixed("CHATD_").split("__")))
    }

    /// Builds settings from a figment (tests layer their own values this way).
    pub fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let mut settings: Settings = figment.extract().map_err(Box::new)?;
        settings.resolve()?;
        Ok(settings)
    }

    /// The defaults with each TOML text layered on top, in order.
    pub fn from_layers(layers: &[&str]) -> Result<Self, ConfigError> {
        let figment = layers
            .iter()
            .fold(Figment::new().merge(Toml::string(DEFAULT_TOML)), |f, layer| f.merge(Toml::string(layer)));
        Self::from_figment(figment)
    }

    /// The defaults alone, with `overrides` (TOML text) on top.
    pub fn with_overrides(overrides: &str) -> Result<Self, ConfigError> {
        Self::from_figment(Figment::new().merge(Toml::string(DEFAULT_TOML)).merge(Toml::string(overrides)))
    }

    /// Fills secrets from the environment and files, adds the mock model when nothing is
    /// configured, and checks that every reference points somewhere.
    fn resolve(&mut self) -> Result<(), ConfigError> {
        if self.profiles.is_empty() {
            self.providers.entry(MOCK_ID.to_owned()).or_insert_with(|| ProviderSettings {
                kind: ProviderKind::Mock,
                base_url: None,
                api_key_env: None,
                api_key_file: None,
                api_key: None,
                connect_timeout_secs: default_connect_timeout(),
                first_byte_timeout_secs: default_stream_timeout(),
                idle_timeout_secs: default_stream_timeout(),
                max_retries: default_max_retries(),
                retry_base_secs: default_retry_base(),
                retry_max_secs: default_retry_max(),
                http2: false,
                mock: MockSettings::default(),
            });
            self.profiles.insert(
                self.chat.default_profile.clone(),
                ProfileSettings {
                    provider: MOCK_ID.to_owned(),
                    model: "mock-1".to_owned(),
                    system_prompt: Some("You are a helpful assistant.".to_owned()),
                    temperature: None,
                    max_tokens: None,
                    enable_thinking: true,
                    thinking_budget: None,
                    reasoning_effort: None,
                    context_limit: None,
                    max_iterations: default_max_iterations(),
                    tools: all_tools(),
                },
            );
        }
        for (id, provider) in &mut self.providers {
            provider.api_key = read_api_key(id, provider)?;
        }
        for (id, profile) in &self.profiles {
            if !self.providers.contains_key(&profile.provider) {
                return Err(ConfigError::Invalid(format!(
                    "profiles.{id}.provider names unknown provider '{}'",
                    profile.provider
                )));
            }
            if profile.model.trim().is_empty() {
                return Err(ConfigError::Invalid(format!("profiles.{id}.model is empty")));
            }
        }
        if !self.profiles.contains_key(&self.chat.default_profile) {
            return Err(ConfigError::Invalid(format!(
                "chat.default_profile '{}' is not a configured profile",
                self.chat.default_profile
            )));
        }
        if let Some(path) = &self.auth.tokens_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ConfigError::Invalid(format!("auth.tokens_file {}: {e}", path.display())))?;
            for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
                let mut parts = line.split_whitespace();
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(token), Some(user), None) => {
                        self.auth.tokens.insert(token.to_owned(), user.to_owned());
                    }
                    _ => {
                        return Err(ConfigError::Invalid(format!(
                            "auth.tokens_file {}: each line must be `token user`",
                            path.display()
                        )));
                    }
                }
            }
        }
        if self.auth.mode == AuthMode::Jwt {
            let jwt = &mut self.auth.jwt;
            let read = |what: &str, path: &Path| {
                std::fs::read_to_string(path)
                    .map_err(|e| ConfigError::Invalid(format!("auth.jwt.{what} {}: {e}", path.display())))
            };
            if let Some(path) = &jwt.public_key_file {
                jwt.public_key_pem = Some(read("public_key_file", path)?);
            } else if let Some(path) = &jwt.secret_file {
                jwt.secret = Some(Secret::new(read("secret_file", path)?.trim()));
            } else if let Some(var) = &jwt.secret_env {
                jwt.secret = std::env::var(var).ok().filter(|s| !s.is_empty()).map(Secret::new);
            }
            if jwt.secret.is_none() && jwt.public_key_pem.is_none() {
                return Err(ConfigError::Invalid(
                    "auth.mode = \"jwt\" needs auth.jwt.public_key_file, secret_file or secret_env (set)".to_owned(),
                ));
            }
        }
        if self.auth.mode == AuthMode::Token && self.auth.tokens.is_empty() {
            return Err(ConfigError::Invalid(
                "auth.mode = \"token\" needs [auth.tokens] or auth.tokens_file".to_owned(),
            ));
        }
        if self.stream.flush_max_events == 0 || self.limits.max_page_size == 0 {
            return Err(ConfigError::Invalid(
                "stream.flush_max_events and limits.max_page_size must be at least 1".to_owned(),
            ));
        }
        Ok(())
    }
}

fn read_api_key(id: &str, provider: &ProviderSettings) -> Result<Option<Secret>, ConfigError> {
    if let Some(path) = &provider.api_key_file {
        let key = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Invalid(format!("providers.{id}.api_key_file {}: {e}", path.display())))?;
        return Ok(Some(Secret::new(key.trim())));
    }
    Ok(provider
        .api_key_env
        .as_deref()
        .and_then(|var| std::env::var(var).ok())
        .filter(|key| !key.is_empty())
        .map(Secret::new))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let mut settings = Settings::with_overrides("[database]\nurl = \"postgres://u:hunter2@db/chat\"").unwrap();
        settings.auth.tokens.insert("tok-hunter2".into(), "alice".into());
        let debug = format!("{settings:?}");
        let json = serde_json::to_string(&settings).unwrap();
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(!json.contains("hunter2"), "{json}");
        assert_eq!(settings.database.url.expose(), "postgres://u:hunter2@db/chat");
    }

    #[test]
    fn no_profiles_means_the_mock_default() {
        let settings = Settings::with_overrides("").unwrap();
        let profile = &settings.profiles["default"];
        assert_eq!(settings.providers[&profile.provider].kind, ProviderKind::Mock);
    }

    #[test]
    fn the_contract_example_loads() {
        let settings = Settings::with_overrides(
            r#"
            [providers.local]
            kind = "openai_compatible"
            base_url = "http://127.0.0.1:11434/v1"
            [providers.claude]
            kind = "anthropic"
            api_key_env = "CHATD_TEST_SURELY_UNSET_KEY"
            [profiles.default]
            provider = "local"
            model = "qwen3:0.6b"
            system_prompt = "You are a helpful assistant."
            max_iterations = 5
            context_limit = 32768
            tools = ["*"]
            [profiles.sonnet]
            provider = "claude"
            model = "claude-sonnet-4-5"
            enable_thinking = true
            thinking_budget = 4000
            "#,
        )
        .unwrap();
        assert_eq!(settings.profiles["sonnet"].thinking_budget, Some(4000));
        assert!(!settings.providers.contains_key(MOCK_ID));
        assert!(settings.providers["claude"].api_key.is_none());
    }

    #[test]
    fn a_profile_with_an_unknown_provider_is_refused() {
        let err = Settings::with_overrides("[profiles.default]\nprovider = \"nope\"\nmodel = \"m\"").unwrap_err();
        assert!(err.to_string().contains("unknown provider 'nope'"), "{err}");
    }

    #[test]
    fn token_mode_needs_tokens() {
        let err = Settings::with_overrides("[auth]\nmode = \"token\"").unwrap_err();
        assert!(err.to_string().contains("auth.tokens"), "{err}");
    }
}
