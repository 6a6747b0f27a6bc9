//! The connection loop: accepts connections, at most `server.max_connections` at once (more
//! wait in the listen backlog), backs off when accepting fails (out of descriptors), and
//! serves each with hyper's HTTP/1.1 under `server.header_read_timeout_secs`. That timeout
//! runs whenever hyper waits for a request's head: from a connection's opening and from the
//! end of each response, so it closes connections that never send anything, that send their
//! headers too slowly, and idle keep-alive connections alike. A streaming response is not
//! waiting for a head: an SSE stream with its keep-alives stays open as long as it lasts.
//! On shutdown, accepting stops and open connections are let finish.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::config::ServerSettings;

/// Descriptors kept for everything but client connections: the database, providers, MCP
/// servers, logs.
const RESERVED_DESCRIPTORS: u64 = 256;

/// Serves `router` on `listener` until `shutdown`, then waits for open connections to end.
pub async fn serve(listener: TcpListener, router: Router, settings: &ServerSettings, shutdown: CancellationToken) {
    let max_connections = connection_cap(settings.max_connections);
    let permits = Arc::new(Semaphore::new(max_connections));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(Duration::from_secs(settings.header_read_timeout_secs.max(1)));
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
        let (stream, peer) = match accepted {
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
        let router = router.clone();
        let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
            router.clone().oneshot(request)
        });
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
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
