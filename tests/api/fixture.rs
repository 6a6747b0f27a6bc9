//! A fake model provider: a real HTTP server on port 0 that answers each request with the
//! next scripted response (status, headers, and a body sent in parts with pauses, a stall or
//! a dropped connection), and records every request it got and how many of its answers are
//! still being sent.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::Value;

/// One piece of a scripted body.
#[derive(Clone, Debug)]
pub enum Part {
    Bytes(String),
    /// Bytes that need not be UTF-8.
    Raw(Vec<u8>),
    Pause(Duration),
    /// Stop sending, keeping the connection open.
    Stall,
    /// Abort the connection mid-body.
    Drop,
}

#[derive(Clone, Debug)]
pub struct Scripted {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub parts: Vec<Part>,
}

impl Scripted {
    /// An SSE answer whose frames are sent one part each.
    pub fn sse(frames: &[String]) -> Self {
        Self {
            status: 200,
            headers: vec![("content-type", "text/event-stream".into())],
            parts: frames.iter().map(|f| Part::Bytes(f.clone())).collect(),
        }
    }

    /// A JSON error answer.
    pub fn error(status: u16, body: Value) -> Self {
        Self::json(status, body)
    }

    /// A JSON answer.
    pub fn json(status: u16, body: Value) -> Self {
        Self {
            status,
            headers: vec![("content-type", "application/json".into())],
            parts: vec![Part::Bytes(body.to_string())],
        }
    }

    pub fn header(mut self, name: &'static str, value: &str) -> Self {
        self.headers.push((name, value.to_owned()));
        self
    }

    pub fn then(mut self, part: Part) -> Self {
        self.parts.push(part);
        self
    }
}

/// A request the fixture received.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    /// HTTP/1.1, or HTTP/2 when the provider is configured with `http2` (the fixture speaks both).
    pub version: axum::http::Version,
    /// The connection it came on (chatd's end of it).
    pub peer: std::net::SocketAddr,
    pub headers: HeaderMap,
    pub body: Value,
}

#[derive(Clone, Default)]
struct Shared {
    script: Arc<Mutex<VecDeque<Scripted>>>,
    received: Arc<Mutex<Vec<Received>>>,
    open: Arc<AtomicUsize>,
}

/// Counts an answer as open from its first byte until its body is dropped: sent whole, or
/// its client gone.
struct Open(Arc<AtomicUsize>);

impl Open {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

pub struct Fixture {
    pub base: String,
    shared: Shared,
}

impl Fixture {
    pub async fn start(script: Vec<Scripted>) -> Self {
        let shared = Shared { script: Arc::new(Mutex::new(script.into())), ..Shared::default() };
        let app = Router::new().fallback(answer).with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { base, shared }
    }

    pub fn received(&self) -> Vec<Received> {
        self.shared.received.lock().unwrap().clone()
    }

    /// How many answers are being sent: begun, and neither sent whole nor left by chatd.
    pub fn open(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }
}

async fn answer(
    State(shared): State<Shared>,
    ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    let path = parts.uri.path_and_query().map(|p| p.to_string()).unwrap_or_default();
    shared.received.lock().unwrap().push(Received {
        path,
        version: parts.version,
        peer,
        headers: parts.headers,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    });
    let next = shared.script.lock().unwrap().pop_front();
    let Some(scripted) = next else {
        return Response::builder().status(500).body(Body::from("fixture: no scripted response left")).unwrap();
    };
    let body = futures_util::stream::iter(scripted.parts)
        .then(|part| async move {
            match part {
                Part::Bytes(text) => Some(Ok::<_, std::io::Error>(Bytes::from(text))),
                Part::Raw(bytes) => Some(Ok(Bytes::from(bytes))),
                Part::Pause(d) => {
                    tokio::time::sleep(d).await;
                    None
                }
                Part::Stall => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    None
                }
                Part::Drop => Some(Err(std::io::Error::other("fixture drops the connection"))),
            }
        })
        .filter_map(|item| async move { item });
    let open = Open::new(&shared.open);
    let body = body.map(move |item| {
        let _open = &open;
        item
    });
    let mut response = Response::builder().status(StatusCode::from_u16(scripted.status).unwrap());
    for (name, value) in scripted.headers {
        response = response.header(name, value);
    }
    response.body(Body::from_stream(body)).unwrap()
}

// Frames in each provider's exact wire format.

/// `data: <json>` + blank line (OpenAI, Gemini).
pub fn data(json: Value) -> String {
    format!("data: {json}\n\n")
}

/// `event: <type>` + `data: <json>` (Anthropic).
pub fn event(json: Value) -> String {
    format!("event: {}\ndata: {json}\n\n", json["type"].as_str().unwrap())
}
