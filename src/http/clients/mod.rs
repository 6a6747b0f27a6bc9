//! The client libraries' protocols over the same runs, one folder each: the AI SDK's UI
//! message stream (`ai_sdk`, CONTRACT.md §13.1), AG-UI (`agui`, §13.2) and the OpenAI
//! Responses API (`openai`, §20). Each holds its inbound types, its encoder from the typed
//! events and its ids' mapping; the http layer mounts them here.

pub mod agui;
pub mod ai_sdk;
pub mod openai;

use axum::Router;

use super::AppState;

/// The routes that start runs (under the start's body limit).
pub fn starting() -> Router<AppState> {
    Router::new().merge(ai_sdk::routes()).merge(agui::routes()).merge(openai::routes())
}
