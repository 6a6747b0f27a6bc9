//! The connection loop: accepts connections, at most `server.max_connections` at once (more
//! wait in the listen backlog), backs off when accepting fails (out of descriptors), and
//! serves each with hyper's HTTP/1.1, or its HTTP/2 when the connection opens with HTTP/2's
//! preface (h2c with prior knowledge: what a proxy in front, or a client that knows, speaks
//! without TLS; there is no upgrade from HTTP/1.1). A connection has
//! `server.header_read_timeout_secs` to show which it speaks.
//!
//! Over HTTP/1.1 that timeout runs whenever hyper waits for a request's head: from a
//! connection's opening and from the end of each response, so it closes connections that
//! never send anything, that send their headers too slowly, and idle keep-alive connections
//! alike. An HTTP/2 connection is closed (GOAWAY, then its open streams may end) once it has
//! had no open request for that long. A streaming response is not waiting for a head: an SSE
//! stream with its keep-alives stays open as long as it lasts, on either.
//! On shutdown, accepting stops and open connections are let finish.
//!
//! Requests hyper refuses before any handler sees them (a malformed request: 400; a URI too
//! long: 414; headers too large: 431) are answered by hyper itself, with an empty body and no
//! hook to fill it: [`Enveloped`] gives those answers the contract's JSON envelope on their
//! way out. (Over HTTP/2 hyper refuses a stream with a reset, which has no body to fill.)

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::config::ServerSettings;

/// Descriptors kept for everything but client connections: the database, providers, MCP
/// servers, logs.
const RESERVED_DESCRIPTORS: u64 = 256;

/// Streams one HTTP/2 connection may have open at once (hyper's default, said out loud): a
/// proxy with more opens another connection.
const HTTP2_STREAMS_PER_CONNECTION: u32 = 200;

/// A request's head over HTTP/1.1 (its request line and headers), at most: more is refused
/// with 431. hyper's own bound, its read buffer (about 400 KiB), is not exact: a read may
/// fill the buffer's spare room past it, and a head that came in larger reads got through.
const MAX_HEAD_BYTES: usize = 400 * 1024;

/// What an HTTP/2 client sends first, before any frame, when it speaks HTTP/2 without TLS.
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves `router` on `listener` until `shutdown`, then waits for open connections to end.
pub async fn serve(listener: TcpListener, router: Router, settings: &ServerSettings, shutdown: CancellationToken) {
    let max_connections = connection_cap(settings.max_connections);
    let permits = Arc::new(Semaphore::new(max_connections));
    let header_timeout = Duration::from_secs(settings.header_read_timeout_secs.max(1));
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.timer(TokioTimer::new()).header_read_timeout(header_timeout).max_header_size(MAX_HEAD_BYTES);
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2.timer(TokioTimer::new()).max_concurrent_streams(HTTP2_STREAMS_PER_CONNECTION);
    let graceful = GracefulShutdown::new();
    let mut pause = Duration::ZERO;
    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
        };
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (mut stream, peer) = match accepted {
            Ok(accepted) => {
                pause = Duration::ZERO;
                accepted
            }
            // The client gave up before it was accepted: nothing wrong here.
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // Out of descriptors (or memory): accepting again at once fails again and
                // spins a core; wait, longer each time, for connections to close.
                pause = (pause * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                tracing::error!(error = %e, pause_ms = pause.as_millis() as u64, "accepting a connection failed; pausing");
                metrics::counter!("chatd_accept_errors_total").increment(1);
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(pause) => continue,
                }
            }
        };
        // No Nagle: an SSE event written just after the response head would otherwise wait
        // for the head's ACK, which the client delays by up to 40 ms.
        let _ = stream.set_nodelay(true);
        let (router, http1, http2, shutdown) = (router.clone(), http1.clone(), http2.clone(), shutdown.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let first = tokio::select! {
                first = tokio::time::timeout(header_timeout, first_bytes(&mut stream)) => first,
                () = shutdown.cancelled() => return drop(permit),
            };
            let first = match first {
                Ok(Ok(first)) if !first.is_empty() => first,
                // Silent for too long, gone, or failed: nothing to answer.
                _ => return drop(permit),
            };
            let http2_prior_knowledge = first == HTTP2_PREFACE;
            let io = TokioIo::new(Enveloped::new(stream, first));
            let ended = if http2_prior_knowledge {
                serve_http2(&http2, io, router, peer, header_timeout, &shutdown).await
            } else {
                let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
                    request.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
                    router.clone().oneshot(request)
                });
                watcher.watch(http1.serve_connection(io, service)).await
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    // HTTP/2 connections close on `shutdown` on their own: each holds its permit till it has.
    let _ = permits.acquire_many(u32::try_from(max_connections).unwrap_or(u32::MAX)).await;
}

/// A connection's first bytes, up to the length of HTTP/2's preface or the first that differs
/// from it (an HTTP/1.1 request's second byte); empty if it closed before sending any.
async fn first_bytes(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut first = vec![0; HTTP2_PREFACE.len()];
    let mut seen = 0;
    while seen < first.len() && HTTP2_PREFACE.starts_with(&first[..seen]) {
        let n = stream.read(&mut first[seen..]).await?;
        if n == 0 {
            break;
        }
        seen += n;
    }
    first.truncate(seen);
    Ok(first)
}

/// Serves one HTTP/2 connection until it ends; closes it gracefully on `shutdown` or once no
/// request has been open on it for `idle_timeout`.
async fn serve_http2(
    http2: &hyper::server::conn::http2::Builder<TokioExecutor>,
    io: TokioIo<Enveloped>,
    router: Router,
    peer: SocketAddr,
    idle_timeout: Duration,
    shutdown: &CancellationToken,
) -> hyper::Result<()> {
    let activity = Arc::new(Activity::default());
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
            let open = Open::new(&activity);
            let response = router.clone().oneshot(request);
            async move {
                Ok::<_, std::convert::Infallible>(response.await?.map(|body| Body::new(Tracked { body, _open: open })))
            }
        })
    };
    let connection = http2.serve_connection(io, service);
    tokio::pin!(connection);
    tokio::select! {
        ended = connection.as_mut() => return ended,
        () = shutdown.cancelled() => {}
        () = activity.idle_for(idle_timeout) => {}
    }
    // A GOAWAY, then the streams open may end; the close waits for the client's answer to a
    // ping, which a client that is gone or hostile never sends: idle as long again, it is cut.
    connection.as_mut().graceful_shutdown();
    tokio::select! {
        ended = connection.as_mut() => ended,
        () = activity.idle_for(idle_timeout) => Ok(()),
    }
}

/// The requests an HTTP/2 connection is serving, and whether one began or ended lately.
#[derive(Default)]
struct Activity {
    open: AtomicUsize,
    lately: AtomicBool,
}

impl Activity {
    /// Ready once a whole `period` has passed with no request open and none begun or ended.
    async fn idle_for(&self, period: Duration) {
        loop {
            tokio::time::sleep(period).await;
            if !self.lately.swap(false, Ordering::Relaxed) && self.open.load(Ordering::Relaxed) == 0 {
                return;
            }
        }
    }
}

/// One open request of an HTTP/2 connection, from its arrival till its response's body is
/// dropped (sent whole, or the stream reset).
struct Open(Arc<Activity>);

impl Open {
    fn new(activity: &Arc<Activity>) -> Self {
        activity.open.fetch_add(1, Ordering::Relaxed);
        activity.lately.store(true, Ordering::Relaxed);
        Self(activity.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
        self.0.lately.store(true, Ordering::Relaxed);
    }
}

/// A response body that keeps its request counted as open while it lives.
struct Tracked {
    body: Body,
    _open: Open,
}

impl http_body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// `wanted`, lowered to what the descriptor limit leaves after [`RESERVED_DESCRIPTORS`]
/// (the soft limit is first raised to the hard one).
fn connection_cap(wanted: usize) -> usize {
    let limit = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the descriptor limit");
            return wanted.max(1);
        }
    };
    let room = usize::try_from(limit.saturating_sub(RESERVED_DESCRIPTORS)).unwrap_or(usize::MAX).max(1);
    if room < wanted {
        tracing::warn!(
            max_connections = wanted,
            descriptor_limit = limit,
            serving = room,
            "server.max_connections is above what the descriptor limit allows; serving fewer (raise `ulimit -n`)"
        );
    }
    wanted.min(room).max(1)
}

/// Errors of one connection, not of the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset)
}

/// A connection whose writes pass through untouched, except hyper's own refusals of a request
/// it could not parse: those heads (status 400, 414 or 431, `connection: close`,
/// `content-length: 0`, written in one piece before the connection closes) get the
/// contract's envelope as their body. chatd's handlers never answer 4xx without a body.
struct Enveloped {
    inner: tokio::net::TcpStream,
    /// The connection's first bytes, read to tell HTTP/2 from HTTP/1.1: read again first.
    first: Vec<u8>,
    first_read: usize,
    /// An answer rewritten with its envelope, still to be written out.
    pending: Vec<u8>,
    written: usize,
}

impl Enveloped {
    fn new(inner: tokio::net::TcpStream, first: Vec<u8>) -> Self {
        Self { inner, first, first_read: 0, pending: Vec::new(), written: 0 }
    }

    /// The rewritten answer, if `head` is one of hyper's bodiless refusals.
    fn envelope(head: &[u8]) -> Option<Vec<u8>> {
        const MAX_HEAD: usize = 512;
        if head.len() > MAX_HEAD || !head.ends_with(b"\r\n\r\n") {
            return None;
        }
        let text = std::str::from_utf8(head).ok()?;
        let (code, message) = match text.get(..13)? {
            "HTTP/1.1 400 " => ("VALIDATION_ERROR", "The request could not be parsed as HTTP"),
            "HTTP/1.1 414 " => ("PAYLOAD_TOO_LARGE", "The request's URI is too long"),
            "HTTP/1.1 431 " => ("PAYLOAD_TOO_LARGE", "The request's headers are too large"),
            _ => return None,
        };
        let lower = text.to_ascii_lowercase();
        if !lower.contains("\r\ncontent-length: 0\r\n") || !lower.contains("\r\nconnection: close\r\n") {
            return None;
        }
        let body = serde_json::to_string(&super::error::Envelope { code, message, field: None }).ok()?;
        let head = lower.replacen(
            "\r\ncontent-length: 0\r\n",
            &format!("\r\ncontent-type: application/json\r\ncontent-length: {}\r\n", body.len()),
            1,
        );
        // The status line keeps its original case (the lower-cased copy is only for headers).
        let status_line_end = text.find("\r\n")?;
        let mut out = text.as_bytes()[..status_line_end].to_vec();
        out.extend_from_slice(&head.as_bytes()[status_line_end..]);
        out.extend_from_slice(body.as_bytes());
        Some(out)
    }

    /// Takes `bytes` whole if they are one of hyper's bodiless refusals, rewritten with the
    /// envelope: they go out now or with the next write, flush or shutdown.
    fn take_refusal(&mut self, cx: &mut std::task::Context<'_>, bytes: &[u8]) -> std::io::Result<bool> {
        let Some(rewritten) = Self::envelope(bytes) else { return Ok(false) };
        self.pending = rewritten;
        self.written = 0;
        if let std::task::Poll::Ready(Err(e)) = self.poll_pending(cx) {
            return Err(e);
        }
        Ok(true)
    }

    /// Writes what is pending; ready once it is all out.
    fn poll_pending(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        use tokio::io::AsyncWrite;
        while self.written < self.pending.len() {
            let n =
                std::task::ready!(std::pin::Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return std::task::Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        std::task::Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncRead for Enveloped {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.first_read < self.first.len() {
            let n = buf.remaining().min(self.first.len() - self.first_read);
            buf.put_slice(&self.first[self.first_read..self.first_read + n]);
            self.first_read += n;
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Enveloped {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::ready!(self.poll_pending(cx))?;
        if buf.starts_with(b"HTTP/1.1 4") && self.take_refusal(cx, buf)? {
            return std::task::Poll::Ready(Ok(buf.len()));
        }
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::ready!(self.poll_pending(cx))?;
        if bufs.first().is_some_and(|b| b.starts_with(b"HTTP/1.1 4")) {
            let whole: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
            if self.take_refusal(cx, &whole)? {
                return std::task::Poll::Ready(Ok(whole.len()));
            }
        }
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::ready!(self.poll_pending(cx))?;
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::ready!(self.poll_pending(cx))?;
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::Enveloped;

    #[test]
    fn hypers_bodiless_refusals_get_the_envelope_and_nothing_else_changes() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: Tue, 24 Nov 2026 07:20:39 GMT\r\n\r\n";
        let out = String::from_utf8(Enveloped::envelope(head).expect("rewritten")).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["code"], "PAYLOAD_TOO_LARGE");
        for untouched in [
            &b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 20\r\n\r\n"[..],
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
        ] {
            assert_eq!(Enveloped::envelope(untouched), None, "{}", String::from_utf8_lossy(untouched));
        }
    }
}
