//! Traces (CONTRACT.md §9): a run's status, timings, spans and its logged events. Owner only.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};

use crate::domain::Trace;
use crate::http::AppState;
use crate::http::error::AppError;
use crate::http::extract::{CurrentUser, IdPath};
use crate::http::views::*;
use crate::ids::{MessageId, TraceId};

pub fn routes() -> Router<AppState> {
    Router::new().route("/api/trace/{id}", get(by_id)).route("/api/trace/by_message/{id}", get(by_message))
}

#[utoipa::path(get, operation_id = "get_trace", path = "/api/trace/{id}", tag = "traces", params(("id" = Uuid, Path, description = "Trace id")), responses((status = 200, description = "The trace with its events and spans", body = TraceView), Refused, Missing))]
async fn by_id(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<TraceId>,
) -> Result<Json<TraceView>, AppError> {
    let trace = state.store.get_trace(&user, id).await.map_err(AppError::missing("Trace not found"))?;
    render(&state, trace).await
}

#[utoipa::path(get, operation_id = "get_trace_by_message", path = "/api/trace/by_message/{id}", tag = "traces", params(("id" = Uuid, Path, description = "Message id")), responses((status = 200, description = "The trace that produced the message", body = TraceView), Refused, Missing))]
async fn by_message(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<MessageId>,
) -> Result<Json<TraceView>, AppError> {
    let trace = state.store.trace_by_message(&user, id).await.map_err(AppError::missing("Trace not found"))?;
    render(&state, trace).await
}

async fn render(state: &AppState, trace: Trace) -> Result<Json<TraceView>, AppError> {
    // A run that has just sent `done` writes its last events a moment later, here or on
    // another replica: a trace read right after the stream ends is whole.
    let (trace, events) = state.chat.whole_log(trace).await?;
    let duration_ms = trace.ended_at.map(|end| (end - trace.started_at).num_milliseconds());
    Ok(Json(TraceView { trace, duration_ms, events }))
}
