//! The cleaning/parsing path: how many provider frames per second one core turns into clean
//! client events (SSE parsing, wire-format decoding, `<think>` splitting, control-character
//! stripping, JSON serialization of each event), against simply forwarding the same bytes.
//!
//! Run: `cargo bench --bench stream` (prints figures; asserts nothing about time).

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chatd::chat::turn::Turn;
use chatd::providers::{WireFormat, decode_sse};
use futures_util::StreamExt;
use serde_json::json;

const TOKENS: usize = 100_000;
/// Bytes per network read, as a provider's HTTP/1.1 chunks arrive.
const READ: usize = 1024;
const ROUNDS: usize = 5;

fn openai_body() -> String {
    let mut body = String::new();
    for i in 0..TOKENS {
        let text = if i == 10 {
            "<think>".to_owned()
        } else if i == 500 {
            "</think>".to_owned()
        } else {
            format!(" tok{}", i % 97)
        };
        let frame = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]});
        body.push_str(&format!("data: {frame}\n\n"));
    }
    body.push_str(&format!(
        "data: {}\n\n",
        json!({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    ));
    body.push_str("data: [DONE]\n\n");
    body
}

fn anthropic_body() -> String {
    let frame = |v: serde_json::Value| format!("event: {}\ndata: {v}\n\n", v["type"].as_str().unwrap());
    let mut body =
        frame(json!({"type": "message_start", "message": {"usage": {"input_tokens": 5, "output_tokens": 1}}}));
    body.push_str(&frame(
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ));
    for i in 0..TOKENS {
        body.push_str(&frame(json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": format!(" tok{}", i % 97)}})));
    }
    body.push_str(&frame(json!({"type": "content_block_stop", "index": 0})));
    body.push_str(&frame(
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": TOKENS}}),
    ));
    body.push_str(&frame(json!({"type": "message_stop"})));
    body
}

fn reads(body: &str) -> Vec<Bytes> {
    body.as_bytes().chunks(READ).map(Bytes::copy_from_slice).collect()
}

/// The floor: hand every read on, copied once, as a proxy that does nothing would.
async fn forward(chunks: Vec<Bytes>) -> usize {
    let mut stream = futures_util::stream::iter(chunks.into_iter().map(Ok::<_, std::io::Error>));
    let mut sink = Vec::with_capacity(READ);
    let mut total = 0;
    while let Some(Ok(chunk)) = stream.next().await {
        sink.clear();
        sink.extend_from_slice(&chunk);
        total += black_box(&sink).len();
    }
    total
}

/// chatd's path: decode frames, clean, and serialize every client event as it is sent.
async fn relay(format: WireFormat, chunks: Vec<Bytes>) -> usize {
    let mut stream = decode_sse(format, futures_util::stream::iter(chunks.into_iter().map(Ok::<_, std::io::Error>)));
    let mut turn = Turn::new(0, vec!["SUGGESTED_VALUES:".into(), "SUGGESTED_ACTIONS:".into()]);
    let mut events = Vec::new();
    let mut sent = 0;
    while let Some(event) = stream.next().await {
        turn.apply(event.expect("decodes"), &mut events).expect("applies");
        for event in events.drain(..) {
            sent += black_box(serde_json::to_string(&event).expect("serializes")).len().min(1);
        }
    }
    sent
}

fn best<F: FnMut() -> usize>(mut run: F) -> (Duration, usize) {
    let mut best = Duration::MAX;
    let mut count = 0;
    for _ in 0..ROUNDS {
        let start = Instant::now();
        count = run();
        best = best.min(start.elapsed());
    }
    (best, count)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    println!("stream path, one core, {TOKENS} provider frames, best of {ROUNDS}");
    for (name, format, body) in
        [("openai", WireFormat::OpenAi, openai_body()), ("anthropic", WireFormat::Anthropic, anthropic_body())]
    {
        let (floor, bytes) = best(|| runtime.block_on(forward(reads(&body))));
        let (time, events) = best(|| runtime.block_on(relay(format, reads(&body))));
        let per_sec = events as f64 / time.as_secs_f64();
        println!(
            "{name:>9}: {bytes} bytes; forward {:.2} ms; parse+clean+serialize {:.2} ms = {:.0} events/s/core, {:.2} µs/event, {:.1}x the forwarding time",
            floor.as_secs_f64() * 1e3,
            time.as_secs_f64() * 1e3,
            per_sec,
            1e6 / per_sec,
            time.as_secs_f64() / floor.as_secs_f64(),
        );
    }
}
