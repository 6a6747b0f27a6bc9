//! Turns sent by the client libraries frontends already use (CONTRACT.md §13): a chat or
//! thread id of the client's making names one of the user's conversations (by its id or its
//! `external_id`), and an edit or a regenerate names a message by the id the client knows
//! it by. What comes out is an ordinary [`ChatRequest`]: from there on a run is a run.

use serde_json::Value;

use std::sync::Arc;

use super::idempotency::IdempotencyKey;
use super::idempotency::Started;
use super::starter::Starter;
use crate::chat::errors::{ChatError, not_found};
use crate::chat::live::runs::LiveRun;
use crate::chat::request::Begun;
use crate::chat::request::{ChatRequest, ClientIds, InteractionType};
use crate::domain::{Conversation, Message, Role};
use crate::ids::{ConversationId, TraceId, UserId};
use crate::store::StoreError;

/// What a client library asked for.
#[derive(Debug, Clone)]
pub struct ClientTurn {
    /// The client's chat (AI SDK) or thread (AG-UI) id.
    pub chat_id: String,
    /// The text of the last user message the client sent.
    pub text: String,
    /// That message's id, as the client made it.
    pub message_id: Option<String>,
    pub intent: Intent,
    pub profile: Option<String>,
    pub context: Option<Value>,
    /// Tools the client runs (CONTRACT.md §15).
    pub client_tools: Vec<crate::chat::request::ClientTool>,
    /// The files of the last user message (CONTRACT.md §14).
    pub attachments: Vec<crate::chat::request::AttachmentRef>,
    /// What the message does while a run of the chat is going (CONTRACT.md §16).
    pub multitask: Option<crate::config::Multitask>,
}

/// What the turn does to the conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Intent {
    /// A new message after the active branch's last one.
    Send,
    /// The user's message with this id, edited: the new text becomes its sibling.
    Edit(String),
    /// A new answer to the same question: beside the answer with this id (or, with a user
    /// message's id, to that message), or to the branch's last question.
    Regenerate(Option<String>),
}

/// The longest id or name a client library sends (a chat, thread, run, message or tool call
/// id; a profile or tool name), in characters. The libraries' own ids are far shorter; a
/// longer one would be stored and listed back with every conversation.
pub const MAX_ID_CHARS: usize = 256;

/// `value`, if it is no longer than [`MAX_ID_CHARS`]; else a 400 naming `field`.
pub fn bounded<'a>(field: &'static str, value: &'a str) -> Result<&'a str, ChatError> {
    match value.chars().nth(MAX_ID_CHARS) {
        None => Ok(value),
        Some(_) => {
            Err(ChatError::Invalid { field, message: format!("{field} is longer than {MAX_ID_CHARS} characters") })
        }
    }
}

/// The last of a client's messages whose role is `user`: the one it sends (both client
/// libraries send the whole thread).
pub fn last_user_message<M>(messages: Vec<M>, role: impl Fn(&M) -> &str) -> Result<M, ChatError> {
    messages
        .into_iter()
        .rev()
        .find(|m| role(m) == "user")
        .ok_or_else(|| ChatError::Invalid { field: "messages", message: "messages holds no user message".into() })
}

impl Starter {
    /// Starts the run a client's turn asks for. Two first messages of one new chat sent at
    /// once (two tabs, a retry) both land in the one conversation the first of them made.
    pub(in crate::chat) async fn start_for_client(
        self: &Arc<Self>,
        user: &UserId,
        turn: ClientTurn,
        key: Option<IdempotencyKey>,
    ) -> Result<Started<Arc<LiveRun>>, ChatError> {
        let start = async {
            let request =
                ChatRequest { idempotency_key: key.clone(), ..self.client_request(user, turn.clone()).await? };
            match self.start(user, request).await? {
                // The other request's chat is this turn's now: read onto it again.
                Begun::ChatTaken => {
                    let request =
                        ChatRequest { idempotency_key: key.clone(), ..self.client_request(user, turn).await? };
                    self.start(user, request).await
                }
                begun => Ok(begun),
            }
        };
        self.once(user, key.clone(), start).await
    }

    /// The user's conversation a client's chat id names: its own id, else its external id.
    /// Another user's conversation is never found (its id becomes this user's external id).
    pub async fn find_chat(&self, user: &UserId, chat_id: &str) -> Result<Option<Conversation>, StoreError> {
        if let Ok(id) = ConversationId::parse(chat_id) {
            match self.store.get_conversation(user, id).await {
                Ok(conversation) => return Ok(Some(conversation)),
                Err(StoreError::NotFound) => {}
                Err(e) => return Err(e),
            }
        }
        match self.store.conversation_by_external_id(user, chat_id).await {
            Ok(conversation) => Ok(Some(conversation)),
            Err(StoreError::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The run of the chat that is running now (the newest, if several are), if any.
    pub async fn running_in_chat(&self, user: &UserId, chat_id: &str) -> Result<Option<TraceId>, StoreError> {
        let Some(conversation) = self.find_chat(user, chat_id).await? else { return Ok(None) };
        let running = self.store.running_in_conversation(user, conversation.id).await?;
        Ok(running.last().map(|trace| trace.trace_id))
    }

    /// The chat request a client's turn amounts to. The stored history is the truth: of
    /// what the client sent, only its last user message and the ids are read.
    pub async fn client_request(&self, user: &UserId, turn: ClientTurn) -> Result<ChatRequest, ChatError> {
        let conversation = self.find_chat(user, &turn.chat_id).await?;
        let mut request = ChatRequest {
            message: turn.text,
            conversation_id: conversation.as_ref().map(|c| c.id),
            profile: turn.profile,
            parent_message_id: None,
            context: turn.context,
            interaction_type: InteractionType::TextInput,
            action: None,
            diagnostics: false,
            client_tools: turn.client_tools,
            attachments: turn.attachments,
            multitask: turn.multitask,
            client: ClientIds {
                chat_id: conversation.is_none().then(|| turn.chat_id.clone()),
                message_id: turn.message_id,
            },
            idempotency_key: None,
            instructions: None,
            max_tokens: None,
            temperature: None,
            metadata: None,
        };
        // A new message needs nothing from the history here (`prepare` reads it): only an edit
        // or a regenerate looks a message up.
        match turn.intent {
            Intent::Send => {}
            Intent::Edit(id) => {
                let (history, active) = self.history(user, conversation.as_ref()).await?;
                let edited = find(&history, &active, &id)?;
                if edited.role != Role::User {
                    return Err(ChatError::Invalid {
                        field: "messageId",
                        message: "messageId names an answer: send a new message, or regenerate that answer".into(),
                    });
                }
                // (Prepare makes it a sibling of the edited message; with the same text, a
                // new answer to it.)
                request.parent_message_id = Some(edited.id);
            }
            Intent::Regenerate(id) => {
                let (history, active) = self.history(user, conversation.as_ref()).await?;
                let named = match &id {
                    Some(id) => find(&history, &active, id)?,
                    None => {
                        active.iter().rev().find(|m| m.role == Role::Assistant).or_else(|| active.last()).ok_or_else(
                            || ChatError::Invalid {
                                field: "messages",
                                message: "There is no answer to regenerate".into(),
                            },
                        )?
                    }
                };
                let question = match named.role {
                    Role::User => named,
                    _ => named
                        .parent_id
                        .and_then(|parent| history.iter().find(|m| m.id == parent))
                        .filter(|m| m.role == Role::User)
                        .ok_or_else(|| not_found("messageId", "The answer's question was not found"))?,
                };
                request.parent_message_id = Some(question.id);
                request.message.clone_from(&question.content);
                // The question keeps the files it was sent with.
                request.attachments.clear();
                request.client.message_id.clone_from(&question.client_id);
            }
        }
        Ok(request)
    }

    /// All of a chat's messages, and its active branch.
    async fn history(
        &self,
        user: &UserId,
        conversation: Option<&Conversation>,
    ) -> Result<(Vec<Message>, Vec<Message>), StoreError> {
        let Some(conversation) = conversation else { return Ok((Vec::new(), Vec::new())) };
        let history = self.store.messages(user, conversation.id).await?;
        let active = crate::chat::control::queue::active_branch(&*self.store, user, conversation, &history).await?;
        Ok((history, active))
    }
}

/// The message a client's id names: by the id the client gave it, else by chatd's own (which
/// is what a client knows an answer by); on the active branch first, else the newest.
fn find<'a>(history: &'a [Message], active: &'a [Message], id: &str) -> Result<&'a Message, ChatError> {
    let named = |m: &&Message| m.client_id.as_deref() == Some(id) || m.id.to_string() == id;
    active
        .iter()
        .rev()
        .find(named)
        .or_else(|| history.iter().rev().find(named))
        .ok_or_else(|| not_found("messageId", "The message messageId names is not in this chat"))
}
