//! `POST /api/chat/stream`: validate (JSON errors), then answer with the run's events as SSE,
//! each frame `id: <seq>` + `data: <json>`, with `: ping` keep-alives when idle.

use std::convert::Infallible;

use axum::Router;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures_util::{Stream, StreamExt};

use super::AppState;
use super::error::AppError;
use super::extract::{AppJson, CurrentUser};
use crate::chat::{ChatRequest, Frame, LiveRun};

pub fn routes() -> Router<AppState> {
    Router::new().route("/api/chat/stream", post(stream))
}

async fn stream(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppJson(request): AppJson<ChatRequest>,
) -> Result<Response, AppError> {
    let run = state.chat.start(&user, request).await?;
    Ok(sse(&state, run, 0))
}

/// The SSE response that follows `run` from after `seq` until `done` or shutdown.
pub fn sse(state: &AppState, run: std::sync::Arc<LiveRun>, after: u64) -> Response {
    let frames = run
        .follow(after)
        .take_until(state.shutdown.clone().cancelled_owned());
    let keepalive = KeepAlive::new().interval(state.keepalive()).text("ping");
    let mut response = Sse::new(to_sse(frames))
        .keep_alive(keepalive)
        .into_response();
    // Proxies such as nginx must pass each frame on at once.
    response.headers_mut().insert(
        "x-accel-buffering",
        axum::http::HeaderValue::from_static("no"),
    );
    response.headers_mut().insert(
        axum::http::header::CACHE_CONTROL,
        axum::http::HeaderValue::from_static("no-cache"),
    );
    response
}

fn to_sse(frames: impl Stream<Item = Frame>) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    frames.map(|frame| {
        Ok(SseEvent::default()
            .id(frame.seq.to_string())
            .data(&*frame.data))
    })
}
