//! Liveness, readiness (the database answers) and the profile list.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};

use super::AppState;
use super::error::AppError;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/readyz", get(ready))
        .route("/api/profiles", get(profiles))
        .route("/metrics", get(|| async { crate::metrics::handle().render() }))
}

async fn ready(State(state): State<AppState>) -> Result<Json<Value>, AppError> {
    state.store.ping().await.map_err(|e| {
        tracing::warn!(error = %e, "readiness check failed");
        AppError::Unavailable("Database unavailable".into())
    })?;
    Ok(Json(json!({"status": "ready"})))
}

/// The configured profiles, without anything secret (keys live on providers, not here).
async fn profiles(State(state): State<AppState>, _user: super::extract::CurrentUser) -> Json<Value> {
    let settings = &state.settings;
    let profiles: Vec<Value> = settings
        .profiles
        .iter()
        .map(|(id, p)| {
            json!({
                "id": id,
                "provider": p.provider,
                "provider_kind": settings.providers.get(&p.provider).map(|k| k.kind),
                "model": p.model,
                "default": *id == settings.chat.default_profile,
                "enable_thinking": p.enable_thinking,
                "max_iterations": p.max_iterations,
                "context_limit": p.context_limit,
            })
        })
        .collect();
    Json(json!({"profiles": profiles, "default_profile": settings.chat.default_profile}))
}
