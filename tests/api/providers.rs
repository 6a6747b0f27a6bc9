//! Real HTTP between chatd and fake providers that replay each provider's exact SSE wire
//! format: text, thinking, tool calls split across deltas, usage, errors mid-stream, dropped
//! connections, 401, 429 with Retry-After, 500 then success, stalls, and what is persisted.

use serde_json::{Value, json};

use crate::fixture::*;
use crate::helpers::*;

const KEY: &str = "sk-test-not-a-real-key-42";

struct Run {
    app: TestApp,
    fixture: Fixture,
    frames: Vec<Frame>,
    _key: tempfile::NamedTempFile,
}

impl Run {
    fn kinds(&self) -> Vec<&str> {
        self.frames.iter().map(Frame::kind).collect()
    }

    fn last(&self, kind: &str) -> &Value {
        &self
            .frames
            .iter()
            .rev()
            .find(|f| f.kind() == kind)
            .unwrap_or_else(|| panic!("no {kind} in {:?}", self.kinds()))
            .data
    }

    async fn conversation(&self) -> Value {
        let id = self.frames[0].data["conversation_id"].as_str().unwrap();
        self.app.get(&format!("/api/conversations/{id}"), "ann").await.1
    }

    async fn trace(&self) -> Value {
        let id = self.frames[0].data["trace_id"].as_str().unwrap();
        self.app.get(&format!("/api/trace/{id}"), "ann").await.1
    }
}

/// Starts a fixture with `script`, and chatd with a profile `fx` on it; sends `message`.
async fn run(kind: &str, script: Vec<Scripted>, extra: &str, message: &str) -> Run {
    run_on(kind, script, "", extra, message).await
}

/// [`run`], with `provider_extra` added to the provider's settings.
async fn run_on(kind: &str, script: Vec<Scripted>, provider_extra: &str, extra: &str, message: &str) -> Run {
    run_with(Backend::Sqlite, kind, script, provider_extra, extra, message).await
}

/// [`run_on`] on `backend`.
async fn run_with(
    backend: Backend,
    kind: &str,
    script: Vec<Scripted>,
    provider_extra: &str,
    extra: &str,
    message: &str,
) -> Run {
    let (app, fixture, key) = spawn_fx(backend, kind, script, provider_extra, extra).await;
    let frames = app.chat("ann", json!({"message": message})).await;
    Run { app, fixture, frames, _key: key }
}

/// chatd with a profile `fx` on a fixture of `kind` that answers with `script`.
async fn spawn_fx(
    backend: Backend,
    kind: &str,
    script: Vec<Scripted>,
    provider_extra: &str,
    extra: &str,
) -> (TestApp, Fixture, tempfile::NamedTempFile) {
    let fixture = Fixture::start(script).await;
    let key = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(key.path(), format!("{KEY}\n")).unwrap();
    let base = match kind {
        "anthropic" => fixture.base.clone(),
        "google" => format!("{}/v1beta", fixture.base),
        _ => format!("{}/v1", fixture.base),
    };
    let config = format!(
        r#"
        [chat]
        default_profile = "fx"
        [providers.fx]
        kind = "{kind}"
        base_url = "{base}"
        api_key_file = "{key}"
        {retries}
        retry_base_secs = 0.01
        retry_max_secs = 0.05
        first_byte_timeout_secs = 5
        idle_timeout_secs = 0.4
        {provider_extra}
        [profiles.fx]
        provider = "fx"
        model = "fx-model"
        system_prompt = "Be brief."
        {extra}
        "#,
        key = key.path().display(),
        // A test of how one failure reads sets its own (`max_retries = 0`: no second try).
        retries = if provider_extra.contains("max_retries") { "" } else { "max_retries = 2" },
    );
    (TestApp::spawn(backend, &config).await, fixture, key)
}

/// [`run`], sending `body` (a whole chat request) instead of a message.
async fn run_body(kind: &str, script: Vec<Scripted>, extra: &str, body: Value) -> Run {
    let (app, fixture, key) = spawn_fx(Backend::Sqlite, kind, script, "", extra).await;
    let frames = app.chat("ann", body).await;
    Run { app, fixture, frames, _key: key }
}

fn openai_chunk(delta: Value, finish: Option<&str>) -> String {
    data(json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": "fx-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }))
}

fn openai_usage(prompt: u64, completion: u64) -> String {
    data(json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": "fx-model",
        "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion, "completion_tokens_details": {"reasoning_tokens": 3}},
    }))
}

const DONE: &str = "data: [DONE]\n\n";

fn openai_text(pieces: &[&str]) -> Vec<String> {
    let mut frames = vec![openai_chunk(json!({"role": "assistant", "content": ""}), None)];
    frames.extend(pieces.iter().map(|p| openai_chunk(json!({"content": p}), None)));
    frames.push(openai_chunk(json!({}), Some("stop")));
    frames.push(openai_usage(9, 12));
    frames.push(DONE.to_owned());
    frames
}

fn anthropic_start() -> Vec<String> {
    vec![event(json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
        "content": [], "model": "fx-model", "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 25, "cache_read_input_tokens": 5, "output_tokens": 1}}}))]
}

fn anthropic_end(reason: &str, output_tokens: u64) -> Vec<String> {
    vec![
        event(
            json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": null}, "usage": {"output_tokens": output_tokens}}),
        ),
        event(json!({"type": "message_stop"})),
    ]
}

fn anthropic_block(index: u64, block: Value, deltas: &[Value]) -> Vec<String> {
    let mut frames = vec![event(json!({"type": "content_block_start", "index": index, "content_block": block}))];
    frames.extend(deltas.iter().map(|d| event(json!({"type": "content_block_delta", "index": index, "delta": d}))));
    frames.push(event(json!({"type": "content_block_stop", "index": index})));
    frames
}

/// Gemini separates its SSE frames with CRLF.
fn gemini(parts: Value, finish: Option<&str>) -> String {
    let mut candidate = json!({"content": {"parts": parts, "role": "model"}, "index": 0});
    if let Some(reason) = finish {
        candidate["finishReason"] = json!(reason);
    }
    let usage = if finish.is_some() {
        json!({"promptTokenCount": 8, "candidatesTokenCount": 6, "thoughtsTokenCount": 4, "totalTokenCount": 18})
    } else {
        json!({"promptTokenCount": 8, "totalTokenCount": 8})
    };
    format!("data: {}\r\n\r\n", json!({"candidates": [candidate], "usageMetadata": usage, "modelVersion": "fx-model"}))
}

// ---- OpenAI Chat Completions (and compatible servers) ----

#[tokio::test]
async fn openai_text_streams_with_usage_and_a_correct_request() {
    let r = run(
        "openai",
        vec![Scripted::sse(&openai_text(&["Hel", "lo", " wor", "ld."]))],
        "temperature = 0.2\nmax_tokens = 300\nreasoning_effort = \"low\"",
        "Say hello",
    )
    .await;
    assert_eq!(
        r.kinds(),
        [
            "start",
            "step_start",
            "status",
            "text_delta",
            "text_delta",
            "text_delta",
            "text_delta",
            "usage",
            "complete",
            "done"
        ]
    );
    assert_eq!(joined(&r.frames, "text_delta"), "Hello world.");
    let usage = r.last("usage");
    assert_eq!((usage["input_tokens"].as_u64(), usage["output_tokens"].as_u64()), (Some(9), Some(12)));
    assert_eq!(usage["reasoning_tokens"], 3);
    let complete = &r.last("complete")["payload"];
    assert_eq!(complete["message"], "Hello world.");
    assert_eq!(complete["finish_reason"], "stop");
    assert_eq!(complete["model"], "fx-model");

    let got = r.fixture.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].path, "/v1/chat/completions");
    assert_eq!(got[0].headers["authorization"], format!("Bearer {KEY}"));
    let body = &got[0].body;
    assert_eq!(body["model"], "fx-model");
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert_eq!(body["max_completion_tokens"], 300);
    assert_eq!(body["temperature"], 0.2, "the configured value as written, not as an f32 reads");
    assert_eq!(body["reasoning_effort"], "low");
    assert!(body["messages"][0]["content"].as_str().unwrap().starts_with("## Identity\nBe brief."));
    assert_eq!(body["messages"][0]["role"], "system");
    assert_eq!(body["messages"][1], json!({"role": "user", "content": "Say hello"}));
    let tools: Vec<&str> =
        body["tools"].as_array().unwrap().iter().map(|t| t["function"]["name"].as_str().unwrap()).collect();
    assert_eq!(tools, ["current_time", "calculator"]);

    let conversation = r.conversation().await;
    assert_eq!(conversation["messages"][1]["content"], "Hello world.");
    assert_eq!(conversation["messages"][1]["usage"]["output_tokens"], 12);
}

#[tokio::test]
async fn openai_compatible_reasoning_fields_and_inline_think_tags_become_thinking() {
    let frames = vec![
        ": OPENROUTER PROCESSING\n\n".to_owned(),
        openai_chunk(json!({"role": "assistant", "reasoning_content": "Deep"}), None),
        openai_chunk(json!({"reasoning": "Seek."}), None),
        openai_chunk(json!({"content": "<thi"}), None),
        openai_chunk(json!({"content": "nk>inline</th"}), None),
        openai_chunk(json!({"content": "ink>\n\nAnswer\u{2404}"}), None),
        openai_chunk(json!({}), Some("stop")),
        DONE.to_owned(),
    ];
    let r = run("openai_compatible", vec![Scripted::sse(&frames)], "max_tokens = 50", "why?").await;
    assert_eq!(joined(&r.frames, "thinking_delta"), "DeepSeek.inline");
    assert_eq!(joined(&r.frames, "text_delta"), "Answer");
    for frame in &r.frames {
        let text = frame.data.to_string();
        assert!(!text.contains("think>") && !text.contains('\u{2404}'), "{text}");
    }
    assert_eq!(r.fixture.received()[0].body["max_tokens"], 50, "compatible servers get max_tokens");
    let message = &r.conversation().await["messages"][1];
    assert_eq!(message["thinking"], "DeepSeek.inline");
    assert_eq!(message["content"], "Answer");
}

#[tokio::test]
async fn openai_tool_calls_stream_run_and_go_back_in_openai_format() {
    let mut frames = vec![openai_chunk(json!({"role": "assistant", "content": "Let me compute."}), None)];
    frames.push(openai_chunk(
        json!({"tool_calls": [{"index": 0, "id": "call_abc", "type": "function", "function": {"name": "calculator", "arguments": ""}}]}),
        None,
    ));
    let arguments = r#"{"expression": "6 * 7"}"#;
    for piece in arguments.as_bytes().chunks(4) {
        let piece = std::str::from_utf8(piece).unwrap();
        frames.push(openai_chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}), None));
    }
    frames.push(openai_chunk(json!({}), Some("tool_calls")));
    frames.push(DONE.to_owned());
    let script = vec![Scripted::sse(&frames), Scripted::sse(&openai_text(&["It is ", "42."]))];
    let r = run("openai", script, "", "what is 6 times 7?").await;
    let start = r.frames.iter().find(|f| f.kind() == "tool_input_start").unwrap();
    assert_eq!(
        start.data,
        json!({"type": "tool_input_start", "tool_call_id": "call_abc", "tool": "calculator", "index": 0})
    );
    let deltas: String =
        r.frames.iter().filter(|f| f.kind() == "tool_input_delta").map(|f| f.data["delta"].as_str().unwrap()).collect();
    assert_eq!(deltas, arguments);
    assert_eq!(r.last("tool_start")["input"], json!({"expression": "6 * 7"}));
    assert_eq!(r.last("tool_output")["output"], "42");
    assert_eq!(r.last("tool_complete")["status"], "success");
    let complete = &r.last("complete")["payload"];
    assert_eq!(complete["message"], "Let me compute.\n\n[[tool:0]]\n\nIt is 42.");
    assert_eq!(joined(&r.frames, "text_delta"), "Let me compute.\n\n[[tool:0]]\n\nIt is 42.");
    assert_eq!(complete["tool_history"][0]["output"], "42");
    assert_eq!(complete["finish_reason"], "stop");

    // The second call carries the call and its result in OpenAI's format.
    let second = &r.fixture.received()[1].body["messages"];
    assert_eq!(
        second[2],
        json!({"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "calculator", "arguments": "{\"expression\":\"6 * 7\"}"}}]})
    );
    assert_eq!(second[3], json!({"role": "tool", "tool_call_id": "call_abc", "content": "42"}));

    let message = &r.conversation().await["messages"][1];
    assert_eq!(
        message["tool_calls"],
        json!([{"id": "call_abc", "name": "calculator", "input": {"expression": "6 * 7"}}])
    );
    assert_eq!(message["tool_history"][0]["tool_name"], "calculator");
    assert_eq!(message["content"], complete["message"]);
}

/// One OpenAI tool call of the calculator with `arguments`, then the call's end.
fn openai_calculator_call(arguments: &str) -> Vec<String> {
    vec![
        openai_chunk(json!({"role": "assistant", "content": ""}), None),
        openai_chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}]}),
            None,
        ),
        openai_chunk(json!({}), Some("tool_calls")),
        DONE.to_owned(),
    ]
}

#[tokio::test]
async fn arguments_that_are_not_json_go_back_to_the_model_as_the_calls_error() {
    let script = vec![
        Scripted::sse(&openai_calculator_call(r#"{"expression": "6 *"#)),
        Scripted::sse(&openai_text(&["Let me try again."])),
    ];
    let r = run("openai", script, "", "what is 6 times 7?").await;
    assert_eq!(r.last("tool_complete")["status"], "error");
    assert_eq!(r.last("complete")["payload"]["finish_reason"], "stop", "{:?}", r.kinds());
    let second = &r.fixture.received()[1].body["messages"];
    let answer = second.as_array().unwrap().iter().find(|m| m["role"] == "tool").unwrap();
    let content = answer["content"].as_str().unwrap();
    assert!(content.starts_with("Error: The arguments are not valid JSON"), "{content}");
    assert!(content.contains(r#"{"expression": "6 *"#), "the model sees what it sent: {content}");
    assert_eq!(r.trace().await["status"], "completed");
}

both_backends! {
    async fn nul_in_a_models_tool_arguments_is_stored_without_it(backend: Backend) {
        let script = vec![
            Scripted::sse(&openai_calculator_call(r#"{"expression": "6 * 7\u0000"}"#)),
            Scripted::sse(&openai_text(&["42."])),
        ];
        let r = run_with(backend, "openai", script, "", "", "what is 6 times 7?").await;
        assert_eq!(r.last("tool_output")["output"], "42");
        assert_eq!(r.last("complete")["payload"]["message"], "[[tool:0]]\n\n42.", "{:?}", r.kinds());
        let message = &r.conversation().await["messages"][1];
        assert_eq!(message["tool_calls"][0]["input"], json!({"expression": "6 * 7"}));
        assert_eq!(r.trace().await["status"], "completed");
    }
}

#[tokio::test]
async fn an_error_frame_on_http_200_fails_the_run_and_keeps_the_partial_text() {
    let frames = vec![
        openai_chunk(json!({"role": "assistant", "content": "Partial"}), None),
        data(json!({"error": {"code": 502, "message": "Upstream provider crashed"}})),
    ];
    let r = run_on("openai_compatible", vec![Scripted::sse(&frames)], "max_retries = 0", "", "go").await;
    assert_eq!(r.kinds(), ["start", "step_start", "status", "text_delta", "error", "done"]);
    let error = r.last("error");
    assert_eq!(error["code"], "SERVICE_UNAVAILABLE");
    assert_eq!(error["retryable"], true);
    assert!(error["message"].as_str().unwrap().contains("Upstream provider crashed"));
    let conversation = r.conversation().await;
    assert_eq!(conversation["messages"].as_array().unwrap().len(), 1, "no assistant message");
    assert_eq!(r.trace().await["error"]["partial_text"], "Partial");
}

#[tokio::test]
async fn a_dropped_connection_is_a_network_error() {
    let script = Scripted::sse(&[openai_chunk(json!({"content": "Half an ans"}), None)])
        .then(Part::Pause(std::time::Duration::from_millis(50)))
        .then(Part::Drop);
    let r = run_on("openai", vec![script], "max_retries = 0", "", "go").await;
    assert_eq!(joined(&r.frames, "text_delta"), "Half an ans");
    assert_eq!(r.fixture.received().len(), 1, "no retries configured");
    let error = r.last("error");
    assert_eq!(error["code"], "NETWORK_ERROR");
    // The server had answered: the message says the answer was cut, not that none came.
    assert_eq!(
        error["message"],
        "Connection failed: the model's server cut the answer off mid-stream; try again (the server's log names the provider)"
    );
    assert_eq!(error["retryable"], true);
    assert_eq!(r.kinds().last(), Some(&"done"));
}

#[tokio::test]
async fn providers_speak_http1_unless_http2_is_configured() {
    let r = run("openai", vec![Scripted::sse(&openai_text(&["One"]))], "", "go").await;
    assert_eq!(joined(&r.frames, "text_delta"), "One");
    assert_eq!(r.fixture.received()[0].version, axum::http::Version::HTTP_11);

    // `http2 = true` over plain http: HTTP/2 with prior knowledge, same events.
    let r = run_on("openai", vec![Scripted::sse(&openai_text(&["Two", " streams"]))], "http2 = true", "", "go").await;
    assert_eq!(joined(&r.frames, "text_delta"), "Two streams");
    assert_eq!(r.last("usage")["output_tokens"], 12);
    assert_eq!(r.fixture.received()[0].version, axum::http::Version::HTTP_2);
}

/// Over HTTP/2 a provider's calls take `http2_connections` connections in turn (four by
/// default): each connection's task relays its share of the streams.
#[tokio::test]
async fn http2_calls_are_spread_over_the_providers_connections() {
    let answers = |n| (0..n).map(|_| Scripted::sse(&openai_text(&["Hi"]))).collect::<Vec<_>>();
    for (setting, connections) in [("", 4), ("\nhttp2_connections = 2", 2), ("\nhttp2_connections = 1", 1)] {
        let (app, fixture, _key) =
            spawn_fx(Backend::Sqlite, "openai", answers(8), &format!("http2 = true{setting}"), "").await;
        for n in 0..8 {
            let frames = app.chat("ann", json!({"message": format!("question {n}")})).await;
            assert_eq!(joined(&frames, "text_delta"), "Hi");
        }
        let received = fixture.received();
        assert!(received.iter().all(|r| r.version == axum::http::Version::HTTP_2));
        let peers: std::collections::BTreeSet<_> = received.iter().map(|r| r.peer).collect();
        assert_eq!(peers.len(), connections, "{setting:?}: {peers:?}");
    }
}

#[tokio::test]
async fn a_stream_reset_over_http2_is_a_network_error() {
    let script = Scripted::sse(&[openai_chunk(json!({"content": "Half"}), None)])
        .then(Part::Pause(std::time::Duration::from_millis(50)))
        .then(Part::Drop);
    let r = run_on("openai", vec![script], "http2 = true\nmax_retries = 0", "", "go").await;
    assert_eq!(r.fixture.received()[0].version, axum::http::Version::HTTP_2);
    assert_eq!(joined(&r.frames, "text_delta"), "Half");
    assert_eq!(r.last("error")["code"], "NETWORK_ERROR");
    assert!(
        r.last("error")["message"].as_str().unwrap().contains("cut the answer off mid-stream"),
        "{:?}",
        r.last("error")
    );
    assert_eq!(r.kinds().last(), Some(&"done"));
    assert_eq!(r.trace().await["error"]["partial_text"], "Half");
}

#[tokio::test]
async fn a_stream_that_ends_without_its_terminal_frame_is_not_a_success() {
    let frames = vec![openai_chunk(json!({"content": "Cut"}), None), openai_chunk(json!({}), Some("stop"))];
    let r = run_on("openai", vec![Scripted::sse(&frames)], "max_retries = 0", "", "go").await;
    assert_eq!(r.last("error")["code"], "NETWORK_ERROR");
    assert!(
        r.last("error")["message"].as_str().unwrap().contains("cut the answer off mid-stream"),
        "{:?}",
        r.last("error")
    );
    assert!(r.frames.iter().all(|f| f.kind() != "complete"));
}

#[tokio::test]
async fn a_stalled_stream_ends_with_an_error_instead_of_hanging() {
    let script = Scripted::sse(&[openai_chunk(json!({"content": "Then silence"}), None)]).then(Part::Stall);
    let r = run_on("openai", vec![script], "max_retries = 0", "", "go").await;
    assert_eq!(r.last("error")["code"], "NETWORK_ERROR");
    assert!(
        r.last("error")["message"].as_str().unwrap().contains("stopped sending mid-stream"),
        "{:?}",
        r.last("error")
    );
    assert_eq!(r.trace().await["status"], "error");
}

#[tokio::test]
async fn an_unparsable_frame_fails_with_failed_to_parse() {
    let frames = vec![openai_chunk(json!({"content": "ok"}), None), "data: {not json\n\n".to_owned()];
    let r = run("openai", vec![Scripted::sse(&frames)], "", "go").await;
    let error = r.last("error");
    assert_eq!(error["code"], "SERVICE_UNAVAILABLE");
    assert_eq!(error["message"], "Failed to parse response");
    assert_eq!(error["retryable"], false);
}

#[tokio::test]
async fn bytes_that_are_no_sse_are_a_parse_error_not_retried() {
    let not_utf8 =
        Scripted::sse(&[openai_chunk(json!({"content": "ok"}), None)]).then(Part::Raw(b"data: \xff\xfe\n\n".to_vec()));
    let json_200 = Scripted::json(200, json!({"error": {"message": "model overloaded"}}));
    let html_200 = Scripted {
        status: 200,
        headers: vec![("content-type", "text/html".into())],
        parts: vec![Part::Bytes("<html>a login page</html>".into())],
    };
    for script in [not_utf8, json_200, html_200] {
        let r = run("openai", vec![script.clone(), script], "", "go").await;
        let error = r.last("error");
        assert_eq!(error["message"], "Failed to parse response", "{:?}", r.kinds());
        assert_eq!(error["retryable"], false);
        assert_eq!(r.fixture.received().len(), 1, "not retried");
        assert_eq!(r.kinds().last(), Some(&"done"));
    }
}

#[tokio::test]
async fn a_frame_of_megabytes_in_many_pieces_is_read_and_one_above_the_cap_is_refused() {
    let text = "abcdefgh".repeat(512 * 1024);
    let chunk = openai_chunk(json!({"content": text}), None);
    let mut script = Scripted::sse(&[openai_chunk(json!({"role": "assistant", "content": ""}), None)]);
    for piece in chunk.as_bytes().chunks(16 * 1024) {
        script = script.then(Part::Bytes(String::from_utf8(piece.to_vec()).unwrap()));
    }
    for frame in [openai_chunk(json!({}), Some("stop")), DONE.to_owned()] {
        script = script.then(Part::Bytes(frame));
    }
    let r = run("openai", vec![script], "", "go").await;
    assert_eq!(r.last("complete")["payload"]["message"].as_str().unwrap().len(), text.len());

    let huge = openai_chunk(json!({"content": "x".repeat(9 * 1024 * 1024)}), None);
    let r = run("openai", vec![Scripted::sse(&[huge])], "", "go").await;
    let error = r.last("error");
    assert_eq!(error["message"], "Failed to parse response");
    assert_eq!(error["retryable"], false);
}

#[tokio::test]
async fn an_error_body_is_read_only_so_far_and_so_long() {
    // An error page that stalls after its headers: each try ends at the idle timeout.
    let stalled = Scripted::error(503, json!({})).then(Part::Stall);
    let stalled = Scripted { parts: vec![Part::Bytes("{\"error\": {\"mess".into()), Part::Stall], ..stalled };
    let r = run("openai", vec![stalled.clone(), stalled.clone(), stalled], "", "go").await;
    assert_eq!(r.fixture.received().len(), 3);
    assert_eq!(r.last("error")["code"], "SERVICE_UNAVAILABLE");
    assert_eq!(r.trace().await["status"], "error");

    // A huge one: only its start is read, so the message at its end is never seen.
    let body = format!("{{\"padding\": \"{}\", \"error\": {{\"message\": \"the end\"}}}}", "p".repeat(2 * 1024 * 1024));
    let huge = Scripted {
        status: 400,
        headers: vec![("content-type", "application/json".into())],
        parts: vec![Part::Bytes(body)],
    };
    let r = run("openai", vec![huge], "", "go").await;
    let message = r.last("error")["message"].as_str().unwrap().to_owned();
    assert!(message.starts_with("Model error: {\"padding\""), "{message}");
    assert!(!message.contains("the end"), "{message}");
}

#[tokio::test]
async fn a_401_is_unauthorized_and_never_retried() {
    let script = Scripted::error(
        401,
        json!({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}}),
    );
    let r = run("openai", vec![script], "", "go").await;
    assert_eq!(r.kinds(), ["start", "step_start", "status", "error", "done"]);
    let error = r.last("error");
    assert_eq!(error["code"], "UNAUTHORIZED");
    assert_eq!(error["message"], "Invalid API key");
    assert_eq!(error["retryable"], false);
    assert_eq!(r.fixture.received().len(), 1);
    assert!(!r.frames.iter().any(|f| f.data.to_string().contains(KEY)), "the key never reaches a client");
}

#[tokio::test]
async fn a_429_is_retried_after_retry_after_then_succeeds() {
    let limited = Scripted::error(429, json!({"error": {"message": "slow down"}})).header("retry-after", "0");
    let r = run("openai", vec![limited, Scripted::sse(&openai_text(&["fine"]))], "", "go").await;
    assert_eq!(joined(&r.frames, "text_delta"), "fine");
    assert_eq!(r.fixture.received().len(), 2);
}

/// A provider with two keys (`api_key_envs`): the key that got a 429 rests for its
/// `Retry-After` while the other serves, at once and for the next run too (CONTRACT.md §19).
#[tokio::test]
async fn a_rate_limited_key_rests_while_the_others_serve() {
    // Names of this test's own: the environment is the whole test process's.
    unsafe {
        std::env::set_var("CHATD_TEST_POOL_KEY_A", "key-a-1111");
        std::env::set_var("CHATD_TEST_POOL_KEY_B", "key-b-2222");
    }
    let limited = Scripted::error(429, json!({"error": {"message": "slow down"}})).header("retry-after", "60");
    let fixture =
        Fixture::start(vec![limited, Scripted::sse(&openai_text(&["one"])), Scripted::sse(&openai_text(&["two"]))])
            .await;
    let config = format!(
        r#"
        [chat]
        default_profile = "fx"
        [providers.fx]
        kind = "openai"
        base_url = "{}/v1"
        api_key_envs = ["CHATD_TEST_POOL_KEY_A", "CHATD_TEST_POOL_UNSET", "CHATD_TEST_POOL_KEY_B"]
        max_retries = 2
        retry_base_secs = 0.01
        [profiles.fx]
        provider = "fx"
        model = "fx-model"
        "#,
        fixture.base
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let first = app.chat("ann", json!({"message": "go"})).await;
    assert_eq!(joined(&first, "text_delta"), "one");
    let second = app.chat("ann", json!({"message": "again"})).await;
    assert_eq!(joined(&second, "text_delta"), "two");
    let keys: Vec<String> =
        fixture.received().iter().map(|r| r.headers["authorization"].to_str().unwrap().to_owned()).collect();
    assert_eq!(keys, ["Bearer key-a-1111", "Bearer key-b-2222", "Bearer key-b-2222"], "A rests for its minute");
    assert!(!first.iter().chain(&second).any(|f| f.data.to_string().contains("key-")), "no key reaches a client");
}

#[test]
fn api_key_envs_replaces_the_one_key_settings() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let text = "[providers.p]\nkind = \"openai\"\napi_key_env = \"X\"\napi_key_envs = [\"Y\"]\n";
    std::fs::write(file.path(), text).unwrap();
    let refused = chatd::config::Settings::load(Some(file.path())).unwrap_err().to_string();
    assert!(refused.contains("providers.p.api_key_envs names the keys already"), "{refused}");
}

#[tokio::test]
async fn persistent_429s_end_as_rate_limited_after_the_configured_retries() {
    let limited = Scripted::error(429, json!({"error": {"message": "slow down"}})).header("retry-after", "0");
    let r = run("openai", vec![limited.clone(), limited.clone(), limited], "", "go").await;
    let error = r.last("error");
    assert_eq!(error["code"], "RATE_LIMITED");
    assert_eq!(error["message"], "Rate limited, try again");
    assert_eq!(error["retryable"], true);
    assert_eq!(r.fixture.received().len(), 3, "one try and max_retries = 2 retries");
}

#[tokio::test]
async fn a_500_then_success_is_retried_before_any_output() {
    let failing = Scripted::error(500, json!({"error": {"message": "internal"}}));
    let r = run("openai", vec![failing, Scripted::sse(&openai_text(&["recovered"]))], "", "go").await;
    assert_eq!(joined(&r.frames, "text_delta"), "recovered");
    assert!(r.frames.iter().all(|f| f.kind() != "error"));
    assert_eq!(r.fixture.received().len(), 2);
}

/// A second profile on the same fixture, `fx` falling back to it (CONTRACT.md §19).
const FALLBACK: &str = r#"fallbacks = ["backup"]
        [profiles.backup]
        provider = "fx"
        model = "fx-backup"
        temperature = 0.5"#;

both_backends! {
    /// A model that fails retryably after its retries, before any output: the fallback's
    /// model answers the same input, seamlessly; the answer and the trace name who answered.
    async fn a_failing_model_falls_back_before_any_output(backend: Backend) {
        let overloaded = || Scripted::error(503, json!({"error": {"message": "overloaded"}}));
        let script = vec![overloaded(), overloaded(), overloaded(), Scripted::sse(&openai_text(&["from ", "the backup"]))];
        let r = run_with(backend, "openai", script, "", FALLBACK, "go").await;
        assert_eq!(r.kinds(), ["start", "step_start", "status", "status", "text_delta", "text_delta", "usage", "complete", "done"]);
        assert_eq!(r.frames[3].data["message"], "Answering with fx-backup");
        assert_eq!(joined(&r.frames, "text_delta"), "from the backup");
        assert_eq!(r.last("complete")["payload"]["model"], "fx-backup");
        let received = r.fixture.received();
        assert_eq!(received.len(), 4, "three tries of fx-model (max_retries = 2), then one of fx-backup");
        assert_eq!(received[0].body["model"], "fx-model");
        assert_eq!(received[3].body["model"], "fx-backup");
        assert_eq!(received[3].body["temperature"], 0.5);
        assert_eq!(received[3].body["messages"], received[0].body["messages"], "the same input");
        let trace = r.trace().await;
        let calls: Vec<&Value> = trace["spans"].as_array().unwrap().iter().filter(|s| s["kind"] == "llm").collect();
        assert_eq!(calls.len(), 2, "a span per model that was asked: {calls:?}");
        assert_eq!(calls[0]["attributes"]["gen_ai.request.model"], "fx-model");
        assert_eq!(calls[0]["status"], "error");
        assert_eq!(calls[1]["attributes"]["gen_ai.request.model"], "fx-backup");
        assert_eq!(calls[1]["status"], "ok");
        let conversation = r.conversation().await;
        assert_eq!(conversation["messages"][1]["model"], "fx-backup");
        assert_eq!(conversation["messages"][1]["content"], "from the backup");
    }
}

#[tokio::test]
async fn a_401_never_falls_back() {
    let script = Scripted::error(401, json!({"error": {"message": "Incorrect API key provided"}}));
    let r = run("openai", vec![script], FALLBACK, "go").await;
    assert_eq!(r.kinds(), ["start", "step_start", "status", "error", "done"]);
    assert_eq!(r.last("error")["code"], "UNAUTHORIZED");
    assert_eq!(r.fixture.received().len(), 1);
}

#[tokio::test]
async fn when_every_fallback_fails_the_run_ends_with_one_error() {
    let overloaded = || Scripted::error(503, json!({"error": {"message": "overloaded"}}));
    let r = run("openai", (0..6).map(|_| overloaded()).collect(), FALLBACK, "go").await;
    assert_eq!(r.kinds(), ["start", "step_start", "status", "status", "error", "done"]);
    assert_eq!(r.last("error")["code"], "SERVICE_UNAVAILABLE");
    assert_eq!(r.fixture.received().len(), 6, "three tries of each model");
    assert_eq!(r.fixture.received()[5].body["model"], "fx-backup");
}

#[tokio::test]
async fn a_failure_after_output_falls_back_after_a_step_reset() {
    // No retries of the same model: it fails after output, and the fallback answers anew.
    let frames = vec![
        openai_chunk(json!({"role": "assistant", "content": "Partial"}), None),
        data(json!({"error": {"code": 502, "message": "Upstream provider crashed"}})),
    ];
    let script = vec![Scripted::sse(&frames), Scripted::sse(&openai_text(&["Whole answer."]))];
    let r = run_on("openai", script, "max_retries = 0", FALLBACK, "go").await;
    assert_eq!(
        r.kinds(),
        [
            "start",
            "step_start",
            "status",
            "text_delta",
            "step_reset",
            "step_start",
            "status",
            "text_delta",
            "usage",
            "complete",
            "done"
        ]
    );
    assert_eq!(r.last("step_reset")["step"], 0);
    assert_eq!(r.frames[6].data["message"], "Answering with fx-backup");
    assert_eq!(r.last("complete")["payload"]["model"], "fx-backup");
    let conversation = r.conversation().await;
    assert_eq!(conversation["messages"][1]["content"], "Whole answer.", "only what survived");
    assert_eq!(r.fixture.received().len(), 2);
}

/// A tool call of the calculator, with its own id.
fn openai_calculator_call_named(id: &str, arguments: &str) -> Vec<String> {
    vec![
        openai_chunk(json!({"role": "assistant", "content": ""}), None),
        openai_chunk(
            json!({"tool_calls": [{"index": 0, "id": id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}]}),
            None,
        ),
        openai_chunk(json!({}), Some("tool_calls")),
        DONE.to_owned(),
    ]
}

/// A model call that says `said`, then fails with a retryable error frame.
fn fails_after(said: &str) -> Scripted {
    Scripted::sse(&[
        openai_chunk(json!({"role": "assistant", "content": said}), None),
        data(json!({"error": {"code": 502, "message": "Upstream provider crashed"}})),
    ])
}

both_backends! {
    /// A call that fails after output is asked again (CONTRACT.md §19): the client is told
    /// what is void, the stored answer is what survived, and the trace has each attempt.
    async fn a_call_that_fails_after_output_is_asked_again(backend: Backend) {
        let script = vec![fails_after("Half a"), Scripted::sse(&openai_text(&["The whole ", "answer."]))];
        let r = run_with(backend, "openai", script, "", "", "go").await;
        assert_eq!(
            r.kinds(),
            ["start", "step_start", "status", "text_delta", "step_reset", "step_start", "text_delta", "text_delta", "usage", "complete", "done"]
        );
        assert_eq!(r.last("step_reset")["step"], 0);
        assert_eq!(r.last("step_reset")["reason"], "Model error: Upstream provider crashed");
        assert_eq!(crate::helpers::surviving_text(&r.frames), "The whole answer.");
        let conversation = r.conversation().await;
        assert_eq!(conversation["messages"][1]["content"], "The whole answer.");
        let trace = r.trace().await;
        let calls: Vec<&Value> = trace["spans"].as_array().unwrap().iter().filter(|s| s["kind"] == "llm").collect();
        assert_eq!(calls.len(), 2, "a span per attempt");
        assert_eq!((calls[0]["status"].as_str(), calls[1]["status"].as_str()), (Some("error"), Some("ok")));
        let received = r.fixture.received();
        assert_eq!(received.len(), 2);
        assert_eq!(received[1].body["messages"], received[0].body["messages"], "the same call again");
    }

    /// After two tool steps, the third call fails after output and is asked again: one run,
    /// each tool ran once and its result was sent once, and the answer is whole.
    async fn a_failure_after_two_tool_steps_retries_only_the_failed_call(backend: Backend) {
        let script = vec![
            Scripted::sse(&openai_calculator_call_named("call_1", r#"{"expression": "6 * 7"}"#)),
            Scripted::sse(&openai_calculator_call_named("call_2", r#"{"expression": "42 + 1"}"#)),
            fails_after("It is"),
            Scripted::sse(&openai_text(&["It is 43."])),
        ];
        let r = run_with(backend, "openai", script, "", "", "go").await;
        let steps: Vec<u64> =
            r.frames.iter().filter(|f| f.kind() == "step_start").map(|f| f.data["step"].as_u64().unwrap()).collect();
        assert_eq!(steps, [0, 1, 2, 2], "the third call started twice");
        assert_eq!(r.frames.iter().filter(|f| f.kind() == "tool_start").count(), 2, "each tool ran once");
        assert_eq!(r.frames.iter().filter(|f| f.kind() == "complete").count(), 1);
        let surviving = crate::helpers::surviving_text(&r.frames);
        assert_eq!(surviving, "[[tool:0]]\n\n[[tool:1]]\n\nIt is 43.", "the tools' places, then the answer");
        let received = r.fixture.received();
        assert_eq!(received.len(), 4);
        let results = |body: &Value| {
            body["messages"].as_array().unwrap().iter().filter(|m| m["role"] == "tool").count()
        };
        assert_eq!((results(&received[2].body), results(&received[3].body)), (2, 2), "each result sent once");
        assert_eq!(received[3].body["messages"], received[2].body["messages"]);
        let conversation = r.conversation().await;
        assert_eq!(conversation["messages"][1]["content"], surviving.as_str());
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(12))]

    /// For any run of calls that fail after output before one answers, the answer a client
    /// assembles and the stored answer are the answering call's text alone.
    #[test]
    fn the_stored_answer_is_what_survived_any_failures(failures in proptest::collection::vec("[a-z]{1,6}", 0..4)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let mut script: Vec<Scripted> = failures.iter().map(|said| fails_after(said)).collect();
            script.push(Scripted::sse(&openai_text(&["Final ", "answer."])));
            let r = run_on("openai", script, "max_retries = 4", "", "go").await;
            assert_eq!(crate::helpers::surviving_text(&r.frames), "Final answer.");
            let resets = r.frames.iter().filter(|f| f.kind() == "step_reset").count();
            assert_eq!(resets, failures.len());
            let conversation = r.conversation().await;
            assert_eq!(conversation["messages"][1]["content"], "Final answer.");
            assert_eq!(r.frames.iter().filter(|f| f.kind() == "complete").count(), 1);
        });
    }

    /// For any sequence of step failures over a run of tool steps (each model call failing
    /// after output any number of times before it answers), the stored answer is the
    /// concatenation of the surviving steps, and each tool ran once.
    #[test]
    fn the_stored_answer_is_the_surviving_steps_for_any_step_failures(
        steps in proptest::collection::vec(proptest::collection::vec("[a-z]{1,6}", 0..3), 1..4),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let (tools, last) = steps.split_at(steps.len() - 1);
            let mut script = Vec::new();
            for (i, failures) in tools.iter().enumerate() {
                script.extend(failures.iter().map(|said| fails_after(said)));
                let expression = format!(r#"{{"expression": "{i} + 1"}}"#);
                script.push(Scripted::sse(&openai_calculator_call_named(&format!("call_{i}"), &expression)));
            }
            script.extend(last[0].iter().map(|said| fails_after(said)));
            script.push(Scripted::sse(&openai_text(&["Final ", "answer."])));
            let r = run_on("openai", script, "max_retries = 4", "", "go").await;
            let mut expected: Vec<String> = (0..tools.len()).map(|i| format!("[[tool:{i}]]")).collect();
            expected.push("Final answer.".to_owned());
            let expected = expected.join("\n\n");
            assert_eq!(crate::helpers::surviving_text(&r.frames), expected);
            let conversation = r.conversation().await;
            assert_eq!(conversation["messages"][1]["content"], expected.as_str());
            let failures: usize = steps.iter().map(Vec::len).sum();
            assert_eq!(r.frames.iter().filter(|f| f.kind() == "step_reset").count(), failures);
            assert_eq!(r.frames.iter().filter(|f| f.kind() == "tool_start").count(), tools.len(), "each tool ran once");
            assert_eq!(r.frames.iter().filter(|f| f.kind() == "complete").count(), 1);
        });
    }
}

#[test]
fn fallbacks_must_name_other_profiles() {
    let config = |fallbacks: &str| {
        format!(
            "[chat]\ndefault_profile = \"a\"\n[providers.m]\nkind = \"mock\"\n[profiles.a]\nprovider = \"m\"\nmodel = \"x\"\nfallbacks = {fallbacks}\n\
             [profiles.b]\nprovider = \"m\"\nmodel = \"y\"\n"
        )
    };
    let load = |text: String| {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), text).unwrap();
        chatd::config::Settings::load(Some(file.path())).map(|_| ())
    };
    load(config(r#"["b"]"#)).expect("a fallback that is another profile");
    let unknown = load(config(r#"["c"]"#)).unwrap_err().to_string();
    assert!(unknown.contains("profiles.a.fallbacks names unknown profile 'c'"), "{unknown}");
    let itself = load(config(r#"["a"]"#)).unwrap_err().to_string();
    assert!(itself.contains("profiles.a.fallbacks names the profile itself"), "{itself}");
}

#[tokio::test]
async fn an_unreachable_provider_is_a_network_error() {
    // A port that was just free: nothing listens there.
    let port = free_port();
    let config = format!(
        "[chat]\ndefault_profile = \"fx\"\n[providers.fx]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:{port}/v1\"\nmax_retries = 1\nretry_base_secs = 0.01\n[profiles.fx]\nprovider = \"fx\"\nmodel = \"m\"\n"
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let frames = app.chat("ann", json!({"message": "anyone?"})).await;
    let error = &frames.iter().find(|f| f.kind() == "error").unwrap().data;
    assert_eq!(error["code"], "NETWORK_ERROR");
    assert!(
        error["message"].as_str().unwrap().starts_with("Connection failed: the model's server did not answer"),
        "{error}"
    );
}

// ---- Anthropic Messages ----

#[tokio::test]
async fn anthropic_thinking_text_and_usage_stream_and_the_signature_goes_back() {
    let mut frames = anthropic_start();
    frames.extend(anthropic_block(
        0,
        json!({"type": "thinking", "thinking": ""}),
        &[
            json!({"type": "thinking_delta", "thinking": "Let me think"}),
            json!({"type": "thinking_delta", "thinking": " carefully."}),
            json!({"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"}),
        ],
    ));
    frames.push(event(json!({"type": "ping"})));
    frames.extend(anthropic_block(
        1,
        json!({"type": "text", "text": ""}),
        &[json!({"type": "text_delta", "text": "Twenty"}), json!({"type": "text_delta", "text": "-seven."})],
    ));
    frames.extend(anthropic_end("end_turn", 42));
    let second = {
        let mut f = anthropic_start();
        f.extend(anthropic_block(
            0,
            json!({"type": "text", "text": ""}),
            &[json!({"type": "text_delta", "text": "Sure."})],
        ));
        f.extend(anthropic_end("end_turn", 2));
        f
    };
    let r = run(
        "anthropic",
        vec![Scripted::sse(&frames), Scripted::sse(&second)],
        "enable_thinking = true\nthinking_budget = 2000\ntemperature = 0.5",
        "27?",
    )
    .await;
    assert_eq!(joined(&r.frames, "thinking_delta"), "Let me think carefully.");
    assert_eq!(joined(&r.frames, "text_delta"), "Twenty-seven.");
    let usage = r.last("usage");
    // Anthropic's input count leaves out what was read from the cache: chatd's includes it.
    assert_eq!((usage["input_tokens"].as_u64(), usage["output_tokens"].as_u64()), (Some(30), Some(42)));
    assert_eq!(usage["cache_read_tokens"], 5);

    let got = r.fixture.received();
    assert_eq!(got[0].path, "/v1/messages");
    assert_eq!(got[0].headers["x-api-key"], KEY);
    assert_eq!(got[0].headers["anthropic-version"], "2023-06-01");
    let body = &got[0].body;
    // The system prompt (and the tools before it) is cached.
    assert_eq!(body["system"].as_array().unwrap().len(), 1);
    assert!(body["system"][0]["text"].as_str().unwrap().starts_with("## Identity\nBe brief."));
    assert_eq!(body["system"][0]["cache_control"], json!({"type": "ephemeral"}));
    assert_eq!(
        body["messages"][0]["content"],
        json!([{"type": "text", "text": "27?", "cache_control": {"type": "ephemeral"}}])
    );
    assert_eq!(body["tools"][1]["name"], "calculator");
    assert!(body["tools"][1]["input_schema"]["properties"]["expression"].is_object());
    assert_eq!(body["thinking"], json!({"type": "enabled", "budget_tokens": 2000}));
    assert!(body.get("temperature").is_none(), "thinking forbids a custom temperature");
    assert!(body["max_tokens"].as_u64().unwrap() > 2000);

    // The next turn sends the signed thinking block back before the text.
    let conversation = r.frames[0].data["conversation_id"].clone();
    r.app.chat("ann", json!({"message": "and?", "conversation_id": conversation})).await;
    let body = &r.fixture.received()[1].body;
    assert_eq!(
        body["messages"][1],
        json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Let me think carefully.", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"},
            {"type": "text", "text": "Twenty-seven."},
        ]})
    );
    assert_eq!(
        body["messages"][2],
        json!({"role": "user", "content": [{"type": "text", "text": "and?", "cache_control": {"type": "ephemeral"}}]})
    );
    assert_eq!(body["messages"][0]["content"], json!([{"type": "text", "text": "27?"}]), "one mark, on the newest");
}

#[tokio::test]
async fn anthropic_tool_use_streams_in_pieces_and_results_go_back_as_tool_result() {
    let mut frames = anthropic_start();
    frames.extend(anthropic_block(
        0,
        json!({"type": "text", "text": ""}),
        &[json!({"type": "text_delta", "text": "Computing."})],
    ));
    let pieces = ["{\"expr", "ession\": \"2", " ^ 1", "0\"}"];
    let deltas: Vec<Value> = pieces.iter().map(|p| json!({"type": "input_json_delta", "partial_json": p})).collect();
    frames.extend(anthropic_block(
        1,
        json!({"type": "tool_use", "id": "toolu_01", "name": "calculator", "input": {}}),
        &deltas,
    ));
    frames.extend(anthropic_end("tool_use", 30));
    let mut answer = anthropic_start();
    answer.extend(anthropic_block(
        0,
        json!({"type": "text", "text": ""}),
        &[json!({"type": "text_delta", "text": "1024."})],
    ));
    answer.extend(anthropic_end("end_turn", 3));
    let r = run("anthropic", vec![Scripted::sse(&frames), Scripted::sse(&answer)], "temperature = 0.7", "2^10?").await;
    let kinds = r.kinds();
    let start = kinds.iter().position(|k| *k == "tool_input_start").unwrap();
    assert_eq!(kinds[start + 1..start + 5], ["tool_input_delta"; 4]);
    assert_eq!(r.frames[start].data["tool_call_id"], "toolu_01");
    assert_eq!(r.last("tool_output")["output"], "1024");
    assert_eq!(r.last("complete")["payload"]["message"], "Computing.\n\n[[tool:0]]\n\n1024.");
    let second = &r.fixture.received()[1].body["messages"];
    assert_eq!(
        second[1],
        json!({"role": "assistant", "content": [
        {"type": "text", "text": "Computing."},
        {"type": "tool_use", "id": "toolu_01", "name": "calculator", "input": {"expression": "2 ^ 10"}}]})
    );
    // Within the loop the newest results end the prefix too: the loop's next call reads it.
    assert_eq!(
        second[2],
        json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "1024", "is_error": false,
         "cache_control": {"type": "ephemeral"}}]})
    );
    assert_eq!(second[0]["content"][0]["cache_control"], json!({"type": "ephemeral"}));
    assert_eq!(r.fixture.received()[0].body["temperature"], 0.7, "as configured, not as an f32 reads");
    let message = &r.conversation().await["messages"][1];
    assert_eq!(message["tool_calls"][0]["input"], json!({"expression": "2 ^ 10"}));
}

#[tokio::test]
async fn anthropic_overloaded_error_mid_stream_is_service_unavailable() {
    let mut frames = anthropic_start();
    frames
        .push(event(json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
    frames.push(event(
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Start"}}),
    ));
    frames.push(event(json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})));
    let r = run_on("anthropic", vec![Scripted::sse(&frames)], "max_retries = 0", "", "go").await;
    assert_eq!(r.kinds(), ["start", "step_start", "status", "text_delta", "error", "done"]);
    let error = r.last("error");
    assert_eq!(error["code"], "SERVICE_UNAVAILABLE");
    assert_eq!(error["message"], "Model error: Overloaded");
    assert_eq!(error["retryable"], true);
    assert_eq!(r.trace().await["error"]["partial_text"], "Start");
}

#[tokio::test]
async fn anthropic_401_and_529() {
    let r = run(
        "anthropic",
        vec![Scripted::error(
            401,
            json!({"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}),
        )],
        "",
        "go",
    )
    .await;
    assert_eq!(r.last("error")["code"], "UNAUTHORIZED");
    let overloaded =
        Scripted::error(529, json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}));
    let r = run("anthropic", vec![overloaded.clone(), overloaded.clone(), overloaded], "", "go").await;
    let error = r.last("error");
    assert_eq!(error["code"], "SERVICE_UNAVAILABLE");
    assert_eq!(error["retryable"], true);
    assert_eq!(r.fixture.received().len(), 3);
}

// ---- Google Gemini ----

#[tokio::test]
async fn gemini_thoughts_text_and_usage_stream() {
    let frames = vec![
        gemini(json!([{"text": "Considering the sky.", "thought": true}]), None),
        gemini(json!([{"text": "It is "}]), None),
        gemini(json!([{"text": "blue."}]), Some("STOP")),
    ];
    let r = run(
        "google",
        vec![Scripted::sse(&frames)],
        "enable_thinking = true\nthinking_budget = 512\nmax_tokens = 100\ntemperature = 0.7",
        "Sky colour?",
    )
    .await;
    assert_eq!(joined(&r.frames, "thinking_delta"), "Considering the sky.");
    assert_eq!(joined(&r.frames, "text_delta"), "It is blue.");
    let usage = r.last("usage");
    assert_eq!((usage["input_tokens"].as_u64(), usage["output_tokens"].as_u64()), (Some(8), Some(10)));
    assert_eq!(usage["reasoning_tokens"], 4);
    let got = &r.fixture.received()[0];
    assert_eq!(got.path, "/v1beta/models/fx-model:streamGenerateContent?alt=sse");
    assert_eq!(got.headers["x-goog-api-key"], KEY);
    assert!(got.body["systemInstruction"]["parts"][0]["text"].as_str().unwrap().starts_with("## Identity\nBe brief."));
    assert_eq!(got.body["tools"][0]["functionDeclarations"][1]["name"], "calculator");
    assert_eq!(got.body["contents"], json!([{"role": "user", "parts": [{"text": "Sky colour?"}]}]));
    assert_eq!(got.body["generationConfig"]["thinkingConfig"], json!({"includeThoughts": true, "thinkingBudget": 512}));
    assert_eq!(got.body["generationConfig"]["maxOutputTokens"], 100);
    assert_eq!(got.body["generationConfig"]["temperature"], 0.7, "as configured, not as an f32 reads");
}

#[tokio::test]
async fn gemini_function_calls_arrive_whole_and_go_back_as_function_responses() {
    let frames =
        vec![gemini(json!([{"functionCall": {"name": "calculator", "args": {"expression": "1 + 1"}}}]), Some("STOP"))];
    let answer = vec![gemini(json!([{"text": "Two."}]), Some("STOP"))];
    let r = run("google", vec![Scripted::sse(&frames), Scripted::sse(&answer)], "", "1+1").await;
    let start = r.frames.iter().find(|f| f.kind() == "tool_input_start").unwrap();
    assert_eq!(start.data["tool"], "calculator");
    assert_eq!(r.last("tool_output")["output"], "2");
    assert_eq!(r.last("complete")["payload"]["message"], "[[tool:0]]\n\nTwo.");
    let contents = &r.fixture.received()[1].body["contents"];
    assert_eq!(
        contents[1],
        json!({"role": "model", "parts": [{"functionCall": {"name": "calculator", "args": {"expression": "1 + 1"}}}]})
    );
    assert_eq!(
        contents[2],
        json!({"role": "user", "parts": [{"functionResponse": {"name": "calculator", "response": {"content": "2", "is_error": false}}}]})
    );
}

#[tokio::test]
async fn gemini_errors_map_to_the_contract() {
    let r = run(
        "google",
        vec![Scripted::error(
            403,
            json!({"error": {"code": 403, "message": "API key not valid", "status": "PERMISSION_DENIED"}}),
        )],
        "",
        "go",
    )
    .await;
    assert_eq!(r.last("error")["code"], "UNAUTHORIZED");
    let frames = vec![
        gemini(json!([{"text": "par"}]), None),
        format!(
            "data: {}\r\n\r\n",
            json!({"error": {"code": 503, "message": "The model is overloaded.", "status": "UNAVAILABLE"}})
        ),
    ];
    let r = run_on("google", vec![Scripted::sse(&frames)], "max_retries = 0", "", "go").await;
    let error = r.last("error");
    assert_eq!(error["code"], "SERVICE_UNAVAILABLE");
    assert_eq!(r.trace().await["error"]["partial_text"], "par");
}

#[tokio::test]
async fn a_provider_whose_key_variable_is_unset_fails_at_once_naming_the_variable() {
    let fixture = Fixture::start(vec![Scripted::sse(&[openai_chunk(json!({"content": "hi"}), Some("stop"))])]).await;
    let config = format!(
        r#"
        [chat]
        default_profile = "fx"
        [providers.fx]
        kind = "openai"
        base_url = "{}/v1"
        api_key_env = "CHATD_TEST_SURELY_UNSET_KEY"
        [profiles.fx]
        provider = "fx"
        model = "fx-model"
        "#,
        fixture.base
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let frames = app.chat("ann", json!({"message": "hello"})).await;
    let error = frames.iter().find(|f| f.kind() == "error").expect("an error event");
    assert_eq!(error.data["code"], "UNAUTHORIZED");
    assert_eq!(error.data["retryable"], false);
    let message = error.data["message"].as_str().unwrap();
    assert!(message.contains("CHATD_TEST_SURELY_UNSET_KEY") && message.contains("restart"), "{message}");
    assert!(fixture.received().is_empty(), "no request went out without its key");
    assert_eq!(frames.last().unwrap().kind(), "done");
}

#[tokio::test]
async fn a_stream_without_token_counts_gets_chatds_estimate_marked_as_such() {
    // llama.cpp's server, among others, sends no usage chunk even when asked for one.
    let mut frames = vec![openai_chunk(json!({"role": "assistant", "content": ""}), None)];
    frames.extend(["A real ", "answer, ", "with no counts."].map(|p| openai_chunk(json!({"content": p}), None)));
    frames.push(openai_chunk(json!({}), Some("stop")));
    frames.push(DONE.to_owned());
    let r = run("openai_compatible", vec![Scripted::sse(&frames)], "", "Count this please").await;
    let mut usage = r.last("usage").clone();
    usage.as_object_mut().unwrap().remove("type");
    assert_eq!(usage["estimated"], true, "{usage}");
    assert!(usage["input_tokens"].as_u64().unwrap() > 0 && usage["output_tokens"].as_u64().unwrap() > 0, "{usage}");
    let complete = &r.last("complete")["payload"];
    assert_eq!(complete["usage"], usage, "the run's sum is the one call's estimate");
    assert_eq!(r.trace().await["usage"], usage, "the trace keeps it, marked");
    let conversation = r.conversation().await;
    assert_eq!(conversation["messages"][1]["usage"], usage, "so does the stored message");
}

#[tokio::test]
async fn a_count_the_provider_leaves_out_is_estimated_and_the_one_it_sends_is_kept() {
    let mut frames = openai_text(&["Some ", "text."]);
    let usage_at = frames.len() - 2;
    frames[usage_at] = openai_usage(7, 0);
    let r = run("openai", vec![Scripted::sse(&frames)], "", "hi").await;
    let usage = r.last("usage");
    assert_eq!(usage["input_tokens"], 7, "the provider's count is kept");
    assert!(usage["output_tokens"].as_u64().unwrap() > 0, "{usage}");
    assert_eq!(usage["estimated"], true);
    // Counts the provider sent whole are not marked.
    let r = run("openai", vec![Scripted::sse(&openai_text(&["Hi."]))], "", "hi").await;
    assert!(r.last("usage").get("estimated").is_none());
}

#[tokio::test]
async fn a_call_that_fails_after_some_output_counts_its_work_in_the_trace() {
    let frames = vec![
        openai_chunk(json!({"role": "assistant", "content": "Partial work"}), None),
        data(json!({"error": {"code": 502, "message": "Upstream provider crashed"}})),
    ];
    let r = run_on("openai_compatible", vec![Scripted::sse(&frames)], "max_retries = 0", "", "go").await;
    assert_eq!(
        r.kinds(),
        ["start", "step_start", "status", "text_delta", "error", "done"],
        "no usage event before the error"
    );
    let usage = &r.trace().await["usage"];
    assert_eq!(usage["estimated"], true, "{usage}");
    assert!(usage["output_tokens"].as_u64().unwrap() > 0, "not zero for work done: {usage}");
}

#[tokio::test]
async fn the_local_model_example_configs_answer_as_they_stand() {
    // Each example of a model server on the user's machine, as a user copies it, with only
    // its address pointed at a server speaking the OpenAI-compatible API (with a <think>
    // section, as qwen3's): its default profile answers, and the answer is bounded.
    let examples = [
        ("ollama.toml", "http://127.0.0.1:11434/v1", "local", "qwen3:0.6b"),
        ("vllm.toml", "http://127.0.0.1:8000/v1", "vllm", "Qwen/Qwen3-8B"),
        ("llamacpp.toml", "http://127.0.0.1:8081/v1", "llamacpp", "local"),
    ];
    for (file, address, profile, model) in examples {
        let fixture =
            Fixture::start(vec![Scripted::sse(&openai_text(&["<think>Short.</think>", "Hi ", "there."]))]).await;
        let path = format!("{}/config/examples/{file}", env!("CARGO_MANIFEST_DIR"));
        let example = std::fs::read_to_string(path).unwrap();
        assert!(example.contains(address), "{file}");
        let config = example.replace(address, &format!("{}/v1", fixture.base));
        let app = TestApp::spawn(Backend::Sqlite, &config).await;
        let frames = app.chat("ann", json!({"message": "Say hi"})).await;
        assert_eq!(frames[0].data["profile"], profile, "{file}");
        assert_eq!(frames[0].data["model"], model, "{file}");
        assert_eq!(joined(&frames, "thinking_delta"), "Short.", "{file}");
        assert_eq!(joined(&frames, "text_delta"), "Hi there.", "{file}");
        let got = fixture.received();
        assert_eq!(got[0].path, "/v1/chat/completions", "{file}");
        assert_eq!(got[0].body["model"], model, "{file}");
        assert!(got[0].body["max_tokens"].as_u64().is_some(), "{file}: {}", got[0].body);
    }
}

// ---- Attachments in each provider's wire format (CONTRACT.md §14) ----

/// A PNG, a PDF and a CSV, as `data:` URLs in a chat request, to a profile that takes them.
fn with_files(message: &str) -> (Value, [Vec<u8>; 3]) {
    use crate::files::{data_url, fixture};
    let (png, pdf, csv) = (fixture("small.png"), fixture("note.pdf"), fixture("cities.csv"));
    let body = json!({"message": message, "attachments": [
        {"url": data_url("image/png", &png), "name": "small.png"},
        {"url": data_url("application/pdf", &pdf), "name": "note.pdf"},
        {"url": data_url("text/csv", &csv), "name": "cities.csv"},
    ]});
    (body, [png, pdf, csv])
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

const CSV_BLOCK: &str = "Attached file cities.csv (text/csv):\ncity,population\nLyon,522969\nNantes,323204\n";

#[tokio::test]
async fn anthropic_gets_image_and_document_blocks_and_text_files_as_text_on_every_turn() {
    let answer = || {
        let mut frames = anthropic_start();
        frames.extend(anthropic_block(
            0,
            json!({"type": "text", "text": ""}),
            &[json!({"type": "text_delta", "text": "Seen."})],
        ));
        frames.extend(anthropic_end("end_turn", 3));
        Scripted::sse(&frames)
    };
    let (body, [png, pdf, _]) = with_files("What is in these?");
    let r = run_body("anthropic", vec![answer(), answer()], "modalities = [\"text\", \"image\", \"pdf\"]", body).await;
    assert_eq!(r.last("complete")["payload"]["message"], "Seen.");
    let expected = json!({"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&png)}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": b64(&pdf)}},
        {"type": "text", "text": CSV_BLOCK},
        // The newest question ends the prefix the next turn reads from the cache.
        {"type": "text", "text": "What is in these?", "cache_control": {"type": "ephemeral"}},
    ]});
    assert_eq!(r.fixture.received()[0].body["messages"][0], expected);
    // The next turn sends them again, in the history.
    let conversation = r.frames[0].data["conversation_id"].as_str().unwrap();
    r.app.chat("ann", json!({"message": "And now?", "conversation_id": conversation})).await;
    let second = &r.fixture.received()[1].body["messages"];
    // The same blocks as before, up to the mark: which moved on to the newest question.
    let mut earlier = expected.clone();
    earlier["content"][3].as_object_mut().unwrap().remove("cache_control");
    assert_eq!(second[0], earlier);
    let marked = json!({"type": "text", "text": "And now?", "cache_control": {"type": "ephemeral"}});
    assert_eq!(second[2], json!({"role": "user", "content": [marked]}));
}

#[tokio::test]
async fn openai_gets_image_url_and_file_parts_with_data_urls() {
    let (body, [png, pdf, _]) = with_files("What is in these?");
    let r = run_body(
        "openai",
        vec![Scripted::sse(&openai_text(&["Seen."]))],
        "modalities = [\"text\", \"image\", \"pdf\"]",
        body,
    )
    .await;
    assert_eq!(r.last("complete")["payload"]["message"], "Seen.");
    assert_eq!(
        r.fixture.received()[0].body["messages"][1],
        json!({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&png))}},
            {"type": "file", "file": {"filename": "note.pdf", "file_data": format!("data:application/pdf;base64,{}", b64(&pdf))}},
            {"type": "text", "text": CSV_BLOCK},
            {"type": "text", "text": "What is in these?"},
        ]})
    );
}

#[tokio::test]
async fn openai_compatible_servers_get_images_and_a_text_only_model_a_note_for_earlier_images() {
    use crate::files::{data_url, fixture};
    let png = fixture("small.png");
    let body = json!({"message": "Describe it", "attachments": [{"url": data_url("image/png", &png)}]});
    let script = vec![Scripted::sse(&openai_text(&["A picture."])), Scripted::sse(&openai_text(&["Ok."]))];
    let r = run_body(
        "openai_compatible",
        script,
        "modalities = [\"text\", \"image\"]\n[profiles.words]\nprovider = \"fx\"\nmodel = \"fx-text\"",
        body,
    )
    .await;
    assert_eq!(
        r.fixture.received()[0].body["messages"][1]["content"][0],
        json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&png))}})
    );
    // A later turn on a text-only profile: the earlier image is named, not sent.
    let conversation = r.frames[0].data["conversation_id"].as_str().unwrap();
    r.app.chat("ann", json!({"message": "Thanks", "conversation_id": conversation, "profile": "words"})).await;
    let second = &r.fixture.received()[1].body["messages"][1]["content"];
    assert_eq!(
        second[0]["text"],
        "[Attached file attachment.png (image/png) is not included: this model takes no image files]"
    );
}

#[tokio::test]
async fn gemini_gets_inline_data_parts() {
    let (body, [png, pdf, _]) = with_files("What is in these?");
    let script = vec![Scripted::sse(&[gemini(json!([{"text": "Seen."}]), Some("STOP"))])];
    let r = run_body("google", script, "modalities = [\"text\", \"image\", \"pdf\"]", body).await;
    assert_eq!(r.last("complete")["payload"]["message"], "Seen.");
    assert_eq!(
        r.fixture.received()[0].body["contents"][0],
        json!({"role": "user", "parts": [
            {"inline_data": {"mime_type": "image/png", "data": b64(&png)}},
            {"inline_data": {"mime_type": "application/pdf", "data": b64(&pdf)}},
            {"text": CSV_BLOCK},
            {"text": "What is in these?"},
        ]})
    );
}

#[tokio::test]
async fn a_message_of_files_alone_has_no_empty_text_and_an_image_over_anthropics_limit_is_refused() {
    use crate::files::{data_url, fixture};
    let answer = || {
        let mut frames = anthropic_start();
        frames.extend(anthropic_block(
            0,
            json!({"type": "text", "text": ""}),
            &[json!({"type": "text_delta", "text": "A picture."})],
        ));
        frames.extend(anthropic_end("end_turn", 3));
        Scripted::sse(&frames)
    };
    let png = fixture("small.png");
    let body = json!({"message": "", "attachments": [{"url": data_url("image/png", &png)}]});
    let r = run_body("anthropic", vec![answer()], "modalities = [\"text\", \"image\"]", body).await;
    let content = &r.fixture.received()[0].body["messages"][0]["content"];
    assert_eq!(content.as_array().unwrap().len(), 1, "{content}");
    assert_eq!(content[0]["type"], "image");
    // A whole PNG of 5.2 MB: above the 5 MB Anthropic takes in an image.
    let mut big = png[..33].to_vec();
    big.extend(std::iter::repeat_n(0u8, 5_200_000));
    big.extend_from_slice(&png[png.len() - 12..]);
    let (status, error) = r
        .app
        .post(
            "/api/chat/stream",
            "ann",
            json!({"message": "and this?", "attachments": [{"url": data_url("image/png", &big), "name": "big.png"}]}),
        )
        .await;
    assert_eq!(status, reqwest::StatusCode::BAD_REQUEST, "{error}");
    assert_eq!(error["field"], "attachments");
    assert!(error["message"].as_str().unwrap().contains("big.png"), "{error}");
    assert_eq!(r.fixture.received().len(), 1, "never sent");
}

// A run's first model call goes out while its start is written (issue 40): on Postgres a
// start waits for its user's lock when another transaction holds it, which shows the order.

/// Polls `done` every 10 ms for up to 10 s.
async fn eventually(what: &str, done: impl Fn() -> bool) {
    for _ in 0..1000 {
        if done() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{what}: not within 10 s");
}

/// Takes `user`'s start lock on Postgres in a transaction of its own (as a start of another
/// replica's would), held until it ends.
async fn hold_users_lock(url: &str, user: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("select pg_advisory_xact_lock(hashtextextended($1, 7))").bind(user).execute(&mut *tx).await.unwrap();
    tx
}

/// Waits until a statement of the test's database waits for an advisory lock.
async fn until_a_start_waits(url: &str) {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    for _ in 0..1000 {
        let waiting: Option<i32> = sqlx::query_scalar(
            "select 1 from pg_stat_activity \
             where wait_event_type = 'Lock' and wait_event = 'advisory' and datname = current_database()",
        )
        .fetch_optional(&pool)
        .await
        .unwrap();
        if waiting.is_some() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("no start waited for its user's lock within 10 s");
}

fn post_chat(app: &TestApp, user: &str, body: Value) -> tokio::task::JoinHandle<reqwest::Result<reqwest::Response>> {
    tokio::spawn(app.client.post(app.url("/api/chat/stream")).header("x-client-id", user).json(&body).send())
}

/// While a new chat's start waits to be written, the model has its request already; once
/// written, the run streams that request's answer whole, and asks nothing again. The call's
/// span begins when the request went out.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_new_chats_model_call_goes_out_while_its_start_is_written() {
    let script = vec![Scripted::sse(&openai_text(&["Sent", " early"]))];
    let (app, fixture, _key) = spawn_fx(Backend::Postgres, "openai", script, "", "").await;
    let held = hold_users_lock(&app.db_url, "ann").await;
    let chat = post_chat(&app, "ann", json!({"message": "go"}));
    until_a_start_waits(&app.db_url).await;
    eventually("the model asked while the start waits", || fixture.received().len() == 1).await;
    assert!(!chat.is_finished(), "the start is not written yet");
    let released = chrono::Utc::now();
    held.commit().await.unwrap();
    let response = chat.await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    let frames = read_frames(response).await;
    assert_eq!(joined(&frames, "text_delta"), "Sent early");
    assert_eq!(frames.iter().rev().map(Frame::kind).take(2).collect::<Vec<_>>(), ["done", "complete"]);
    assert_eq!(fixture.received().len(), 1, "the run took the early call's answer");
    assert_eq!(fixture.received()[0].body["messages"].as_array().unwrap().last().unwrap()["content"], "go");
    let trace = app.get(&format!("/api/trace/{}", frames[0].data["trace_id"].as_str().unwrap()), "ann").await.1;
    let span = &trace["spans"][0];
    assert_eq!(span["kind"], "llm");
    let began: chrono::DateTime<chrono::Utc> = serde_json::from_value(span["started_at"].clone()).unwrap();
    assert!(began < released, "the call's span begins before the start was written: {span}");
}

/// `chatd_time_to_first_token_seconds` is clocked from the first model call's going out: for
/// a call sent while the start was written, from before the run began, so the wait for the
/// commit counts.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn the_time_to_first_token_counts_from_the_early_calls_going_out() {
    let fixture = Fixture::start(vec![Scripted::sse(&openai_text(&["Clocked"]))]).await;
    // A model of its own: the metric is the process's, and other tests' models are in it.
    let config = format!(
        "[chat]\ndefault_profile = \"clocked\"\n[providers.fx]\nkind = \"openai\"\nbase_url = \"{}/v1\"\n\
         [profiles.clocked]\nprovider = \"fx\"\nmodel = \"clocked-early\"\n",
        fixture.base
    );
    let app = TestApp::spawn(Backend::Postgres, &config).await;
    let held = hold_users_lock(&app.db_url, "ann").await;
    let chat = post_chat(&app, "ann", json!({"message": "go"}));
    until_a_start_waits(&app.db_url).await;
    eventually("the model asked while the start waits", || fixture.received().len() == 1).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    held.commit().await.unwrap();
    let frames = read_frames(chat.await.unwrap().unwrap()).await;
    assert_eq!(joined(&frames, "text_delta"), "Clocked");
    let metrics = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let value = |name: &str| metric(&metrics, name);
    assert_eq!(value("chatd_time_to_first_token_seconds_count{model=\"clocked-early\"}"), 1.0);
    let took = value("chatd_time_to_first_token_seconds_sum{model=\"clocked-early\"}");
    assert!(took >= 0.5, "the wait for the commit counts: {took} s");
}

/// A start refused at its commit (here: another replica's run fills the user's limit, which
/// only the commit counts) drops the call it sent: the model's answer is left unread, and
/// nothing of the request is kept.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_start_refused_at_its_commit_leaves_the_call_it_sent() {
    let limit = "[limits]\nmax_concurrent_runs_per_user = 1\n";
    let script = Scripted::sse(&[openai_chunk(json!({"role": "assistant", "content": "Never read"}), None)]);
    let (app, fixture, _key) = spawn_fx(Backend::Postgres, "openai", vec![script.then(Part::Stall)], "", limit).await;
    let other = TestApp::on(&app.db_url, limit).await;
    // Running still when the start commits, however slow the machine (a minute).
    let slow = json!({"message": "[mock:words=4000] [mock:delay=15] [mock:think=off]", "profile": "default"});
    let going = post_chat(&other, "ann", slow).await.unwrap().unwrap();
    assert_eq!(going.status(), 200);
    let held = hold_users_lock(&app.db_url, "ann").await;
    let refused = post_chat(&app, "ann", json!({"message": "one too many"}));
    until_a_start_waits(&app.db_url).await;
    eventually("the model asked while the start waits", || fixture.received().len() == 1).await;
    eventually("the model's answer begun", || fixture.open() == 1).await;
    held.commit().await.unwrap();
    let refused = refused.await.unwrap().unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.json::<Value>().await.unwrap()["code"], "RATE_LIMITED");
    eventually("the early call's answer left", || fixture.open() == 0).await;
    assert_eq!(fixture.received().len(), 1, "asked once, never again");
    let (_, listed) = app.get("/api/conversations", "ann").await;
    assert_eq!(listed["conversations"].as_array().unwrap().len(), 1, "only the other replica's: {listed}");
    drop(going);
}

/// A file that could not be read for the early call (here: its bytes gone while the start
/// waits, back before the run begins) is read again by the run, which sends the call anew
/// with it: the model never answers a request that lacked a file.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_file_the_early_call_could_not_read_is_read_again_and_sent_by_the_run() {
    use crate::files::{fixture, stored_files, upload};
    let script = vec![Scripted::sse(&openai_text(&["Seen", " it"]))];
    let (app, fixture_server, _key) =
        spawn_fx(Backend::Postgres, "openai", script, "", "modalities = [\"text\", \"image\"]").await;
    let png = fixture("small.png");
    let (status, file) = upload(&app, "ann", "small.png", png.clone()).await;
    assert_eq!(status, 201, "{file}");
    let blobs = stored_files(&app);
    assert_eq!(blobs.len(), 1, "{blobs:?}");
    let held = hold_users_lock(&app.db_url, "ann").await;
    std::fs::remove_file(&blobs[0]).unwrap();
    let chat = post_chat(&app, "ann", json!({"message": "Describe it", "attachments": [{"file_id": file["id"]}]}));
    until_a_start_waits(&app.db_url).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(fixture_server.received().len(), 0, "nothing sent without the file");
    std::fs::write(&blobs[0], &png).unwrap();
    held.commit().await.unwrap();
    let frames = read_frames(chat.await.unwrap().unwrap()).await;
    assert_eq!(joined(&frames, "text_delta"), "Seen it", "{frames:?}");
    let received = fixture_server.received();
    assert_eq!(received.len(), 1);
    let image = &received[0].body["messages"].as_array().unwrap().last().unwrap()["content"][0];
    assert_eq!(image["type"], "image_url", "the run sent the file: {image}");
}

/// Sends `message` to a fixture with `extra` in its profile while the user's lock is held:
/// the model is asked nothing until the start is written, then once.
async fn asked_only_once_written(extra: &str, message: &str) {
    let script = vec![Scripted::sse(&openai_text(&["Asked", " after"]))];
    let (app, fixture, _key) = spawn_fx(Backend::Postgres, "openai", script, "", extra).await;
    let held = hold_users_lock(&app.db_url, "ann").await;
    let chat = post_chat(&app, "ann", json!({"message": message}));
    until_a_start_waits(&app.db_url).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(fixture.received().len(), 0, "asked before the start was written");
    held.commit().await.unwrap();
    let frames = read_frames(chat.await.unwrap().unwrap()).await;
    assert_eq!(joined(&frames, "text_delta"), "Asked after");
    assert_eq!(fixture.received().len(), 1);
}

/// A user with a budget is asked nothing of the model until the start is written: a start
/// refused at its commit would have spent what the budget cannot count.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_user_with_a_budget_asks_the_model_only_once_the_start_is_written() {
    asked_only_once_written("[limits]\nbudget_tokens_per_day = 100000\n", "go").await;
}

/// A queued run asks its model when its turn comes, not while its start is written: its
/// request is planned again then, on the answers before it.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_queued_run_asks_its_model_only_when_its_turn_comes() {
    let script = vec![Scripted::sse(&openai_text(&["Its", " turn"]))];
    let (app, fixture, _key) = spawn_fx(Backend::Postgres, "openai", script, "", "").await;
    let slow = json!({"message": "[mock:words=4000] [mock:delay=15] [mock:think=off]", "profile": "default"});
    let mut ahead = crate::runs::start(&app, "ann", slow).await;
    let begun = ahead.until("start").await.data.clone();
    let conversation = begun["conversation_id"].as_str().unwrap().to_owned();
    // The start's locks: its user's, and its conversation's (a queued start takes that one).
    let mut held = hold_users_lock(&app.db_url, "ann").await;
    sqlx::query("select pg_advisory_xact_lock(hashtextextended($1, 8))")
        .bind(&conversation)
        .execute(&mut *held)
        .await
        .unwrap();
    let next = json!({"message": "next", "conversation_id": conversation, "profile": "fx"});
    let queued = post_chat(&app, "ann", next);
    until_a_start_waits(&app.db_url).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(fixture.received().len(), 0, "asked while its start was written");
    held.commit().await.unwrap();
    let mut queued = crate::runs::Live::open(queued.await.unwrap().unwrap()).await;
    assert_eq!(queued.until("status").await.data["message"], "Queued");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(fixture.received().len(), 0, "asked before its turn");
    let (status, body) = app.post("/api/cancel_stream", "ann", json!({"trace_id": begun["trace_id"]})).await;
    assert_eq!(status, 200, "{body}");
    let rest = queued.rest().await;
    assert_eq!(joined(&rest, "text_delta"), "Its turn");
    assert_eq!(fixture.received().len(), 1, "asked once, in its turn");
    drop(ahead);
}

/// A request whose context needs a trim is sent by its run: the trim begins from the one
/// the conversation keeps, which the run reads.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_request_to_trim_asks_the_model_only_once_the_start_is_written() {
    asked_only_once_written("context_limit = 100", &"word ".repeat(400)).await;
}
