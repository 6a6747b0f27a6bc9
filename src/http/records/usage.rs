//! What runs spent (CONTRACT.md §18): `GET /api/usage` sums a user's tokens, cost and runs
//! over a period, by day, model, profile or user. Users listed in `auth.admins` may ask for
//! another user's, or everyone's; the others see their own.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

use crate::domain::now;
use crate::http::AppState;
use crate::http::error::AppError;
use crate::http::extract::{AppQuery, CurrentUser};
use crate::http::views::{Missing, Refused};
use crate::ids::UserId;
use crate::store::{UsageGroup, UsageGrouping};

pub fn routes() -> Router<AppState> {
    Router::new().route("/api/usage", get(usage))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UsageQuery {
    from: Option<String>,
    to: Option<String>,
    group_by: Option<String>,
    user: Option<String>,
}

/// `GET /api/usage`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct UsageView {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub group_by: String,
    pub groups: Vec<UsageGroup>,
    /// Every group's sums together (its `key` is `total`).
    pub total: UsageGroup,
}

/// How far back a period starts when `from` is not given.
const DEFAULT_PERIOD_DAYS: i64 = 30;

#[utoipa::path(get, operation_id = "get_usage", path = "/api/usage", tag = "usage",
    params(
        ("from" = Option<String>, Query, description = "RFC 3339; default 30 days before `to`"),
        ("to" = Option<String>, Query, description = "RFC 3339; default now"),
        ("group_by" = Option<String>, Query, description = "`day` (default), `model`, `profile` or `user`"),
        ("user" = Option<String>, Query, description = "Another user's usage (admins only)"),
    ),
    responses((status = 200, description = "Sums per group and in total", body = UsageView), Refused, Missing))]
async fn usage(
    State(state): State<AppState>,
    CurrentUser(me): CurrentUser,
    AppQuery(query): AppQuery<UsageQuery>,
) -> Result<Json<UsageView>, AppError> {
    let to = time("to", query.to.as_deref())?.unwrap_or_else(now);
    let from = time("from", query.from.as_deref())?.unwrap_or(to - Duration::days(DEFAULT_PERIOD_DAYS));
    if from > to {
        return Err(AppError::validation("from", "`from` is after `to`"));
    }
    let group_by = query.group_by.as_deref().unwrap_or("day");
    let grouping = match group_by {
        "day" => UsageGrouping::Day,
        "model" => UsageGrouping::Model,
        "profile" => UsageGrouping::Profile,
        "user" => UsageGrouping::User,
        other => {
            return Err(AppError::validation(
                "group_by",
                format!("Unknown group_by '{other}': one of day, model, profile, user"),
            ));
        }
    };
    let admin = state.settings.auth.admins.iter().any(|a| a == me.as_str());
    // An admin sees everyone's unless they name one user; the others only their own (and
    // another user, named, is not found: never a hint that they exist).
    let whose: Option<UserId> = match (query.user, admin) {
        (Some(user), true) => Some(UserId::new(user)),
        (None, true) => None,
        (Some(user), false) if user != me.as_str() => {
            return Err(AppError::NotFound { field: Some("user".into()), message: "User not found".into() });
        }
        (_, false) => Some(me),
    };
    let groups = state.store.usage_sums(whose.as_ref(), from, to, grouping).await?;
    let mut total = UsageGroup { key: "total".into(), ..UsageGroup::default() };
    for group in &groups {
        total.runs += group.runs;
        total.input_tokens += group.input_tokens;
        total.output_tokens += group.output_tokens;
        total.cache_read_tokens += group.cache_read_tokens;
        total.cache_write_tokens += group.cache_write_tokens;
        total.cost_usd = match (total.cost_usd, group.cost_usd) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        };
    }
    Ok(Json(UsageView { from, to, group_by: group_by.to_owned(), groups, total }))
}

/// A query's time, RFC 3339.
fn time(field: &'static str, value: Option<&str>) -> Result<Option<DateTime<Utc>>, AppError> {
    value
        .map(|v| {
            DateTime::parse_from_rfc3339(v)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|_| AppError::validation(field, format!("`{field}` is not an RFC 3339 time: '{v}'")))
        })
        .transpose()
}
