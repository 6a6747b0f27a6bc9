//! `GET /api/tools`: every tool a request could get, where it comes from, and the state of
//! each MCP server. `?page=&tab=&subtab=&profile=` shows what such a request would get.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;

use super::AppState;
use super::error::AppError;
use super::extract::{AppQuery, CurrentUser};
use super::views::*;
use crate::config::pages::{Location, PageScope};

pub fn routes() -> Router<AppState> {
    Router::new().route("/api/tools", get(list))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Scope {
    page: Option<String>,
    tab: Option<String>,
    subtab: Option<String>,
    profile: Option<String>,
}

#[utoipa::path(get, operation_id = "list_tools", path = "/api/tools", tag = "health", params(("page" = Option<String>, Query, description = "Show what a request on this page gets"), ("tab" = Option<String>, Query, description = "Its tab"), ("subtab" = Option<String>, Query, description = "Its subtab"), ("profile" = Option<String>, Query, description = "Its profile")), responses((status = 200, description = "Every tool and each MCP server's state", body = ToolsView), Refused, Missing))]
async fn list(
    State(state): State<AppState>,
    _user: CurrentUser,
    AppQuery(scope): AppQuery<Scope>,
) -> Result<Json<ToolsView>, AppError> {
    let tools = state
        .tools
        .all()
        .into_iter()
        .map(|t| {
            let spec = t.tool.spec();
            ToolView {
                name: spec.name,
                description: spec.description,
                input_schema: spec.input_schema,
                source: t.source,
                global: t.global,
            }
        })
        .collect();
    let mut body = ToolsView { tools, mcp_servers: state.tools.mcp().status(), for_request: None };
    if scope.page.is_some() || scope.profile.is_some() {
        let profile_name = scope.profile.as_deref().unwrap_or(&state.settings.chat.default_profile);
        let profile = state.settings.profiles.get(profile_name).ok_or_else(|| AppError::NotFound {
            field: Some("profile".into()),
            message: crate::chat::errors::unknown_profile(profile_name),
        })?;
        let location =
            Location { page: scope.page.as_deref(), tab: scope.tab.as_deref(), subtab: scope.subtab.as_deref() };
        let page_scope = PageScope::resolve(&state.settings, location);
        let names: Vec<String> =
            state.tools.for_request(&page_scope, &profile.tools).iter().map(|t| t.name().to_owned()).collect();
        body.for_request = Some(names);
    }
    Ok(Json(body))
}
