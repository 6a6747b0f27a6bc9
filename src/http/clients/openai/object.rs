//! The Responses API's objects (CONTRACT.md §20): the Response, its output items and usage,
//! the model list, and OpenAI's error shape. chatd's ids travel with a prefix: a response
//! is its run (`resp_<trace id>`), a conversation `conv_<id>`, an answer `msg_<id>`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response as HttpResponse};
use serde::Serialize;

use crate::domain::Usage;
use crate::ids::{ConversationId, MessageId, TraceId};

/// `resp_<trace id>`.
pub fn response_id(trace_id: TraceId) -> String {
    format!("resp_{}", trace_id.0.simple())
}

/// `conv_<conversation id>`.
pub fn conversation_id(id: ConversationId) -> String {
    format!("conv_{}", id.0.simple())
}

/// The run and the seq after which a response's events begin, behind its id:
/// `resp_<trace id>` (a run's first response, 0) or `resp_<trace id>_<seq>` (one that goes on
/// after a wait).
pub fn parse_response_id(id: &str) -> Option<(TraceId, u64)> {
    let (trace, from) = match id.strip_prefix("resp_").and_then(|rest| rest.split_once('_')) {
        Some((trace, from)) => (trace, from.parse().ok().filter(|from| *from > 0)?),
        None => (id, 0),
    };
    Some((TraceId::from(parse_id("resp", trace)?), from))
}

/// The run behind an item id of a wait's request, `<prefix>_<trace id>_<rest>`, and its rest.
pub fn parse_request_id<'a>(prefix: &str, id: &'a str) -> Option<(TraceId, &'a str)> {
    let (trace, rest) = id.strip_prefix(prefix)?.strip_prefix('_')?.split_once('_')?;
    Some((TraceId::from(uuid::Uuid::try_parse(trace).ok()?), rest))
}

/// The id behind `prefix_<uuid>` (or a bare UUID, as chatd's own endpoints name it).
pub fn parse_id(prefix: &str, text: &str) -> Option<uuid::Uuid> {
    let bare = text.strip_prefix(prefix).and_then(|t| t.strip_prefix('_')).unwrap_or(text);
    uuid::Uuid::try_parse(bare).ok()
}

/// A response's state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseStatus)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    #[default]
    InProgress,
    Completed,
    Failed,
    Cancelled,
    Incomplete,
}

/// The Response object.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseObject)]
pub struct Response {
    pub id: String,
    pub object: &'static str,
    pub created_at: i64,
    pub status: Status,
    /// The profile that answered the request (a "model" to the SDKs).
    pub model: String,
    pub output: Vec<OutputItem>,
    pub usage: Option<ResponseUsage>,
    pub conversation: Option<ConversationRef>,
    pub previous_response_id: Option<String>,
    pub error: Option<ResponseError>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<String>,
    #[schema(value_type = Object)]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub parallel_tool_calls: bool,
    pub tool_choice: &'static str,
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<serde_json::Value>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub store: bool,
    pub background: bool,
    /// The answer's stored message, whose id the message item carries.
    #[serde(skip)]
    pub message_id: Option<MessageId>,
    /// The run it is of.
    #[serde(skip)]
    pub trace_id: Option<TraceId>,
    /// The seq in its run's log after which its events begin (0: the run's first response).
    #[serde(skip)]
    pub from: u64,
}

impl Default for Response {
    fn default() -> Self {
        Self {
            id: String::new(),
            object: "response",
            created_at: 0,
            status: Status::InProgress,
            model: String::new(),
            output: Vec::new(),
            usage: None,
            conversation: None,
            previous_response_id: None,
            error: None,
            incomplete_details: None,
            instructions: None,
            metadata: serde_json::Map::new(),
            parallel_tool_calls: true,
            tool_choice: "auto",
            tools: Vec::new(),
            temperature: None,
            top_p: None,
            store: true,
            background: false,
            message_id: None,
            trace_id: None,
            from: 0,
        }
    }
}

impl Response {
    /// A response whose run has just begun (a background one, answered at once).
    pub fn begun(trace_id: TraceId, conversation: ConversationId, message_id: MessageId, profile: &str) -> Self {
        Response {
            id: response_id(trace_id),
            // When the run started, from its time-ordered id: the same on every replay.
            created_at: trace_id.0.get_timestamp().map_or(0, |t| t.to_unix().0 as i64),
            model: profile.to_owned(),
            conversation: Some(ConversationRef { id: conversation_id(conversation) }),
            message_id: Some(message_id),
            trace_id: Some(trace_id),
            ..Response::default()
        }
    }

    /// What the ids of this response's items are made from: its answer's id (and, for a
    /// response that goes on after a wait, where it begins).
    pub fn message_key(&self) -> String {
        let message = self.message_id.map(|m| m.0.simple().to_string()).unwrap_or_default();
        match self.from {
            0 => message,
            from => format!("{message}_{from}"),
        }
    }

    /// Its run's trace id, as the ids of its requests' items carry it.
    pub fn trace_key(&self) -> String {
        self.trace_id.map(|t| t.0.simple().to_string()).unwrap_or_default()
    }
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseConversation)]
pub struct ConversationRef {
    pub id: String,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseIncompleteDetails)]
pub struct IncompleteDetails {
    pub reason: &'static str,
}

/// Why a response failed: OpenAI's code where one fits, with chatd's message.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseError)]
pub struct ResponseError {
    pub code: String,
    pub message: String,
}

impl ResponseError {
    /// The error of a run that failed with the contract's `code`.
    pub fn of(code: &str, message: &str) -> Self {
        let code = match code {
            "RATE_LIMITED" => "rate_limit_exceeded",
            "VALIDATION_ERROR" => "invalid_prompt",
            _ => "server_error",
        };
        Self { code: code.to_owned(), message: message.to_owned() }
    }
}

/// An output item.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseOutputItem)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The model's thinking, as a summary.
    Reasoning { id: String, status: &'static str, summary: Vec<SummaryText> },
    /// The answer's clean text.
    Message { id: String, role: &'static str, status: &'static str, content: Vec<OutputText> },
    /// A tool chatd ran itself (a built-in, an HTTP tool, an MCP server's).
    McpCall {
        id: String,
        server_label: String,
        name: String,
        arguments: String,
        output: Option<String>,
        error: Option<String>,
        status: &'static str,
    },
    /// A call of a client tool (a `function` tool of the request): the client runs it and
    /// sends its `function_call_output`. Its id is `fc_<trace id>_<index>`.
    FunctionCall { id: String, call_id: String, name: String, arguments: String, status: &'static str },
    /// A call waiting for a person's approval: the client sends its `mcp_approval_response`.
    /// Its id is `mcpr_<trace id>_<approval id>`.
    McpApprovalRequest { id: String, server_label: String, name: String, arguments: String },
}

impl OutputItem {
    /// A reasoning item as it is added: its summary part follows.
    pub fn reasoning(id: String) -> Self {
        OutputItem::Reasoning { id, status: "in_progress", summary: Vec::new() }
    }

    /// A message item as it is added: its text part follows.
    pub fn message(id: String) -> Self {
        OutputItem::Message { id, role: "assistant", status: "in_progress", content: Vec::new() }
    }

    pub fn id(&self) -> &str {
        match self {
            OutputItem::Reasoning { id, .. }
            | OutputItem::Message { id, .. }
            | OutputItem::McpCall { id, .. }
            | OutputItem::FunctionCall { id, .. }
            | OutputItem::McpApprovalRequest { id, .. } => id,
        }
    }
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseSummaryText)]
pub struct SummaryText {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseOutputText)]
pub struct OutputText {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
    #[schema(value_type = Vec<Object>)]
    pub annotations: Vec<serde_json::Value>,
    #[schema(value_type = Vec<Object>)]
    pub logprobs: Vec<serde_json::Value>,
}

/// Usage as the SDKs read it: flat counts only (the Agents SDK refuses nested details).
#[derive(Debug, Clone, Copy, Serialize, utoipa::ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: u64,
    pub input_tokens_details: InputDetails,
    pub output_tokens: u64,
    pub output_tokens_details: OutputDetails,
    pub total_tokens: u64,
}

#[derive(Debug, Clone, Copy, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseInputTokensDetails)]
pub struct InputDetails {
    pub cached_tokens: u64,
}

#[derive(Debug, Clone, Copy, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseOutputTokensDetails)]
pub struct OutputDetails {
    pub reasoning_tokens: u64,
}

impl From<Usage> for ResponseUsage {
    fn from(u: Usage) -> Self {
        Self {
            input_tokens: u.input_tokens,
            input_tokens_details: InputDetails { cached_tokens: u.cache_read_tokens.unwrap_or(0) },
            output_tokens: u.output_tokens,
            output_tokens_details: OutputDetails { reasoning_tokens: u.reasoning_tokens.unwrap_or(0) },
            total_tokens: u.input_tokens + u.output_tokens,
        }
    }
}

/// An item of a response's input: its user message, or an answer to a call its run waited
/// on (the input of a response that goes on after a wait).
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseInputItem)]
#[serde(untagged)]
pub enum InputItem {
    Message(super::conversations::Item),
    Answer(Answer),
}

impl InputItem {
    pub fn id(&self) -> &str {
        match self {
            InputItem::Message(item) => &item.id,
            InputItem::Answer(Answer::FunctionCallOutput { id, .. } | Answer::McpApprovalResponse { id, .. }) => id,
        }
    }
}

/// An answer to a call a run waited on, as the run's log shows it settled.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseInputAnswer)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Answer {
    /// A client tool's result: `fco_<trace id>_<index>`.
    FunctionCallOutput { id: String, call_id: String, output: String, status: &'static str },
    /// A decision: `mcpa_<trace id>_<approval id>`.
    McpApprovalResponse { id: String, approval_request_id: String, approve: bool },
}

/// `GET /v1/responses/{id}/input_items`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = ResponseInputItemList)]
pub struct InputItemList {
    pub object: &'static str,
    pub data: Vec<InputItem>,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
    pub has_more: bool,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = OpenAiModelList)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<Model>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = OpenAiModel)]
pub struct Model {
    pub id: String,
    pub object: &'static str,
    pub created: i64,
    pub owned_by: String,
}

/// An error, as OpenAI answers it.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = OpenAiErrorBody)]
pub struct ErrorBody {
    pub error: ErrorFields,
}

#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = OpenAiError)]
pub struct ErrorFields {
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `not_found_error`, `rate_limit_error`, …
    #[serde(rename = "type")]
    pub kind: String,
    /// The request's field at fault, where there is one.
    pub param: Option<String>,
    /// The contract's error code, in lower case.
    pub code: Option<String>,
}

/// What a `/v1` route may answer instead of its result, each as an [`ErrorBody`] (only
/// described: [`rewrite`] makes the answers).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub enum Refused {
    #[response(status = 400, description = "Invalid input")]
    Invalid(ErrorBody),
    #[response(status = 401, description = "Missing or invalid credentials")]
    Unauthorized(ErrorBody),
    #[response(status = 404, description = "Unknown, or another user's")]
    Missing(ErrorBody),
    #[response(status = 413, description = "Too large")]
    TooLarge(ErrorBody),
    #[response(status = 429, description = "Rate limited, or over a budget")]
    RateLimited(ErrorBody),
    #[response(status = 503, description = "Shutting down, or the database is unavailable")]
    Unavailable(ErrorBody),
}

/// A field chatd's request names, as the Responses request names it.
fn param(field: &str) -> &str {
    match field {
        "profile" => "model",
        "message" | "attachments" => "input",
        other => other,
    }
}

/// The OpenAI error type of an HTTP status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        429 => "rate_limit_error",
        500.. => "server_error",
        _ => "invalid_request_error",
    }
}

/// A chatd error answer (`{code, message, field}`) as OpenAI's shape, `{"error": {"message",
/// "type", "param", "code"}}`, its status and headers (`Retry-After`) kept; any other answer
/// as it is. The `/v1` routes answer through it, so that refusals of the extractors (auth,
/// a body that is not JSON) read the same (the SDKs raise their typed errors by status).
pub async fn rewrite(response: HttpResponse) -> HttpResponse {
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    // chatd's error answers are small JSON built in memory.
    let Ok(bytes) = axum::body::to_bytes(body, 64 * 1024).await else {
        return HttpResponse::from_parts(parts, axum::body::Body::empty());
    };
    #[derive(serde::Deserialize)]
    struct Chatd {
        code: String,
        message: String,
        field: Option<String>,
    }
    let Ok(chatd) = serde_json::from_slice::<Chatd>(&bytes) else {
        return HttpResponse::from_parts(parts, axum::body::Body::from(bytes));
    };
    let code = chatd.code.to_ascii_lowercase();
    let body = ErrorBody {
        error: ErrorFields {
            message: chatd.message,
            kind: error_type(status).to_owned(),
            param: chatd.field.as_deref().map(|f| param(f).to_owned()),
            code: Some(code),
        },
    };
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let mut rewritten = (status, Json(body)).into_response();
    for (name, value) in parts.headers.iter() {
        if name != axum::http::header::CONTENT_TYPE {
            rewritten.headers_mut().insert(name.clone(), value.clone());
        }
    }
    rewritten
}
