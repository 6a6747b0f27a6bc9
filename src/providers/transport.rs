//! What every HTTP adapter shares: sending with bounded retries (exponential backoff with
//! jitter, `Retry-After` honoured) before any output, mapping HTTP failures onto the
//! contract's codes, and driving a wire-format [`Decoder`] over the SSE frames with a
//! first-byte and an idle timeout. Cancellation is dropping the stream: the connection goes
//! with it.

use std::time::Duration;

use bytes::Bytes;
use eventsource_stream::{Event as SseFrame, Eventsource};
use futures_util::{Stream, StreamExt};
use reqwest::{RequestBuilder, Response, StatusCode};
use serde_json::Value;

use super::{ProviderError, ProviderErrorKind, ProviderEvent, ProviderStream};
use crate::config::{ProviderSettings, Secret};

/// One wire format's frame parser. It sees every SSE frame in order and says when the
/// provider's terminal frame has arrived.
pub trait Decoder: Send + 'static {
    /// Decodes one frame into `out`.
    fn frame(&mut self, frame: &SseFrame, out: &mut Vec<ProviderEvent>) -> Result<(), ProviderError>;
    /// Whether the terminal frame has been seen; after it nothing more is read.
    fn finished(&self) -> bool;
}

/// Timeouts and retry bounds of one provider.
#[derive(Debug, Clone)]
pub struct Transport {
    client: reqwest::Client,
    /// Blotted out of every error message and log line: providers echo keys in errors.
    api_key: Option<Secret>,
    max_retries: u32,
    retry_base: Duration,
    retry_max: Duration,
    first_byte: Duration,
    idle: Duration,
}

impl Transport {
    /// The transport to a provider whose API root is `base` (its `base_url` or the kind's
    /// default): with `http2`, a plain `http` root is spoken to with prior knowledge.
    pub fn new(settings: &ProviderSettings, base: &str) -> Self {
        let builder = reqwest::Client::builder()
            .connect_timeout(secs(settings.connect_timeout_secs))
            .user_agent(concat!("chatd/", env!("CARGO_PKG_VERSION")));
        let builder = match (settings.http2, base.starts_with("http:")) {
            (false, _) => builder.http1_only(),
            (true, true) => builder.http2_prior_knowledge(),
            (true, false) => builder,
        };
        let client = builder.build().expect("the TLS backend initialises");
        Self {
            client,
            api_key: settings.api_key.clone(),
            max_retries: settings.max_retries,
            retry_base: secs(settings.retry_base_secs),
            retry_max: secs(settings.retry_max_secs),
            first_byte: secs(settings.first_byte_timeout_secs),
            idle: secs(settings.idle_timeout_secs),
        }
    }

    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// Sends the request built by `build`, retrying connection failures, 408, 429 and 5xx
    /// with backoff; returns the first successful response.
    pub async fn send(&self, build: impl Fn() -> RequestBuilder) -> Result<Response, ProviderError> {
        let mut attempt = 0;
        loop {
            let error = match tokio::time::timeout(self.first_byte, build().send()).await {
                Ok(Ok(response)) if response.status().is_success() => return Ok(response),
                Ok(Ok(response)) => http_error(response, self.api_key.as_ref()).await,
                Ok(Err(e)) => {
                    let cause = std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default();
                    tracing::warn!(error = %e, cause, "provider request failed");
                    network_error()
                }
                Err(_) => network_error(),
            };
            if !error.retryable || attempt >= self.max_retries {
                return Err(error.redacted(self.api_key.as_ref()));
            }
            let backoff = self.backoff(attempt, error.retry_after);
            tracing::info!(
                code = error.code(),
                attempt,
                wait_ms = backoff.as_millis() as u64,
                "retrying provider call"
            );
            tokio::time::sleep(backoff).await;
            attempt += 1;
        }
    }

    /// The wait before retry `attempt` (from 0): the provider's `Retry-After` when it sent
    /// one, else exponential with full jitter; never above the configured maximum.
    fn backoff(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let wait = retry_after.unwrap_or_else(|| {
            let ceiling = self.retry_base.saturating_mul(2u32.saturating_pow(attempt));
            ceiling.mul_f64(0.5 + fastrand::f64() / 2.0)
        });
        wait.min(self.retry_max)
    }

    /// Decodes a successful response's SSE body with `decoder`.
    pub fn decode(&self, response: Response, decoder: impl Decoder) -> ProviderStream {
        let key = self.api_key.clone();
        decode(response.bytes_stream(), decoder, self.first_byte, self.idle)
            .map(move |event| event.map_err(|e| e.redacted(key.as_ref())))
            .boxed()
    }
}

fn secs(value: f64) -> Duration {
    Duration::try_from_secs_f64(value.max(0.0)).unwrap_or(Duration::MAX)
}

/// Cuts every chunk after each line feed, without copying. eventsource-stream copies what is
/// left of its buffer for each line it parses, so a large read holding many frames (an
/// HTTP/2 DATA frame carries up to 16 KiB) would cost time quadratic in its length; line by
/// line, what is left is at most a line.
fn lines<S, E>(bytes: S) -> impl Stream<Item = Result<Bytes, E>> + Send
where
    S: Stream<Item = Result<Bytes, E>> + Send,
    E: Send,
{
    bytes.flat_map(|chunk| {
        futures_util::stream::iter(match chunk {
            Ok(rest) => Cuts::Lines(rest),
            Err(e) => Cuts::Failed(Some(e)),
        })
    })
}

enum Cuts<E> {
    Lines(Bytes),
    Failed(Option<E>),
}

impl<E> Iterator for Cuts<E> {
    type Item = Result<Bytes, E>;

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Cuts::Lines(rest) if rest.is_empty() => None,
            Cuts::Lines(rest) => {
                let end = memchr::memchr(b'\n', rest).map_or(rest.len(), |i| i + 1);
                Some(Ok(rest.split_to(end)))
            }
            Cuts::Failed(e) => e.take().map(Err),
        }
    }
}

/// Runs `decoder` over an SSE byte stream. Frames may be split anywhere between chunks.
/// Ends after the terminal frame; a stream that stops before it is an error.
pub fn decode<S, E>(bytes: S, mut decoder: impl Decoder, first_byte: Duration, idle: Duration) -> ProviderStream
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    async_stream::stream! {
        let mut frames = Box::pin(lines(bytes).eventsource());
        let mut out = Vec::new();
        // One timer for the whole stream. A frame only notes the time; the timer, when it
        // fires, moves itself to `last frame + idle` if frames came meanwhile (re-arming a
        // timer for every frame cost more than decoding the frame).
        let stall = tokio::time::sleep(first_byte);
        tokio::pin!(stall);
        let mut last_frame: Option<tokio::time::Instant> = None;
        loop {
            let next = tokio::select! {
                biased;
                next = frames.next() => next,
                () = &mut stall => {
                    if let Some(at) = last_frame.filter(|at| at.elapsed() < idle) {
                        stall.as_mut().reset(later(at, idle));
                        continue;
                    }
                    let waited = if last_frame.is_some() { idle } else { first_byte };
                    tracing::warn!(after_ms = waited.as_millis() as u64, "provider stream stalled");
                    yield Err(network_error());
                    return;
                }
            };
            let now = tokio::time::Instant::now();
            if last_frame.replace(now).is_none() {
                stall.as_mut().reset(later(now, idle));
            }
            match next {
                Some(Ok(frame)) => {
                    let decoded = decoder.frame(&frame, &mut out);
                    for event in out.drain(..) {
                        yield Ok(event);
                    }
                    if let Err(error) = decoded {
                        yield Err(error);
                        return;
                    }
                    if decoder.finished() {
                        return;
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "provider stream broke");
                    yield Err(network_error());
                    return;
                }
                None => {
                    tracing::warn!("provider stream ended before its terminal frame");
                    yield Err(network_error());
                    return;
                }
            }
        }
    }
    .boxed()
}

/// `at + wait`, or a year from `at` for a wait too long to add (an unlimited timeout).
fn later(at: tokio::time::Instant, wait: Duration) -> tokio::time::Instant {
    at.checked_add(wait).unwrap_or_else(|| at + Duration::from_secs(365 * 24 * 3600))
}

pub fn network_error() -> ProviderError {
    ProviderError::new(ProviderErrorKind::Network, "Connection failed")
}

pub fn parse_error() -> ProviderError {
    ProviderError::new(ProviderErrorKind::Parse, "Failed to parse response")
}

/// Parses one frame's JSON (into a `Value`, or a typed frame borrowing from it), or fails
/// the run with "Failed to parse response".
pub fn json<'a, T: serde::Deserialize<'a>>(frame: &'a SseFrame) -> Result<T, ProviderError> {
    serde_json::from_str(&frame.data).map_err(|e| {
        tracing::warn!(error = %e, data = %truncate(&frame.data, 200), "unparsable provider frame");
        parse_error()
    })
}

/// Maps a non-success HTTP answer onto the contract: 401/403 → UNAUTHORIZED, 429 →
/// RATE_LIMITED (with `Retry-After`), 408/5xx → SERVICE_UNAVAILABLE (retryable), other 4xx →
/// SERVICE_UNAVAILABLE with the provider's message (not retryable).
pub async fn http_error(response: Response, key: Option<&Secret>) -> ProviderError {
    let status = response.status();
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|s| Duration::try_from_secs_f64(s).ok());
    let body = response.text().await.unwrap_or_default();
    let detail = ProviderError::new(ProviderErrorKind::Unavailable, provider_message(&body)).redacted(key).message;
    tracing::warn!(status = status.as_u16(), detail = %truncate(&detail, 300), "provider answered an error");
    let mut error = match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
            ProviderError::new(ProviderErrorKind::Unauthorized, "Invalid API key")
        }
        StatusCode::TOO_MANY_REQUESTS => ProviderError::new(ProviderErrorKind::RateLimited, "Rate limited, try again"),
        s if s.is_server_error() || s == StatusCode::REQUEST_TIMEOUT => {
            ProviderError::new(ProviderErrorKind::Unavailable, unavailable_message(&detail))
        }
        _ => ProviderError {
            retryable: false,
            ..ProviderError::new(ProviderErrorKind::Unavailable, unavailable_message(&detail))
        },
    };
    error.retry_after = retry_after;
    error
}

fn unavailable_message(detail: &str) -> String {
    if detail.is_empty() {
        "The model provider is unavailable".to_owned()
    } else {
        format!("Model error: {}", truncate(detail, 300))
    }
}

/// The human part of a provider's error body: `error.message` in all three APIs.
pub fn provider_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| body.trim().to_owned())
}

fn truncate(text: &str, max: usize) -> &str {
    match text.char_indices().nth(max) {
        Some((cut, _)) => &text[..cut],
        None => text,
    }
}

/// Joins a configured API root and a path without doubling or losing the slash.
pub fn join(base: &str, path: &str) -> String {
    format!("{}/{}", base.trim_end_matches('/'), path.trim_start_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn chunks_are_cut_after_each_line_feed_and_errors_pass_through() {
        let chunks = vec![Ok(Bytes::from("data: a\n\ndata: b")), Ok(Bytes::from("c\r\n\r\n")), Err("cut")];
        let pieces: Vec<Result<Bytes, &str>> = lines(futures_util::stream::iter(chunks)).collect().await;
        let expected = ["data: a\n", "\n", "data: b", "c\r\n", "\r\n"].map(|p| Ok(Bytes::from(p)));
        assert_eq!(pieces[..5], expected);
        assert_eq!(pieces[5], Err("cut"));
        assert_eq!(pieces.len(), 6);
    }
}
