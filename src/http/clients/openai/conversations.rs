//! The Conversations API (CONTRACT.md §20): chatd's own conversations, as the `openai` SDKs
//! name them (`conv_<id>`); the native API, the web page and the other vocabularies see the
//! same ones. Their items are the active branch's messages.

use axum::extract::{Path, State};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::object::{Refused, conversation_id, parse_id};
use crate::domain::{Conversation, Message, Role};
use crate::http::AppState;
use crate::http::error::AppError;
use crate::http::extract::{AppJson, AppQuery, CurrentUser};
use crate::ids::{ConversationId, UserId};
use crate::store::ConversationPatch;

pub fn routes() -> Router<AppState> {
    use axum::routing::{get, post};
    Router::new()
        .route("/v1/conversations", post(create))
        .route("/v1/conversations/{id}", get(retrieve).post(update).delete(delete))
        .route("/v1/conversations/{id}/items", get(items))
}

/// A conversation, as the SDKs read it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = OpenAiConversation)]
pub struct ConversationObject {
    pub id: String,
    pub object: &'static str,
    pub created_at: i64,
    #[schema(value_type = Object)]
    pub metadata: Value,
}

impl From<&Conversation> for ConversationObject {
    fn from(c: &Conversation) -> Self {
        let metadata = match &c.metadata {
            Value::Object(_) => c.metadata.clone(),
            _ => Value::Object(serde_json::Map::new()),
        };
        Self { id: conversation_id(c.id), object: "conversation", created_at: c.created_at.timestamp(), metadata }
    }
}

/// `POST /v1/conversations`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = OpenAiConversationBody)]
pub struct CreateBody {
    /// Items to start it with: none yet (a message is added by a response).
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub items: Option<Vec<Value>>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Map<String, Value>>,
}

/// `POST /v1/conversations/{id}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = OpenAiConversationUpdate)]
pub struct UpdateBody {
    #[schema(value_type = Object)]
    pub metadata: Option<serde_json::Map<String, Value>>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = OpenAiConversationDeleted)]
pub struct Deleted {
    pub id: String,
    pub object: &'static str,
    pub deleted: bool,
}

/// A message of the conversation, as an item.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = OpenAiConversationItem)]
pub struct Item {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: &'static str,
    pub status: &'static str,
    pub content: Vec<ItemContent>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = OpenAiItemContent)]
pub struct ItemContent {
    /// `input_text` (the user's) or `output_text` (the answer's).
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
    /// On `output_text` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub annotations: Option<Vec<Value>>,
}

impl Item {
    /// A user's or an answer's message as an item; `None` for another role.
    pub fn of(message: &Message) -> Option<Self> {
        let (role, content) = match message.role {
            Role::User => {
                ("user", ItemContent { kind: "input_text", text: message.content.clone(), annotations: None })
            }
            Role::Assistant => (
                "assistant",
                ItemContent {
                    kind: "output_text",
                    text: without_markers(&message.content),
                    annotations: Some(Vec::new()),
                },
            ),
            _ => return None,
        };
        Some(Item {
            id: format!("msg_{}", message.id.0.simple()),
            kind: "message",
            role,
            status: "completed",
            content: vec![content],
        })
    }
}

/// An answer's text without the `[[tool:N]]` markers that say where its tool calls stood.
fn without_markers(content: &str) -> String {
    let mut text = String::with_capacity(content.len());
    let mut rest = content;
    while let Some(start) = rest.find("[[tool:") {
        let Some(len) = rest[start..].find("]]") else { break };
        let marker = &rest[start + "[[tool:".len()..start + len];
        if marker.is_empty() || !marker.bytes().all(|b| b.is_ascii_digit()) {
            text.push_str(&rest[..start + 2]);
            rest = &rest[start + 2..];
            continue;
        }
        text.push_str(rest[..start].strip_suffix("\n\n").unwrap_or(&rest[..start]));
        rest = &rest[start + len + 2..];
    }
    text.push_str(rest);
    text
}

/// `GET /v1/conversations/{id}/items`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = OpenAiConversationItems)]
pub struct ItemList {
    pub object: &'static str,
    pub data: Vec<Item>,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
    pub has_more: bool,
}

impl ItemList {
    pub fn of(data: Vec<Item>, has_more: bool) -> Self {
        let (first_id, last_id) = (data.first().map(|i| i.id.clone()), data.last().map(|i| i.id.clone()));
        ItemList { object: "list", data, first_id, last_id, has_more }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ItemsQuery {
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<u32>,
    #[serde(default)]
    order: Option<String>,
    /// Accepted: every item is whole already.
    #[serde(default, rename = "include[]")]
    #[allow(dead_code)]
    include: Option<String>,
}

/// Items listed when `limit` is not given, and at most.
const DEFAULT_LIMIT: u32 = 20;
const MAX_LIMIT: u32 = 100;

async fn owned(state: &AppState, user: &UserId, id: &str) -> Result<Conversation, AppError> {
    let id: ConversationId = parse_id("conv", id).ok_or_else(|| AppError::not_found("Conversation not found"))?.into();
    state.store.get_conversation(user, id).await.map_err(AppError::missing("Conversation not found"))
}

#[utoipa::path(post, operation_id = "openai_create_conversation", path = "/v1/conversations", tag = "openai",
    request_body = CreateBody,
    responses((status = 200, description = "The conversation", body = ConversationObject), Refused))]
pub async fn create(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    AppJson(body): AppJson<CreateBody>,
) -> Result<Json<ConversationObject>, AppError> {
    if body.items.as_ref().is_some_and(|items| !items.is_empty()) {
        return Err(AppError::validation("items", "items are not built yet: add a message with POST /v1/responses"));
    }
    let conversation = Conversation {
        metadata: Value::Object(body.metadata.unwrap_or_default()),
        ..Conversation::new(&user, "New conversation".to_owned())
    };
    state.store.create_conversation(&conversation).await?;
    Ok(Json(ConversationObject::from(&conversation)))
}

#[utoipa::path(get, operation_id = "openai_retrieve_conversation", path = "/v1/conversations/{id}", tag = "openai",
    params(("id" = String, Path, description = "`conv_<conversation id>`")),
    responses((status = 200, description = "The conversation", body = ConversationObject), Refused))]
pub async fn retrieve(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path(id): Path<String>,
) -> Result<Json<ConversationObject>, AppError> {
    Ok(Json(ConversationObject::from(&owned(&state, &user, &id).await?)))
}

#[utoipa::path(post, operation_id = "openai_update_conversation", path = "/v1/conversations/{id}", tag = "openai",
    params(("id" = String, Path, description = "`conv_<conversation id>`")), request_body = UpdateBody,
    responses((status = 200, description = "The conversation, its metadata replaced", body = ConversationObject), Refused))]
pub async fn update(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path(id): Path<String>,
    AppJson(body): AppJson<UpdateBody>,
) -> Result<Json<ConversationObject>, AppError> {
    let conversation = owned(&state, &user, &id).await?;
    let patch = ConversationPatch {
        title: None,
        profile: None,
        system_prompt: None,
        metadata: Some(Value::Object(body.metadata.unwrap_or_default())),
    };
    let conversation = state
        .store
        .update_conversation(&user, conversation.id, &patch)
        .await
        .map_err(AppError::missing("Conversation not found"))?;
    Ok(Json(ConversationObject::from(&conversation)))
}

#[utoipa::path(delete, operation_id = "openai_delete_conversation", path = "/v1/conversations/{id}", tag = "openai",
    params(("id" = String, Path, description = "`conv_<conversation id>`")),
    responses((status = 200, description = "Deleted with its messages and runs", body = Deleted), Refused))]
pub async fn delete(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path(id): Path<String>,
) -> Result<Json<Deleted>, AppError> {
    let conversation = owned(&state, &user, &id).await?;
    // As the native delete: its runs stop, then it goes with its messages and files.
    state.chat.stop_runs_in(&user, conversation.id).await;
    let freed = state
        .store
        .delete_conversation(&user, conversation.id)
        .await
        .map_err(AppError::missing("Conversation not found"))?;
    state.chat.conversation_deleted(conversation.id).await;
    state.files.forget(&freed).await;
    Ok(Json(Deleted { id: conversation_id(conversation.id), object: "conversation.deleted", deleted: true }))
}

#[utoipa::path(get, operation_id = "openai_list_conversation_items", path = "/v1/conversations/{id}/items", tag = "openai",
    params(
        ("id" = String, Path, description = "`conv_<conversation id>`"),
        ("after" = Option<String>, Query, description = "The items after this one, in the order asked"),
        ("limit" = Option<u32>, Query, description = "1..100; default 20"),
        ("order" = Option<String>, Query, description = "`desc` (default: newest first) or `asc`"),
    ),
    responses((status = 200, description = "The active branch's messages as items", body = ItemList), Refused))]
pub async fn items(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path(id): Path<String>,
    AppQuery(query): AppQuery<ItemsQuery>,
) -> Result<Json<ItemList>, AppError> {
    let conversation = owned(&state, &user, &id).await?;
    let limit = query.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(AppError::validation("limit", format!("`limit` must be between 1 and {MAX_LIMIT}")));
    }
    let messages = state.store.messages(&user, conversation.id).await?;
    let mut items: Vec<Item> =
        crate::domain::branch(&messages, conversation.active_leaf_id).iter().filter_map(Item::of).collect();
    match query.order.as_deref() {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(other) => return Err(AppError::validation("order", format!("Unknown order '{other}': asc or desc"))),
    }
    if let Some(after) = &query.after {
        let at = items.iter().position(|item| &item.id == after).ok_or_else(|| AppError::NotFound {
            field: Some("after".into()),
            message: format!("No item {after} in this conversation"),
        })?;
        items.drain(..=at);
    }
    let has_more = items.len() > limit as usize;
    items.truncate(limit as usize);
    Ok(Json(ItemList::of(items, has_more)))
}

#[cfg(test)]
mod tests {
    use super::without_markers;

    #[test]
    fn an_answers_markers_are_left_out() {
        assert_eq!(
            without_markers("Mock reply: Add them\n\n[[tool:0]]\n\nThe tools answered."),
            "Mock reply: Add them\n\nThe tools answered."
        );
        assert_eq!(without_markers("a [[tool:x]] b [[tool:12]]"), "a [[tool:x]] b ");
        assert_eq!(without_markers("no markers"), "no markers");
        assert_eq!(without_markers("cut [[tool:3"), "cut [[tool:3");
    }
}
