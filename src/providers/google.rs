//! Google Gemini streaming (`POST {base_url}/models/{model}:streamGenerateContent?alt=sse`).
//!
//! Wire format: each `data:` frame is a whole `GenerateContentResponse`: `candidates[0]
//! .content.parts[]` with `text` (a `thought: true` part is thinking) or `functionCall
//! {name, args}` (whole, never split), `finishReason` on the last candidate, and
//! `usageMetadata` (cumulative). There is no `[DONE]`: the frame carrying `finishReason` is
//! the terminal one. Errors arrive as HTTP statuses, or as `{"error": …}` in a frame.

use std::collections::VecDeque;

use async_trait::async_trait;
use serde_json::{Value, json};

use super::sse::Frame as SseFrame;

use super::transport::{Decoder, Transport, join, json as frame_json};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;

use super::{
    FileContent, InputFile, InputMessage, LlmProvider, ModelRequest, ProviderError, ProviderErrorKind, ProviderEvent,
    ProviderStream,
};
use crate::config::ProviderSettings;
use crate::domain::Usage;
use crate::events::Text;

pub struct GoogleProvider {
    transport: Transport,
    base: String,
}

/// A file as an `inline_data` part (base64), a text file as a `text` part.
fn file_part(file: &InputFile) -> Value {
    match &file.content {
        FileContent::Bytes(bytes) => {
            json!({"inline_data": {"mime_type": file.file.media_type, "data": BASE64.encode(bytes)}})
        }
        FileContent::Text(text) => json!({"text": file.text_block(text)}),
        FileContent::Unread | FileContent::Left(_) => json!({"text": file.note()}),
    }
}

impl GoogleProvider {
    pub fn new(settings: &ProviderSettings) -> Self {
        let base =
            settings.base_url.clone().unwrap_or_else(|| "https://generativelanguage.googleapis.com/v1beta".to_owned());
        Self { transport: Transport::new(settings, &base), base }
    }

    fn body(request: &ModelRequest) -> Value {
        let mut contents: Vec<Value> = Vec::new();
        let newest_question = request.messages.iter().rposition(|m| matches!(m, InputMessage::User { .. }));
        for (i, message) in request.messages.iter().enumerate() {
            match message {
                InputMessage::User { text, files, .. } => {
                    let mut parts: Vec<Value> = files.iter().map(file_part).collect();
                    // A message of files alone has no words: an empty text part is refused.
                    if !text.is_empty() || parts.is_empty() {
                        parts.push(json!({"text": text}));
                    }
                    // The request's notes follow the newest question as a part of their own:
                    // Gemini's implicit cache keeps the prefix before them (CONTRACT.md §21).
                    if let Some(notes) = request.notes.as_ref().filter(|_| Some(i) == newest_question) {
                        parts.push(json!({"text": notes}));
                    }
                    push(&mut contents, "user", parts)
                }
                InputMessage::Assistant { turns, .. } => {
                    for turn in turns {
                        let mut parts = Vec::new();
                        if !turn.text.is_empty() {
                            parts.push(json!({"text": turn.text}));
                        }
                        parts.extend(
                            turn.tool_calls.iter().map(|c| json!({"functionCall": {"name": c.name, "args": c.input}})),
                        );
                        push(&mut contents, "model", parts);
                        let responses = turn.tool_results.iter().map(|r| {
                            json!({"functionResponse": {"name": r.tool_name, "response": {"content": r.content, "is_error": r.is_error}}})
                        });
                        push(&mut contents, "user", responses.collect());
                    }
                }
                InputMessage::System { .. } => {}
            }
        }
        let mut generation = json!({});
        if let Some(t) = request.temperature {
            generation["temperature"] = json!(t);
        }
        if let Some(max) = request.max_tokens {
            generation["maxOutputTokens"] = json!(max);
        }
        if request.enable_thinking {
            let mut thinking = json!({"includeThoughts": true});
            if let Some(budget) = request.thinking_budget {
                thinking["thinkingBudget"] = json!(budget);
            }
            generation["thinkingConfig"] = thinking;
        }
        let mut body = json!({"contents": contents, "generationConfig": generation});
        if let Some(system) = &request.system_prompt {
            body["systemInstruction"] = json!({"parts": [{"text": system}]});
        }
        if !request.tools.is_empty() {
            let declarations: Vec<Value> = request
                .tools
                .iter()
                .map(|t| json!({"name": t.name, "description": t.description, "parameters": t.input_schema}))
                .collect();
            body["tools"] = json!([{"functionDeclarations": declarations}]);
        }
        body
    }
}

/// Appends parts as a content of `role`, merged into the previous one of the same role.
fn push(contents: &mut Vec<Value>, role: &str, parts: Vec<Value>) {
    super::push_merged(contents, role, "parts", parts);
}

#[async_trait]
impl LlmProvider for GoogleProvider {
    async fn stream(&self, request: &ModelRequest) -> Result<ProviderStream, ProviderError> {
        let url = join(&self.base, &format!("models/{}:streamGenerateContent?alt=sse", request.model));
        let body = Self::body(request);
        let response = self
            .transport
            .send(|key| {
                let builder = self.transport.client().post(&url).json(&body);
                match key {
                    Some(key) => builder.header("x-goog-api-key", key.expose()),
                    None => builder,
                }
            })
            .await?;
        Ok(self.transport.decode(response, ResponseDecoder::default()))
    }
}

/// Decodes `GenerateContentResponse` frames.
#[derive(Default)]
pub struct ResponseDecoder {
    calls: u32,
    done: bool,
}

impl Decoder for ResponseDecoder {
    fn frame(&mut self, frame: &SseFrame<'_>, out: &mut VecDeque<ProviderEvent>) -> Result<(), ProviderError> {
        let response: Value = frame_json(frame)?;
        if let Some(error) = response.get("error") {
            let message = error["message"].as_str().unwrap_or("Model error");
            return Err(match error["code"].as_u64() {
                Some(401 | 403) => ProviderError::new(ProviderErrorKind::Unauthorized, "Invalid API key"),
                Some(429) => ProviderError::new(ProviderErrorKind::RateLimited, "Rate limited, try again"),
                _ => ProviderError::new(ProviderErrorKind::Unavailable, format!("Model error: {message}")),
            });
        }
        let candidate = &response["candidates"][0];
        for part in candidate["content"]["parts"].as_array().into_iter().flatten() {
            if let Some(call) = part.get("functionCall") {
                let index = self.calls;
                self.calls += 1;
                let name = call["name"].as_str().unwrap_or_default().to_owned();
                let id = call["id"].as_str().map_or_else(|| format!("call_{index}"), str::to_owned);
                out.push_back(ProviderEvent::ToolCallStart { index, id, name });
                let args = call.get("args").cloned().unwrap_or_else(|| json!({}));
                out.push_back(ProviderEvent::ToolCallDelta { index, arguments: args.to_string() });
                out.push_back(ProviderEvent::ToolCallEnd { index });
            } else if let Some(text) = part["text"].as_str().filter(|t| !t.is_empty()) {
                let text = Text::from(text);
                out.push_back(if part["thought"] == true {
                    ProviderEvent::Thinking(text)
                } else {
                    ProviderEvent::Text(text)
                });
            }
        }
        if let Some(reason) = candidate["finishReason"].as_str() {
            if let Some(usage) = response.get("usageMetadata") {
                out.push_back(ProviderEvent::Usage(Usage {
                    input_tokens: usage["promptTokenCount"].as_u64().unwrap_or(0),
                    output_tokens: usage["candidatesTokenCount"].as_u64().unwrap_or(0)
                        + usage["thoughtsTokenCount"].as_u64().unwrap_or(0),
                    cache_read_tokens: usage["cachedContentTokenCount"].as_u64(),
                    cache_write_tokens: None,
                    cache_write_1h_tokens: None,
                    reasoning_tokens: usage["thoughtsTokenCount"].as_u64(),
                    estimated: false,
                }));
            }
            out.push_back(ProviderEvent::Finish(match reason {
                "STOP" if self.calls > 0 => "tool_calls".to_owned(),
                "STOP" => "stop".to_owned(),
                "MAX_TOKENS" => "length".to_owned(),
                other => other.to_ascii_lowercase(),
            }));
            self.done = true;
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.done
    }
}
