//! The body chatd posts to `chat/completions`: typed members that borrow from the
//! [`ModelRequest`], written straight to bytes once per call and shared by its attempts.
//! (Built as a `serde_json::Value` first, every member was an allocation and a map insert,
//! and the tree was walked again at each attempt to write it: 18,000 instructions a call
//! more, 2-3 % of a short run; docs/benchmarks.md.)

use std::borrow::Cow;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use serde::Serialize;
use serde_json::Value;

use crate::config::CacheTtl;
use crate::providers::{FileContent, InputFile, InputMessage, ModelRequest};

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    messages: Vec<Message<'a>>,
    stream: bool,
    stream_options: StreamOptions,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    /// OpenAI itself takes `max_completion_tokens`; compatible servers take `max_tokens`.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_effort: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_cache_key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_cache_retention: Option<&'static str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
#[serde(tag = "role", rename_all = "lowercase")]
enum Message<'a> {
    System {
        content: &'a str,
    },
    User {
        content: Content<'a>,
    },
    Assistant {
        content: &'a str,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<Call<'a>>,
    },
    Tool {
        tool_call_id: &'a str,
        content: &'a str,
    },
}

/// A user's message: its text alone, or its files and then its text as parts.
#[derive(Serialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part<'a> {
    Text { text: Cow<'a, str> },
    ImageUrl { image_url: ImageUrl },
    File { file: FileData<'a> },
}

#[derive(Serialize)]
struct ImageUrl {
    url: String,
}

#[derive(Serialize)]
struct FileData<'a> {
    filename: &'a str,
    file_data: String,
}

#[derive(Serialize)]
struct Call<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: CallFunction<'a>,
}

#[derive(Serialize)]
struct CallFunction<'a> {
    name: &'a str,
    /// The arguments as a JSON text, as the API sends and takes them.
    arguments: String,
}

#[derive(Serialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: ToolFunction<'a>,
}

#[derive(Serialize)]
struct ToolFunction<'a> {
    name: &'a str,
    description: &'a str,
    parameters: &'a Value,
}

/// The body for `request`; `native` for OpenAI itself, which takes a few members that
/// compatible servers do not.
pub(super) fn body(request: &ModelRequest, native: bool) -> Bytes {
    let mut messages = Vec::with_capacity(request.messages.len() + 1);
    if let Some(system) = &request.system_prompt {
        messages.push(Message::System { content: system });
    }
    let newest_question = request.messages.iter().rposition(|m| matches!(m, InputMessage::User { .. }));
    for (i, message) in request.messages.iter().enumerate() {
        // The request's notes end the newest question: the prefix before them is the
        // previous turn's, which the provider's cache keeps (CONTRACT.md §21).
        let notes = request.notes.as_deref().filter(|_| Some(i) == newest_question);
        match message {
            InputMessage::User { text, files, .. } if files.is_empty() => {
                messages.push(Message::User { content: Content::Text(with_notes(text, notes)) });
            }
            InputMessage::User { text, files, .. } => {
                let mut parts: Vec<Part> = files.iter().map(file_part).collect();
                let text = with_notes(text, notes);
                if !text.is_empty() {
                    parts.push(Part::Text { text });
                }
                messages.push(Message::User { content: Content::Parts(parts) });
            }
            InputMessage::System { text, .. } => messages.push(Message::System { content: text }),
            InputMessage::Assistant { turns, .. } => {
                for turn in turns {
                    let tool_calls = turn
                        .tool_calls
                        .iter()
                        .map(|call| Call {
                            id: &call.id,
                            kind: "function",
                            function: CallFunction { name: &call.name, arguments: call.input.to_string() },
                        })
                        .collect();
                    messages.push(Message::Assistant { content: &turn.text, tool_calls });
                    messages.extend(
                        turn.tool_results.iter().map(|result| Message::Tool {
                            tool_call_id: &result.tool_call_id,
                            content: &result.content,
                        }),
                    );
                }
            }
        }
    }
    // OpenAI caches every long prefix by itself; the key keeps one conversation's requests
    // on the machines that hold its prefix. Servers that only speak the format get neither
    // member (some refuse what they do not know).
    let cache = request.prompt_cache.filter(|_| native).zip(request.cache_key.as_deref());
    let body = Body {
        model: &request.model,
        messages,
        stream: true,
        stream_options: StreamOptions { include_usage: true },
        temperature: request.temperature,
        max_completion_tokens: request.max_tokens.filter(|_| native),
        max_tokens: request.max_tokens.filter(|_| !native),
        reasoning_effort: request.reasoning_effort.as_deref(),
        prompt_cache_key: cache.map(|(_, key)| key),
        // The API's retention past its in-memory default (minutes, up to an hour).
        prompt_cache_retention: cache.filter(|(ttl, _)| *ttl == CacheTtl::OneHour).map(|_| "24h"),
        tools: request
            .tools
            .iter()
            .map(|t| Tool {
                kind: "function",
                function: ToolFunction { name: &t.name, description: &t.description, parameters: &t.input_schema },
            })
            .collect(),
    };
    serde_json::to_vec(&body).expect("a request body serializes").into()
}

/// A file as a content part: an image as `image_url` (a data URL), a PDF as `file`
/// (`file_data`, a data URL), a text file as `text`.
fn file_part(file: &InputFile) -> Part<'_> {
    match &file.content {
        FileContent::Bytes(bytes) => {
            let url = format!("data:{};base64,{}", file.file.media_type, BASE64.encode(bytes));
            if file.file.is_pdf() {
                Part::File { file: FileData { filename: &file.file.name, file_data: url } }
            } else {
                Part::ImageUrl { image_url: ImageUrl { url } }
            }
        }
        FileContent::Text(text) => Part::Text { text: file.text_block(text).into() },
        FileContent::Unread | FileContent::Left(_) => Part::Text { text: file.note().into() },
    }
}

/// The user's words with the request's notes after them, where they go.
fn with_notes<'a>(text: &'a str, notes: Option<&str>) -> Cow<'a, str> {
    match notes {
        Some(notes) if text.is_empty() => notes.to_owned().into(),
        Some(notes) => format!("{text}\n\n{notes}").into(),
        None => text.into(),
    }
}
