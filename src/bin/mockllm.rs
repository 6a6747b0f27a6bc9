//! A fast fake model server for benchmarks: streams the OpenAI chat-completions wire format
//! (`POST /v1/chat/completions`) and Anthropic's (`POST /v1/messages`) with a configurable
//! number of tokens, pause between tokens and, optionally, one tool call on the first turn.
//!
//! It speaks HTTP/1.1 and HTTP/2 with prior knowledge (h2c) on the same port, with no cap on
//! the streams of one HTTP/2 connection.
//!
//! `mockllm --port 9100 --tokens 2000 --delay-ms 0 [--tool calculator]`

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use clap::Parser;
use futures_util::StreamExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use serde_json::{Value, json};

#[derive(Parser, Clone)]
struct Args {
    #[arg(long, default_value_t = 9100)]
    port: u16,
    /// Tokens per answer.
    #[arg(long, default_value_t = 100)]
    tokens: usize,
    /// Pause before each token, in milliseconds.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    /// Ask for this tool on a request's first turn (when the request offers tools).
    #[arg(long)]
    tool: Option<String>,
    /// End every OpenAI frame with an `obfuscation` member of varying length and content,
    /// as OpenAI's own chat completions do.
    #[arg(long)]
    obfuscation: bool,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let app = Router::new()
        .route("/v1/chat/completions", post(openai))
        .route("/chat/completions", post(openai))
        .route("/v1/messages", post(anthropic))
        .with_state(args.clone());
    let listener = chatd::listen("127.0.0.1", args.port).await.expect("port free");
    eprintln!("mockllm on 127.0.0.1:{} ({} tokens, {} ms apart)", args.port, args.tokens, args.delay_ms);
    // axum::serve caps an HTTP/2 connection at hyper's default of 200 streams; the capacity
    // scenario puts 10,000 on one.
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http2().max_concurrent_streams(None);
    loop {
        let Ok((socket, _)) = listener.accept().await else { continue };
        let _ = socket.set_nodelay(true);
        let (builder, service) = (builder.clone(), TowerToHyperService::new(app.clone()));
        tokio::spawn(async move { builder.serve_connection(TokioIo::new(socket), service).await });
    }
}

/// Whether this request should get a tool call: it offers tools and has no results yet.
fn wants_tool(args: &Args, body: &Value) -> Option<String> {
    let offered = body["tools"].as_array().is_some_and(|t| !t.is_empty());
    let answered = body["messages"]
        .as_array()
        .is_some_and(|m| m.iter().any(|m| m["role"] == "tool" || m["content"].to_string().contains("tool_result")));
    args.tool.clone().filter(|_| offered && !answered)
}

fn sse(frames: impl futures_util::Stream<Item = String> + Send + 'static) -> Response {
    let body = Body::from_stream(frames.map(|f| Ok::<_, Infallible>(Bytes::from(f))));
    Response::builder().header(header::CONTENT_TYPE, "text/event-stream").body(body).expect("a response")
}

async fn pause(delay: Duration) {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
}

async fn openai(State(args): State<Args>, Json(body): Json<Value>) -> Response {
    let delay = Duration::from_millis(args.delay_ms);
    let tool = wants_tool(&args, &body);
    let model = body["model"].as_str().unwrap_or("mock").to_owned();
    let mut sent = 0u64;
    let obfuscation = args.obfuscation;
    let mut chunk = move |delta: Value, finish: Option<&str>| {
        let frame = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        .to_string();
        sent += 1;
        match obfuscation {
            // Last, as OpenAI puts it: hex digits of a hash of the frame's number, 0 to 15 of them.
            true => {
                let hash = sent.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let padding = format!("{hash:016x}");
                let padding = &padding[..(hash >> 60) as usize];
                format!("data: {},\"obfuscation\":\"{padding}\"}}\n\n", &frame[..frame.len() - 1])
            }
            false => format!("data: {frame}\n\n"),
        }
    };
    let tokens = args.tokens;
    sse(async_stream::stream! {
        yield chunk(json!({"role": "assistant", "content": ""}), None);
        if let Some(name) = tool {
            yield chunk(json!({"tool_calls": [{"index": 0, "id": "call_mock", "type": "function",
                "function": {"name": name, "arguments": "{\"expression\": \"6 * 7\"}"}}]}), None);
            yield chunk(json!({}), Some("tool_calls"));
        } else {
            for i in 0..tokens {
                pause(delay).await;
                yield chunk(json!({"content": format!(" tok{}", i % 100)}), None);
            }
            yield chunk(json!({}), Some("stop"));
        }
        yield format!("data: {}\n\n", json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": tokens, "total_tokens": tokens + 10}}));
        yield "data: [DONE]\n\n".to_owned();
    })
}

async fn anthropic(State(args): State<Args>, Json(_body): Json<Value>) -> Response {
    let delay = Duration::from_millis(args.delay_ms);
    let tokens = args.tokens;
    let frame = |v: Value| format!("event: {}\ndata: {v}\n\n", v["type"].as_str().unwrap_or("ping"));
    sse(async_stream::stream! {
        yield frame(json!({"type": "message_start", "message": {"id": "msg_mock", "type": "message", "role": "assistant",
            "content": [], "usage": {"input_tokens": 10, "output_tokens": 1}}}));
        yield frame(json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}));
        for i in 0..tokens {
            pause(delay).await;
            yield frame(json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": format!(" tok{}", i % 100)}}));
        }
        yield frame(json!({"type": "content_block_stop", "index": 0}));
        yield frame(json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": tokens}}));
        yield frame(json!({"type": "message_stop"}));
    })
}
