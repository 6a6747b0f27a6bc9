//! Webhook deliveries (CONTRACT.md §18): `GET /api/webhooks/deliveries` lists the newest,
//! with their status, attempts and last error, for the users in `auth.admins` (the others
//! get 404: the deliveries are the operator's, not theirs).

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use crate::http::AppState;
use crate::http::error::AppError;
use crate::http::extract::{AppQuery, CurrentUser};
use crate::http::views::{Missing, Refused};
use crate::store::{Delivery, DeliveryFilter, DeliveryStatus};

pub fn routes() -> Router<AppState> {
    Router::new().route("/api/webhooks/deliveries", get(deliveries))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeliveriesQuery {
    status: Option<String>,
    endpoint: Option<String>,
    limit: Option<u32>,
}

/// `GET /api/webhooks/deliveries`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct DeliveriesView {
    /// Newest first.
    pub deliveries: Vec<Delivery>,
}

/// Deliveries listed when `limit` is not given.
const DEFAULT_LIMIT: u32 = 50;

#[utoipa::path(get, operation_id = "list_webhook_deliveries", path = "/api/webhooks/deliveries", tag = "usage",
    params(
        ("status" = Option<String>, Query, description = "`pending`, `delivered`, `failed` or `disabled`"),
        ("endpoint" = Option<String>, Query, description = "One endpoint's (its id in `webhooks.<id>`)"),
        ("limit" = Option<u32>, Query, description = "1..`limits.max_page_size`; default 50"),
    ),
    responses((status = 200, description = "The newest deliveries", body = DeliveriesView), Refused, Missing))]
async fn deliveries(
    State(state): State<AppState>,
    CurrentUser(me): CurrentUser,
    AppQuery(query): AppQuery<DeliveriesQuery>,
) -> Result<Json<DeliveriesView>, AppError> {
    if !state.settings.auth.admins.iter().any(|a| a == me.as_str()) {
        return Err(AppError::NotFound {
            field: None,
            message: "Webhook deliveries are shown to the users in auth.admins".into(),
        });
    }
    let max = state.settings.limits.max_page_size;
    let limit = query.limit.unwrap_or(DEFAULT_LIMIT.min(max));
    if limit == 0 || limit > max {
        return Err(AppError::validation("limit", format!("`limit` must be between 1 and {max}")));
    }
    let status = match query.status.as_deref() {
        None => None,
        Some(text) => Some(DeliveryStatus::parse(text).ok_or_else(|| {
            AppError::validation(
                "status",
                format!("Unknown status '{text}': one of pending, delivered, failed, disabled"),
            )
        })?),
    };
    let filter = DeliveryFilter { status, endpoint: query.endpoint, limit };
    Ok(Json(DeliveriesView { deliveries: state.store.deliveries(&filter).await? }))
}
