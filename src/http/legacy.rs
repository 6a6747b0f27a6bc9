//! The legacy endpoints (CONTRACT.md §11, seed 004), served from the same runs and records:
//! no second agent loop. The stream speaks the legacy vocabulary (`events::legacy`).

use crate::ids::{ConversationId, UserId};
use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;

use super::AppState;
use super::chat::from_the_start;
use super::error::AppError;
use super::extract::{AppQuery, CurrentUser, KeyedJson};
use super::sse::{Legacy, sse};
use super::views::*;
use crate::chat::{ChatRequest, Started};
use crate::config::AuthMode;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/get_chat_response_stream", post(stream))
        .route("/api/load_conversation", get(load))
        .route("/api/list_conversations", get(list))
}

#[utoipa::path(post, operation_id = "legacy_chat_stream", path = "/api/get_chat_response_stream", tag = "legacy", params(("Idempotency-Key" = Option<String>, Header, description = "Makes a retry of this request get the run it started (within 24 h), from its first event, instead of a second run")), request_body = ChatRequest, responses((status = 200, description = "The run in the legacy vocabulary: chunk, tool_start, tool_output, tool_end, error, done", content_type = "text/event-stream", body = SseFrame), Refused, Missing, (status = 413, description = "Too large", body = ErrorBody)))]
async fn stream(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    KeyedJson(key, request): KeyedJson<ChatRequest>,
) -> Result<Response, AppError> {
    let request = ChatRequest { idempotency_key: key, ..request };
    Ok(match state.chat.start_once(&user, request).await? {
        Started::New(run) => sse(&state, from_the_start(&state, run), Legacy::default()),
        Started::Again(trace) => sse(&state, state.chat.follow(*trace, 0, true), Legacy::default()),
    })
}

#[derive(Deserialize)]
struct LoadQuery {
    conversation_id: ConversationId,
}

/// The conversation's messages in order, each with its feedback status.
#[utoipa::path(get, operation_id = "legacy_load_conversation", path = "/api/load_conversation", tag = "legacy", params(("conversation_id" = Uuid, Query, description = "Conversation id")), responses((status = 200, description = "Messages in order with their feedback", body = LegacyConversation), Refused, Missing))]
async fn load(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppQuery(query): AppQuery<LoadQuery>,
) -> Result<Json<LegacyConversation>, AppError> {
    let conversation = state
        .store
        .get_conversation(&user, query.conversation_id)
        .await
        .map_err(AppError::missing("Conversation not found"))?;
    let all = state.store.messages(&user, conversation.id).await?;
    let messages = state
        .chat
        .active_branch(&user, &conversation, &all)
        .await?
        .into_iter()
        .map(|m| LegacyMessage {
            message_id: m.id,
            role: m.role,
            content: m.content,
            timestamp: m.created_at,
            feedback: m.feedback.and_then(|f| f.rating),
            trace_id: m.trace_id,
        })
        .collect();
    Ok(Json(LegacyConversation {
        conversation_id: conversation.id,
        title: conversation.title,
        created_at: conversation.created_at,
        last_message_at: conversation.last_message_at,
        messages,
    }))
}

#[derive(Deserialize)]
struct ListQuery {
    client_id: Option<String>,
}

/// The user's conversations, newest first. In auth mode `none` the legacy `client_id`
/// parameter names the user (as `X-Client-Id` does); with real auth it is ignored.
#[utoipa::path(get, operation_id = "legacy_list_conversations", path = "/api/list_conversations", tag = "legacy", params(("client_id" = Option<String>, Query, description = "The user, in auth mode none")), responses((status = 200, description = "Newest first", body = LegacyList), Refused))]
async fn list(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppQuery(query): AppQuery<ListQuery>,
) -> Result<Json<LegacyList>, AppError> {
    let user = match (state.settings.auth.mode, query.client_id) {
        (AuthMode::None, Some(client)) if !client.trim().is_empty() => UserId::new(client.trim()),
        _ => user,
    };
    let conversations = state.store.list_conversations(&user, state.settings.limits.max_page_size, None).await?;
    let conversations = conversations
        .into_iter()
        .map(|c| LegacyListed {
            conversation_id: c.id,
            title: c.title,
            created_at: c.created_at,
            last_message_at: c.last_message_at,
        })
        .collect();
    Ok(Json(LegacyList { conversations }))
}
