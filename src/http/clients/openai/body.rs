//! What `client.responses.create(...)` sends (CONTRACT.md §20), as types: nothing of it is
//! read by hand. Fields the SDKs send that chatd has no use for are named, accepted and
//! left aside; any other field is refused, as in every body.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use super::object::{parse_id, parse_request_id, parse_response_id};
use crate::chat::control::waits::WaitAnswer;
use crate::chat::request::{AttachmentRef, ChatRequest, ClientTool};
use crate::http::error::AppError;
use crate::ids::{ConversationId, FileId, TraceId};

/// `POST /v1/responses`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = CreateResponseBody)]
#[serde(deny_unknown_fields)]
// The fields after `metadata` are sent by the SDKs and accepted without being applied.
#[allow(dead_code)]
pub struct CreateResponse {
    /// A chatd profile (`GET /v1/models` lists them).
    pub model: String,
    /// A string, or input items (`message`, `function_call_output`, `mcp_approval_response`).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub input: Option<Input>,
    /// Added to the profile's system prompt for this response.
    #[serde(default)]
    pub instructions: Option<String>,
    /// A conversation's id (`conv_…`), or `{"id": …}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub conversation: Option<ConversationParam>,
    /// Continues from that response's answer (its branch).
    #[serde(default)]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub background: bool,
    /// chatd keeps every run: `false` is refused.
    #[serde(default)]
    pub store: Option<bool>,
    /// `function` tools are client tools (CONTRACT.md §15); chatd's own are the profile's.
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Map<String, Value>>,
    // Sent by the SDKs, not used by chatd.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub reasoning: Option<Value>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub include: Option<Value>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub text: Option<Value>,
    #[serde(default)]
    pub truncation: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub safety_identifier: Option<String>,
    #[serde(default)]
    pub prompt_cache_key: Option<String>,
    #[serde(default)]
    pub prompt_cache_retention: Option<String>,
    #[serde(default)]
    pub service_tier: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub stream_options: Option<Value>,
    #[serde(default)]
    pub max_tool_calls: Option<u32>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
}

/// `input`: a string, or items.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

/// `conversation`: an id, or an object with one.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ConversationParam {
    Id(String),
    Object { id: String },
}

impl ConversationParam {
    fn id(&self) -> &str {
        match self {
            ConversationParam::Id(id) | ConversationParam::Object { id } => id,
        }
    }
}

/// An input item. A message may leave out its `type` (the SDKs send `{role, content}`); items
/// of the model's own output sent back (a reasoning item, an assistant message, a tool call)
/// are history chatd keeps itself.
#[derive(Debug)]
pub enum InputItem {
    Message(MessageItem),
    FunctionCallOutput(FunctionCallOutput),
    McpApprovalResponse(McpApprovalResponse),
    /// A client tool's call of an earlier output, sent back: its id names its run.
    FunctionCall(FunctionCall),
    /// Any other item of an earlier output, sent back.
    Echoed,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum TaggedItem {
    Message(MessageItem),
    FunctionCallOutput(FunctionCallOutput),
    McpApprovalResponse(McpApprovalResponse),
    FunctionCall(FunctionCall),
    #[serde(other)]
    Echoed,
}

impl<'de> Deserialize<'de> for InputItem {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut value = Value::deserialize(deserializer)?;
        if let Value::Object(item) = &mut value {
            item.entry("type").or_insert_with(|| "message".into());
        }
        Ok(match TaggedItem::deserialize(value).map_err(D::Error::custom)? {
            TaggedItem::Message(m) => InputItem::Message(m),
            TaggedItem::FunctionCallOutput(o) => InputItem::FunctionCallOutput(o),
            TaggedItem::McpApprovalResponse(r) => InputItem::McpApprovalResponse(r),
            TaggedItem::FunctionCall(c) => InputItem::FunctionCall(c),
            TaggedItem::Echoed => InputItem::Echoed,
        })
    }
}

/// A message item (its `id` and `status`, on items sent back, are not read).
#[derive(Debug, Deserialize)]
pub struct MessageItem {
    pub role: String,
    pub content: Content,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    InputText {
        text: String,
    },
    OutputText {
        text: String,
    },
    Refusal {},
    /// An image: a `data:` URL (or, where allowed, an http(s) one), or a stored file.
    InputImage {
        #[serde(default)]
        image_url: Option<String>,
        #[serde(default)]
        file_id: Option<String>,
    },
    /// A file: its bytes as a `data:` URL, a URL, or a stored file.
    InputFile {
        #[serde(default)]
        file_id: Option<String>,
        #[serde(default)]
        file_data: Option<String>,
        #[serde(default)]
        file_url: Option<String>,
        #[serde(default)]
        filename: Option<String>,
    },
}

/// A client tool's result (CONTRACT.md §15): text, or content parts whose text is taken.
#[derive(Debug, Deserialize)]
pub struct FunctionCallOutput {
    pub call_id: String,
    pub output: Value,
}

/// A decision on a call that waits for approval (CONTRACT.md §15).
#[derive(Debug, Deserialize)]
pub struct McpApprovalResponse {
    /// The `mcp_approval_request` item's id.
    pub approval_request_id: String,
    pub approve: bool,
    #[serde(default)]
    pub reason: Option<String>,
}

/// A `function_call` item sent back (only its ids are read).
#[derive(Debug, Deserialize)]
pub struct FunctionCall {
    #[serde(default)]
    pub id: Option<String>,
    pub call_id: String,
}

/// What a request's input answers of a run that waits: the client tools' results and the
/// decisions, and the run the items name (a decision's request id, or a call's sent back).
pub struct Answers {
    pub answers: Vec<WaitAnswer>,
    pub named: Option<TraceId>,
}

/// Where a new response's message goes, from `conversation` and `previous_response_id`.
pub enum Placement {
    /// A new conversation.
    New,
    /// After the conversation's active branch.
    Conversation(ConversationId),
    /// After that response's answer: its run's trace, and the seq after which the
    /// response's events begin.
    After(TraceId, u64),
}

impl CreateResponse {
    /// What is refused before anything is read or stored.
    pub fn check(&self) -> Result<(), AppError> {
        if self.store == Some(false) {
            return Err(AppError::validation("store", "chatd keeps every response: store must be true or left out"));
        }
        if self.background && self.stream {
            return Err(AppError::validation(
                "stream",
                "a background response is read with GET /v1/responses/{id}?stream=true",
            ));
        }
        if let Some(metadata) = &self.metadata {
            check_metadata(metadata)?;
        }
        if self.temperature.is_some_and(|t| !(0.0..=2.0).contains(&t)) {
            return Err(AppError::validation("temperature", "temperature must be between 0 and 2"));
        }
        if self.max_output_tokens == Some(0) {
            return Err(AppError::validation("max_output_tokens", "max_output_tokens must be at least 1"));
        }
        if self.conversation.is_some() && self.previous_response_id.is_some() {
            return Err(AppError::validation(
                "previous_response_id",
                "give conversation or previous_response_id, not both",
            ));
        }
        Ok(())
    }

    pub fn placement(&self) -> Result<Placement, AppError> {
        if let Some(previous) = &self.previous_response_id {
            let (trace_id, from) = parse_response_id(previous).ok_or_else(|| AppError::NotFound {
                field: Some("previous_response_id".into()),
                message: "Response not found".into(),
            })?;
            return Ok(Placement::After(trace_id, from));
        }
        match &self.conversation {
            Some(conversation) => {
                parse_id("conv", conversation.id()).map(|id| Placement::Conversation(id.into())).ok_or_else(|| {
                    AppError::NotFound { field: Some("conversation".into()), message: "Conversation not found".into() }
                })
            }
            None => Ok(Placement::New),
        }
    }

    /// What the input answers of a waiting run, when its last items do (after its last user
    /// message: the items before are history sent back, chatd's own already).
    pub fn answers(&self) -> Result<Option<Answers>, AppError> {
        let Some(Input::Items(items)) = &self.input else { return Ok(None) };
        let last_user = items.iter().rposition(|i| matches!(i, InputItem::Message(m) if m.role == "user"));
        let after = &items[last_user.map_or(0, |i| i + 1)..];
        let mut answers = Answers { answers: Vec::new(), named: None };
        for item in after {
            match item {
                InputItem::FunctionCallOutput(FunctionCallOutput { call_id, output }) => {
                    // The call it answers, sent back before it, names its run.
                    let call = items.iter().find_map(|i| match i {
                        InputItem::FunctionCall(c) if c.call_id == *call_id => c.id.as_deref(),
                        _ => None,
                    });
                    answers.named = answers.named.or(call.and_then(|id| parse_request_id("fc", id)).map(|(t, _)| t));
                    answers.answers.push(WaitAnswer::Result {
                        tool_call_id: call_id.clone(),
                        output: output_text(output),
                        is_error: false,
                    });
                }
                InputItem::McpApprovalResponse(McpApprovalResponse { approval_request_id, approve, reason }) => {
                    let Some((trace, approval)) = parse_request_id("mcpr", approval_request_id) else {
                        return Err(AppError::NotFound {
                            field: Some("input".into()),
                            message: format!("Approval request {approval_request_id} not found"),
                        });
                    };
                    let approval_id = uuid::Uuid::try_parse(approval).map_err(|_| {
                        AppError::validation("input", format!("{approval_request_id} is no approval request's id"))
                    })?;
                    answers.named = answers.named.or(Some(trace));
                    answers.answers.push(WaitAnswer::Approval {
                        approval_id,
                        approved: *approve,
                        reason: reason.clone(),
                    });
                }
                _ => {}
            }
        }
        Ok((!answers.answers.is_empty()).then_some(answers))
    }

    /// The chat request this asks for: its last user message, with its files, and its
    /// function tools as client tools.
    pub fn request(&self) -> Result<ChatRequest, AppError> {
        let (message, attachments) = match &self.input {
            None => (String::new(), Vec::new()),
            Some(Input::Text(text)) => (text.clone(), Vec::new()),
            Some(Input::Items(items)) => {
                let user = items.iter().rev().find_map(|item| match item {
                    InputItem::Message(m) if m.role == "user" => Some(m),
                    _ => None,
                });
                let Some(user) = user else {
                    return Err(AppError::validation("input", "input holds no user message"));
                };
                user.text_and_files()?
            }
        };
        if message.trim().is_empty() && attachments.is_empty() {
            return Err(AppError::validation("input", "input is empty: send a user message"));
        }
        let client_tools = self
            .tools
            .iter()
            .filter(|tool| tool.get("type").and_then(Value::as_str) == Some("function"))
            .map(|tool| {
                serde_json::from_value::<FunctionTool>(tool.clone())
                    .map(|f| ClientTool {
                        name: f.name,
                        description: f.description.unwrap_or_default(),
                        parameters: f.parameters,
                    })
                    .map_err(|e| AppError::validation("tools", format!("a function tool: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let instructions = self.instructions.clone().filter(|i| !i.trim().is_empty());
        Ok(ChatRequest {
            message,
            profile: Some(self.model.clone()),
            attachments,
            client_tools,
            instructions,
            max_tokens: self.max_output_tokens,
            temperature: self.temperature,
            metadata: self.metadata.clone().filter(|m| !m.is_empty()).map(Value::Object),
            ..ChatRequest::default()
        })
    }
}

#[derive(Deserialize)]
struct FunctionTool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default = "object_schema")]
    parameters: Value,
}

/// `metadata` as OpenAI bounds it: at most 16 keys of up to 64 characters, each with a
/// string of up to 512.
fn check_metadata(metadata: &serde_json::Map<String, Value>) -> Result<(), AppError> {
    if metadata.len() > 16 {
        return Err(AppError::validation("metadata", "metadata holds at most 16 keys"));
    }
    for (key, value) in metadata {
        if key.chars().count() > 64 {
            return Err(AppError::validation("metadata", format!("metadata key '{key}' is longer than 64 characters")));
        }
        match value {
            Value::String(text) if text.chars().count() <= 512 => {}
            Value::String(_) => {
                return Err(AppError::validation(
                    "metadata",
                    format!("metadata '{key}' is longer than 512 characters"),
                ));
            }
            _ => return Err(AppError::validation("metadata", format!("metadata '{key}' must be a string"))),
        }
    }
    Ok(())
}

/// A tool's output as the model gets it: text as it is, content parts' text joined, any
/// other JSON as its text.
fn output_text(output: &Value) -> String {
    match output {
        Value::Array(parts) if parts.iter().all(|p| p.get("text").is_some_and(Value::is_string)) => {
            parts.iter().filter_map(|p| p["text"].as_str()).collect::<Vec<_>>().join("\n")
        }
        other => crate::chat::control::waits::output_text(other),
    }
}

fn object_schema() -> Value {
    serde_json::json!({"type": "object", "properties": {}})
}

impl MessageItem {
    /// The message's text (its text parts joined) and its files.
    pub(super) fn text_and_files(&self) -> Result<(String, Vec<AttachmentRef>), AppError> {
        let parts = match &self.content {
            Content::Text(text) => return Ok((text.clone(), Vec::new())),
            Content::Parts(parts) => parts,
        };
        let (mut text, mut files) = (String::new(), Vec::new());
        for part in parts {
            match part {
                ContentPart::InputText { text: t } | ContentPart::OutputText { text: t, .. } => {
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(t);
                }
                ContentPart::Refusal {} => {}
                ContentPart::InputImage { image_url, file_id, .. } => files.push(attachment(file_id, image_url, None)?),
                ContentPart::InputFile { file_id, file_data, file_url, filename } => {
                    files.push(attachment(file_id, &file_data.clone().or(file_url.clone()), filename.clone())?)
                }
            }
        }
        Ok((text, files))
    }
}

/// A file part as an attachment (CONTRACT.md §14): a stored file's id, or a URL.
fn attachment(file_id: &Option<String>, url: &Option<String>, name: Option<String>) -> Result<AttachmentRef, AppError> {
    match (file_id, url) {
        (Some(id), _) => {
            let id = parse_id("file", id).ok_or_else(|| AppError::NotFound {
                field: Some("input".into()),
                message: format!("File {id} not found"),
            })?;
            Ok(AttachmentRef::file(FileId(id)))
        }
        (None, Some(url)) => Ok(AttachmentRef::url(url.clone(), name)),
        (None, None) => Err(AppError::validation("input", "a file part needs a file_id or its data")),
    }
}
