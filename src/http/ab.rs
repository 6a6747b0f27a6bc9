//! A/B comparisons (CONTRACT.md §10): one message answered by two profiles over one SSE
//! stream, the comparison with what each side cost and did, votes, and the leaderboard.

use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::AppState;
use super::chat::from_the_start;
use super::error::AppError;
use super::extract::{AppJson, CurrentUser, IdPath, KeyedJson, parse_json};
use super::sse::{Comparisons, Paired, sse};
use super::views::*;
use crate::chat::arena;
use crate::chat::{ChatRequest, Frame, Started};
use crate::domain::{Comparison, Preference};
use crate::events::comparison::Variant;
use crate::ids::{ComparisonId, TraceId, UserId};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/ab/stream", post(stream))
        .route("/api/ab/leaderboard", get(leaderboard))
        .route("/api/ab/{id}", get(show))
        .route("/api/ab/{id}/vote", post(vote).put(change_vote))
}

#[utoipa::path(post, operation_id = "ab_stream", path = "/api/ab/stream", tag = "ab", params(("Idempotency-Key" = Option<String>, Header, description = "Makes a retry of this request get the run it started (within 24 h), from its first event, instead of a second run")), request_body = AbStreamBody, responses((status = 200, description = "Both runs as SSE: a `comparison` event, every event of both runs tagged with `variant`, one `done`", content_type = "text/event-stream", body = SseFrame), Refused, Missing, (status = 413, description = "Too large", body = ErrorBody)))]
async fn stream(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    KeyedJson(key, mut body): KeyedJson<Map<String, Value>>,
) -> Result<Response, AppError> {
    let mut profile = |field: &'static str| match body.remove(field) {
        Some(Value::String(name)) if !name.trim().is_empty() => Ok(name),
        Some(_) => Err(AppError::validation(field, format!("{field} must be a profile name"))),
        None => Err(AppError::validation(field, format!("{field} is required"))),
    };
    let (profile_a, profile_b) = (profile("profile_a")?, profile("profile_b")?);
    let request: ChatRequest = parse_json(&serde_json::to_vec(&body).expect("a map serializes"))?;
    let request = ChatRequest { idempotency_key: key, ..request };
    match state.chat.start_comparison_once(&user, &request, &profile_a, &profile_b).await? {
        Started::New((comparison, run_a, run_b)) => {
            let encoder = Comparisons::new(comparison, run_a.message_id, run_b.message_id);
            let (frames_a, frames_b) = (from_the_start(&state, run_a), from_the_start(&state, run_b));
            Ok(sse(&state, paired(frames_a, frames_b), encoder))
        }
        // A repeat: both runs from their first events, from wherever they are.
        Started::Again(trace) => {
            let comparison_id = trace.comparison_id.ok_or(AppError::Internal)?;
            let comparison = state.store.get_comparison(&user, comparison_id).await?;
            let a = state.store.get_trace(&user, comparison.trace_a).await?;
            let b = state.store.get_trace(&user, comparison.trace_b).await?;
            let encoder = Comparisons::new(comparison, a.message_id, b.message_id);
            let (frames_a, frames_b) = (state.chat.follow(a, 0, true), state.chat.follow(b, 0, true));
            Ok(sse(&state, paired(frames_a, frames_b), encoder))
        }
    }
}

/// Both runs as one stream: the opening, then every event of both but their own `done`,
/// as they come, then the closing.
fn paired(
    frames_a: impl Stream<Item = Frame> + Send + 'static,
    frames_b: impl Stream<Item = Frame> + Send + 'static,
) -> impl Stream<Item = Paired> + Send + 'static {
    let side =
        |variant| move |frame: Frame| std::future::ready((!frame.is_last()).then_some(Paired::Side(variant, frame)));
    let sides =
        futures_util::stream::select(frames_a.filter_map(side(Variant::A)), frames_b.filter_map(side(Variant::B)));
    futures_util::stream::once(std::future::ready(Paired::Opening))
        .chain(sides)
        .chain(futures_util::stream::once(std::future::ready(Paired::Closing)))
}

/// The comparison with, for each side, its trace's status, model, timings and usage.
#[utoipa::path(get, operation_id = "get_comparison", path = "/api/ab/{id}", tag = "ab", params(("id" = Uuid, Path, description = "Comparison id")), responses((status = 200, description = "The comparison and both sides' costs", body = ComparisonView), Refused, Missing))]
async fn show(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<ComparisonId>,
) -> Result<Json<ComparisonView>, AppError> {
    let comparison = state.store.get_comparison(&user, id).await.map_err(AppError::missing("Comparison not found"))?;
    describe(&state, &user, comparison).await.map(Json)
}

async fn describe(state: &AppState, user: &UserId, comparison: Comparison) -> Result<ComparisonView, AppError> {
    // Together: each may wait a moment for its run's last events to be logged.
    let (a, b) = tokio::try_join!(
        side(state, user, comparison.trace_a, &comparison.profile_a),
        side(state, user, comparison.trace_b, &comparison.profile_b)
    )?;
    Ok(ComparisonView { comparison, a, b })
}

async fn side(state: &AppState, user: &UserId, trace_id: TraceId, profile: &str) -> Result<SideView, AppError> {
    // A run that has just sent `done` may not have its log written yet.
    let (trace, events) = state.chat.whole_log(state.store.get_trace(user, trace_id).await?).await?;
    let first_token =
        events.iter().find(|e| matches!(e.event, Some(Event::TextDelta { .. } | Event::ThinkingDelta { .. })));
    Ok(SideView {
        trace_id: trace.trace_id,
        message_id: trace.message_id,
        model: trace.model,
        profile: profile.to_owned(),
        status: trace.status,
        time_to_first_token_ms: first_token.map(|e| (e.at - trace.started_at).num_milliseconds()),
        duration_ms: trace.ended_at.map(|end| (end - trace.started_at).num_milliseconds()),
        usage: trace.usage,
        cost: trace.cost,
    })
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct VoteBody {
    preference: Preference,
}

/// Records a vote; a different vote than the one recorded is a conflict (change it with PUT).
#[utoipa::path(post, operation_id = "vote", path = "/api/ab/{id}/vote", tag = "ab", params(("id" = Uuid, Path, description = "Comparison id")), request_body = VoteBody, responses((status = 200, description = "Recorded", body = ComparisonView), Refused, Missing, (status = 409, description = "Another vote was recorded; change it with PUT", body = ErrorBody)))]
async fn vote(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<ComparisonId>,
    AppJson(body): AppJson<VoteBody>,
) -> Result<Json<ComparisonView>, AppError> {
    cast(&state, &user, id, body.preference, false).await
}

/// Changes a vote; the history keeps the earlier ones.
#[utoipa::path(put, operation_id = "change_vote", path = "/api/ab/{id}/vote", tag = "ab", params(("id" = Uuid, Path, description = "Comparison id")), request_body = VoteBody, responses((status = 200, description = "Changed; the history keeps the earlier votes", body = ComparisonView), Refused, Missing))]
async fn change_vote(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<ComparisonId>,
    AppJson(body): AppJson<VoteBody>,
) -> Result<Json<ComparisonView>, AppError> {
    cast(&state, &user, id, body.preference, true).await
}

async fn cast(
    state: &AppState,
    user: &UserId,
    id: ComparisonId,
    preference: Preference,
    change: bool,
) -> Result<Json<ComparisonView>, AppError> {
    let comparison =
        state.store.vote(user, id, preference, change).await.map_err(AppError::missing("Comparison not found"))?;
    describe(state, user, comparison).await.map(Json)
}

#[utoipa::path(get, operation_id = "leaderboard", path = "/api/ab/leaderboard", tag = "ab", responses((status = 200, description = "Standings per model", body = LeaderboardView), Refused))]
async fn leaderboard(State(state): State<AppState>, _user: CurrentUser) -> Result<Json<LeaderboardView>, AppError> {
    let voted = state.store.voted_comparisons().await?;
    Ok(Json(LeaderboardView {
        models: arena::leaderboard(&voted),
        votes: voted.len(),
        k: arena::K,
        start: arena::START,
    }))
}
