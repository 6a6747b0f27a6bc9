//! Anthropic Messages streaming (`POST {base_url}/v1/messages`, `stream: true`).
//!
//! Wire format: named SSE events `message_start` (input usage), `content_block_start`
//! (`text`, `thinking`, `redacted_thinking` or `tool_use`), `content_block_delta`
//! (`text_delta`, `thinking_delta`, `signature_delta`, `input_json_delta`),
//! `content_block_stop`, `message_delta` (`stop_reason`, output usage), `message_stop` (the
//! terminal frame), `ping`, and `error` (e.g. `overloaded_error`) at any point. Thinking
//! blocks go back to the API in later turns with their signatures, as it requires.

use std::collections::{HashMap, VecDeque};

use super::sse::Frame as SseFrame;
use async_trait::async_trait;
use serde_json::{Value, json};

use super::transport::{Decoder, Endpoint, Transport, json as frame_json, parse_error};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;

use super::{
    FileContent, InputFile, InputMessage, LlmProvider, ModelRequest, ProviderError, ProviderErrorKind, ProviderEvent,
    ProviderStream,
};
use crate::config::{CacheTtl, ProviderSettings};
use crate::domain::{ThinkingBlock, Usage};

const API_VERSION: &str = "2023-06-01";
/// Anthropic requires `max_tokens`; used when the profile sets none.
const DEFAULT_MAX_TOKENS: u32 = 4096;
/// The smallest thinking budget the API accepts.
const MIN_THINKING_BUDGET: u32 = 1024;

pub struct AnthropicProvider {
    transport: Transport,
    url: Endpoint,
}

/// A file as an `image` or `document` block (base64), a text file as a `text` block.
fn file_block(file: &InputFile) -> Value {
    match &file.content {
        FileContent::Bytes(bytes) => {
            let kind = if file.file.is_pdf() { "document" } else { "image" };
            json!({"type": kind, "source": {"type": "base64", "media_type": file.file.media_type, "data": BASE64.encode(bytes)}})
        }
        FileContent::Text(text) => json!({"type": "text", "text": file.text_block(text)}),
        FileContent::Unread | FileContent::Left(_) => json!({"type": "text", "text": file.note()}),
    }
}

impl AnthropicProvider {
    pub fn new(settings: &ProviderSettings) -> Self {
        let base = settings.base_url.as_deref().unwrap_or("https://api.anthropic.com");
        Self { transport: Transport::new(settings, base), url: Endpoint::new(base, "v1/messages") }
    }

    fn body(request: &ModelRequest) -> Value {
        let mut messages: Vec<Value> = Vec::new();
        let newest_question = request.messages.iter().rposition(|m| matches!(m, InputMessage::User { .. }));
        // Where the newest question's last block is: the prefix the next turn reads back.
        let mut question_end = None;
        for (i, message) in request.messages.iter().enumerate() {
            match message {
                InputMessage::User { text, files, .. } => {
                    // Files first: Anthropic advises images before the words about them.
                    let mut content: Vec<Value> = files.iter().map(file_block).collect();
                    // A message of files alone has no words: an empty text block is refused.
                    if !text.is_empty() || content.is_empty() {
                        content.push(json!({"type": "text", "text": text}));
                    }
                    push(&mut messages, "user", content);
                    if Some(i) == newest_question {
                        let last = messages.len() - 1;
                        question_end = Some((last, messages[last]["content"].as_array().map_or(0, Vec::len) - 1));
                        // The request's notes follow the question, past the cached prefix.
                        if let Some(notes) = &request.notes {
                            push(&mut messages, "user", vec![json!({"type": "text", "text": notes})]);
                        }
                    }
                }
                InputMessage::Assistant { turns, .. } => {
                    for turn in turns {
                        let mut content: Vec<Value> = turn
                            .thinking_blocks
                            .iter()
                            .filter_map(|block| match block {
                                ThinkingBlock::Thinking { thinking, signature } if !signature.is_empty() => {
                                    Some(json!({"type": "thinking", "thinking": thinking, "signature": signature}))
                                }
                                ThinkingBlock::Thinking { .. } => None,
                            })
                            .collect();
                        if !turn.text.is_empty() {
                            content.push(json!({"type": "text", "text": turn.text}));
                        }
                        content.extend(turn.tool_calls.iter().map(
                            |call| json!({"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}),
                        ));
                        push(&mut messages, "assistant", content);
                        let results = turn.tool_results.iter().map(|result| {
                            json!({"type": "tool_result", "tool_use_id": result.tool_call_id,
                                   "content": result.content, "is_error": result.is_error})
                        });
                        push(&mut messages, "user", results.collect());
                    }
                }
                InputMessage::System { .. } => {}
            }
        }
        let thinking_budget = request
            .enable_thinking
            .then(|| request.thinking_budget.unwrap_or(MIN_THINKING_BUDGET).max(MIN_THINKING_BUDGET));
        let mut max_tokens = request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
        if let Some(budget) = thinking_budget {
            // The answer needs room beyond the thinking budget.
            max_tokens = max_tokens.max(budget + 1024);
        }
        if let Some(ttl) = request.prompt_cache {
            mark_prefix(&mut messages, question_end, ttl);
        }
        let mut body = json!({"model": request.model, "max_tokens": max_tokens, "messages": messages, "stream": true});
        if let Some(system) = &request.system_prompt {
            body["system"] = match request.prompt_cache {
                // Cached with the tools before it.
                Some(ttl) => json!([{"type": "text", "text": system, "cache_control": cache_control(ttl)}]),
                None => json!(system),
            };
        }
        match thinking_budget {
            Some(budget) => body["thinking"] = json!({"type": "enabled", "budget_tokens": budget}),
            // Thinking does not allow a temperature other than the default.
            None => {
                if let Some(t) = request.temperature {
                    body["temperature"] = json!(t);
                }
            }
        }
        if !request.tools.is_empty() {
            body["tools"] = request
                .tools
                .iter()
                .map(|t| json!({"name": t.name, "description": t.description, "input_schema": t.input_schema}))
                .collect();
        }
        body
    }
}

/// Marks the conversation for the prompt cache (CONTRACT.md §21): up to the newest
/// question, which the next turn sends again unchanged (the notes after it are not), and,
/// within a run's tool loop, up to the newest tool results, which the loop's next call sends
/// again. With the system prompt's mark that is three of the four the API allows.
fn mark_prefix(messages: &mut [Value], question_end: Option<(usize, usize)>, ttl: CacheTtl) {
    if let Some((message, block)) = question_end {
        messages[message]["content"][block]["cache_control"] = cache_control(ttl);
    }
    let Some(last) = messages.len().checked_sub(1) else { return };
    if question_end.is_some_and(|(message, _)| message == last) {
        return; // the question (and its notes) end the request: it is marked already
    }
    if let Some(block) = messages[last]["content"].as_array_mut().and_then(|blocks| blocks.last_mut()) {
        block["cache_control"] = cache_control(ttl);
    }
}

/// The `cache_control` of a block that ends a cached prefix.
fn cache_control(ttl: CacheTtl) -> Value {
    match ttl {
        CacheTtl::FiveMinutes => json!({"type": "ephemeral"}),
        CacheTtl::OneHour => json!({"type": "ephemeral", "ttl": "1h"}),
    }
}

/// Appends content blocks as a message of `role` (the API wants user and assistant to
/// alternate, so same-role neighbours merge).
fn push(messages: &mut Vec<Value>, role: &str, content: Vec<Value>) {
    super::push_merged(messages, role, "content", content);
}

#[async_trait]
impl LlmProvider for AnthropicProvider {
    async fn stream(&self, request: &ModelRequest) -> Result<ProviderStream, ProviderError> {
        let body = Self::body(request);
        let response = self
            .transport
            .send(|key| {
                let builder =
                    self.url.post(self.transport.client()).header("anthropic-version", API_VERSION).json(&body);
                match key {
                    Some(key) => builder.header("x-api-key", key.expose()),
                    None => builder,
                }
            })
            .await?;
        Ok(self.transport.decode(response, MessageDecoder::default()))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
    ToolUse,
    Other,
}

/// Decodes the Messages stream's named events.
#[derive(Default)]
pub struct MessageDecoder {
    blocks: HashMap<u64, Block>,
    usage: Usage,
    /// The input that was neither read from nor written to the cache.
    uncached: u64,
    stop_reason: Option<String>,
    done: bool,
}

impl MessageDecoder {
    /// Takes the counts a `usage` object gives: `message_start` gives them all, and
    /// `message_delta` the output's and, lately, the input's again (cumulative both times).
    /// The input is the uncached part plus what was read from and written to the cache.
    fn count(&mut self, usage: &Value) {
        let (uncached, read, written) = (
            usage["input_tokens"].as_u64(),
            usage["cache_read_input_tokens"].as_u64(),
            usage["cache_creation_input_tokens"].as_u64(),
        );
        if uncached.is_some() || read.is_some() || written.is_some() {
            let (read, written) = (read.or(self.usage.cache_read_tokens), written.or(self.usage.cache_write_tokens));
            let uncached = uncached.unwrap_or(self.uncached);
            self.uncached = uncached;
            self.usage.input_tokens = uncached + read.unwrap_or(0) + written.unwrap_or(0);
            (self.usage.cache_read_tokens, self.usage.cache_write_tokens) = (read, written);
        }
        if let Some(hour) = usage["cache_creation"]["ephemeral_1h_input_tokens"].as_u64() {
            self.usage.cache_write_1h_tokens = Some(hour);
        }
        if let Some(output) = usage["output_tokens"].as_u64() {
            self.usage.output_tokens = output;
        }
    }
}

impl Decoder for MessageDecoder {
    fn frame(&mut self, frame: &SseFrame<'_>, out: &mut VecDeque<ProviderEvent>) -> Result<(), ProviderError> {
        // The `type` in the data is authoritative; the SSE event name repeats it.
        let data: Value = frame_json(frame)?;
        match data["type"].as_str().unwrap_or(frame.event) {
            "message_start" => {
                self.count(&data["message"]["usage"]);
            }
            "content_block_start" => {
                let index = data["index"].as_u64().ok_or_else(parse_error)?;
                let block = &data["content_block"];
                let kind = match block["type"].as_str() {
                    Some("text") => Block::Text,
                    Some("thinking") => Block::Thinking,
                    Some("tool_use") => {
                        out.push_back(ProviderEvent::ToolCallStart {
                            index: index as u32,
                            id: block["id"].as_str().unwrap_or_default().to_owned(),
                            name: block["name"].as_str().unwrap_or_default().to_owned(),
                        });
                        Block::ToolUse
                    }
                    _ => Block::Other,
                };
                if let Some(text) = block["text"].as_str().filter(|t| !t.is_empty()) {
                    out.push_back(ProviderEvent::Text(text.into()));
                }
                self.blocks.insert(index, kind);
            }
            "content_block_delta" => {
                let index = data["index"].as_u64().ok_or_else(parse_error)?;
                let delta = &data["delta"];
                let text = |key: &str| delta[key].as_str().ok_or_else(parse_error);
                match delta["type"].as_str() {
                    Some("text_delta") => out.push_back(ProviderEvent::Text(text("text")?.into())),
                    Some("thinking_delta") => out.push_back(ProviderEvent::Thinking(text("thinking")?.into())),
                    Some("signature_delta") => {
                        out.push_back(ProviderEvent::ThinkingSignature(text("signature")?.into()))
                    }
                    Some("input_json_delta") => out.push_back(ProviderEvent::ToolCallDelta {
                        index: index as u32,
                        arguments: text("partial_json")?.into(),
                    }),
                    // Deltas of block types this version does not know (e.g. citations).
                    _ => {}
                }
            }
            "content_block_stop" => {
                let index = data["index"].as_u64().ok_or_else(parse_error)?;
                if self.blocks.remove(&index) == Some(Block::ToolUse) {
                    out.push_back(ProviderEvent::ToolCallEnd { index: index as u32 });
                }
            }
            "message_delta" => {
                if let Some(reason) = data["delta"]["stop_reason"].as_str() {
                    self.stop_reason = Some(reason.to_owned());
                }
                self.count(&data["usage"]);
            }
            "message_stop" => {
                out.push_back(ProviderEvent::Usage(self.usage));
                out.push_back(ProviderEvent::Finish(finish_reason(self.stop_reason.as_deref())));
                self.done = true;
            }
            "error" => {
                let error = &data["error"];
                let message = error["message"].as_str().unwrap_or("Model error");
                return Err(match error["type"].as_str() {
                    Some("authentication_error" | "permission_error") => {
                        ProviderError::new(ProviderErrorKind::Unauthorized, "Invalid API key")
                    }
                    Some("rate_limit_error") => {
                        ProviderError::new(ProviderErrorKind::RateLimited, "Rate limited, try again")
                    }
                    _ => ProviderError::new(ProviderErrorKind::Unavailable, format!("Model error: {message}")),
                });
            }
            // `ping` and event types added after this was written.
            _ => {}
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.done
    }
}

/// Anthropic's stop reasons in the contract's vocabulary.
fn finish_reason(reason: Option<&str>) -> String {
    match reason {
        None | Some("end_turn" | "stop_sequence") => "stop",
        Some("max_tokens") => "length",
        Some("tool_use") => "tool_calls",
        Some(other) => other,
    }
    .to_owned()
}
