//! The sections of the settings, one type each, with their defaults (the values in
//! `config/default.toml` are the documented ones; these fill what a layer leaves out).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Secret;

/// A URL with its password, if it has one, as `***`.
fn password_masked<S: serde::Serializer>(url: &Secret, serializer: S) -> Result<S::Ok, S::Error> {
    match url::Url::parse(url.expose()) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            serializer.serialize_str(parsed.as_str())
        }
        Ok(_) => serializer.serialize_str(url.expose()),
        Err(_) => serializer.serialize_str("***"),
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
pub struct DatabaseSettings {
    /// Printed (`check-config`) with its password masked, the rest shown: a SQLite path is
    /// not a secret.
    #[serde(serialize_with = "password_masked")]
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
#[serde(deny_unknown_fields)]
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
    /// Users who may read every user's usage (`GET /api/usage?user=`, `group_by=user`).
    #[serde(default)]
    pub admins: Vec<String>,
}

/// Mode `jwt`: bearer JWTs signed with HS256 (a shared secret) or RS256 (a public key);
/// the user is `sub`; `exp` is required; `aud` and `iss` are checked when configured.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
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
    /// Tokens (input and output) one user may spend per UTC day (CONTRACT.md §18); none:
    /// no budget.
    #[serde(default)]
    pub budget_tokens_per_day: Option<u64>,
    /// US dollars one user may spend per calendar month (UTC); none: no budget.
    #[serde(default)]
    pub budget_usd_per_month: Option<f64>,
    /// Budgets of one user, each replacing the general one where given.
    #[serde(default)]
    pub budgets: BTreeMap<String, Budget>,
}

impl Limits {
    /// `user`'s budgets: tokens per day, US dollars per month.
    pub fn budget_for(&self, user: &str) -> (Option<u64>, Option<f64>) {
        let own = self.budgets.get(user);
        (
            own.and_then(|b| b.tokens_per_day).or(self.budget_tokens_per_day),
            own.and_then(|b| b.usd_per_month).or(self.budget_usd_per_month),
        )
    }
}

/// One user's budgets (`limits.budgets.<user>`).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    pub tokens_per_day: Option<u64>,
    pub usd_per_month: Option<f64>,
}

/// A model's price (`pricing.<model>`), US dollars per million tokens: it overrides the
/// price table's, or prices a model the table lacks. Cache reads and writes cost what input
/// does where not given.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPricing {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
    pub cache_read_per_mtok: Option<f64>,
    pub cache_write_per_mtok: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnDisconnect {
    Continue,
    Cancel,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StreamSettings {
    pub keepalive_secs: u64,
    pub flush_interval_ms: u64,
    pub flush_max_events: usize,
    pub on_disconnect: OnDisconnect,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
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
    /// What a new message does while a run of its conversation is going (CONTRACT.md §16).
    #[serde(default = "default_multitask")]
    pub multitask: Multitask,
}

/// Runs that outlive their server (CONTRACT.md §19).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RunsSettings {
    /// Seconds between a replica's heartbeats: one row per replica, whatever its runs.
    pub heartbeat_secs: f64,
    /// Seconds without a heartbeat after which another replica takes a replica's running
    /// runs over and continues them from their last completed step.
    pub takeover_after_secs: f64,
    /// A run found `running` at start-up (its process died) is continued from its last
    /// completed step; false: it is marked `interrupted` (CONTRACT.md §9).
    pub continue_after_restart: bool,
}

impl Default for RunsSettings {
    fn default() -> Self {
        Self { heartbeat_secs: 2.0, takeover_after_secs: 10.0, continue_after_restart: true }
    }
}

impl RunsSettings {
    pub fn heartbeat(&self) -> std::time::Duration {
        std::time::Duration::try_from_secs_f64(self.heartbeat_secs).unwrap_or(std::time::Duration::from_secs(2))
    }

    pub fn takeover_after(&self) -> std::time::Duration {
        std::time::Duration::try_from_secs_f64(self.takeover_after_secs).unwrap_or(std::time::Duration::from_secs(10))
    }
}

/// What a new message does while a run of the same conversation is going (CONTRACT.md §16).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Multitask {
    /// 409, naming the going run; the message is not stored.
    Reject,
    /// The new run is queued: its stream opens at once with `status` "Queued", and it starts
    /// once the going runs (and those queued before it) have ended, on their answers.
    Enqueue,
    /// The going run is cancelled (its partial answer kept) and the new one starts on it.
    Interrupt,
    /// As `interrupt`, and the cancelled partial answer is deleted.
    Rollback,
}

pub(super) fn default_multitask() -> Multitask {
    Multitask::Enqueue
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

impl ProviderKind {
    /// The largest file the provider takes inline, where it documents one below
    /// `files.max_bytes`: Anthropic refuses images over 5 MB; Gemini a request over 20 MB,
    /// which a file's base64 must fit in.
    pub fn max_inline_bytes(self, image: bool) -> Option<u64> {
        match self {
            ProviderKind::Anthropic if image => Some(5_000_000),
            ProviderKind::Google => Some(14_000_000),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderSettings {
    pub kind: ProviderKind,
    #[serde(default)]
    pub base_url: Option<String>,
    /// Name of the environment variable holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Names of environment variables holding several keys of the provider (CONTRACT.md
    /// §19): a key that gets a 429 rests for its `Retry-After` while the others serve.
    #[serde(default)]
    pub api_key_envs: Vec<String>,
    /// A file holding the API key (e.g. a mounted secret).
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// Filled at load time from `api_key_env` / `api_key_file`; never read from config text.
    #[serde(skip)]
    pub api_key: Option<Secret>,
    /// Filled at load time from `api_key_envs` (the variables that are set); never read
    /// from config text.
    #[serde(skip)]
    pub api_keys: Vec<Secret>,
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
    /// With `http2`, how many connections the provider's calls are spread over, in turn:
    /// each carries its share of the streams, read by a task of its own (one connection's
    /// task relays every stream's frames, on one core at a time).
    #[serde(default = "default_http2_connections")]
    pub http2_connections: usize,
    /// The mock model's options (`kind = "mock"` only; see [`MockSettings`]).
    #[serde(default)]
    pub chunk_chars: Option<usize>,
    #[serde(default)]
    pub delay_ms: Option<u64>,
    #[serde(default)]
    pub thinking: Option<bool>,
    #[serde(default)]
    pub rules: Vec<MockRule>,
}

impl ProviderSettings {
    /// The mock model's options, with the defaults for those not set.
    pub fn mock(&self) -> MockSettings {
        let defaults = MockSettings::default();
        MockSettings {
            chunk_chars: self.chunk_chars.unwrap_or(defaults.chunk_chars),
            delay_ms: self.delay_ms.unwrap_or(defaults.delay_ms),
            thinking: self.thinking.unwrap_or(defaults.thinking),
            rules: self.rules.clone(),
        }
    }

    /// The mock's options that are set, by name (a provider of another kind refuses them).
    pub(super) fn mock_keys_set(&self) -> Vec<&'static str> {
        [
            ("chunk_chars", self.chunk_chars.is_some()),
            ("delay_ms", self.delay_ms.is_some()),
            ("thinking", self.thinking.is_some()),
            ("rules", !self.rules.is_empty()),
        ]
        .into_iter()
        .filter_map(|(key, set)| set.then_some(key))
        .collect()
    }
}

/// The scripted mock model: deterministic, so tests and demos can rely on what it says. Set
/// in its provider's section (`chunk_chars`, `delay_ms`, `thinking`, `[[providers.<id>.rules]]`).
#[derive(Debug, Clone)]
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
#[serde(deny_unknown_fields)]
pub struct MockRule {
    pub when: String,
    #[serde(default)]
    pub text: String,
    #[serde(default)]
    pub thinking: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSettings {
    pub provider: String,
    pub model: String,
    #[serde(default)]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub temperature: Option<f64>,
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
    /// Tools that need approval in this profile, beside `tools.require_approval`.
    #[serde(default)]
    pub require_approval: Vec<String>,
    /// What the model takes in a message (CONTRACT.md §14): `text` always; `image` and
    /// `pdf` only where the model reads them.
    #[serde(default = "text_only")]
    pub modalities: Vec<Modality>,
    /// Profiles whose models answer instead, tried in order, when a model call of this one
    /// fails after its retries with a retryable error (CONTRACT.md §19).
    #[serde(default)]
    pub fallbacks: Vec<String>,
    /// Whether requests mark their stable prefix for the provider's prompt cache
    /// (CONTRACT.md §21).
    #[serde(default)]
    pub prompt_cache: PromptCache,
    /// How long a cached prefix lives: `5m` or `1h` (Anthropic; OpenAI's retention).
    #[serde(default)]
    pub prompt_cache_ttl: CacheTtl,
}

/// A kind of attachment a profile's model takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Modality {
    /// Messages, and text files sent as text.
    Text,
    Image,
    Pdf,
}

pub(super) fn text_only() -> Vec<Modality> {
    vec![Modality::Text]
}

/// Attachments (CONTRACT.md §14): where their bytes are kept and what is accepted.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileSettings {
    /// `file://PATH` (a folder, created on first use) or `s3://bucket/prefix`.
    pub url: String,
    /// For `s3://`: an S3-compatible endpoint (`http://127.0.0.1:9000`), path-style.
    #[serde(default)]
    pub s3_endpoint: Option<String>,
    /// The largest file accepted, in bytes (413 past it).
    pub max_bytes: u64,
    /// Whether an attachment may name an `http(s)` URL for chatd to fetch.
    #[serde(default)]
    pub fetch_remote: bool,
    /// Seconds a remote fetch may take, all of it.
    #[serde(default = "default_fetch_timeout")]
    pub fetch_timeout_secs: f64,
    /// Attachments a message may carry.
    #[serde(default = "default_max_attachments")]
    pub max_per_message: usize,
}

fn default_fetch_timeout() -> f64 {
    10.0
}

fn default_max_attachments() -> usize {
    10
}

pub(super) fn default_connect_timeout() -> f64 {
    10.0
}

pub(super) fn default_stream_timeout() -> f64 {
    120.0
}

pub(super) fn default_http2_connections() -> usize {
    4
}

pub(super) fn default_max_retries() -> u32 {
    2
}

pub(super) fn default_retry_base() -> f64 {
    0.5
}

pub(super) fn default_retry_max() -> f64 {
    20.0
}

pub(super) fn default_max_iterations() -> u32 {
    5
}

pub(super) fn all_tools() -> Vec<String> {
    vec!["*".to_owned()]
}

/// `profiles.<id>.prompt_cache`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptCache {
    #[default]
    Auto,
    Off,
}

/// `profiles.<id>.prompt_cache_ttl`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum CacheTtl {
    #[default]
    #[serde(rename = "5m")]
    FiveMinutes,
    #[serde(rename = "1h")]
    OneHour,
}
