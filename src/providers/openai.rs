//! OpenAI Chat Completions streaming, used for OpenAI itself and every OpenAI-compatible
//! server (OpenRouter, Ollama's `/v1`, vLLM, llama.cpp, LM Studio, any `base_url`).
//!
//! Wire format: `data: {chat.completion.chunk}` frames with `choices[0].delta.content`,
//! `reasoning_content` / `reasoning` (DeepSeek, OpenRouter, vLLM), `tool_calls[]` deltas keyed
//! by `index`, `finish_reason`; with `stream_options.include_usage` a last chunk with empty
//! `choices` and `usage`; then `data: [DONE]`. OpenRouter adds `: OPENROUTER PROCESSING`
//! comments and reports failures as `data: {"error": …}` on an HTTP 200.

use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};

use super::sse::Frame as SseFrame;
use async_trait::async_trait;
use reqwest::header::CONTENT_TYPE;
use serde::Deserialize;
use serde_json::Value;

use super::transport::{Decoder, Endpoint, Transport, json_text, text as frame_text};

use super::{LlmProvider, ModelRequest, ProviderError, ProviderErrorKind, ProviderEvent, ProviderStream};
use crate::config::{ProviderKind, ProviderSettings};
use crate::domain::Usage;

mod quick;
mod request;

pub struct OpenAiProvider {
    transport: Transport,
    url: Endpoint,
    /// OpenAI itself takes `max_completion_tokens`; compatible servers take `max_tokens`.
    native: bool,
}

impl OpenAiProvider {
    pub fn new(settings: &ProviderSettings) -> Self {
        let native = settings.kind == ProviderKind::Openai;
        let default = if native { "https://api.openai.com/v1" } else { "http://127.0.0.1:11434/v1" };
        let base = settings.base_url.as_deref().unwrap_or(default);
        Self { transport: Transport::new(settings, base), url: Endpoint::new(base, "chat/completions"), native }
    }
}

#[async_trait]
impl LlmProvider for OpenAiProvider {
    async fn stream(&self, request: &ModelRequest) -> Result<ProviderStream, ProviderError> {
        let body = request::body(request, self.native);
        let response = self
            .transport
            .send(|key| {
                let builder =
                    self.url.post(self.transport.client()).header(CONTENT_TYPE, "application/json").body(body.clone());
                match key {
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
    /// The stream's last frame, as the quick reader keeps it (to read the next without a walk).
    frames: quick::Frames,
}

impl Decoder for ChunkDecoder {
    fn frame(&mut self, frame: &SseFrame<'_>, out: &mut VecDeque<ProviderEvent>) -> Result<(), ProviderError> {
        // A token's frame is read by the quick reader, from its bytes where they are the last
        // frame's around another text; any other frame is read as text, by the quick reader
        // where it can and by serde where it declines.
        let chunk = match self.frames.like_the_last(frame.data) {
            Some(chunk) => chunk,
            None => {
                let data = frame_text(frame)?;
                if data.trim() == "[DONE]" {
                    self.close_calls(out);
                    out.push_back(ProviderEvent::Finish(
                        self.finish_reason.take().unwrap_or_else(|| "stop".to_owned()),
                    ));
                    self.done = true;
                    return Ok(());
                }
                match self.frames.chunk(data) {
                    Some(chunk) => chunk,
                    None => json_text(data)?,
                }
            }
        };
        if let Some(error) = &chunk.error {
            return Err(stream_error(error));
        }
        if let Some(choice) = &chunk.choices.0 {
            let delta = &choice.delta;
            for text in [&delta.reasoning_content, &delta.reasoning] {
                if let Some(text) = text.get() {
                    out.push_back(ProviderEvent::Thinking(text.into()));
                }
            }
            if let Some(text) = delta.content.get() {
                out.push_back(ProviderEvent::Text(text.into()));
            }
            for call in &delta.tool_calls {
                self.tool_call(call, out)?;
            }
            if let Some(reason) = choice.finish_reason.get() {
                if reason == "error" {
                    return Err(ProviderError::new(ProviderErrorKind::Unavailable, "Model error"));
                }
                self.close_calls(out);
                self.finish_reason = Some(reason.to_owned());
            }
        }
        if let Some(usage) = chunk.usage.as_ref().filter(|u| u.is_object()) {
            out.push_back(ProviderEvent::Usage(Usage {
                input_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
                output_tokens: usage["completion_tokens"].as_u64().unwrap_or(0),
                cache_read_tokens: usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
                cache_write_tokens: None,
                cache_write_1h_tokens: None,
                reasoning_tokens: usage["completion_tokens_details"]["reasoning_tokens"].as_u64(),
                estimated: false,
            }));
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.done
    }
}

impl ChunkDecoder {
    fn tool_call(&mut self, call: &ToolCallDelta, out: &mut VecDeque<ProviderEvent>) -> Result<(), ProviderError> {
        let index = call.index.ok_or_else(super::transport::parse_error)?;
        if let std::collections::btree_map::Entry::Vacant(slot) = self.open_calls.entry(index) {
            slot.insert(());
            out.push_back(ProviderEvent::ToolCallStart {
                index,
                id: call.id.get().unwrap_or_default().to_owned(),
                name: call.function.name.get().unwrap_or_default().to_owned(),
            });
        }
        if let Some(arguments) = call.function.arguments.get() {
            out.push_back(ProviderEvent::ToolCallDelta { index, arguments: arguments.to_owned() });
        }
        Ok(())
    }

    fn close_calls(&mut self, out: &mut VecDeque<ProviderEvent>) {
        for (index, ()) in std::mem::take(&mut self.open_calls) {
            out.push_back(ProviderEvent::ToolCallEnd { index });
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

/// A `chat.completion.chunk`, read without building a JSON tree: the text borrows from the
/// frame unless it holds escapes. Fields chatd does not use are skipped unparsed.
#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: First<Choice<'a>>,
    #[serde(default)]
    usage: Option<Value>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct Choice<'a> {
    #[serde(default, borrow, deserialize_with = "null_as_default")]
    delta: Delta<'a>,
    #[serde(default, borrow)]
    finish_reason: Text<'a>,
}

#[derive(Deserialize, Default)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Text<'a>,
    #[serde(default, borrow)]
    reasoning_content: Text<'a>,
    #[serde(default, borrow)]
    reasoning: Text<'a>,
    #[serde(default, borrow, deserialize_with = "null_as_default")]
    tool_calls: Vec<ToolCallDelta<'a>>,
}

#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct ToolCallDelta<'a> {
    index: Option<u32>,
    #[serde(default, borrow)]
    id: Text<'a>,
    #[serde(default, borrow, deserialize_with = "null_as_default")]
    function: FunctionDelta<'a>,
}

#[derive(Deserialize, Default)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct FunctionDelta<'a> {
    #[serde(default, borrow)]
    name: Text<'a>,
    #[serde(default, borrow)]
    arguments: Text<'a>,
}

/// The first item of an array (a chunk's `choices`: chatd asks for one), read without a
/// `Vec`; the others are skipped unparsed, and `null` reads as none.
#[cfg_attr(test, derive(Debug, PartialEq))]
struct First<T>(Option<T>);

impl<T> Default for First<T> {
    fn default() -> Self {
        Self(None)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for First<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Visit<T> {
            type Value = First<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array or null")
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(First(None))
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(First(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first = seq.next_element()?;
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(First(first))
            }
        }
        deserializer.deserialize_any(Visit(std::marker::PhantomData))
    }
}

/// A string field that servers also send as `null` (or, for some, as something else): only
/// a non-empty string counts.
#[derive(Default)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct Text<'a>(Option<Cow<'a, str>>);

impl Text<'_> {
    fn get(&self) -> Option<&str> {
        self.0.as_deref().filter(|t| !t.is_empty())
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Text(Some(Cow::Owned(v.to_owned()))))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Text(Some(Cow::Owned(v))))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Text(None))
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(Text(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Text(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Text(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Text(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Text(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(Text(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?.is_some() {}
                Ok(Text(None))
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

/// `null` where an object or a list belongs reads as empty.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn decode(frames: &[Value]) -> Result<Vec<ProviderEvent>, ProviderError> {
        let mut decoder = ChunkDecoder::default();
        let mut out = VecDeque::new();
        for frame in frames {
            let data = frame.to_string();
            decoder.frame(&SseFrame { event: "message", data: data.as_bytes(), id: "", retry: None }, &mut out)?;
        }
        Ok(out.into())
    }

    #[test]
    fn nulls_and_odd_shapes_from_compatible_servers_read_as_absent() {
        let events = decode(&[
            json!({"choices": null}),
            json!({"choices": [{"delta": null, "finish_reason": null}]}),
            json!({"choices": [{"delta": {"content": null, "tool_calls": null, "reasoning": ""}}]}),
            json!({"choices": [{"delta": {"content": [{"type": "text"}], "role": "assistant"}}], "usage": null}),
            json!({"choices": [{"delta": {"content": "say \"hi\"\n", "reasoning_content": "hm"}}]}),
            // One choice is asked for: a second is skipped.
            json!({"choices": [{"delta": {"content": "one"}}, {"delta": {"content": "two"}}]}),
        ])
        .unwrap();
        assert_eq!(
            events,
            [
                ProviderEvent::Thinking("hm".into()),
                ProviderEvent::Text("say \"hi\"\n".into()),
                ProviderEvent::Text("one".into())
            ]
        );
        assert!(decode(&[json!({"choices": "none"})]).is_err(), "choices that are no array");
    }

    #[test]
    fn a_tool_call_without_an_index_is_a_parse_error() {
        let error =
            decode(&[json!({"choices": [{"delta": {"tool_calls": [{"id": "c1", "function": {"name": "f"}}]}}]})])
                .unwrap_err();
        assert_eq!(error.kind, ProviderErrorKind::Parse);
    }
}
