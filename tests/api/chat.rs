//! POST /api/chat/stream: events per CONTRACT.md §5, persistence, validation, failures.

use reqwest::Method;
use serde_json::json;

use crate::helpers::*;

both_backends! {
    async fn a_burst_of_new_chats_all_start_stream_and_persist(backend: Backend) {
        // Starts that arrive together are written in one transaction: every one of them
        // must still get its own conversation, stream and stored answer. (One user's forty
        // runs at once: above the default limit of running runs.)
        let app = TestApp::spawn(backend, "[limits]\nmax_concurrent_runs_per_user = 40\n").await;
        let chats = (0..40).map(|i| app.chat("ann", json!({"message": format!("burst {i} [mock:words=30]")})));
        let streams = futures_util::future::join_all(chats).await;
        let mut conversations = std::collections::HashSet::new();
        for frames in &streams {
            assert_eq!(frames.first().unwrap().kind(), "start");
            assert_eq!(frames.last().unwrap().kind(), "done");
            assert!(!joined(frames, "text_delta").is_empty());
            conversations.insert(frames[0].data["conversation_id"].as_str().unwrap().to_owned());
        }
        assert_eq!(conversations.len(), 40);
        let (status, page) = app.get("/api/conversations?limit=100", "ann").await;
        assert_eq!(status, 200, "{page}");
        let listed = page["conversations"].as_array().expect("a page of conversations");
        assert_eq!(listed.len(), 40);
        assert!(listed.iter().all(|c| c["message_count"] == 2), "each holds its question and its answer");
    }

    async fn a_first_message_streams_every_event_in_order(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let frames = app.chat("ann", json!({"message": "Hello there"})).await;

        let ids: Vec<u64> = frames.iter().map(|f| f.id).collect();
        assert_eq!(ids, (1..=frames.len() as u64).collect::<Vec<_>>(), "seq starts at 1 and grows by 1");
        let kinds: Vec<&str> = frames.iter().map(Frame::kind).collect();
        assert_eq!(kinds[..3], ["start", "step_start", "status"]);
        assert_eq!(kinds[kinds.len() - 3..], ["usage", "complete", "done"]);
        let first_text = kinds.iter().position(|k| *k == "text_delta").expect("text streamed");
        let last_thinking = kinds.iter().rposition(|k| *k == "thinking_delta").expect("thinking streamed");
        assert!(last_thinking < first_text, "the mock thinks before it answers: {kinds:?}");
        assert_eq!(frames[1].data["step"], 0, "model calls count from 0");
        assert_eq!(frames[2].data["message"], "Thinking…");

        let start = &frames[0].data;
        assert_eq!(start["model"], "mock-1");
        assert_eq!(start["profile"], "default");
        let complete = &frames[frames.len() - 2].data["payload"];
        let done = &frames[frames.len() - 1].data;
        for key in ["conversation_id", "message_id", "trace_id"] {
            assert_eq!(complete[key], start[key], "{key}");
            assert_eq!(done[key], start[key], "{key}");
        }
        assert_eq!(complete["message"], "Mock reply: Hello there");
        assert_eq!(joined(&frames, "text_delta"), "Mock reply: Hello there");
        assert_eq!(complete["thinking"].as_str().unwrap(), joined(&frames, "thinking_delta"));
        assert_eq!(complete["finish_reason"], "stop");
        assert_eq!(complete["tool_history"], json!([]));
        assert_eq!(complete["suggested_values"], json!([]));
        let usage = &frames[frames.len() - 3].data;
        assert!(usage["input_tokens"].as_u64().unwrap() > 0);
        assert_eq!(complete["usage"]["output_tokens"], usage["output_tokens"]);
        assert!(complete.get("diagnostics").is_none());
    }

    async fn the_answer_is_persisted_and_loads_back(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let frames = app.chat("ann", json!({"message": "  What is up?\nSecond line"})).await;
        let start = frames[0].data.clone();
        let conversation = start["conversation_id"].as_str().unwrap();

        let (status, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        assert_eq!(status, 200);
        assert_eq!(loaded["title"], "What is up?");
        assert_eq!(loaded["message_count"], 2);
        let messages = loaded["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0]["id"], start["user_message_id"]);
        assert_eq!(messages[0]["role"], "user");
        assert_eq!(messages[0]["content"], "What is up?\nSecond line");
        assert_eq!(messages[1]["id"], start["message_id"]);
        assert_eq!(messages[1]["role"], "assistant");
        assert_eq!(messages[1]["parent_id"], start["user_message_id"]);
        assert_eq!(messages[1]["content"], "Mock reply: What is up?\nSecond line", "the echo keeps its lines");
        assert_eq!(messages[1]["thinking"], frames[frames.len() - 2].data["payload"]["thinking"]);
        assert_eq!(messages[1]["model"], "mock-1");
        assert_eq!(messages[1]["trace_id"], start["trace_id"]);
        assert_eq!(messages[1]["cancelled"], false);

        // A second turn continues the same conversation and branch.
        let again = app.chat("ann", json!({"message": "And now?", "conversation_id": conversation})).await;
        assert_eq!(again[0].data["conversation_id"], conversation);
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        let messages = loaded["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 4);
        assert_eq!(messages[2]["parent_id"], messages[1]["id"]);
        assert_eq!(messages[3]["content"], "Mock reply: And now?");
        assert_eq!(loaded["title"], "What is up?", "the title stays the first message's");
    }

    async fn the_run_is_traced_with_its_event_log(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let frames = app.chat("ann", json!({"message": "trace me"})).await;
        let trace_id = frames[0].data["trace_id"].as_str().unwrap();
        let (status, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
        assert_eq!(status, 200);
        assert_eq!(trace["status"], "completed");
        assert!(trace["duration_ms"].as_i64().unwrap() >= 0);
        let logged: Vec<(u64, serde_json::Value)> = trace["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["seq"].as_u64().unwrap(), e["data"].clone()))
            .collect();
        let sent: Vec<(u64, serde_json::Value)> = frames.iter().map(|f| (f.id, f.data.clone())).collect();
        assert_eq!(logged, sent, "the log holds exactly what was sent");
        let span = &trace["spans"][0];
        assert_eq!(span["kind"], "llm");
        assert_eq!(span["attributes"]["gen_ai.request.model"], "mock-1");
        assert!(span["attributes"]["gen_ai.usage.output_tokens"].as_u64().unwrap() > 0);

        let message_id = frames[0].data["message_id"].as_str().unwrap();
        let (status, by_message) = app.get(&format!("/api/trace/by_message/{message_id}"), "ann").await;
        assert_eq!(status, 200);
        assert_eq!(by_message["trace_id"], trace_id);
        let (status, _) = app.get(&format!("/api/trace/{trace_id}"), "bob").await;
        assert_eq!(status, 404, "another user's trace does not exist for them");
    }

    async fn a_provider_error_ends_the_run_and_keeps_the_user_message(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let frames = app.chat("ann", json!({"message": "fail please [mock:error=unauthorized]"})).await;
        let kinds: Vec<&str> = frames.iter().map(Frame::kind).collect();
        assert_eq!(kinds, ["start", "step_start", "status", "error", "done"]);
        let error = &frames[3].data;
        assert_eq!(error["code"], "UNAUTHORIZED");
        assert_eq!(error["message"], "Invalid API key");
        assert_eq!(error["retryable"], false);
        assert_eq!(error["trace_id"], frames[0].data["trace_id"]);

        let conversation = frames[0].data["conversation_id"].as_str().unwrap();
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        let messages = loaded["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 1, "no assistant message for an error run");
        assert_eq!(messages[0]["role"], "user");
        let (_, trace) = app.get(&format!("/api/trace/{}", frames[0].data["trace_id"].as_str().unwrap()), "ann").await;
        assert_eq!(trace["status"], "error");
        assert_eq!(trace["error"]["code"], "UNAUTHORIZED");
    }

    /// The mock fails after two chunks every time: each failure after output voids what the
    /// call said (`step_reset`) and asks again, as often as the provider's `max_retries` (2);
    /// the last failure ends the run, keeping what that attempt said (CONTRACT.md §19).
    async fn a_failure_mid_stream_keeps_the_partial_text_in_the_trace(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let frames = app.chat("ann", json!({"message": "[mock:words=10] [mock:fail_after=2] [mock:think=off]"})).await;
        let kinds: Vec<&str> = frames.iter().map(Frame::kind).collect();
        let attempt = ["step_start", "text_delta", "text_delta"];
        let mut expected = vec!["start", "step_start", "status", "text_delta", "text_delta"];
        for _ in 0..2 {
            expected.push("step_reset");
            expected.extend(attempt);
        }
        expected.extend(["error", "done"]);
        assert_eq!(kinds, expected);
        let error = &frames[frames.len() - 2].data;
        assert_eq!(error["code"], "SERVICE_UNAVAILABLE");
        assert_eq!(error["retryable"], true);
        let (_, trace) = app.get(&format!("/api/trace/{}", frames[0].data["trace_id"].as_str().unwrap()), "ann").await;
        let surviving = crate::helpers::surviving_text(&frames);
        assert_eq!(trace["error"]["partial_text"], surviving.as_str());
        assert!(!surviving.is_empty() && surviving.len() < joined(&frames, "text_delta").len());
        let calls = trace["spans"].as_array().unwrap().iter().filter(|s| s["kind"] == "llm").count();
        assert_eq!(calls, 3, "a span per attempt");
    }

    async fn validation_fails_before_the_stream_and_writes_nothing(backend: Backend) {
        // The body limit is max_body_bytes and one inline file (1,024 bytes as base64): 5,464.
        let app =
            TestApp::spawn(backend, "[limits]\nmax_message_chars = 50\nmax_body_bytes = 4096\n[files]\nmax_bytes = 1024")
                .await;
        let unknown = uuid::Uuid::now_v7();
        let cases = [
            (json!({"message": "   \n "}), 400, "VALIDATION_ERROR", Some("message")),
            (json!({"message": 42}), 400, "VALIDATION_ERROR", Some("message")),
            (json!({}), 400, "VALIDATION_ERROR", Some("message")),
            (json!({"message": "hi", "conversation_id": "not-a-uuid"}), 400, "VALIDATION_ERROR", Some("conversation_id")),
            (json!({"message": "hi", "interaction_type": "shout"}), 400, "VALIDATION_ERROR", Some("interaction_type")),
            (json!({"message": "hi", "conversation_id": unknown}), 404, "NOT_FOUND", Some("conversation_id")),
            (json!({"message": "hi", "profile": "nope"}), 404, "NOT_FOUND", Some("profile")),
            (json!({"message": "x".repeat(51)}), 413, "PAYLOAD_TOO_LARGE", Some("message")),
            (json!({"message": "x".repeat(6000)}), 413, "PAYLOAD_TOO_LARGE", None),
            (json!(["hi"]), 400, "VALIDATION_ERROR", None),
            (json!(["hi", unknown]), 400, "VALIDATION_ERROR", None),
        ];
        for (body, status, code, field) in cases {
            let (got, error) = app.post("/api/chat/stream", "ann", body.clone()).await;
            assert_eq!(got.as_u16(), status, "{body}: {error}");
            assert_eq!(error["code"], code, "{body}");
            assert_eq!(error["field"].as_str(), field, "{body}: {error}");
            assert!(!error["message"].as_str().unwrap().is_empty());
        }
        // The 413 names the setting to raise, and its value.
        let (_, error) = app.post("/api/chat/stream", "ann", json!({"message": "x".repeat(51)})).await;
        assert_eq!(error["message"], "Message is 51 characters, longer than limits.max_message_chars (50)");
        let response = app
            .client
            .post(app.url("/api/chat/stream"))
            .header("content-type", "application/json")
            .body("{\"message\": \"hi\"")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400);
        let error: serde_json::Value = response.json().await.unwrap();
        assert_eq!(error["code"], "VALIDATION_ERROR");
        assert!(error["message"].as_str().unwrap().starts_with("Invalid JSON"), "{error}");

        let (_, list) = app.get("/api/conversations", "ann").await;
        assert_eq!(list["conversations"], json!([]), "a refused request leaves nothing behind");
    }

    async fn a_parent_from_elsewhere_is_not_found(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let one = app.chat("ann", json!({"message": "one"})).await;
        let two = app.chat("ann", json!({"message": "two"})).await;
        let conversation = one[0].data["conversation_id"].clone();
        let foreign_parent = two[0].data["message_id"].clone();
        let (status, error) = app
            .post("/api/chat/stream", "ann", json!({"message": "x", "conversation_id": conversation, "parent_message_id": foreign_parent}))
            .await;
        assert_eq!(status, 404);
        assert_eq!(error["field"], "parent_message_id");
        let (_, loaded) = app.get(&format!("/api/conversations/{}", conversation.as_str().unwrap()), "ann").await;
        assert_eq!(loaded["message_count"], 2, "nothing was added");
    }

    async fn another_users_conversation_cannot_be_continued(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let frames = app.chat("ann", json!({"message": "mine"})).await;
        let conversation = frames[0].data["conversation_id"].clone();
        let (status, error) = app.post("/api/chat/stream", "bob", json!({"message": "yours?", "conversation_id": conversation})).await;
        assert_eq!(status, 404);
        assert_eq!(error["code"], "NOT_FOUND");
    }

    async fn the_profile_is_remembered_by_the_conversation(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let (status, created) = app.post("/api/conversations", "ann", json!({"profile": "other"})).await;
        assert_eq!(status, 201);
        let frames = app.chat("ann", json!({"message": "hi", "conversation_id": created["id"]})).await;
        assert_eq!(frames[0].data["profile"], "other");
        assert_eq!(frames[0].data["model"], "mock-2");
        let frames = app.chat("ann", json!({"message": "hi", "conversation_id": created["id"], "profile": "default"})).await;
        assert_eq!(frames[0].data["model"], "mock-1", "the request's profile wins");
    }
}

#[tokio::test]
async fn idle_streams_get_keepalive_comments() {
    let app = TestApp::spawn(Backend::Sqlite, "[stream]\nkeepalive_secs = 1").await;
    let response = app
        .client
        .post(app.url("/api/chat/stream"))
        .json(&json!({"message": "slow [mock:delay=1400] [mock:think=off]"}))
        .send()
        .await
        .unwrap();
    let body = response.text().await.unwrap();
    assert!(body.contains("\n: ping\n") || body.starts_with(": ping\n"), "{body}");
    assert!(body.contains("\"type\":\"done\""));
}

#[tokio::test]
async fn unknown_routes_and_bad_ids_get_the_envelope() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let (status, error) = app.get("/api/nothing-here", "ann").await;
    assert_eq!(status, 404);
    assert_eq!(error["code"], "NOT_FOUND");
    let (status, error) = app.call(Method::GET, "/api/trace/12345", "ann", None).await;
    assert_eq!(status, 400);
    assert_eq!(error["field"], "id");
}

#[tokio::test]
async fn health_and_readiness_answer() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    assert_eq!(app.get("/healthz", "x").await.0, 200);
    let (status, ready) = app.get("/readyz", "x").await;
    assert_eq!(status, 200);
    assert_eq!(ready["status"], "ready");
    let (_, profiles) = app.get("/api/profiles", "x").await;
    assert_eq!(profiles["default_profile"], "default");
    assert_eq!(profiles["profiles"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn thinking_of_several_model_calls_is_one_paragraph_each() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let frames = app.chat("ann", json!({"message": "Add [mock:tool=calculator {\"expression\": \"2 + 40\"}]"})).await;
    let thinking = joined(&frames, "thinking_delta");
    let paragraphs: Vec<&str> = thinking.split("\n\n").collect();
    assert_eq!(paragraphs.len(), 2, "two model calls, two paragraphs: {thinking:?}");
    assert!(paragraphs.iter().all(|p| !p.trim().is_empty()), "{thinking:?}");
    let complete = frames.iter().find(|f| f.kind() == "complete").unwrap();
    assert_eq!(complete.data["payload"]["thinking"], thinking, "stored as streamed");
}

#[tokio::test]
async fn the_mock_echo_keeps_its_lines_and_a_title_leaves_out_its_directives() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let frames = app.chat("ann", json!({"message": "# Plan\n\n- one\n- two [mock:think=off]"})).await;
    assert_eq!(joined(&frames, "text_delta"), "Mock reply: # Plan\n\n- one\n- two");
    let frames = app.chat("ann", json!({"message": "[mock:words=3] Three words please"})).await;
    let conversation = frames[0].data["conversation_id"].as_str().unwrap();
    let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
    assert_eq!(loaded["title"], "Three words please");
}

#[tokio::test]
async fn an_unknown_profile_is_named_and_says_where_the_known_ones_are() {
    // A profile name from another configuration (an example's), which this one lacks.
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let (status, error) = app.post("/api/chat/stream", "ann", json!({"message": "hi", "profile": "sonnet"})).await;
    assert_eq!(status, 404);
    assert_eq!(error["code"], "NOT_FOUND");
    assert_eq!(error["field"], "profile");
    assert_eq!(error["message"], "Profile 'sonnet' not found: GET /api/profiles lists the configured ones");

    // AG-UI's forwardedProps.profile, as a client copied from a snippet sends it.
    let agui = json!({"threadId": "t1", "runId": "r1", "messages": [{"id": "m1", "role": "user", "content": "Hello"}],
        "forwardedProps": {"profile": "sonnet"}});
    let (status, error) = app.post("/api/agui", "ann", agui).await;
    assert_eq!((status.as_u16(), error["field"].as_str()), (404, Some("profile")));
    assert!(error["message"].as_str().unwrap().starts_with("Profile 'sonnet' not found"), "{error}");

    // A/B sides and the tools of a profile name theirs too.
    let (status, error) =
        app.post("/api/ab/stream", "ann", json!({"message": "x", "profile_a": "default", "profile_b": "nope"})).await;
    assert_eq!((status.as_u16(), error["field"].as_str()), (404, Some("profile_b")));
    assert!(error["message"].as_str().unwrap().starts_with("Profile 'nope' not found"), "{error}");
    let (status, error) = app.get("/api/tools?profile=gone", "ann").await;
    assert_eq!(status, 404);
    assert!(error["message"].as_str().unwrap().starts_with("Profile 'gone' not found"), "{error}");

    // A long name is echoed only in part: the answer stays short whatever was sent.
    let long = format!("{}{}", "p".repeat(100), "q".repeat(10_000));
    let (status, error) = app.post("/api/chat/stream", "ann", json!({"message": "hi", "profile": long})).await;
    assert_eq!(status, 404);
    let message = error["message"].as_str().unwrap();
    assert!(message.starts_with(&format!("Profile '{}…' not found", "p".repeat(100))), "{message}");
    assert!(!message.contains('q'), "{message}");
}

/// The JSON `data:` of a whole SSE answer (a client library's stream; `[DONE]` left out).
async fn sse_data(app: &TestApp, path: &str, body: serde_json::Value) -> Vec<serde_json::Value> {
    let response = app.client.post(app.url(path)).header("x-client-id", "ann").json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200, "{path}");
    let text = response.text().await.unwrap();
    text.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect()
}

#[tokio::test]
async fn a_later_model_calls_reasoning_starts_at_its_first_line_in_client_libraries_streams() {
    // Two model calls (a tool call, then the answer), each thinking: the native stream joins
    // their thinking by a blank line; useChat and AG-UI get a reasoning part per call.
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let message = r#"Add [mock:tool=calculator {"expression": "2 + 3"}]"#;
    let ui = sse_data(
        &app,
        "/api/ui/chat",
        json!({"id": "chat-1", "messages": [{"id": "u1", "role": "user", "parts": [{"type": "text", "text": message}]}]}),
    )
    .await;
    let mut parts: Vec<String> = Vec::new();
    for chunk in &ui {
        match chunk["type"].as_str().unwrap() {
            "reasoning-start" => parts.push(String::new()),
            "reasoning-delta" => parts.last_mut().unwrap().push_str(chunk["delta"].as_str().unwrap()),
            _ => {}
        }
    }
    let conversation = ui.iter().find_map(|c| c["messageMetadata"]["conversation_id"].as_str()).unwrap();
    let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
    let thinking = loaded["messages"][1]["thinking"].as_str().unwrap();
    assert_eq!(parts.len(), 2, "{ui:?}");
    assert!(parts.iter().all(|p| !p.is_empty() && !p.starts_with('\n')), "{parts:?}");
    assert_eq!(parts.join("\n\n"), thinking);

    let agui = sse_data(
        &app,
        "/api/agui",
        json!({"threadId": "t1", "runId": "r1", "messages": [{"id": "m1", "role": "user", "content": message}]}),
    )
    .await;
    let mut reasonings: Vec<(String, String)> = Vec::new();
    for event in agui.iter().filter(|e| e["type"] == "REASONING_MESSAGE_CONTENT") {
        let id = event["messageId"].as_str().unwrap();
        match reasonings.last_mut() {
            Some((last, text)) if last == id => text.push_str(event["delta"].as_str().unwrap()),
            _ => reasonings.push((id.to_owned(), event["delta"].as_str().unwrap().to_owned())),
        }
    }
    assert_eq!(reasonings.len(), 2, "{agui:?}");
    assert!(reasonings.iter().all(|(_, text)| !text.starts_with('\n')), "{reasonings:?}");
}
