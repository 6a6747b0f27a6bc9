//! What a model call needs, in no provider's format: the settings, the tools offered, and
//! the conversation as typed messages. Each adapter turns these into its own wire body;
//! none of them reads the store's rows or the API's views.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use bytes::Bytes;

use crate::domain::{AssistantTurn, Attachment, Message, Role};
use crate::ids::MessageId;

/// Serializable: a waiting run keeps the request it goes on with (CONTRACT.md §15). Its large
/// parts are shared: a model call's copy of its run's request (fitted to the context, its
/// files read) copies only what it changes, not the whole conversation, for as long as the
/// answer streams.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRequest {
    pub model: String,
    pub system_prompt: Option<Arc<str>>,
    /// The conversation so far, oldest first, ending with the user's new message and this
    /// run's exchanges (changed through [`Arc::make_mut`]: copied where shared).
    pub messages: Arc<Vec<InputMessage>>,
    pub temperature: Option<f64>,
    pub max_tokens: Option<u32>,
    pub enable_thinking: bool,
    pub thinking_budget: Option<u32>,
    pub reasoning_effort: Option<String>,
    pub tools: Arc<Vec<ToolSpec>>,
    /// What this request says that the next one will not (the page the user is on, an
    /// action's result, the payloads so far): sent after the history, so that everything
    /// before it stays the same from one turn to the next and the provider's prompt cache
    /// keeps it (CONTRACT.md §21).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notes: Option<String>,
    /// Whether the request marks its stable prefix for the provider's cache, and for how
    /// long it is kept; `None`: it does not (`prompt_cache = "off"`).
    #[serde(default)]
    pub prompt_cache: Option<crate::config::CacheTtl>,
    /// What the provider groups cached prefixes by (OpenAI's `prompt_cache_key`): the
    /// conversation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_key: Option<String>,
}

/// A tool as offered to the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub input_schema: Value,
}

/// One message of the model's input. `id` names the stored message it comes from (context
/// trimming records which were kept).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum InputMessage {
    User {
        id: MessageId,
        text: String,
        /// The files the message carries (CONTRACT.md §14), in their order.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        files: Vec<InputFile>,
    },
    /// A system note in the history, where the provider's format has a place for one.
    System { id: MessageId, text: String },
    /// An answer: its model calls, oldest first, each with what its tools answered.
    Assistant { id: MessageId, turns: Vec<AssistantTurn> },
}

/// A file of a user's message as a model gets it. Its content is read just before each
/// model call (a waiting run's checkpoint keeps only the file itself).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputFile {
    pub file: Attachment,
    #[serde(skip)]
    pub content: FileContent,
}

impl InputFile {
    pub fn new(file: Attachment) -> Self {
        Self { file, content: FileContent::Unread }
    }

    /// What a provider sends in its place where it cannot send the file itself.
    pub fn note(&self) -> String {
        let why = match &self.content {
            FileContent::Left(why) => why.as_str(),
            _ => "it could not be sent",
        };
        format!("[Attached file {} ({}) is not included: {why}]", self.file.name, self.file.media_type)
    }

    /// About how many tokens the file costs a model: an image by Anthropic's documented
    /// rule (width × height / 750, at most about 1,600 once the provider scales it down), a
    /// PDF 1,500 a page (Anthropic's low end; pages guessed from the size, 50 KiB each), a text file
    /// four characters a token.
    pub fn estimated_tokens(&self) -> u64 {
        let file = &self.file;
        if file.is_image() {
            let pixels = u64::from(file.width.unwrap_or(1000)) * u64::from(file.height.unwrap_or(1000));
            (pixels / 750).clamp(1, 1600)
        } else if file.is_pdf() {
            (file.size / 51_200).max(1) * 1500
        } else {
            file.size.div_ceil(4)
        }
    }

    /// A text file's text, as the model reads it.
    pub fn text_block(&self, text: &str) -> String {
        format!("Attached file {} ({}):\n{text}", self.file.name, self.file.media_type)
    }
}

/// What of a file goes to the model.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum FileContent {
    /// Not read yet: the chat reads every file before a model call.
    #[default]
    Unread,
    /// An image or a PDF, to send in the provider's format.
    Bytes(Bytes),
    /// A text file, sent as text.
    Text(String),
    /// Left out, and why (the profile takes no such files; the file was deleted).
    Left(String),
}

impl InputMessage {
    /// The stored message as model input; `None` for a role no provider is sent.
    pub fn of(message: &Message) -> Option<Self> {
        let id = message.id;
        match message.role {
            Role::User => Some(InputMessage::User {
                id,
                text: message.content.clone(),
                files: message.attachments.iter().cloned().map(InputFile::new).collect(),
            }),
            Role::System => Some(InputMessage::System { id, text: message.content.clone() }),
            Role::Assistant if message.turns.is_empty() => {
                Some(InputMessage::Assistant { id, turns: vec![AssistantTurn::of_text(&message.content)] })
            }
            Role::Assistant => Some(InputMessage::Assistant { id, turns: message.turns.clone() }),
            Role::Tool => None,
        }
    }

    /// The user's words, alone (a title or summary request).
    pub fn user(text: impl Into<String>) -> Self {
        InputMessage::User { id: MessageId::new(), text: text.into(), files: Vec::new() }
    }

    pub fn id(&self) -> MessageId {
        match self {
            InputMessage::User { id, .. } | InputMessage::System { id, .. } | InputMessage::Assistant { id, .. } => *id,
        }
    }

    pub fn is_user(&self) -> bool {
        matches!(self, InputMessage::User { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::ConversationId;

    #[test]
    fn an_answer_stored_without_its_turns_is_one_turn_of_its_text() {
        let answer = Message::new(ConversationId::new(), None, Role::Assistant, "hello".into());
        let Some(InputMessage::Assistant { turns, .. }) = InputMessage::of(&answer) else { panic!("an answer") };
        assert_eq!(turns, vec![AssistantTurn { text: "hello".into(), ..AssistantTurn::default() }]);
        let tool = Message::new(ConversationId::new(), None, Role::Tool, "x".into());
        assert_eq!(InputMessage::of(&tool), None);
    }

    /// What the store keeps of an answer's turns ([`Message::turns_to_keep`]) is sent to the
    /// model as the whole turns are, for answers of one plain turn and for the rest.
    #[test]
    fn an_answer_is_sent_the_same_with_the_turns_the_store_keeps() {
        let answer = |text: &str, turns: Vec<AssistantTurn>| Message {
            turns,
            ..Message::new(ConversationId::new(), None, Role::Assistant, text.into())
        };
        let thinking = crate::domain::ThinkingBlock::Thinking { thinking: "hm".into(), signature: "s".into() };
        let signed = AssistantTurn { thinking_blocks: vec![thinking], ..AssistantTurn::of_text("a") };
        let cases = [
            (answer("a", vec![AssistantTurn::of_text("a")]), 0),
            (answer("", vec![AssistantTurn::of_text("")]), 0),
            (answer("a", vec![signed]), 1),
            (answer("a [cancelled]", vec![AssistantTurn::of_text("a")]), 1),
            (answer("ab", vec![AssistantTurn::of_text("a"), AssistantTurn::of_text("b")]), 2),
        ];
        for (full, kept) in cases {
            let stored = Message { turns: full.turns_to_keep().to_vec(), ..full.clone() };
            assert_eq!(stored.turns.len(), kept, "{:?}", full.content);
            assert_eq!(InputMessage::of(&stored), InputMessage::of(&full), "{:?}", full.content);
        }
    }
}
