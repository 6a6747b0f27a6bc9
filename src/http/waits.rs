//! What a waiting run waits for (CONTRACT.md §15): a person's decision on an approval
//! (`POST /api/approvals/{approval_id}`) and a client tool's result
//! (`POST /api/runs/{trace_id}/tool_results`). Owner only; the run goes on from the
//! replica that settles its last call.

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::AppState;
use super::error::AppError;
use super::extract::{AppJson, CurrentUser, IdPath};
use super::views::*;
use crate::chat::control::waits::output_text;
use crate::ids::TraceId;
use crate::store::Settlement;

pub fn routes() -> Router<AppState> {
    Router::new().route("/api/approvals/{id}", post(decide)).route("/api/runs/{id}/tool_results", post(tool_result))
}

/// A decision on an approval.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct Decision {
    approved: bool,
    /// Why it was denied; the model is told.
    #[serde(default)]
    reason: Option<String>,
}

#[derive(Serialize, utoipa::ToSchema)]
struct Decided {
    approval_id: Uuid,
    trace_id: TraceId,
    /// `approved` or `denied`.
    status: &'static str,
}

/// Longest reason or tool result taken, in characters.
const MAX_TEXT_CHARS: usize = 100_000;

#[utoipa::path(post, operation_id = "decide_approval", path = "/api/approvals/{id}", tag = "chat", params(("id" = Uuid, Path, description = "The approval id of a tool_approval_request event")), request_body = Decision, responses((status = 200, description = "Decided; an approved call runs and the run goes on", body = Decided), Refused, Missing, (status = 409, description = "Decided already, expired, or its run ended", body = ErrorBody)))]
async fn decide(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(approval_id): IdPath<Uuid>,
    AppJson(body): AppJson<Decision>,
) -> Result<Json<Decided>, AppError> {
    if body.reason.as_ref().is_some_and(|r| r.chars().count() > MAX_TEXT_CHARS) {
        return Err(AppError::validation("reason", format!("reason is longer than {MAX_TEXT_CHARS} characters")));
    }
    let settled = state.chat.decide(&user, approval_id, body.approved, body.reason).await?;
    let status = if settled.wait.settled == Some(Settlement::Approved) { "approved" } else { "denied" };
    Ok(Json(Decided { approval_id, trace_id: settled.wait.trace_id, status }))
}

/// A client tool's result.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ToolResultBody {
    tool_call_id: String,
    /// Text, or any JSON (the model gets it as JSON text).
    #[schema(value_type = Object)]
    output: Value,
    #[serde(default)]
    is_error: bool,
}

#[derive(Serialize, utoipa::ToSchema)]
struct Accepted {
    trace_id: TraceId,
    tool_call_id: String,
    /// Always `accepted`.
    status: &'static str,
}

#[utoipa::path(post, operation_id = "submit_tool_result", path = "/api/runs/{id}/tool_results", tag = "chat", params(("id" = Uuid, Path, description = "The trace id of the waiting run")), request_body = ToolResultBody, responses((status = 200, description = "Taken; the run goes on once all its calls have results", body = Accepted), Refused, Missing, (status = 409, description = "The call has its result already, or its run ended", body = ErrorBody)))]
async fn tool_result(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(trace_id): IdPath<TraceId>,
    AppJson(body): AppJson<ToolResultBody>,
) -> Result<Json<Accepted>, AppError> {
    let output = output_text(&body.output);
    if output.chars().count() > MAX_TEXT_CHARS {
        return Err(AppError::validation("output", format!("output is longer than {MAX_TEXT_CHARS} characters")));
    }
    let settled = state.chat.tool_result(&user, trace_id, &body.tool_call_id, output, body.is_error).await?;
    Ok(Json(Accepted { trace_id, tool_call_id: settled.wait.tool_call_id, status: "accepted" }))
}
