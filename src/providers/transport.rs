//! What every HTTP adapter shares: sending with bounded retries (exponential backoff with
//! jitter, `Retry-After` honoured) before any output, mapping HTTP failures onto the
//! contract's codes, and driving a wire-format [`Decoder`] over the SSE frames with a
//! first-byte and an idle timeout. Cancellation is dropping the stream: the connection goes
//! with it.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{Stream, StreamExt, TryStreamExt};
use reqwest::{RequestBuilder, Response, StatusCode};
use serde_json::Value;

use super::sse::{Frame as SseFrame, Parser, Stop};
use super::{ProviderError, ProviderErrorKind, ProviderEvent, ProviderStream};
use crate::config::{ProviderSettings, Secret};

/// One wire format's frame parser. It sees every SSE frame in order and says when the
/// provider's terminal frame has arrived.
pub trait Decoder: Send + 'static {
    /// Decodes one frame into `out`.
    fn frame(&mut self, frame: &SseFrame<'_>, out: &mut VecDeque<ProviderEvent>) -> Result<(), ProviderError>;
    /// Whether the terminal frame has been seen; after it nothing more is read.
    fn finished(&self) -> bool;
}

/// How often, and after how long, a provider's failed calls are tried again
/// (`providers.<id>.max_retries`, `retry_base_secs`, `retry_max_secs`): by the transport
/// before any output, by the run for a call that failed after output (CONTRACT.md §19).
#[derive(Debug, Clone, Copy, Default)]
pub struct Retries {
    pub max: u32,
    base: Duration,
    ceiling: Duration,
}

impl Retries {
    pub fn of(settings: &ProviderSettings) -> Self {
        Self { max: settings.max_retries, base: secs(settings.retry_base_secs), ceiling: secs(settings.retry_max_secs) }
    }

    /// The wait before retry `attempt` (from 0): the provider's `Retry-After` when it sent
    /// one, else exponential with full jitter; never above the configured maximum.
    pub fn wait(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let wait = retry_after.unwrap_or_else(|| {
            let ceiling = self.base.saturating_mul(2u32.saturating_pow(attempt));
            ceiling.mul_f64(0.5 + fastrand::f64() / 2.0)
        });
        wait.min(self.ceiling)
    }
}

/// A provider's API keys (`api_key_envs`, or its one key): each call takes the first that
/// is not resting; a key that got a 429 rests for the `Retry-After` the provider sent (or
/// the retry's wait) while the others serve (CONTRACT.md §19).
#[derive(Debug, Clone, Default)]
pub struct Keys {
    keys: Vec<Secret>,
    resting: Arc<Mutex<Vec<Option<Instant>>>>,
}

impl Keys {
    pub fn of(settings: &ProviderSettings) -> Self {
        let keys: Vec<Secret> = if settings.api_keys.is_empty() {
            settings.api_key.iter().cloned().collect()
        } else {
            settings.api_keys.clone()
        };
        Self { resting: Arc::new(Mutex::new(vec![None; keys.len()])), keys }
    }

    /// The key a call takes now, by its place: the first not resting, else the one whose
    /// rest ends first. `None`: the provider has no key.
    fn pick(&self) -> Option<usize> {
        let resting = self.resting.lock().expect("keys lock");
        let now = Instant::now();
        let free = resting.iter().position(|until| until.is_none_or(|until| until <= now));
        free.or_else(|| resting.iter().enumerate().min_by_key(|(_, until)| *until).map(|(i, _)| i))
    }

    /// Rests key `index` for `pause`; whether another key is free meanwhile.
    fn rest(&self, index: usize, pause: Duration) -> bool {
        let mut resting = self.resting.lock().expect("keys lock");
        let now = Instant::now();
        resting[index] = Some(now + pause);
        resting.iter().any(|until| until.is_none_or(|until| until <= now))
    }

    fn get(&self, index: Option<usize>) -> Option<&Secret> {
        index.map(|i| &self.keys[i])
    }
}

/// A broken body's error with what caused it: reqwest's own words ("error decoding
/// response body") say nothing of why; its sources (hyper's, h2's) do, and hold no key.
struct WithCauses(String, String);

impl std::fmt::Display for WithCauses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.1.is_empty() { f.write_str(&self.0) } else { write!(f, "{}: {}", self.0, self.1) }
    }
}

/// The messages of `error`'s sources, joined.
fn causes(error: &dyn std::error::Error) -> String {
    let mut causes = Vec::new();
    let mut source = error.source();
    while let Some(inner) = source {
        causes.push(inner.to_string());
        source = inner.source();
    }
    causes.join(": ")
}

/// An HTTP/2 provider connection's receive window (see [`Transport::new`]).
const HTTP2_CONNECTION_WINDOW: u32 = 64 << 20;

/// Timeouts and retry bounds of one provider.
#[derive(Debug, Clone)]
pub struct Transport {
    /// One client, or over HTTP/2 `http2_connections` of them, each with its connection:
    /// calls take them in turn.
    clients: Vec<reqwest::Client>,
    turn: Arc<AtomicUsize>,
    /// Blotted out of every error message and log line: providers echo keys in errors.
    keys: Keys,
    retries: Retries,
    first_byte: Duration,
    idle: Duration,
}

impl Transport {
    /// The transport to a provider whose API root is `base` (its `base_url` or the kind's
    /// default): with `http2`, a plain `http` root is spoken to with prior knowledge.
    pub fn new(settings: &ProviderSettings, base: &str) -> Self {
        let client = || {
            let builder = reqwest::Client::builder()
                .connect_timeout(secs(settings.connect_timeout_secs))
                .user_agent(concat!("chatd/", env!("CARGO_PKG_VERSION")));
            let builder = match (settings.http2, base.starts_with("http:")) {
                (false, _) => builder.http1_only(),
                (true, true) => builder.http2_prior_knowledge(),
                (true, false) => builder,
            };
            // h2 closes a connection whose small DATA frames (a token each) pile up unread
            // past half its window (ENHANCE_YOUR_CALM, "too_many_data_frames"), failing every
            // stream on it: at 50,000 streams on four connections, a few seconds' lag did.
            // The default 5 MiB window allowed ~23,000 unread tokens a connection; this one
            // ~300,000. (Each stream's own window stays 2 MiB.)
            let builder = builder.http2_initial_connection_window_size(HTTP2_CONNECTION_WINDOW);
            builder.build().expect("the TLS backend initialises")
        };
        // HTTP/1.1's pool opens a connection per stream anyway.
        let connections = if settings.http2 { settings.http2_connections.max(1) } else { 1 };
        Self {
            clients: (0..connections).map(|_| client()).collect(),
            turn: Arc::default(),
            keys: Keys::of(settings),
            retries: Retries::of(settings),
            first_byte: secs(settings.first_byte_timeout_secs),
            idle: secs(settings.idle_timeout_secs),
        }
    }

    /// How long a body that is no stream (an error's) may take to read.
    fn error_body_within(&self) -> Duration {
        self.idle.min(ERROR_BODY_WITHIN)
    }

    /// The client of the next call.
    pub fn client(&self) -> &reqwest::Client {
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        &self.clients[turn % self.clients.len()]
    }

    /// Sends the request `build` makes with a key (the provider's next free one), retrying
    /// connection failures, 408, 429 and 5xx with backoff; returns the first successful
    /// response. A 429 rests its key; while another is free the retry does not wait.
    pub async fn send(&self, build: impl Fn(Option<&Secret>) -> RequestBuilder) -> Result<Response, ProviderError> {
        let mut attempt = 0;
        loop {
            let key = self.keys.pick();
            let error = match tokio::time::timeout(self.first_byte, build(self.keys.get(key)).send()).await {
                Ok(Ok(response)) if response.status().is_success() => return Ok(response),
                Ok(Ok(response)) => http_error(response, &self.keys.keys, self.error_body_within()).await,
                Ok(Err(e)) => {
                    let cause = std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default();
                    tracing::warn!(error = %e, cause, "provider request failed");
                    network_error()
                }
                Err(_) => network_error(),
            };
            if !error.retryable || attempt >= self.retries.max {
                return Err(error.redacted(&self.keys.keys));
            }
            let mut backoff = self.retries.wait(attempt, error.retry_after);
            if let (ProviderErrorKind::RateLimited, Some(key)) = (error.kind, key) {
                if self.keys.rest(key, error.retry_after.unwrap_or(backoff)) {
                    backoff = Duration::ZERO;
                }
            }
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

    /// Decodes a successful response's SSE body with `decoder`. A body that says it is
    /// JSON or HTML is no stream: a parse error (some servers answer errors with 200).
    pub fn decode(&self, response: Response, decoder: impl Decoder) -> ProviderStream {
        let key = self.keys.keys.clone();
        let content_type = response.headers().get(reqwest::header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
        if let Some(kind) = content_type.filter(|t| t.starts_with("application/json") || t.starts_with("text/html")) {
            let (kind, within) = (kind.to_owned(), self.error_body_within());
            return futures_util::stream::once(async move {
                let body = bounded_body(response, within).await;
                let detail = ProviderError::new(ProviderErrorKind::Parse, provider_message(&body)).redacted(&key).message;
                tracing::warn!(content_type = kind, detail = %truncate(&detail, 300), "provider answered 200 without a stream");
                Err(parse_error())
            })
            .boxed();
        }
        let bytes = response.bytes_stream().map_err(|e| WithCauses(e.to_string(), causes(&e)));
        decode(bytes, decoder, self.first_byte, self.idle, key).boxed()
    }
}

fn secs(value: f64) -> Duration {
    Duration::try_from_secs_f64(value.max(0.0)).unwrap_or(Duration::MAX)
}

/// Runs `decoder` over an SSE byte stream. Frames may be split anywhere between chunks.
/// Ends after the terminal frame; a stream that stops before it is an error. Errors say
/// none of `keys`.
pub fn decode<S, E>(
    bytes: S,
    decoder: impl Decoder,
    first_byte: Duration,
    idle: Duration,
    keys: Vec<Secret>,
) -> impl Stream<Item = Result<ProviderEvent, ProviderError>> + Send + 'static
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    Decoded {
        bytes: Box::pin(bytes),
        parser: Parser::default(),
        decoder,
        out: VecDeque::new(),
        // One timer for the whole stream. A frame only notes the time; the timer, when it
        // fires, moves itself to `last frame + idle` if frames came meanwhile (re-arming a
        // timer for every frame cost more than decoding the frame).
        stall: Box::pin(tokio::time::sleep(first_byte)),
        last_frame: None,
        first_byte,
        idle,
        keys,
        ending: None,
    }
}

/// The stream [`decode`] makes: a chunk's frames are decoded as it arrives, and their
/// events handed out one by one; one layer between the connection and the run, with the
/// frames lent by the parser (none is allocated for its own sake).
struct Decoded<S, D> {
    bytes: Pin<Box<S>>,
    parser: Parser,
    decoder: D,
    /// Events decoded and not handed out yet.
    out: VecDeque<ProviderEvent>,
    stall: Pin<Box<tokio::time::Sleep>>,
    last_frame: Option<tokio::time::Instant>,
    first_byte: Duration,
    idle: Duration,
    keys: Vec<Secret>,
    /// How the stream ends once `out` is handed out: `Some(None)` after the terminal frame,
    /// `Some(Some(error))` with an error.
    ending: Option<Option<ProviderError>>,
}

// Nothing of it is pinned but the byte stream and the timer, each in its own box.
impl<S, D> Unpin for Decoded<S, D> {}

/// Why a chunk's frames were read no further.
enum Halt {
    Finished,
    Failed(ProviderError),
}

impl<S, D, E> Stream for Decoded<S, D>
where
    S: Stream<Item = Result<Bytes, E>>,
    D: Decoder,
    E: std::fmt::Display,
{
    type Item = Result<ProviderEvent, ProviderError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(event) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(event)));
            }
            if let Some(ending) = &mut this.ending {
                return Poll::Ready(ending.take().map(|error| Err(error.redacted(&this.keys))));
            }
            let next = match this.bytes.as_mut().poll_next(cx) {
                Poll::Ready(next) => next,
                Poll::Pending => {
                    ready!(this.stall.as_mut().poll(cx));
                    if let Some(at) = this.last_frame.filter(|at| at.elapsed() < this.idle) {
                        this.stall.as_mut().reset(later(at, this.idle));
                        continue;
                    }
                    let waited = if this.last_frame.is_some() { this.idle } else { this.first_byte };
                    tracing::warn!(after_ms = waited.as_millis() as u64, "provider stream stalled");
                    let error = if this.last_frame.is_some() { stalled_error() } else { network_error() };
                    this.ending = Some(Some(error));
                    continue;
                }
            };
            // Whether a frame came before: a stream that breaks after one was cut off
            // mid-answer; one that breaks before it never answered.
            let begun = this.last_frame.is_some();
            let chunk = match next {
                Some(Ok(chunk)) => chunk,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "provider stream broke");
                    this.ending = Some(Some(if begun { cut_off_error() } else { network_error() }));
                    continue;
                }
                None => {
                    tracing::warn!("provider stream ended before its terminal frame");
                    this.ending = Some(Some(if begun { cut_off_error() } else { network_error() }));
                    continue;
                }
            };
            let (decoder, out) = (&mut this.decoder, &mut this.out);
            let mut framed = false;
            let fed = this.parser.feed(&chunk, &mut |frame| {
                framed = true;
                decoder.frame(&frame, out).map_err(Halt::Failed)?;
                if decoder.finished() { Err(Halt::Finished) } else { Ok(()) }
            });
            if framed {
                let now = tokio::time::Instant::now();
                if this.last_frame.replace(now).is_none() {
                    this.stall.as_mut().reset(later(now, this.idle));
                }
            }
            match fed {
                Ok(()) => {}
                Err(Stop::Reader(Halt::Finished)) => this.ending = Some(None),
                Err(Stop::Reader(Halt::Failed(error))) => this.ending = Some(Some(error)),
                // Bytes that are no SSE (not UTF-8, a frame too large) are a broken answer,
                // not a broken connection: trying again would not mend them.
                Err(Stop::Fault(fault)) => {
                    tracing::warn!(error = %fault, "provider stream is not SSE");
                    this.ending = Some(Some(parse_error()));
                }
            }
        }
    }
}

/// `at + wait`, or a year from `at` for a wait too long to add (an unlimited timeout).
fn later(at: tokio::time::Instant, wait: Duration) -> tokio::time::Instant {
    at.checked_add(wait).unwrap_or_else(|| at + Duration::from_secs(365 * 24 * 3600))
}

/// No answer at all: the connection failed, or the server sent nothing in time.
pub fn network_error() -> ProviderError {
    ProviderError::new(
        ProviderErrorKind::Network,
        "Connection failed: the model's server did not answer; try again (the server's log names the provider)",
    )
}

/// The server answered, then its stream broke or ended before its last frame: the same code
/// (a connection that failed), told as what the user saw, an answer that stopped.
pub fn cut_off_error() -> ProviderError {
    ProviderError::new(
        ProviderErrorKind::Network,
        "Connection failed: the model's server cut the answer off mid-stream; try again (the server's log names the provider)",
    )
}

/// The server answered, then sent nothing for the provider's `idle_timeout_secs`.
pub fn stalled_error() -> ProviderError {
    ProviderError::new(
        ProviderErrorKind::Network,
        "Connection failed: the model's server stopped sending mid-stream; try again (the server's log names the provider)",
    )
}

pub fn parse_error() -> ProviderError {
    ProviderError::new(ProviderErrorKind::Parse, "Failed to parse response")
}

/// Parses one frame's JSON (into a `Value`, or a typed frame borrowing from it), or fails
/// the run with "Failed to parse response".
pub fn json<'a, T: serde::Deserialize<'a>>(frame: &SseFrame<'a>) -> Result<T, ProviderError> {
    json_text(text(frame)?)
}

/// [`json`] of a frame's data already read as text.
pub fn json_text<'a, T: serde::Deserialize<'a>>(data: &'a str) -> Result<T, ProviderError> {
    serde_json::from_str(data).map_err(|e| {
        tracing::warn!(error = %e, data = %truncate(data, 200), "unparsable provider frame");
        parse_error()
    })
}

/// A frame's data as text; bytes that are not UTF-8 are no SSE, a broken answer (not a
/// broken connection: trying again would not mend them).
pub fn text<'a>(frame: &SseFrame<'a>) -> Result<&'a str, ProviderError> {
    frame.text().map_err(|fault| {
        tracing::warn!(error = %fault, "provider stream is not SSE");
        parse_error()
    })
}

/// Maps a non-success HTTP answer onto the contract: 401/403 → UNAUTHORIZED, 429 →
/// RATE_LIMITED (with `Retry-After`), 408/5xx → SERVICE_UNAVAILABLE (retryable), other 4xx →
/// SERVICE_UNAVAILABLE with the provider's message (not retryable).
pub async fn http_error(response: Response, keys: &[Secret], within: Duration) -> ProviderError {
    let status = response.status();
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|s| Duration::try_from_secs_f64(s).ok());
    let body = bounded_body(response, within).await;
    let detail = ProviderError::new(ProviderErrorKind::Unavailable, provider_message(&body)).redacted(keys).message;
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

/// What is read of a body that is not a stream (an error's), at most.
pub const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;
/// How long reading such a body may take, at most (less if the provider's idle timeout is
/// shorter).
pub const ERROR_BODY_WITHIN: Duration = Duration::from_secs(10);

/// The start of `response`'s body as text: at most [`MAX_ERROR_BODY_BYTES`], read within
/// `within`; what does not fit or come in time is left unread (the connection
/// is closed with the response). A 300 MB error page or one that stalls after its headers
/// must cost neither memory nor the run's time.
async fn bounded_body(response: Response, within: Duration) -> String {
    let mut body = Vec::new();
    let mut chunks = response.bytes_stream();
    let read = async {
        while let Some(Ok(chunk)) = chunks.next().await {
            let room = MAX_ERROR_BODY_BYTES - body.len();
            body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            if body.len() >= MAX_ERROR_BODY_BYTES {
                break;
            }
        }
    };
    if tokio::time::timeout(within, read).await.is_err() {
        tracing::warn!(read = body.len(), "provider error body stalled; reading no more of it");
    }
    String::from_utf8_lossy(&body).into_owned()
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

/// A provider's endpoint, its URL parsed once: reqwest parses a URL given as text again for
/// every request (some 7,000 instructions a call).
#[derive(Debug, Clone)]
pub struct Endpoint(Result<reqwest::Url, String>);

impl Endpoint {
    /// `path` under the API root `base`.
    pub fn new(base: &str, path: &str) -> Self {
        let text = join(base, path);
        Self(reqwest::Url::parse(&text).map_err(|_| text))
    }

    /// A POST to the endpoint. One whose URL does not parse fails as reqwest fails it, when
    /// the request is sent (a run's error, as before the URL was parsed here).
    pub fn post(&self, client: &reqwest::Client) -> RequestBuilder {
        match &self.0 {
            Ok(url) => client.post(url.clone()),
            Err(text) => client.post(text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_posts_to_its_joined_url_and_a_bad_one_fails_as_reqwest_does() {
        let client = reqwest::Client::new();
        let request = Endpoint::new("http://127.0.0.1:9/v1/", "/chat/completions").post(&client).build().unwrap();
        assert_eq!(
            (request.method().as_str(), request.url().as_str()),
            ("POST", "http://127.0.0.1:9/v1/chat/completions")
        );
        for base in ["127.0.0.1:9/v1", "http://", "not a url"] {
            let ours = Endpoint::new(base, "v1/messages").post(&client).build().map(|r| r.url().to_string());
            let reqwests = client.post(join(base, "v1/messages")).build().map(|r| r.url().to_string());
            assert_eq!(ours.map_err(|e| e.to_string()), reqwests.map_err(|e| e.to_string()), "{base}");
        }
    }

    /// What `decode` makes of `chunks` (an `Err` is a broken connection), as OpenAI's format.
    async fn decoded(chunks: Vec<Result<&'static str, &'static str>>) -> Vec<Result<ProviderEvent, String>> {
        decoded_bytes(chunks.into_iter().map(|c| c.map(|c| Bytes::from_static(c.as_bytes()))).collect()).await
    }

    async fn decoded_bytes(chunks: Vec<Result<Bytes, &'static str>>) -> Vec<Result<ProviderEvent, String>> {
        let bytes = futures_util::stream::iter(chunks);
        let forever = Duration::from_secs(3600);
        let stream = decode(bytes, super::super::openai::ChunkDecoder::default(), forever, forever, Vec::new());
        stream.map(|event| event.map_err(|e| e.message)).collect().await
    }

    fn text(text: &str) -> &'static str {
        let frame = serde_json::json!({"choices": [{"delta": {"content": text}}]});
        format!("data: {frame}\n\n").leak()
    }

    #[tokio::test]
    async fn frames_come_as_they_end_then_what_broke_the_stream() {
        // A frame cut between chunks, then the connection breaks: the answer was cut off.
        let (first, second) = text("b").split_at(12);
        let read = decoded(vec![Ok(text("a")), Ok(first), Ok(second), Err("reset")]).await;
        assert_eq!(
            read,
            [Ok(ProviderEvent::Text("a".into())), Ok(ProviderEvent::Text("b".into())), Err(cut_off_error().message)]
        );
        // Broken before any frame: the server never answered.
        assert_eq!(decoded(vec![Ok(": ping\n\n"), Err("reset")]).await, [Err(network_error().message)]);
        // Ended without its terminal frame, after output.
        assert_eq!(
            decoded(vec![Ok(text("a"))]).await,
            [Ok(ProviderEvent::Text("a".into())), Err(cut_off_error().message)]
        );
    }

    #[tokio::test]
    async fn nothing_is_read_past_the_terminal_frame_or_a_frame_that_fails() {
        let read =
            decoded(vec![Ok("data: [DONE]\n\ndata: {\"choices\": [{\"delta\": {\"content\": \"late\"}}]}\n\n")]).await;
        assert_eq!(read, [Ok(ProviderEvent::Finish("stop".into()))]);
        let chunk = format!("{}data: {{not json\n\n{}", text("a"), text("never")).leak();
        let read = decoded(vec![Ok(chunk)]).await;
        assert_eq!(read, [Ok(ProviderEvent::Text("a".into())), Err(parse_error().message)]);
        // Bytes that are no UTF-8 are no SSE.
        let read = decoded_bytes(vec![Ok(Bytes::from(text("a"))), Ok(Bytes::from_static(b"data: \xff\n\n"))]).await;
        assert_eq!(read, [Ok(ProviderEvent::Text("a".into())), Err(parse_error().message)]);
    }
}
