//! Routers only: each file maps endpoints of CONTRACT.md §3 onto the chat service or the
//! store. One cloneable [`AppState`]; one [`AppError`](error::AppError) envelope.

mod ab;
mod chat;
mod clients;
mod conversations;
mod docs;
mod edge;
mod files;
mod health;
mod legacy;
mod records;
pub mod server;
mod sse;
mod tools;
mod waits;

use docs::web;
pub use docs::{openapi, views};
pub use edge::{auth, error, extract};

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderName, Request};
use tokio_util::sync::CancellationToken;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::chat::ChatService;
use crate::config::Settings;
use crate::store::Store;
use crate::tools::Registry;

#[derive(Clone)]
pub struct AppState {
    pub settings: Arc<Settings>,
    pub store: Arc<dyn Store>,
    pub chat: ChatService,
    pub tools: Arc<Registry>,
    pub auth: Arc<auth::Authenticator>,
    pub files: crate::files::Files,
    /// Cancelled when the server shuts down; every open stream ends with it.
    pub shutdown: CancellationToken,
}

impl AppState {
    fn keepalive(&self) -> Duration {
        Duration::from_secs(self.settings.stream.keepalive_secs.max(1))
    }
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// CORS for the configured browser origins (`"*"`: any); none configured, no CORS headers.
fn cors(origins: &[String]) -> tower_http::cors::CorsLayer {
    use tower_http::cors::{AllowOrigin, Any, CorsLayer};
    if origins.is_empty() {
        return CorsLayer::new();
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| o.parse().ok()))
    };
    CorsLayer::new()
        .allow_origin(allow)
        .allow_methods(Any)
        .allow_headers(Any)
        .expose_headers([REQUEST_ID, axum::http::header::RETRY_AFTER])
}

/// A body refused as too large is not read: the connection cannot carry another request
/// after it, and the client must hear so (`Connection: close`) instead of finding its next
/// request on it failing.
async fn close_after_refused_body(mut response: axum::response::Response) -> axum::response::Response {
    if response.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        response.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    }
    response
}

pub fn router(state: AppState) -> Router {
    let body_limit = state.settings.limits.max_body_bytes;
    // The endpoints that start runs take a message's files inline too (`data:` URLs, which
    // is how `useChat` sends files): room for one file of `files.max_bytes` in base64.
    let inline_file = usize::try_from(state.settings.files.max_bytes.div_ceil(3) * 4).unwrap_or(usize::MAX);
    let mut starts_runs = Router::new()
        .merge(chat::routes())
        .merge(ab::routes())
        .merge(legacy::routes())
        .merge(clients::starting())
        .layer(DefaultBodyLimit::max(body_limit.saturating_add(inline_file)));
    // Where runs are exported as traces, a start's `traceparent` is kept for its run's spans.
    if crate::report::otlp::enabled() {
        starts_runs = starts_runs.layer(axum::middleware::from_fn(crate::report::otlp::remember_traceparent));
    }
    let routes = Router::new()
        .merge(health::routes())
        .merge(conversations::routes())
        .merge(starts_runs)
        .merge(records::routes())
        .merge(waits::routes())
        .merge(files::routes(state.settings.files.max_bytes))
        .merge(tools::routes())
        .merge(web::routes())
        .route(
            "/openapi.json",
            axum::routing::get(|| async {
                ([(axum::http::header::CONTENT_TYPE, "application/json")], openapi::document())
            }),
        )
        .fallback(|| async { error::AppError::not_found("No such endpoint") })
        .method_not_allowed_fallback(|| async { error::AppError::MethodNotAllowed })
        .route_layer(axum::middleware::from_fn(crate::report::metrics::track));
    // What every request passes, around the routes as one service (outermost first).
    // `Router::layer` would wrap each route in each of these, every layer in a box of its
    // own, and a request clones its route: a clone of every box, some 50 allocations a
    // request. Around the whole router they are cloned as one value.
    let (timeout, cors) =
        (state.settings.server.request_body_timeout_secs.max(1), cors(&state.settings.server.cors_origins));
    let edge = tower::ServiceBuilder::new()
        .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
        .layer(PropagateRequestIdLayer::new(REQUEST_ID))
        .layer(TraceLayer::new_for_http().make_span_with(|request: &Request<_>| {
            let id = request.headers().get(&REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("-");
            tracing::info_span!("request", method = %request.method(), uri = %request.uri().path(), request_id = %id)
        }))
        .layer(cors)
        .layer(axum::middleware::map_response(close_after_refused_body))
        // A request body that stops coming fails instead of holding its connection.
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(Duration::from_secs(timeout)))
        .layer(DefaultBodyLimit::max(body_limit))
        .service(routes.with_state(state));
    Router::new().fallback_service(edge)
}
