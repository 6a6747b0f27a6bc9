//! Liveness, readiness (the database answers and takes writes, the server is not shutting
//! down) and the profile list.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};

use super::AppState;
use super::error::AppError;
use super::views::*;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(ready))
        .route("/api/profiles", get(profiles))
        .route("/metrics", get(metrics))
}

#[utoipa::path(get, operation_id = "healthz", path = "/healthz", tag = "health", responses((status = 200, description = "The process is up", body = StatusBody)))]
async fn healthz() -> Json<StatusBody> {
    Json(StatusBody { status: "ok" })
}

#[utoipa::path(get, operation_id = "metrics", path = "/metrics", tag = "health",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain", body = String)))]
async fn metrics() -> String {
    crate::report::metrics::handle().render()
}

#[utoipa::path(get, operation_id = "readyz", path = "/readyz", tag = "health", responses((status = 200, description = "The database answers and takes writes, and (on Postgres) the other replicas' notices are heard", body = StatusBody), (status = 503, description = "It does not, the notice listener is reconnecting, or the server is shutting down", body = ErrorBody)))]
async fn ready(State(state): State<AppState>) -> Result<Json<StatusBody>, AppError> {
    if state.chat.is_draining() {
        return Err(AppError::Unavailable("Shutting down".into()));
    }
    if state.tools.mcp().starting() {
        return Err(AppError::Unavailable("MCP servers are starting".into()));
    }
    // Another replica's cancels, logs and starts would go unheard: its runs' streams here
    // would stall until the listener is back.
    if !state.store.hears_others() {
        return Err(AppError::Unavailable(
            "Not hearing the other replicas: the notice listener is reconnecting".into(),
        ));
    }
    state.store.ping().await.map_err(|e| {
        tracing::warn!(error = %e, "readiness check failed");
        AppError::Unavailable("Database unavailable".into())
    })?;
    Ok(Json(StatusBody { status: "ready" }))
}

/// The configured profiles, without anything secret (keys live on providers, not here).
#[utoipa::path(get, operation_id = "list_profiles", path = "/api/profiles", tag = "health", responses((status = 200, description = "Configured profiles, never a secret", body = ProfilesView), Refused))]
async fn profiles(State(state): State<AppState>, _user: super::extract::CurrentUser) -> Json<ProfilesView> {
    let settings = &state.settings;
    let profiles = settings
        .profiles
        .iter()
        .map(|(id, p)| ProfileView {
            id: id.clone(),
            provider: p.provider.clone(),
            provider_kind: settings.providers.get(&p.provider).map(|k| k.kind),
            model: p.model.clone(),
            default: *id == settings.chat.default_profile,
            enable_thinking: p.enable_thinking,
            max_iterations: p.max_iterations,
            context_limit: p.context_limit,
        })
        .collect();
    Json(ProfilesView { profiles, default_profile: settings.chat.default_profile.clone() })
}
