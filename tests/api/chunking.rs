//! For any split of a provider's byte stream into chunks — inside frames, inside UTF-8
//! characters, inside `<think>` tags — the client sees the same text, thinking and tool
//! calls, and the turn ends with the same payload.

use bytes::Bytes;
use chatd::chat::run::turn::{Turn, TurnOutput};
use chatd::domain::ThinkingBlock;
use chatd::events::Event;
use chatd::providers::{WireFormat, decode_sse};
use futures_util::StreamExt;
use proptest::prelude::*;
use serde_json::json;

use crate::fixture::{data, event};

/// A recorded body per wire format with everything that can be split badly.
fn recorded(format: WireFormat) -> String {
    match format {
        WireFormat::OpenAi => {
            let chunk = |delta: serde_json::Value, finish: Option<&str>| {
                data(json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))
            };
            [
                ": OPENROUTER PROCESSING\n\n".to_owned(),
                chunk(json!({"role": "assistant", "reasoning_content": "Résumé → plan\u{1}"}), None),
                chunk(json!({"content": "<think>inner 😀</think>\n\nHéllo "}), None),
                chunk(json!({"content": "wörld\u{2404}, 3 < 4\n\nSUGGESTED_VALUES: [{\"label\": \"Oui ]\", "}), None),
                chunk(json!({"content": "\"value\": \"y\"}]"}), None),
                chunk(json!({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "calc", "arguments": "{\"x\": \"é"}}]}), None),
                chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "→\"}"}}]}), None),
                chunk(json!({}), Some("tool_calls")),
                data(json!({"id": "c", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 20}})),
                "data: [DONE]\n\n".to_owned(),
            ]
            .concat()
        }
        WireFormat::Anthropic => [
            event(json!({"type": "message_start", "message": {"usage": {"input_tokens": 7, "output_tokens": 1}}})),
            event(json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}})),
            event(json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Ünïcode thinking"}})),
            event(json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig=="}})),
            event(json!({"type": "content_block_stop", "index": 0})),
            event(json!({"type": "ping"})),
            event(json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}})),
            event(json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Answer: 😀 "}})),
            event(json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "done\u{7}."}})),
            event(json!({"type": "content_block_stop", "index": 1})),
            event(json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}})),
            event(json!({"type": "message_stop"})),
        ]
        .concat(),
        WireFormat::Google => {
            let frame = |parts: serde_json::Value, finish: Option<&str>| {
                let mut candidate = json!({"content": {"parts": parts, "role": "model"}});
                if let Some(f) = finish {
                    candidate["finishReason"] = json!(f);
                }
                format!("data: {}\r\n\r\n", json!({"candidates": [candidate], "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 4}}))
            };
            [
                frame(json!([{"text": "Pensée…", "thought": true}]), None),
                frame(json!([{"text": "Ça va "}]), None),
                frame(json!([{"text": "très bien 👍"}, {"functionCall": {"name": "f", "args": {"a": "ü"}}}]), Some("STOP")),
            ]
            .concat()
        }
    }
}

/// Runs `body`, cut at `cuts` (byte offsets), through the decoder and one turn.
fn replay(format: WireFormat, body: &str, cuts: &[usize]) -> (Vec<Event>, TurnOutput) {
    let bytes = body.as_bytes();
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.sort_unstable();
    points.dedup();
    let mut chunks = Vec::new();
    let mut from = 0;
    for to in points.into_iter().chain([bytes.len()]) {
        chunks.push(Ok::<_, std::io::Error>(Bytes::copy_from_slice(&bytes[from..to])));
        from = to;
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    runtime.block_on(async {
        let mut stream = decode_sse(format, futures_util::stream::iter(chunks));
        let mut turn = Turn::new(0, vec!["SUGGESTED_VALUES:".into(), "SUGGESTED_ACTIONS:".into()]);
        let mut events = Vec::new();
        while let Some(event) = stream.next().await {
            turn.apply(event.expect("the recording decodes"), &mut events);
        }
        (events, turn.output)
    })
}

/// The text a client assembles: (text deltas, thinking deltas, tool argument deltas).
fn assembled(events: &[Event]) -> (String, String, String) {
    let mut out = (String::new(), String::new(), String::new());
    for event in events {
        match event {
            Event::TextDelta { text } => out.0.push_str(text),
            Event::ThinkingDelta { text } => out.1.push_str(text),
            Event::ToolInputDelta { delta, .. } => out.2.push_str(delta),
            _ => {}
        }
    }
    out
}

#[test]
fn the_recordings_decode_to_what_they_say() {
    let (events, output) = replay(WireFormat::OpenAi, &recorded(WireFormat::OpenAi), &[]);
    assert_eq!(output.text, "Héllo wörld, 3 < 4");
    assert_eq!(output.captured[0].json, r#"[{"label": "Oui ]", "value": "y"}]"#);
    assert_eq!(output.thinking, "Résumé → planinner 😀");
    assert_eq!(output.tool_calls[0].input, json!({"x": "é→"}));
    assert_eq!(output.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!(assembled(&events).0, output.text);

    let (_, output) = replay(WireFormat::Anthropic, &recorded(WireFormat::Anthropic), &[]);
    assert_eq!(output.text, "Answer: 😀 done.");
    let ThinkingBlock::Thinking { signature, .. } = &output.thinking_blocks[0];
    assert_eq!(signature, "sig==");
    assert_eq!((output.usage.input_tokens, output.usage.output_tokens), (7, 9));

    let (_, output) = replay(WireFormat::Google, &recorded(WireFormat::Google), &[]);
    assert_eq!(output.text, "Ça va très bien 👍");
    assert_eq!(output.thinking, "Pensée…");
    assert_eq!(output.tool_calls[0].input, json!({"a": "ü"}));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn any_chunking_gives_the_same_stream(
        format in prop::sample::select(vec![WireFormat::OpenAi, WireFormat::Anthropic, WireFormat::Google]),
        cuts in prop::collection::vec(0usize..4000, 0..40),
    ) {
        let body = recorded(format);
        let (whole_events, whole) = replay(format, &body, &[]);
        let (events, output) = replay(format, &body, &cuts);
        prop_assert_eq!(assembled(&events), assembled(&whole_events));
        prop_assert_eq!(output, whole);
    }
}
