//! What `@ag-ui/client`'s `HttpAgent` (and CopilotKit through it) posts to `/api/agui`, as
//! types: the `RunAgentInput`, its messages and the parts of a user message's content, the
//! client's tools, and the answers to a waiting run's interrupts. Its other fields
//! (`state`, `protocolVersion`, …) are not read.

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::chat::control::waits::{WaitAnswer, output_text};
use crate::chat::request::ClientTool;
use crate::chat::{AttachmentRef, ChatError, ClientTurn, Intent, bounded, last_user_message};
use crate::ids::FileId;

/// AG-UI's `RunAgentInput`; its other fields (`state`, `protocolVersion`, …) are ignored.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunAgentInput {
    /// The thread: a conversation's id or `external_id`, else a new conversation's
    /// `external_id`.
    pub(super) thread_id: String,
    /// Echoed in `RUN_STARTED` and `RUN_FINISHED`.
    pub(super) run_id: String,
    /// The client's messages; the last user message is the one sent.
    #[serde(default)]
    pub(super) messages: Vec<AguiMessage>,
    /// The client's tools (CONTRACT.md §15): offered to the model; a call of one ends the run
    /// with an interrupt, and the client's next run (a tool message, or `resume[]`) answers it.
    #[serde(default)]
    tools: Vec<AguiTool>,
    /// Entries for the system prompt's context section.
    #[serde(default)]
    context: Vec<AguiContext>,
    /// Answers to the interrupts of the thread's waiting run (CONTRACT.md §15).
    #[serde(default)]
    pub(super) resume: Option<Vec<ResumeEntry>>,
    /// `profile` picks the profile to answer with.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    forwarded_props: Option<Value>,
}

/// One message of the thread: its text content is read (and a `tool` message's call id
/// and error).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AguiMessage {
    id: String,
    pub(super) role: String,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    error: Option<String>,
    /// A string, or (for a user message) an array of parts.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    content: Option<Value>,
}

/// A tool of the client's.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct AguiTool {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    parameters: Option<Value>,
}

/// An answer to one interrupt: an approval (`payload.approved`, `payload.reason`; `cancelled`
/// denies it) or a client tool's result (`payload`; `cancelled` is an error result).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResumeEntry {
    interrupt_id: String,
    /// `resolved` or `cancelled`.
    status: String,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    payload: Option<Value>,
}

#[derive(Deserialize, utoipa::ToSchema)]
pub struct AguiContext {
    description: String,
    value: String,
}

/// A part of a user message's content.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum ContentPart {
    Text {
        #[serde(default)]
        text: String,
    },
    Image(FilePart),
    Document(FilePart),
    /// The older form of a file: its bytes, a URL, or a file chatd stored.
    Binary(FilePart),
}

/// An image, document or binary part: its `source`, or (a binary part) its `data` with its
/// `mimeType`, its `url`, or its `id`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct FilePart {
    #[serde(default)]
    source: Option<Source>,
    #[serde(default)]
    data: Option<String>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    mime_type: Option<String>,
    #[serde(default)]
    filename: Option<String>,
    #[serde(default)]
    metadata: Option<PartMetadata>,
}

/// Where a file part's bytes are.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum Source {
    /// Base64 with its media type.
    Data {
        value: String,
        #[serde(rename = "mimeType")]
        mime_type: String,
    },
    /// A `data:` or `http(s)` URL.
    Url { value: String },
}

#[derive(Deserialize)]
struct PartMetadata {
    #[serde(default)]
    filename: Option<String>,
}

/// An approval's answer in `resume[].payload`.
#[derive(Deserialize)]
struct Decision {
    #[serde(default = "approved_unless_said")]
    approved: bool,
    #[serde(default)]
    reason: Option<String>,
}

fn approved_unless_said() -> bool {
    true
}

impl FilePart {
    /// The part as an attachment (CONTRACT.md §14).
    fn attachment(self) -> Result<AttachmentRef, ChatError> {
        let name = self.filename.or_else(|| self.metadata.and_then(|m| m.filename));
        if let Some(source) = self.source {
            return Ok(match source {
                Source::Data { value, mime_type } => {
                    AttachmentRef::url(format!("data:{mime_type};base64,{value}"), name)
                }
                Source::Url { value } => AttachmentRef::url(value, name),
            });
        }
        match (self.data, self.url, self.id, self.mime_type) {
            (Some(data), _, _, Some(mime)) => Ok(AttachmentRef::url(format!("data:{mime};base64,{data}"), name)),
            (None, Some(url), _, _) => Ok(AttachmentRef::url(url, name)),
            (None, None, Some(id), _) => FileId::parse(&id).map(AttachmentRef::file).map_err(|_| ChatError::Invalid {
                field: "messages",
                message: "A binary part's id must be a file id of POST /api/files".into(),
            }),
            _ => Err(no_source()),
        }
    }
}

fn no_source() -> ChatError {
    ChatError::Invalid {
        field: "messages",
        message: "A file part needs a source (data with its mimeType, or a url)".into(),
    }
}

impl RunAgentInput {
    /// Refuses an id or name past the bound, before anything reads them.
    pub(super) fn check_ids(&self) -> Result<(), ChatError> {
        bounded("threadId", &self.thread_id)?;
        bounded("runId", &self.run_id)?;
        for message in &self.messages {
            bounded("messages", &message.id)?;
            if let Some(call) = &message.tool_call_id {
                bounded("messages", call)?;
            }
        }
        for tool in &self.tools {
            bounded("tools", &tool.name)?;
        }
        for entry in self.resume.iter().flatten() {
            bounded("resume", &entry.interrupt_id)?;
        }
        if let Some(Value::String(profile)) = self.forwarded_props.as_ref().and_then(|props| props.get("profile")) {
            bounded("forwardedProps", profile)?;
        }
        Ok(())
    }

    /// What the input answers of a waiting run's interrupts (CONTRACT.md §15): `resume[]`
    /// entries, and the client tools' results as `tool` messages last in `messages`.
    pub(super) fn wait_answers(&self) -> Vec<WaitAnswer> {
        let mut answers = Vec::new();
        for entry in self.resume.as_deref().unwrap_or_default() {
            let resolved = entry.status == "resolved";
            let payload = entry.payload.as_ref();
            if let Ok(approval_id) = entry.interrupt_id.parse::<uuid::Uuid>() {
                let decision = payload.and_then(|p| Decision::deserialize(p).ok());
                answers.push(WaitAnswer::Approval {
                    approval_id,
                    approved: resolved && decision.as_ref().is_none_or(|d| d.approved),
                    reason: decision.and_then(|d| d.reason),
                });
            }
            answers.push(WaitAnswer::Result {
                tool_call_id: entry.interrupt_id.clone(),
                output: match payload {
                    _ if !resolved => "The user cancelled this tool call".to_owned(),
                    Some(payload) => output_text(payload),
                    None => String::new(),
                },
                is_error: !resolved,
            });
        }
        for message in self.tool_messages() {
            let (Some(tool_call_id), content) = (&message.tool_call_id, &message.content) else { continue };
            let output = content.as_ref().map(output_text).unwrap_or_default();
            answers.push(WaitAnswer::Result {
                tool_call_id: tool_call_id.clone(),
                output: message.error.clone().unwrap_or(output),
                is_error: message.error.is_some(),
            });
        }
        answers
    }

    /// The `tool` messages that end `messages`, newest first.
    pub(super) fn tool_messages(&self) -> impl Iterator<Item = &AguiMessage> {
        self.messages.iter().rev().take_while(|m| m.role == "tool")
    }

    pub(super) fn into_turn(self) -> Result<(ClientTurn, String), ChatError> {
        if self.thread_id.trim().is_empty() {
            return Err(ChatError::Invalid { field: "threadId", message: "threadId cannot be empty".into() });
        }
        if self.resume.as_ref().is_some_and(|resume| !resume.is_empty()) {
            return Err(ChatError::Invalid {
                field: "resume",
                message: "No run of this thread waits for these interrupts".into(),
            });
        }
        let client_tools = self
            .tools
            .into_iter()
            .map(|t| ClientTool {
                name: t.name,
                description: t.description,
                parameters: t.parameters.unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}})),
            })
            .collect();
        let last = last_user_message(self.messages, |m| &m.role)?;
        let mut attachments = Vec::new();
        let text = match last.content {
            Some(Value::String(text)) => text,
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for part in parts {
                    let part = ContentPart::deserialize(&part).map_err(|e| ChatError::Invalid {
                        field: "messages",
                        message: format!(
                            "A user message's parts may be text, image, document or binary, a file part with a \
                             source (data with its mimeType, or a url): {e}"
                        ),
                    })?;
                    match part {
                        ContentPart::Text { text: part } => text.push_str(&part),
                        ContentPart::Image(file) | ContentPart::Document(file) | ContentPart::Binary(file) => {
                            attachments.push(file.attachment()?)
                        }
                    }
                }
                text
            }
            _ => String::new(),
        };
        let context = (!self.context.is_empty()).then(|| {
            Value::Object(
                self.context.into_iter().map(|c| (c.description, Value::String(c.value))).collect::<Map<_, _>>(),
            )
        });
        let profile = match self.forwarded_props.as_ref().and_then(|props| props.get("profile")) {
            None | Some(Value::Null) => None,
            Some(Value::String(profile)) => Some(profile.clone()),
            Some(_) => {
                return Err(ChatError::Invalid {
                    field: "forwardedProps",
                    message: "forwardedProps.profile must be a string".into(),
                });
            }
        };
        let multitask = match self.forwarded_props.as_ref().and_then(|props| props.get("multitask")) {
            None | Some(Value::Null) => None,
            Some(value) => Some(serde_json::from_value(value.clone()).map_err(|_| ChatError::Invalid {
                field: "forwardedProps",
                message: "forwardedProps.multitask is reject, interrupt or rollback".into(),
            })?),
        };
        let turn = ClientTurn {
            chat_id: self.thread_id,
            text,
            message_id: Some(last.id),
            intent: Intent::Send,
            profile,
            context,
            client_tools,
            attachments,
            multitask,
        };
        Ok((turn, self.run_id))
    }
}
