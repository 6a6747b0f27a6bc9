//! The reference web page at `/` and the API reference at `/docs` (which renders
//! `/openapi.json`): hand-written HTML, CSS and JavaScript modules from `web/`, compiled into
//! the binary, so `cargo run` serves them with no Node, no build step and no network.
//!
//! The files are small and their names carry no hash, so browsers revalidate them
//! (`no-cache`) against an `ETag` computed at compile time: a new binary is never shadowed by
//! an old cached file, and an unchanged file costs a 304.

use axum::Router;
use axum::extract::Path;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::http::AppState;
use crate::http::error::AppError;

struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
    /// FNV-1a of the body, computed at compile time: the `ETag`.
    hash: u64,
}

macro_rules! asset {
    ($name:literal, $content_type:literal) => {
        Asset {
            name: $name,
            content_type: $content_type,
            body: include_bytes!(concat!("../../../web/", $name)),
            hash: fnv1a(include_bytes!(concat!("../../../web/", $name))),
        }
    };
}

const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    hash
}

const INDEX: Asset = asset!("index.html", "text/html; charset=utf-8");
const DOCS: Asset = asset!("docs.html", "text/html; charset=utf-8");
/// The pages link it as `/favicon.svg`; `/favicon.ico`, which browsers and tools ask for by
/// habit, is the same icon rather than a 404.
const FAVICON: Asset = asset!("favicon.svg", "image/svg+xml");

/// What `/assets/{file}` serves; any other name is a 404 in the contract's envelope.
const ASSETS: &[Asset] = &[
    asset!("style.css", "text/css; charset=utf-8"),
    asset!("app.js", "text/javascript; charset=utf-8"),
    asset!("api.js", "text/javascript; charset=utf-8"),
    asset!("markdown.js", "text/javascript; charset=utf-8"),
    asset!("render.js", "text/javascript; charset=utf-8"),
    asset!("docs.css", "text/css; charset=utf-8"),
    asset!("docs.js", "text/javascript; charset=utf-8"),
];

/// The page talks only to this server; nothing inline runs.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(index))
        .route("/docs", get(docs))
        .route("/assets/{file}", get(asset))
        .route("/favicon.svg", get(favicon))
        .route("/favicon.ico", get(favicon))
}

async fn index(headers: HeaderMap) -> Response {
    serve(&INDEX, &headers)
}

async fn docs(headers: HeaderMap) -> Response {
    serve(&DOCS, &headers)
}

async fn favicon(headers: HeaderMap) -> Response {
    serve(&FAVICON, &headers)
}

async fn asset(Path(file): Path<String>, headers: HeaderMap) -> Response {
    match ASSETS.iter().find(|a| a.name == file) {
        Some(asset) => serve(asset, &headers),
        None => AppError::not_found("No such asset").into_response(),
    }
}

fn serve(asset: &Asset, request: &HeaderMap) -> Response {
    let etag = format!("\"{:016x}\"", asset.hash);
    let fresh = request
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|tags| tags.split(',').any(|t| t.trim() == etag));
    let mut response = if fresh { StatusCode::NOT_MODIFIED.into_response() } else { asset.body.into_response() };
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(asset.content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(etag) = HeaderValue::from_str(&etag) {
        headers.insert(header::ETAG, etag);
    }
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    // An SVG opened by itself is a document too: the same policy keeps it inert.
    if asset.content_type.starts_with("text/html") || asset.content_type.starts_with("image/svg") {
        headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
        headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    }
    response
}
