//! The legacy vocabulary (CONTRACT.md §11, seed 004), mapped at the edge from the same runs
//! and records: no second agent loop. `chunk`, `tool_start`, `tool_output`, `tool_end`,
//! `error`, `done`; events with no legacy counterpart are left out.

use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::AppState;
use super::chat::{from_the_start, sse};
use super::error::AppError;
use super::extract::{AppJson, AppQuery, CurrentUser};
use super::views::*;
use crate::chat::{ChatRequest, Frame};
use crate::config::AuthMode;
use crate::domain::branch;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/get_chat_response_stream", post(stream))
        .route("/api/load_conversation", get(load))
        .route("/api/list_conversations", get(list))
}

#[utoipa::path(post, operation_id = "legacy_chat_stream", path = "/api/get_chat_response_stream", tag = "legacy", request_body = ChatRequest, responses((status = 200, description = "The run in the legacy vocabulary: chunk, tool_start, tool_output, tool_end, error, done", content_type = "text/event-stream", body = SseFrame), Refused, Missing, (status = 413, description = "Too large", body = ErrorBody)))]
async fn stream(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppJson(request): AppJson<ChatRequest>,
) -> Result<Response, AppError> {
    let run = state.chat.start(&user, request).await?;
    let mut conversation_id = Value::Null;
    let frames =
        from_the_start(&state, run).filter_map(move |frame| std::future::ready(legacy(frame, &mut conversation_id)));
    Ok(sse(&state, frames))
}

/// One canonical frame in the legacy vocabulary, or `None` where it has no word for it.
/// `start` has no legacy word, but its conversation id goes into every `chunk`.
fn legacy(frame: Frame, conversation_id: &mut Value) -> Option<Frame> {
    let event: Value = serde_json::from_str(&frame.data).ok()?;
    let mapped = match event["type"].as_str()? {
        "start" => {
            *conversation_id = event["conversation_id"].clone();
            return None;
        }
        "text_delta" => {
            json!({"type": "chunk", "content": event["text"], "conversation_id": conversation_id})
        }
        "tool_start" => {
            json!({"type": "tool_start", "tool_call_id": event["tool_call_id"], "tool_name": event["tool"],
                               "tool_args": event["input"], "timestamp": event["timestamp"]})
        }
        "tool_output" => {
            json!({"type": "tool_output", "tool_call_id": event["tool_call_id"], "output": event["output"],
                                "truncated": event["truncated"], "full_length": event["full_length"]})
        }
        "tool_complete" => {
            json!({"type": "tool_end", "tool_call_id": event["tool_call_id"], "status": event["status"],
                                  "duration_ms": event["duration_ms"]})
        }
        "error" => json!({"type": "error", "status": event["code"], "message": event["message"]}),
        "done" => {
            json!({"type": "done", "conversation_id": event["conversation_id"], "message_id": event["message_id"],
                         "trace_id": event["trace_id"]})
        }
        _ => return None,
    };
    Some(Frame { seq: frame.seq, data: mapped.to_string().into(), last: frame.last })
}

#[derive(Deserialize)]
struct LoadQuery {
    conversation_id: Uuid,
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
    let messages = branch(&all, conversation.active_leaf_id)
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
        (AuthMode::None, Some(client)) if !client.trim().is_empty() => client.trim().to_owned(),
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
