//! OpenAI Chat Completions streaming, used for OpenAI itself and every OpenAI-compatible
//! server (OpenRouter, Ollama's `/v1`, vLLM, llama.cpp, LM Studio, any `base_url`).
//!
//! Wire format: `data: {chat.completion.chunk}` frames with `choices[0].delta.content`,
//! `reasoning_content` / `reasoning` (DeepSeek, OpenRouter, vLLM), `tool_calls[]` deltas keyed
//! by `index`, `finish_reason`; with `stream_options.include_usage` a last chunk with empty
//! `choices` and `usage`; then `data: [DONE]`. OpenRouter adds `: OPENROUTER PROCESSING`
//! comments and reports failures as `data: {"error": …}` on an HTTP 200.

use std::collections::BTreeMap;

use async_trait::async_trait;
use eventsource_stream::Event as SseFrame;
use serde_json::{Value, json};

use super::transport::{Decoder, Transport, join, json as frame_json};
use super::{LlmProvider, ModelRequest, ProviderError, ProviderErrorKind, ProviderEvent, ProviderStream};
use crate::config::{ProviderKind, ProviderSettings, Secret};
use crate::domain::{Role, Usage};

pub struct OpenAiProvider {
    transport: Transport,
    url: String,
    api_key: Option<Secret>,
    /// OpenAI itself takes `max_completion_tokens`; compatible servers take `max_tokens`.
    native: bool,
}

impl OpenAiProvider {
    pub fn new(settings: &ProviderSettings) -> Self {
        let native = settings.kind == ProviderKind::Openai;
        let default = if native { "https://api.openai.com/v1" } else { "http://127.0.0.1:11434/v1" };
        let base = settings.base_url.as_deref().unwrap_or(default);
        Self {
            transport: Transport::new(settings),
            url: join(base, "chat/completions"),
            api_key: settings.api_key.clone(),
            native,
        }
    }

    fn body(&self, request: &ModelRequest) -> Value {
        let mut messages = Vec::with_capacity(request.messages.len() + 1);
        if let Some(system) = &request.system_prompt {
            messages.push(json!({"role": "system", "content": system}));
        }
        for message in &request.messages {
            match message.role {
                Role::User => messages.push(json!({"role": "user", "content": message.content})),
                Role::System => messages.push(json!({"role": "system", "content": message.content})),
                Role::Assistant => {
                    for turn in message.turns() {
                        let mut assistant = json!({"role": "assistant", "content": turn.text});
                        if !turn.tool_calls.is_empty() {
                            assistant["tool_calls"] = turn
                                .tool_calls
                                .iter()
                                .map(|call| {
                                    json!({"id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": call.input.to_string()}})
                                })
                                .collect();
                        }
                        messages.push(assistant);
                        messages.extend(turn.tool_results.iter().map(|result| {
                            json!({"role": "tool", "tool_call_id": result.tool_call_id, "content": result.content})
                        }));
                    }
                }
                Role::Tool => {}
            }
        }
        let mut body = json!({
            "model": request.model,
            "messages": messages,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(t) = request.temperature {
            body["temperature"] = json!(t);
        }
        if let Some(max) = request.max_tokens {
            body[if self.native { "max_completion_tokens" } else { "max_tokens" }] = json!(max);
        }
        if let Some(effort) = &request.reasoning_effort {
            body["reasoning_effort"] = json!(effort);
        }
        if !request.tools.is_empty() {
            body["tools"] = request
                .tools
                .iter()
                .map(|t| {
                    json!({"type": "function", "function": {
                        "name": t.name, "description": t.description, "parameters": t.input_schema,
                    }})
                })
                .collect();
        }
        body
    }
}

#[async_trait]
impl LlmProvider for OpenAiProvider {
    async fn stream(&self, request: &ModelRequest) -> Result<ProviderStream, ProviderError> {
        let body = self.body(request);
        let response = self
            .transport
            .send(|| {
                let builder = self.transport.client().post(&self.url).json(&body);
                match &self.api_key {
                    Some(key) => builder.bearer_auth(key.expose()),
                    None => builder,
                }
            })
            .await?;
        Ok(self.transport.decode(response, ChunkDecoder::default()))
    }
}

/// Decodes `chat.completion.chunk` frames.
#[derive(Default)]
pub struct ChunkDecoder {
    /// Tool calls begun, by the provider's `index`, to end them at the finish.
    open_calls: BTreeMap<u32, ()>,
    finish_reason: Option<String>,
    done: bool,
}

impl Decoder for ChunkDecoder {
    fn frame(&mut self, frame: &SseFrame, out: &mut Vec<ProviderEvent>) -> Result<(), ProviderError> {
        if frame.data.trim() == "[DONE]" {
            self.close_calls(out);
            out.push(ProviderEvent::Finish(self.finish_reason.take().unwrap_or_else(|| "stop".to_owned())));
            self.done = true;
            return Ok(());
        }
        let chunk = frame_json(frame)?;
        if let Some(error) = chunk.get("error") {
            return Err(stream_error(error));
        }
        if let Some(choice) = chunk["choices"].get(0) {
            let delta = &choice["delta"];
            for key in ["reasoning_content", "reasoning"] {
                if let Some(text) = delta[key].as_str().filter(|t| !t.is_empty()) {
                    out.push(ProviderEvent::Thinking(text.to_owned()));
                }
            }
            if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                out.push(ProviderEvent::Text(text.to_owned()));
            }
            for call in delta["tool_calls"].as_array().into_iter().flatten() {
                self.tool_call(call, out)?;
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                if reason == "error" {
                    return Err(ProviderError::new(ProviderErrorKind::Unavailable, "Model error"));
                }
                self.close_calls(out);
                self.finish_reason = Some(reason.to_owned());
            }
        }
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            out.push(ProviderEvent::Usage(Usage {
                input_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
                output_tokens: usage["completion_tokens"].as_u64().unwrap_or(0),
                cache_read_tokens: usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
                reasoning_tokens: usage["completion_tokens_details"]["reasoning_tokens"].as_u64(),
            }));
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.done
    }
}

impl ChunkDecoder {
    fn tool_call(&mut self, call: &Value, out: &mut Vec<ProviderEvent>) -> Result<(), ProviderError> {
        let index = call["index"].as_u64().ok_or_else(super::transport::parse_error)? as u32;
        if let std::collections::btree_map::Entry::Vacant(slot) = self.open_calls.entry(index) {
            slot.insert(());
            out.push(ProviderEvent::ToolCallStart {
                index,
                id: call["id"].as_str().unwrap_or_default().to_owned(),
                name: call["function"]["name"].as_str().unwrap_or_default().to_owned(),
            });
        }
        if let Some(arguments) = call["function"]["arguments"].as_str().filter(|a| !a.is_empty()) {
            out.push(ProviderEvent::ToolCallDelta { index, arguments: arguments.to_owned() });
        }
        Ok(())
    }

    fn close_calls(&mut self, out: &mut Vec<ProviderEvent>) {
        for (index, ()) in std::mem::take(&mut self.open_calls) {
            out.push(ProviderEvent::ToolCallEnd { index });
        }
    }
}

/// An error reported inside the stream (`{"error": {"code", "message"}}`).
fn stream_error(error: &Value) -> ProviderError {
    let message = error["message"].as_str().unwrap_or("Model error");
    let code = error["code"].as_u64().or_else(|| error["code"].as_str().and_then(|c| c.parse().ok()));
    match code {
        Some(401 | 403) => ProviderError::new(ProviderErrorKind::Unauthorized, "Invalid API key"),
        Some(429) => ProviderError::new(ProviderErrorKind::RateLimited, "Rate limited, try again"),
        _ => ProviderError::new(ProviderErrorKind::Unavailable, format!("Model error: {message}")),
    }
}
