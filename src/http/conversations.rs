//! Conversations and messages (CONTRACT.md §3, §8): create, list with a keyset cursor, load
//! the active branch, patch, delete (cascading), and feedback on a message.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, put};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::Value;

use super::AppState;
use super::error::AppError;
use super::extract::{AppJson, AppQuery, CurrentUser, IdPath};
use super::views::*;
use crate::domain::{Conversation, Feedback, Rating, branch, branch_through, now};
use crate::ids::{ConversationId, MessageId, UserId};
use crate::store::{ConversationPatch, PageCursor};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/conversations", get(list).post(create))
        .route("/api/conversations/{id}", get(load).patch(patch).delete(delete))
        .route("/api/conversations/{id}/stream", get(stream))
        .route("/api/messages/{id}/feedback", put(feedback))
        .route("/api/messages/{id}/siblings", get(siblings))
        .route("/api/messages/{id}/activate", axum::routing::post(activate))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    limit: Option<u32>,
    cursor: Option<String>,
}

#[utoipa::path(get, operation_id = "list_conversations", path = "/api/conversations", tag = "conversations", params(("limit" = Option<u32>, Query, description = "Page size"), ("cursor" = Option<String>, Query, description = "`next_cursor` of the previous page")), responses((status = 200, description = "Newest `last_message_at` first", body = ConversationList), Refused))]
async fn list(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppQuery(query): AppQuery<ListQuery>,
) -> Result<Json<ConversationList>, AppError> {
    let limits = &state.settings.limits;
    let limit = query.limit.unwrap_or(limits.default_page_size);
    if limit == 0 || limit > limits.max_page_size {
        return Err(AppError::validation("limit", format!("limit must be between 1 and {}", limits.max_page_size)));
    }
    let cursor = match query.cursor.as_deref() {
        Some(text) => Some(PageCursor::parse(text).ok_or_else(|| AppError::validation("cursor", "Invalid cursor"))?),
        None => None,
    };
    let mut conversations = state.store.list_conversations(&user, limit + 1, cursor).await?;
    let next_cursor = if conversations.len() > limit as usize {
        conversations.truncate(limit as usize);
        conversations.last().map(|c| PageCursor { last_message_at: c.last_message_at, id: c.id }.encode())
    } else {
        None
    };
    Ok(Json(ConversationList { conversations, next_cursor }))
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ConversationBody {
    title: Option<String>,
    profile: Option<String>,
    system_prompt: Option<String>,
    metadata: Option<Value>,
}

impl ConversationBody {
    /// Checks the fields both create and patch accept.
    fn validate(&self, state: &AppState) -> Result<(), AppError> {
        if self.title.as_deref().is_some_and(|t| t.trim().is_empty()) {
            return Err(AppError::validation("title", "Title cannot be empty"));
        }
        if let Some(profile) = &self.profile {
            if !state.settings.profiles.contains_key(profile) {
                return Err(AppError::NotFound {
                    field: Some("profile".into()),
                    message: crate::chat::errors::unknown_profile(profile),
                });
            }
        }
        if self.metadata.as_ref().is_some_and(|m| !m.is_object()) {
            return Err(AppError::validation("metadata", "metadata must be a JSON object"));
        }
        Ok(())
    }
}

#[utoipa::path(post, operation_id = "create_conversation", path = "/api/conversations", tag = "conversations", request_body = ConversationBody, responses((status = 201, description = "Created", body = ConversationView), Refused, Missing))]
async fn create(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppJson(body): AppJson<ConversationBody>,
) -> Result<(StatusCode, Json<ConversationView>), AppError> {
    body.validate(&state)?;
    let conversation = Conversation {
        profile: body.profile,
        system_prompt: body.system_prompt,
        metadata: body.metadata.unwrap_or_else(|| Value::Object(serde_json::Map::new())),
        ..Conversation::new(&user, body.title.map_or_else(|| "New conversation".to_owned(), |t| t.trim().to_owned()))
    };
    state.store.create_conversation(&conversation).await?;
    Ok((
        StatusCode::CREATED,
        Json(ConversationView { conversation, messages: Vec::new(), context_state: None, active_runs: Vec::new() }),
    ))
}

#[utoipa::path(get, operation_id = "get_conversation", path = "/api/conversations/{id}", tag = "conversations", params(("id" = Uuid, Path, description = "Conversation id")), responses((status = 200, description = "The conversation with its active branch, oldest first", body = ConversationView), Refused, Missing))]
async fn load(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<ConversationId>,
) -> Result<Json<ConversationView>, AppError> {
    let conversation =
        state.store.get_conversation(&user, id).await.map_err(AppError::missing("Conversation not found"))?;
    let messages = state.store.messages(&user, id).await?;
    let context_state = state.store.context_state(&user, id).await?;
    let active_runs = active_runs(&state, &user, id).await?;
    // Across the answers still being written: a queued message follows one (CONTRACT.md §16).
    let pending: Vec<_> = active_runs.iter().map(|r| (r.message_id, r.user_message_id)).collect();
    let messages = branch_through(&messages, &pending, conversation.active_leaf_id);
    Ok(Json(ConversationView { conversation, messages, context_state, active_runs }))
}

#[utoipa::path(patch, operation_id = "update_conversation", path = "/api/conversations/{id}", tag = "conversations", params(("id" = Uuid, Path, description = "Conversation id")), request_body = ConversationBody, responses((status = 200, description = "Changed", body = Conversation), Refused, Missing))]
async fn patch(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<ConversationId>,
    AppJson(body): AppJson<ConversationBody>,
) -> Result<Json<Conversation>, AppError> {
    body.validate(&state)?;
    let patch = ConversationPatch {
        title: body.title.map(|t| t.trim().to_owned()),
        profile: body.profile,
        system_prompt: body.system_prompt,
        metadata: body.metadata,
    };
    let conversation = state
        .store
        .update_conversation(&user, id, &patch)
        .await
        .map_err(AppError::missing("Conversation not found"))?;
    Ok(Json(conversation))
}

#[utoipa::path(delete, operation_id = "delete_conversation", path = "/api/conversations/{id}", tag = "conversations", params(("id" = Uuid, Path, description = "Conversation id")), responses((status = 204, description = "Deleted with its messages, traces and context state"), Refused, Missing))]
async fn delete(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<ConversationId>,
) -> Result<StatusCode, AppError> {
    state.store.get_conversation(&user, id).await.map_err(AppError::missing("Conversation not found"))?;
    state.chat.stop_runs_in(&user, id).await;
    let freed =
        state.store.delete_conversation(&user, id).await.map_err(AppError::missing("Conversation not found"))?;
    state.chat.conversation_deleted(id).await;
    state.files.forget(&freed).await;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct FeedbackBody {
    rating: Option<Rating>,
    comment: Option<String>,
}

#[utoipa::path(put, operation_id = "set_feedback", path = "/api/messages/{id}/feedback", tag = "conversations", params(("id" = Uuid, Path, description = "Message id")), request_body = FeedbackBody, responses((status = 200, description = "Stored", body = FeedbackResult), Refused, Missing))]
async fn feedback(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<MessageId>,
    AppJson(body): AppJson<FeedbackBody>,
) -> Result<Json<FeedbackResult>, AppError> {
    let comment = body.comment.map(|c| c.trim().to_owned()).filter(|c| !c.is_empty());
    let feedback =
        (body.rating.is_some() || comment.is_some()).then(|| Feedback { rating: body.rating, comment, at: now() });
    let message =
        state.store.set_feedback(&user, id, feedback).await.map_err(AppError::missing("Message not found"))?;
    Ok(Json(FeedbackResult { message_id: message.id, feedback: message.feedback }))
}

/// The message and its siblings (the other answers to, or edits of, the same point), oldest
/// first, each marked whether it is on the active branch.
#[utoipa::path(get, operation_id = "list_siblings", path = "/api/messages/{id}/siblings", tag = "conversations", params(("id" = Uuid, Path, description = "Message id")), responses((status = 200, description = "The alternatives at that point", body = SiblingsView), Refused, Missing))]
async fn siblings(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<MessageId>,
) -> Result<Json<SiblingsView>, AppError> {
    let message = state.store.get_message(&user, id).await.map_err(AppError::missing("Message not found"))?;
    let conversation = state.store.get_conversation(&user, message.conversation_id).await?;
    let all = state.store.messages(&user, message.conversation_id).await?;
    let active: Vec<MessageId> = branch(&all, conversation.active_leaf_id).iter().map(|m| m.id).collect();
    let siblings = all
        .into_iter()
        .filter(|m| m.parent_id == message.parent_id && m.role == message.role)
        .map(|m| SiblingView { active: active.contains(&m.id), message: m })
        .collect();
    Ok(Json(SiblingsView { message_id: id, parent_id: message.parent_id, siblings }))
}

/// Makes the branch through this message the active one (down to its newest descendants) and
/// returns the conversation as it now loads.
#[utoipa::path(post, operation_id = "activate_branch", path = "/api/messages/{id}/activate", tag = "conversations", params(("id" = Uuid, Path, description = "Message id")), responses((status = 200, description = "The conversation on its new active branch", body = ConversationView), Refused, Missing))]
async fn activate(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<MessageId>,
) -> Result<Json<ConversationView>, AppError> {
    let message = state.store.get_message(&user, id).await.map_err(AppError::missing("Message not found"))?;
    let all = state.store.messages(&user, message.conversation_id).await?;
    let leaf = crate::domain::branch::newest_leaf(&all, message.id);
    state.store.set_active_leaf(&user, message.conversation_id, leaf).await?;
    let conversation = state.store.get_conversation(&user, message.conversation_id).await?;
    let context_state = state.store.context_state(&user, conversation.id).await?;
    let active_runs = active_runs(&state, &user, conversation.id).await?;
    let pending: Vec<_> = active_runs.iter().map(|r| (r.message_id, r.user_message_id)).collect();
    let messages = branch_through(&all, &pending, Some(leaf));
    Ok(Json(ConversationView { conversation, messages, context_state, active_runs }))
}

/// The conversation's runs still going, as loading shows them (CONTRACT.md §16).
async fn active_runs(state: &AppState, user: &UserId, id: ConversationId) -> Result<Vec<ActiveRun>, AppError> {
    Ok(state
        .chat
        .active_runs(user, id)
        .await?
        .into_iter()
        .map(|(trace, last_seq)| ActiveRun {
            trace_id: trace.trace_id,
            message_id: trace.message_id,
            user_message_id: trace.user_message_id,
            status: trace.status,
            last_seq,
        })
        .collect())
}

#[utoipa::path(get, operation_id = "conversation_stream", path = "/api/conversations/{id}/stream", tag = "conversations", params(("id" = Uuid, Path, description = "Conversation id")), responses((status = 200, description = "Every run of the conversation as SSE: the going ones from their first event, then each that starts, every event with its `trace_id` and `seq` (`id: <trace_id>:<seq>`), keep-alives between, until the client leaves or the conversation is deleted", content_type = "text/event-stream", body = SseFrame), Refused, Missing))]
async fn stream(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<ConversationId>,
) -> Result<axum::response::Response, AppError> {
    state.store.get_conversation(&user, id).await.map_err(AppError::missing("Conversation not found"))?;
    Ok(super::sse::sse(&state, state.chat.follow_conversation(&user, id), super::sse::Conversational))
}
