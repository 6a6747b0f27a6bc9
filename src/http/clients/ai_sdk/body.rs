//! What `useChat`'s `DefaultChatTransport` posts to `/api/ui/chat`, as types: the body, its
//! `UIMessage`s and the parts chatd reads of them (a user message's text and files, an
//! answer's tool parts when they answer a waiting run, CONTRACT.md §15). Any other field or
//! part is the client library's and is not read.

use serde::Deserialize;
use serde_json::Value;

use crate::chat::control::waits::{WaitAnswer, output_text};
use crate::chat::{AttachmentRef, ChatError, ClientTurn, Intent, bounded, last_user_message};

/// The body `DefaultChatTransport` sends (and fields `useChat`'s `body` adds).
#[derive(Deserialize, utoipa::ToSchema)]
pub struct UiChatBody {
    /// The chat: a conversation's id or `external_id`, else a new conversation's
    /// `external_id`.
    pub(super) id: String,
    /// The client's messages; the last user message is the one sent.
    pub(super) messages: Vec<UiMessage>,
    #[serde(default)]
    pub(super) trigger: Trigger,
    /// With `submit-message`: the user message edited; with `regenerate-message`: the answer
    /// regenerated (else the last one).
    #[serde(default, rename = "messageId")]
    pub(super) message_id: Option<String>,
    /// The profile to answer with (`useChat`'s `body`).
    #[serde(default)]
    profile: Option<String>,
    /// Page context for the system prompt, as in `POST /api/chat/stream`.
    #[serde(default)]
    context: Option<Value>,
    /// Tools the client runs (`onToolCall`), as in `POST /api/chat/stream` (CONTRACT.md §15).
    #[serde(default)]
    client_tools: Vec<crate::chat::request::ClientTool>,
    /// What the message does while a run of the chat is going (CONTRACT.md §16).
    #[serde(default)]
    multitask: Option<crate::config::Multitask>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Trigger {
    #[default]
    SubmitMessage,
    RegenerateMessage,
}

/// A `UIMessage` of the AI SDK: only its id, role and parts are read.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct UiMessage {
    pub(super) id: String,
    pub(super) role: String,
    /// A user message's text parts; an answer's tool parts, when they answer a waiting run.
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    parts: Vec<Value>,
}

/// A part of a `UIMessage`, as far as chatd reads one.
#[derive(Debug, PartialEq, Deserialize)]
#[serde(try_from = "PartFields")]
pub enum UiPart {
    Text {
        text: String,
    },
    /// A file the user attached: a `data:` URL (what `useChat` sends for files picked in the
    /// browser), or an `http(s)` URL where `files.fetch_remote` allows.
    File {
        url: String,
        filename: Option<String>,
    },
    /// A tool call of an answer (`tool-<name>`, or `dynamic-tool`), with what its `state`
    /// says.
    Tool {
        tool_call_id: String,
        state: ToolState,
    },
    /// Any other part (`step-start`, `reasoning`, …): not read.
    Other,
}

/// What a tool part's `state` tells chatd.
#[derive(Debug, PartialEq)]
pub enum ToolState {
    /// `approval-responded`: the person's decision on an approval.
    ApprovalResponded(Approval),
    /// `output-available`: a client tool's output.
    OutputAvailable(Value),
    /// `output-error`: a client tool's error.
    OutputError(Option<Value>),
    /// Any other state (`input-available`, `approval-requested`, …).
    Other,
}

/// A tool part's `approval`.
#[derive(Debug, PartialEq, Deserialize)]
pub struct Approval {
    id: String,
    approved: bool,
    #[serde(default)]
    reason: Option<String>,
}

/// A part's fields, before its `type` tells which part it is: the AI SDK names a tool part
/// by its tool (`tool-<name>`), which a serde tag cannot match.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PartFields {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    filename: Option<String>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    approval: Option<Approval>,
    #[serde(default)]
    output: Option<Value>,
    #[serde(default)]
    error_text: Option<Value>,
}

impl TryFrom<PartFields> for UiPart {
    type Error = String;

    fn try_from(part: PartFields) -> Result<Self, String> {
        let kind = part.kind.as_str();
        Ok(match kind {
            "text" => UiPart::Text { text: part.text.ok_or("missing field `text`")? },
            "file" => UiPart::File { url: part.url.ok_or("missing field `url`")?, filename: part.filename },
            _ if kind.starts_with("tool-") || kind == "dynamic-tool" => {
                let Some(tool_call_id) = part.tool_call_id else { return Ok(UiPart::Other) };
                let state = match (part.state.as_deref(), part.approval, part.output) {
                    (Some("approval-responded"), Some(approval), _) => ToolState::ApprovalResponded(approval),
                    (Some("output-available"), _, Some(output)) => ToolState::OutputAvailable(output),
                    (Some("output-error"), ..) => ToolState::OutputError(part.error_text),
                    _ => ToolState::Other,
                };
                UiPart::Tool { tool_call_id, state }
            }
            _ => UiPart::Other,
        })
    }
}

impl UiMessage {
    /// The message's parts chatd reads, in order.
    fn parts(&self) -> Result<Vec<UiPart>, ChatError> {
        self.parts
            .iter()
            .map(|part| {
                UiPart::deserialize(part).map_err(|e| ChatError::Invalid {
                    field: "messages",
                    message: format!("A message part does not read: {e}"),
                })
            })
            .collect()
    }

    /// What an answer's tool parts say of the calls its run waits on: decisions and
    /// client tools' results (a part that does not read says nothing).
    pub(super) fn wait_answers(&self) -> Vec<WaitAnswer> {
        let parts = self.parts.iter().filter_map(|part| UiPart::deserialize(part).ok());
        parts.filter_map(wait_answer).collect()
    }
}

/// What a tool part says of a waiting call, if anything.
fn wait_answer(part: UiPart) -> Option<WaitAnswer> {
    let UiPart::Tool { tool_call_id, state } = part else { return None };
    match state {
        ToolState::ApprovalResponded(Approval { id, approved, reason }) => {
            Some(WaitAnswer::Approval { approval_id: id.parse().ok()?, approved, reason })
        }
        ToolState::OutputAvailable(output) => {
            Some(WaitAnswer::Result { tool_call_id, output: output_text(&output), is_error: false })
        }
        ToolState::OutputError(error) => Some(WaitAnswer::Result {
            tool_call_id,
            output: error.as_ref().map(output_text).unwrap_or_default(),
            is_error: true,
        }),
        ToolState::Other => None,
    }
}

impl UiChatBody {
    /// Refuses an id or name past the bound, before anything reads them.
    pub(super) fn check_ids(&self) -> Result<(), ChatError> {
        bounded("id", &self.id)?;
        if let Some(id) = &self.message_id {
            bounded("messageId", id)?;
        }
        if let Some(profile) = &self.profile {
            bounded("profile", profile)?;
        }
        for message in &self.messages {
            bounded("messages", &message.id)?;
        }
        for tool in &self.client_tools {
            bounded("client_tools", &tool.name)?;
        }
        Ok(())
    }

    pub(super) fn into_turn(self) -> Result<ClientTurn, ChatError> {
        if self.id.trim().is_empty() {
            return Err(ChatError::Invalid { field: "id", message: "id (the chat's id) cannot be empty".into() });
        }
        let last = last_user_message(self.messages, |m| &m.role)?;
        let mut text = String::new();
        let mut attachments = Vec::new();
        for part in last.parts()? {
            match part {
                UiPart::Text { text: part } => text.push_str(&part),
                UiPart::File { url, filename } => attachments.push(AttachmentRef::url(url, filename)),
                UiPart::Tool { .. } | UiPart::Other => {}
            }
        }
        let intent = match (self.trigger, self.message_id) {
            (Trigger::SubmitMessage, None) => Intent::Send,
            (Trigger::SubmitMessage, Some(id)) => Intent::Edit(id),
            (Trigger::RegenerateMessage, id) => Intent::Regenerate(id),
        };
        Ok(ClientTurn {
            chat_id: self.id,
            text,
            message_id: Some(last.id),
            intent,
            profile: self.profile,
            context: self.context,
            client_tools: self.client_tools,
            attachments,
            multitask: self.multitask,
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn parts_are_read_by_their_type_tool_parts_by_their_prefix() {
        let read = |part: Value| UiPart::deserialize(&part).map_err(|e| e.to_string());
        assert_eq!(read(json!({"type": "text", "text": "hi"})), Ok(UiPart::Text { text: "hi".into() }));
        assert!(read(json!({"type": "text"})).unwrap_err().contains("missing field `text`"));
        assert_eq!(read(json!({"type": "step-start"})), Ok(UiPart::Other));
        let approved = json!({"type": "tool-calculator", "toolCallId": "c1", "state": "approval-responded",
            "input": {}, "approval": {"id": "a1", "approved": true}});
        let state = ToolState::ApprovalResponded(Approval { id: "a1".into(), approved: true, reason: None });
        assert_eq!(read(approved), Ok(UiPart::Tool { tool_call_id: "c1".into(), state }));
        let output =
            json!({"type": "dynamic-tool", "toolCallId": "c2", "state": "output-available", "output": {"zone": "UTC"}});
        let state = ToolState::OutputAvailable(json!({"zone": "UTC"}));
        assert_eq!(read(output), Ok(UiPart::Tool { tool_call_id: "c2".into(), state }));
        let failed = json!({"type": "tool-x", "toolCallId": "c3", "state": "output-error", "errorText": "no"});
        assert_eq!(
            wait_answer(read(failed).unwrap()),
            Some(WaitAnswer::Result { tool_call_id: "c3".into(), output: "no".into(), is_error: true })
        );
    }
}
