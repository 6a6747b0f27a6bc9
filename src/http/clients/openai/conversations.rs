//! The Conversations API (CONTRACT.md §20): chatd's own conversations, as the `openai` SDKs
//! name them (`conv_<id>`); the native API, the web page and the other vocabularies see the
//! same ones. Their items are the active branch's messages.

use axum::extract::{Path, State};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::body::MessageItem;
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
        .route("/v1/conversations/{id}/items", get(items).post(add_items))
        .route("/v1/conversations/{id}/items/{item_id}", get(item).delete(delete_item))
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
    /// Messages to start it with (user and assistant messages, text only).
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub items: Option<Vec<MessageItem>>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Map<String, Value>>,
}

/// `POST /v1/conversations/{id}/items`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = OpenAiConversationItemsBody)]
pub struct AddItemsBody {
    /// User and assistant messages, text only (a file comes with a response).
    #[schema(value_type = Vec<Object>)]
    pub items: Vec<MessageItem>,
}

/// The messages a conversation's new items are, after the active branch: user messages,
/// and answers stored as they are given (without a run), of text only (a file comes with a
/// response, which reads it).
fn messages_of(items: &[MessageItem]) -> Result<Vec<Message>, AppError> {
    if items.len() > MAX_LIMIT as usize {
        return Err(AppError::validation("items", format!("at most {MAX_LIMIT} items at once")));
    }
    items
        .iter()
        .map(|item| {
            let role = match item.role.as_str() {
                "user" => Role::User,
                "assistant" => Role::Assistant,
                other => {
                    return Err(AppError::validation(
                        "items",
                        format!("a conversation's items are user and assistant messages, not '{other}'"),
                    ));
                }
            };
            let (text, files) = item.text_and_files()?;
            if !files.is_empty() {
                return Err(AppError::validation("items", "a file comes with a response: POST /v1/responses"));
            }
            if text.trim().is_empty() {
                return Err(AppError::validation("items", "an item's text is empty"));
            }
            Ok(Message::new(ConversationId::new(), None, role, text))
        })
        .collect()
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

/// A list's query, for conversation items and a response's input items.
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

impl ItemsQuery {
    /// The page of `items` (oldest first) the query asks for, in its order (newest first
    /// unless `asc`), after its `after`, at most `limit`; and whether more follow.
    pub fn page<T>(&self, mut items: Vec<T>, id: impl Fn(&T) -> &str) -> Result<(Vec<T>, bool), AppError> {
        let limit = self.limit.unwrap_or(DEFAULT_LIMIT);
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(AppError::validation("limit", format!("`limit` must be between 1 and {MAX_LIMIT}")));
        }
        match self.order.as_deref() {
            None | Some("desc") => items.reverse(),
            Some("asc") => {}
            Some(other) => return Err(AppError::validation("order", format!("Unknown order '{other}': asc or desc"))),
        }
        if let Some(after) = &self.after {
            let at = items.iter().position(|item| id(item) == after).ok_or_else(|| AppError::NotFound {
                field: Some("after".into()),
                message: format!("No item {after} in this list"),
            })?;
            items.drain(..=at);
        }
        let has_more = items.len() > limit as usize;
        items.truncate(limit as usize);
        Ok((items, has_more))
    }
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
    let messages = messages_of(body.items.as_deref().unwrap_or_default())?;
    let conversation = Conversation {
        metadata: Value::Object(body.metadata.unwrap_or_default()),
        ..Conversation::new(&user, "New conversation".to_owned())
    };
    state.store.create_conversation(&conversation).await?;
    if !messages.is_empty() {
        state.store.append_messages(&user, conversation.id, messages).await?;
    }
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
    let messages = state.store.messages(&user, conversation.id).await?;
    let items: Vec<Item> =
        crate::domain::branch(&messages, conversation.active_leaf_id).iter().filter_map(Item::of).collect();
    let (items, has_more) = query.page(items, |item| &item.id)?;
    Ok(Json(ItemList::of(items, has_more)))
}

#[utoipa::path(post, operation_id = "openai_create_conversation_items", path = "/v1/conversations/{id}/items", tag = "openai",
    params(("id" = String, Path, description = "`conv_<conversation id>`")), request_body = AddItemsBody,
    responses((status = 200, description = "The items added, after the active branch, in order", body = ItemList), Refused))]
pub async fn add_items(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path(id): Path<String>,
    AppJson(body): AppJson<AddItemsBody>,
) -> Result<Json<ItemList>, AppError> {
    let conversation = owned(&state, &user, &id).await?;
    let messages = messages_of(&body.items)?;
    let added = state.store.append_messages(&user, conversation.id, messages).await?;
    Ok(Json(ItemList::of(added.iter().filter_map(Item::of).collect(), false)))
}

/// A message of the user's conversation `id`, by its item id.
async fn owned_item(
    state: &AppState,
    user: &UserId,
    id: &str,
    item_id: &str,
) -> Result<(Conversation, Message), AppError> {
    let conversation = owned(state, user, id).await?;
    let missing = || AppError::not_found(format!("No item {item_id} in this conversation"));
    let message_id = parse_id("msg", item_id).ok_or_else(missing)?;
    let message = state.store.get_message(user, message_id.into()).await.map_err(|_| missing())?;
    if message.conversation_id != conversation.id {
        return Err(missing());
    }
    Ok((conversation, message))
}

#[utoipa::path(get, operation_id = "openai_retrieve_conversation_item", path = "/v1/conversations/{id}/items/{item_id}", tag = "openai",
    params(("id" = String, Path, description = "`conv_<conversation id>`"), ("item_id" = String, Path, description = "`msg_<message id>`")),
    responses((status = 200, description = "The item", body = Item), Refused))]
pub async fn item(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path((id, item_id)): Path<(String, String)>,
) -> Result<Json<Item>, AppError> {
    let (_, message) = owned_item(&state, &user, &id, &item_id).await?;
    Item::of(&message).map(Json).ok_or_else(|| AppError::not_found(format!("No item {item_id} in this conversation")))
}

/// `DELETE /v1/conversations/{id}/items/{item_id}`: the conversation's last message goes
/// (what the Agents SDK's session does to take its last item back); a message others
/// follow, or an answer whose run is going, stays (409).
#[utoipa::path(delete, operation_id = "openai_delete_conversation_item", path = "/v1/conversations/{id}/items/{item_id}", tag = "openai",
    params(("id" = String, Path, description = "`conv_<conversation id>`"), ("item_id" = String, Path, description = "`msg_<message id>`")),
    responses((status = 200, description = "The conversation, without the item", body = ConversationObject), Refused))]
pub async fn delete_item(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path((id, item_id)): Path<(String, String)>,
) -> Result<Json<ConversationObject>, AppError> {
    let (conversation, message) = owned_item(&state, &user, &id, &item_id).await?;
    if let Some(trace_id) = message.trace_id
        && let Ok(trace) = state.store.get_trace(&user, trace_id).await
        && trace.ended_at.is_none()
    {
        return Err(AppError::Conflict("This answer's run is going: cancel it first".into()));
    }
    state.store.delete_last_message(&user, message.id).await?;
    Ok(Json(ConversationObject::from(&conversation)))
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
