//! The sections of what chatd reports to the operator's other systems (CONTRACT.md §18):
//! webhooks and the OTLP export of traces.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Secret;

/// `webhooks.*`: how deliveries are tried, and beside those keys, one table per endpoint
/// (`webhooks.<id>`).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct WebhooksSettings {
    /// Seconds before the second attempt; each later wait doubles, with jitter.
    #[serde(default = "default_retry_base")]
    pub retry_base_secs: f64,
    /// Attempts before a delivery is `failed`.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Seconds to connect to a receiver.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_secs: f64,
    /// Seconds a whole attempt may take (connect, send, the receiver's answer).
    #[serde(default = "default_timeout")]
    pub timeout_secs: f64,
    /// Deliveries in flight at once, per process.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// The endpoints, by id.
    #[serde(flatten)]
    pub endpoints: BTreeMap<String, WebhookSettings>,
}

impl Default for WebhooksSettings {
    fn default() -> Self {
        Self {
            retry_base_secs: default_retry_base(),
            max_attempts: default_max_attempts(),
            connect_timeout_secs: default_connect_timeout(),
            timeout_secs: default_timeout(),
            concurrency: default_concurrency(),
            endpoints: BTreeMap::new(),
        }
    }
}

impl WebhooksSettings {
    pub fn retry_base(&self) -> Duration {
        Duration::try_from_secs_f64(self.retry_base_secs).unwrap_or(Duration::from_secs(5))
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.connect_timeout_secs).unwrap_or(Duration::from_secs(5))
    }

    pub fn timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.timeout_secs).unwrap_or(Duration::from_secs(15))
    }

    /// What is wrong with these settings, naming the key.
    pub fn check(&self) -> Result<(), String> {
        if !(self.retry_base_secs > 0.0 && self.retry_base_secs.is_finite()) {
            return Err(format!("webhooks.retry_base_secs ({}) must be above 0", self.retry_base_secs));
        }
        if self.max_attempts == 0 {
            return Err("webhooks.max_attempts must be at least 1".into());
        }
        if self.concurrency == 0 {
            return Err("webhooks.concurrency must be at least 1".into());
        }
        for (key, value) in [("connect_timeout_secs", self.connect_timeout_secs), ("timeout_secs", self.timeout_secs)] {
            if !(value > 0.0 && value.is_finite()) {
                return Err(format!("webhooks.{key} ({value}) must be above 0"));
            }
        }
        for (id, endpoint) in &self.endpoints {
            let url = url::Url::parse(&endpoint.url)
                .map_err(|e| format!("webhooks.{id}.url ({}) is not a URL: {e}", endpoint.url))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(format!("webhooks.{id}.url ({}) must be http:// or https://", endpoint.url));
            }
            if endpoint.events.is_empty() {
                return Err(format!("webhooks.{id}.events is empty: name the events it takes"));
            }
        }
        Ok(())
    }

    /// Reads each endpoint's secret from its variable (or file): one that is missing or not
    /// a Standard Webhooks secret stops the start, naming its key.
    pub fn resolve_secrets(&mut self) -> Result<(), String> {
        for (id, endpoint) in &mut self.endpoints {
            let secret = match (&endpoint.secret_env, &endpoint.secret_file) {
                (Some(var), None) => std::env::var(var)
                    .ok()
                    .filter(|s| !s.trim().is_empty())
                    .ok_or_else(|| format!("webhooks.{id}.secret_env names {var}, which is not set"))?,
                (None, Some(file)) => std::fs::read_to_string(file)
                    .map_err(|e| format!("webhooks.{id}.secret_file ({}) cannot be read: {e}", file.display()))?,
                _ => return Err(format!("webhooks.{id} needs one of secret_env and secret_file")),
            };
            let secret = secret.trim().to_owned();
            standardwebhooks::Webhook::new(&secret)
                .map_err(|e| format!("webhooks.{id}: its secret is not whsec_<base64> ({e})"))?;
            endpoint.secret = Some(Secret::new(secret));
        }
        Ok(())
    }
}

/// An endpoint (`webhooks.<id>`): where its messages go, which it takes, and where its
/// secret is (`whsec_<base64>`, as the Standard Webhooks libraries take it): the
/// environment variable `secret_env`, or the file `secret_file`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSettings {
    pub url: String,
    pub events: Vec<WebhookEvent>,
    #[serde(default)]
    pub secret_env: Option<String>,
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// Filled at load time from `secret_env` / `secret_file`; never read from config text.
    #[serde(skip_deserializing)]
    pub secret: Option<Secret>,
}

/// What a webhook reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
pub enum WebhookEvent {
    #[serde(rename = "run.completed")]
    RunCompleted,
    #[serde(rename = "run.failed")]
    RunFailed,
    #[serde(rename = "run.cancelled")]
    RunCancelled,
    #[serde(rename = "run.waiting")]
    RunWaiting,
    #[serde(rename = "comparison.voted")]
    ComparisonVoted,
    #[serde(rename = "feedback.created")]
    FeedbackCreated,
}

impl WebhookEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RunCompleted => "run.completed",
            Self::RunFailed => "run.failed",
            Self::RunCancelled => "run.cancelled",
            Self::RunWaiting => "run.waiting",
            Self::ComparisonVoted => "comparison.voted",
            Self::FeedbackCreated => "feedback.created",
        }
    }
}

/// `telemetry.*`: each run exported as an OpenTelemetry trace over OTLP/HTTP.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetrySettings {
    /// An OTLP/HTTP base URL (chatd posts to `<it>/v1/traces`), as
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`, which is taken when this is not set (and
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, a whole URL, over both). None: nothing is
    /// exported.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
}

fn default_retry_base() -> f64 {
    5.0
}

fn default_max_attempts() -> u32 {
    8
}

fn default_connect_timeout() -> f64 {
    5.0
}

fn default_timeout() -> f64 {
    15.0
}

fn default_concurrency() -> usize {
    8
}
