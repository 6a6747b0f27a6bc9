//! Model providers behind one [`LlmProvider`] trait: a request in, a stream of
//! [`ProviderEvent`]s out. One file per wire format. Providers know nothing of HTTP handlers,
//! the store or the client's events; dropping the stream drops the provider connection.

mod anthropic;
mod google;
mod input;
mod mock;
mod openai;
pub mod sse;
pub mod transport;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::stream::BoxStream;

use crate::config::{ProviderKind, Settings};
use crate::domain::Usage;

pub use anthropic::AnthropicProvider;
pub use google::GoogleProvider;
pub use input::{FileContent, InputFile, InputMessage, ModelRequest, ToolSpec};
pub use mock::{MockProvider, without_directives};
pub use openai::OpenAiProvider;

/// One thing a provider said, already decoded from its wire format.
#[derive(Debug, Clone, PartialEq)]
pub enum ProviderEvent {
    Text(crate::events::Text),
    Thinking(crate::events::Text),
    /// Opaque proof of a thinking block, to be sent back in later turns (Anthropic).
    ThinkingSignature(String),
    ToolCallStart {
        index: u32,
        id: String,
        name: String,
    },
    ToolCallDelta {
        index: u32,
        arguments: String,
    },
    ToolCallEnd {
        index: u32,
    },
    Usage(Usage),
    /// The provider's terminal frame, with its reason (`stop`, `tool_calls`, `length`, …).
    Finish(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderErrorKind {
    /// The provider refused the credentials (HTTP 401/403).
    Unauthorized,
    /// HTTP 429 after retries.
    RateLimited,
    /// HTTP 5xx, an error frame, or a model error.
    Unavailable,
    /// Could not connect, or timed out.
    Network,
    /// A frame that does not parse, or a stream that ended without its terminal frame.
    Parse,
}

/// A failed model call, mapped onto the contract's error codes.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ProviderError {
    pub kind: ProviderErrorKind,
    pub message: String,
    /// Whether sending the same request again may succeed.
    pub retryable: bool,
    pub retry_after: Option<Duration>,
}

impl ProviderError {
    pub fn new(kind: ProviderErrorKind, message: impl Into<String>) -> Self {
        let retryable = !matches!(kind, ProviderErrorKind::Unauthorized | ProviderErrorKind::Parse);
        Self { kind, message: message.into(), retryable, retry_after: None }
    }

    /// The contract §1 code a client sees.
    pub fn code(&self) -> &'static str {
        match self.kind {
            ProviderErrorKind::Unauthorized => "UNAUTHORIZED",
            ProviderErrorKind::RateLimited => "RATE_LIMITED",
            ProviderErrorKind::Unavailable | ProviderErrorKind::Parse => "SERVICE_UNAVAILABLE",
            ProviderErrorKind::Network => "NETWORK_ERROR",
        }
    }
}

pub type ProviderStream = BoxStream<'static, Result<ProviderEvent, ProviderError>>;

impl ProviderError {
    /// The same error with the API key, and anything shaped like a key, blotted out of its
    /// message: providers echo keys in their errors ("Incorrect API key provided: sk-…").
    pub fn redacted<'k>(mut self, keys: impl IntoIterator<Item = &'k crate::config::Secret>) -> Self {
        for key in keys.into_iter().map(|k| k.expose()).filter(|k| !k.is_empty()) {
            self.message = self.message.replace(key, "***");
        }
        self.message = self
            .message
            .split(' ')
            .map(|word| if word.starts_with("sk-") || word.starts_with("AIza") { "***" } else { word })
            .collect::<Vec<_>>()
            .join(" ");
        self
    }
}

#[async_trait]
pub trait LlmProvider: Send + Sync {
    /// Starts a model call. Errors before the first event come back here; later ones in
    /// the stream.
    async fn stream(&self, request: &ModelRequest) -> Result<ProviderStream, ProviderError>;
}

/// The configured providers by id.
#[derive(Clone, Default)]
pub struct Providers {
    by_id: HashMap<String, Arc<dyn LlmProvider>>,
}

impl Providers {
    pub fn from_settings(settings: &Settings) -> Self {
        let by_id = settings
            .providers
            .iter()
            .map(|(id, provider)| {
                if !provider.api_key_envs.is_empty() && provider.api_keys.is_empty() {
                    let vars = provider.api_key_envs.join(", ");
                    tracing::warn!(
                        provider = %id,
                        "providers.{id}.api_key_envs names {vars}, none of which is set: its profiles fail until one is set and chatd restarted"
                    );
                    let missing: Arc<dyn LlmProvider> = Arc::new(MissingKey { id: id.clone(), var: vars });
                    return (id.clone(), missing);
                }
                if let (Some(var), None) = (&provider.api_key_env, &provider.api_key) {
                    tracing::warn!(
                        provider = %id,
                        "providers.{id}.api_key_env names {var}, which is not set: its profiles fail until it is set and chatd restarted"
                    );
                    let missing: Arc<dyn LlmProvider> = Arc::new(MissingKey { id: id.clone(), var: var.clone() });
                    return (id.clone(), missing);
                }
                let adapter: Arc<dyn LlmProvider> = match provider.kind {
                    ProviderKind::Mock => Arc::new(MockProvider::new(provider.mock())),
                    ProviderKind::Anthropic => Arc::new(AnthropicProvider::new(provider)),
                    ProviderKind::Openai | ProviderKind::OpenaiCompatible => Arc::new(OpenAiProvider::new(provider)),
                    ProviderKind::Google => Arc::new(GoogleProvider::new(provider)),
                };
                (id.clone(), adapter)
            })
            .collect();
        Self { by_id }
    }

    pub fn get(&self, id: &str) -> Option<Arc<dyn LlmProvider>> {
        self.by_id.get(id).cloned()
    }

    /// Replaces or adds one provider (tests and embedders plug their own in this way).
    pub fn insert(&mut self, id: impl Into<String>, provider: Arc<dyn LlmProvider>) {
        self.by_id.insert(id.into(), provider);
    }
}

/// A provider whose `api_key_env` names a variable that was not set at start: every call
/// fails at once, saying which variable to set, instead of reaching the provider without a
/// key.
struct MissingKey {
    id: String,
    var: String,
}

#[async_trait]
impl LlmProvider for MissingKey {
    async fn stream(&self, _request: &ModelRequest) -> Result<ProviderStream, ProviderError> {
        Err(ProviderError::new(
            ProviderErrorKind::Unauthorized,
            format!(
                "provider '{}' has no API key: set the environment variable {} (its api_key_env) and restart chatd",
                self.id, self.var
            ),
        ))
    }
}

/// Appends `items` as a message `{"role": role, field: items}`, or onto the previous message
/// when it has the same role: Anthropic and Gemini want the roles to alternate, and a turn's
/// tool results followed by the user's next message are both "user".
fn push_merged(messages: &mut Vec<serde_json::Value>, role: &str, field: &str, items: Vec<serde_json::Value>) {
    if items.is_empty() {
        return;
    }
    if let Some(last) = messages.last_mut().filter(|m| m["role"] == role) {
        if let Some(existing) = last[field].as_array_mut() {
            existing.extend(items);
            return;
        }
    }
    messages.push(serde_json::json!({"role": role, field: items}));
}

/// The three streaming wire formats chatd speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireFormat {
    OpenAi,
    Anthropic,
    Google,
}

/// Decodes a raw SSE body of `format`, split into chunks anywhere (for tests and benchmarks;
/// the adapters do the same on their HTTP responses).
pub fn decode_sse<S, E>(format: WireFormat, bytes: S) -> ProviderStream
where
    S: futures_util::Stream<Item = Result<bytes::Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let forever = Duration::from_secs(3600);
    use futures_util::StreamExt;
    let keys = Vec::new();
    match format {
        WireFormat::OpenAi => transport::decode(bytes, openai::ChunkDecoder::default(), forever, forever, keys).boxed(),
        WireFormat::Anthropic => {
            transport::decode(bytes, anthropic::MessageDecoder::default(), forever, forever, keys).boxed()
        }
        WireFormat::Google => {
            transport::decode(bytes, google::ResponseDecoder::default(), forever, forever, keys).boxed()
        }
    }
}
