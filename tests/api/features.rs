//! A/B comparisons, votes and the leaderboard; branching; titles; context trimming; the
//! legacy API.

use reqwest::Method;
use serde_json::{Value, json};

use crate::fixture::*;
use crate::helpers::*;

async fn ab(app: &TestApp, body: Value) -> Vec<Frame> {
    let response =
        app.client.post(app.url("/api/ab/stream")).header("x-client-id", "ann").json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200, "{:?}", response.text().await);
    read_frames(response).await
}

fn side<'a>(frames: &'a [Frame], variant: &str) -> Vec<&'a Frame> {
    frames.iter().filter(|f| f.data["variant"] == variant).collect()
}

fn side_text(frames: &[Frame], variant: &str) -> String {
    side(frames, variant)
        .iter()
        .filter(|f| f.kind() == "text_delta")
        .map(|f| f.data["text"].as_str().unwrap())
        .collect()
}

both_backends! {
    async fn an_ab_stream_runs_both_sides_and_a_vote_picks_the_branch(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let frames = ab(&app, json!({"message": "Compare us", "profile_a": "default", "profile_b": "other"})).await;
        let first = &frames[0].data;
        assert_eq!(first["type"], "comparison");
        assert_eq!((first["a"]["model"].as_str(), first["b"]["model"].as_str()), (Some("mock-1"), Some("mock-2")));
        let ids: Vec<u64> = frames.iter().map(|f| f.id).collect();
        assert_eq!(ids, (1..=frames.len() as u64).collect::<Vec<_>>());
        let dones: Vec<&Frame> = frames.iter().filter(|f| f.kind() == "done").collect();
        assert_eq!(dones.len(), 1, "one final done");
        assert_eq!(dones[0].data["comparison_id"], first["comparison_id"]);
        assert_eq!(frames.last().unwrap().kind(), "done");
        for variant in ["a", "b"] {
            let events = side(&frames, variant);
            assert_eq!(events[0].kind(), "start");
            assert_eq!(events.last().unwrap().kind(), "complete");
            assert_eq!(side_text(&frames, variant), "Mock reply: Compare us");
            assert_eq!(events[0].data["trace_id"], first[variant]["trace_id"]);
        }
        let comparison_id = first["comparison_id"].as_str().unwrap().to_owned();
        let conversation = side(&frames, "a")[0].data["conversation_id"].as_str().unwrap().to_owned();

        let (status, shown) = app.get(&format!("/api/ab/{comparison_id}"), "ann").await;
        assert_eq!(status, 200, "{shown}");
        for variant in ["a", "b"] {
            assert_eq!(shown[variant]["status"], "completed");
            assert!(shown[variant]["time_to_first_token_ms"].as_i64().unwrap() >= 0);
            assert!(shown[variant]["duration_ms"].as_i64().unwrap() >= 0);
            assert!(shown[variant]["usage"]["output_tokens"].as_u64().unwrap() > 0);
        }
        assert_eq!(shown["preference"], Value::Null);

        // Both answers are siblings under the message; A is active until a vote.
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        let messages = loaded["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[1]["id"], first["a"]["message_id"]);
        assert_eq!(messages[1]["variant"], "a");
        assert_eq!(messages[1]["comparison_id"], first["comparison_id"]);
        let (_, siblings) = app.get(&format!("/api/messages/{}/siblings", first["a"]["message_id"].as_str().unwrap()), "ann").await;
        assert_eq!(siblings["siblings"].as_array().unwrap().len(), 2);

        let vote = format!("/api/ab/{comparison_id}/vote");
        let (status, voted) = app.post(&vote, "ann", json!({"preference": "b"})).await;
        assert_eq!(status, 200, "{voted}");
        assert_eq!(voted["preference"], "b");
        assert!(voted["voted_at"].is_string());
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        assert_eq!(loaded["messages"][1]["id"], first["b"]["message_id"], "the preferred answer is the active branch");

        assert_eq!(app.post(&vote, "ann", json!({"preference": "b"})).await.0, 200, "the same vote again is fine");
        let (status, error) = app.post(&vote, "ann", json!({"preference": "a"})).await;
        assert_eq!((status.as_u16(), error["code"].as_str()), (409, Some("CONFLICT")));
        let (status, changed) = app.call(Method::PUT, &vote, "ann", Some(json!({"preference": "tie"}))).await;
        assert_eq!(status, 200);
        assert_eq!(changed["preference"], "tie");
        let history: Vec<&str> = changed["vote_history"].as_array().unwrap().iter().map(|v| v["preference"].as_str().unwrap()).collect();
        assert_eq!(history, ["b", "tie"]);
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        assert_eq!(loaded["messages"][1]["id"], first["a"]["message_id"], "a tie makes A active");
        let (status, error) = app.post(&vote, "ann", json!({"preference": "maybe"})).await;
        assert_eq!((status.as_u16(), error["field"].as_str()), (400, Some("preference")));
        assert_eq!(app.post(&vote, "bob", json!({"preference": "a"})).await.0, 404);
        assert_eq!(app.get(&format!("/api/ab/{comparison_id}"), "bob").await.0, 404);
    }

    async fn regenerating_makes_a_sibling_and_the_next_turn_follows_the_active_branch(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let first = app.chat("ann", json!({"message": "Tell me"})).await;
        let conversation = first[0].data["conversation_id"].clone();
        let user_message = first[0].data["user_message_id"].clone();
        let old_answer = first[0].data["message_id"].clone();
        let again = app.chat("ann", json!({"message": "Tell me", "conversation_id": conversation, "parent_message_id": user_message})).await;
        assert_eq!(again[0].data["user_message_id"], user_message, "the same message, answered again");
        let new_answer = again[0].data["message_id"].clone();
        let (_, siblings) = app.get(&format!("/api/messages/{}/siblings", new_answer.as_str().unwrap()), "ann").await;
        let listed: Vec<(Value, bool)> = siblings["siblings"].as_array().unwrap().iter().map(|m| (m["id"].clone(), m["active"].as_bool().unwrap())).collect();
        assert_eq!(listed, vec![(old_answer.clone(), false), (new_answer.clone(), true)]);

        // Switch back to the first answer; the next turn continues from it.
        let (status, switched) = app.post(&format!("/api/messages/{}/activate", old_answer.as_str().unwrap()), "ann", json!({})).await;
        assert_eq!(status, 200, "{switched}");
        assert_eq!(switched["messages"][1]["id"], old_answer);
        let next = app.chat("ann", json!({"message": "Go on", "conversation_id": conversation})).await;
        let (_, loaded) = app.get(&format!("/api/conversations/{}", conversation.as_str().unwrap()), "ann").await;
        let ids: Vec<&Value> = loaded["messages"].as_array().unwrap().iter().map(|m| &m["id"]).collect();
        assert_eq!(ids, vec![&user_message, &old_answer, &next[0].data["user_message_id"], &next[0].data["message_id"]]);
        assert_eq!(loaded["message_count"], 5, "every branch's messages are kept");

        // An edit: other text for the first message makes a sibling user message.
        let edited = app.chat("ann", json!({"message": "Tell me more", "conversation_id": conversation, "parent_message_id": user_message})).await;
        let (_, loaded) = app.get(&format!("/api/conversations/{}", conversation.as_str().unwrap()), "ann").await;
        assert_eq!(loaded["messages"][0]["id"], edited[0].data["user_message_id"]);
        assert_eq!(loaded["messages"][0]["content"], "Tell me more");
        assert_eq!(loaded["messages"].as_array().unwrap().len(), 2);
    }
}

#[tokio::test]
async fn an_ab_stream_where_one_side_fails_still_completes_the_other() {
    let broken = Fixture::start(vec![Scripted::json(500, json!({"error": {"message": "down"}}))]).await;
    let config = format!(
        "[providers.broken]\nkind = \"openai\"\nbase_url = \"{}/v1\"\nmax_retries = 0\n[profiles.broken]\nprovider = \"broken\"\nmodel = \"gpt-x\"\n",
        broken.base
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let frames = ab(&app, json!({"message": "Which works?", "profile_a": "default", "profile_b": "broken"})).await;
    let a = side(&frames, "a");
    let b = side(&frames, "b");
    assert_eq!(a.last().unwrap().kind(), "complete");
    assert_eq!(b.last().unwrap().kind(), "error");
    assert_eq!(b.last().unwrap().data["code"], "SERVICE_UNAVAILABLE");
    assert_eq!(frames.last().unwrap().kind(), "done");
    let comparison_id = frames[0].data["comparison_id"].as_str().unwrap();
    let (_, shown) = app.get(&format!("/api/ab/{comparison_id}"), "ann").await;
    assert_eq!((shown["a"]["status"].as_str(), shown["b"]["status"].as_str()), (Some("completed"), Some("error")));

    let (status, error) = app.post("/api/ab/stream", "ann", json!({"message": "x", "profile_a": "default"})).await;
    assert_eq!((status.as_u16(), error["field"].as_str()), (400, Some("profile_b")));
    let (status, error) =
        app.post("/api/ab/stream", "ann", json!({"message": "x", "profile_a": "default", "profile_b": "nope"})).await;
    assert_eq!((status.as_u16(), error["field"].as_str()), (404, Some("profile_b")));
}

/// Starts a slow A/B run; returns its first event and the rest, parsed, as they come.
async fn open_comparison(app: &TestApp) -> (Value, futures_util::stream::BoxStream<'static, Value>) {
    use futures_util::StreamExt;
    let response = app
        .client
        .post(app.url("/api/ab/stream"))
        .json(&json!({"message": "[mock:words=80] [mock:think=off]", "profile_a": "default", "profile_b": "other"}))
        .send()
        .await
        .unwrap();
    let mut events = eventsource_stream::Eventsource::eventsource(response.bytes_stream())
        .map(|event| serde_json::from_str::<Value>(&event.unwrap().data).unwrap())
        .boxed();
    let first = events.next().await.unwrap();
    (first, events)
}

#[tokio::test]
async fn cancelling_one_side_leaves_the_other_running() {
    let app = TestApp::spawn(Backend::Sqlite, "[providers.mock]\ndelay_ms = 10").await;
    let (first, mut events) = open_comparison(&app).await;
    let trace_b = first["b"]["trace_id"].clone();
    let (status, body) = app.post("/api/cancel_stream", "local", json!({"trace_id": trace_b})).await;
    assert_eq!(status, 200, "{body}");
    let mut rest = Vec::new();
    while let Some(event) = futures_util::StreamExt::next(&mut events).await {
        rest.push(event);
    }
    let terminal = |variant: &str| rest.iter().rev().find(|e| e["variant"] == variant).unwrap()["type"].clone();
    assert_eq!(terminal("b"), "cancelled");
    assert_eq!(terminal("a"), "complete");

    // comparison_id cancels both.
    let (first, mut events) = open_comparison(&app).await;
    let (status, body) =
        app.post("/api/cancel_stream", "local", json!({"comparison_id": first["comparison_id"]})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["trace_ids"].as_array().unwrap().len(), 2);
    let mut kinds = Vec::new();
    while let Some(event) = futures_util::StreamExt::next(&mut events).await {
        kinds.push((event["variant"].clone(), event["type"].clone()));
    }
    assert!(
        kinds.contains(&(json!("a"), json!("cancelled"))) && kinds.contains(&(json!("b"), json!("cancelled"))),
        "{kinds:?}"
    );
}

#[tokio::test]
async fn the_leaderboard_follows_the_votes() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let mut comparisons = Vec::new();
    for _ in 0..3 {
        let frames = ab(&app, json!({"message": "vote", "profile_a": "default", "profile_b": "other"})).await;
        comparisons.push(frames[0].data["comparison_id"].as_str().unwrap().to_owned());
    }
    for (id, preference) in comparisons.iter().zip(["a", "b", "both_bad"]) {
        assert_eq!(app.post(&format!("/api/ab/{id}/vote"), "ann", json!({"preference": preference})).await.0, 200);
    }
    let (_, board) = app.get("/api/ab/leaderboard", "ann").await;
    assert_eq!(board["votes"], 3);
    let models = board["models"].as_array().unwrap();
    let row = |model: &str| models.iter().find(|m| m["model"] == model).unwrap().clone();
    let (one, two) = (row("mock-1"), row("mock-2"));
    assert_eq!((one["wins"].as_u64(), one["losses"].as_u64(), one["both_bad"].as_u64()), (Some(1), Some(1), Some(1)));
    assert_eq!((two["wins"].as_u64(), two["losses"].as_u64(), two["both_bad"].as_u64()), (Some(1), Some(1), Some(1)));
    // 1016/984 after A; then B wins from 984: +17.47 → 1001.47 / 998.53; then a draw at
    // 998.53 vs 1001.47 moves mock-1 by 32 * (0.5 - 0.49577) = +0.135.
    assert_eq!(one["rating"].as_f64().unwrap(), 998.7);
    assert_eq!(two["rating"].as_f64().unwrap(), 1001.3);
}

#[tokio::test]
async fn a_long_conversation_is_trimmed_at_the_threshold_with_tool_pairs_intact() {
    let turn = |text: &str| {
        vec![
            data(json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop"}]})),
            "data: [DONE]\n\n".to_owned(),
        ]
    };
    let tool_call = vec![
        data(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": "{\"expression\": \"2+2\"}"}}]}, "finish_reason": "tool_calls"}]})),
        "data: [DONE]\n\n".to_owned(),
    ];
    let long = "word ".repeat(60); // about 75 tokens
    let mut script = vec![Scripted::sse(&tool_call), Scripted::sse(&turn(&long))];
    for _ in 0..4 {
        script.push(Scripted::sse(&turn(&long)));
    }
    let provider = Fixture::start(script).await;
    let config = format!(
        "[chat]\ndefault_profile = \"fx\"\n[tools]\nbuiltins = [\"calculator\"]\n[providers.fx]\nkind = \"openai_compatible\"\nbase_url = \"{}/v1\"\n\
         [profiles.fx]\nprovider = \"fx\"\nmodel = \"m\"\nsystem_prompt = \"S\"\ncontext_limit = 1000\n",
        provider.base
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let first = app.chat("ann", json!({"message": format!("compute {long}")})).await;
    let conversation = first[0].data["conversation_id"].clone();
    let mut last = first;
    for n in 0..4 {
        last = app.chat("ann", json!({"message": format!("turn {n} {long}"), "conversation_id": conversation})).await;
    }
    let requests = provider.received();
    let sizes: Vec<usize> = requests.iter().map(|r| r.body["messages"].as_array().unwrap().len()).collect();
    // Untrimmed the history grows by two each turn; trimmed it stops growing.
    assert!(sizes.last().unwrap() < &(sizes[1] + 8), "{sizes:?}");
    for request in &requests {
        let messages = request.body["messages"].as_array().unwrap();
        assert_eq!(messages[0]["role"], "system", "the system prompt is always kept");
        assert_eq!(messages[1]["role"], "user", "history starts with the user");
        for (i, m) in messages.iter().enumerate() {
            if m.get("tool_calls").is_some() {
                assert_eq!(messages[i + 1]["role"], "tool", "a call keeps its result");
            }
            if m["role"] == "tool" {
                assert!(messages[i - 1].get("tool_calls").is_some(), "a result keeps its call");
            }
        }
    }
    let (_, loaded) = app.get(&format!("/api/conversations/{}", conversation.as_str().unwrap()), "ann").await;
    let state = &loaded["context_state"];
    assert_eq!(state["strategy"], "trim_oldest", "{loaded}");
    assert!(state["dropped"].as_u64().unwrap() > 0);
    assert!(state["estimate"].as_u64().unwrap() <= 700);
    let (_, trace) = app.get(&format!("/api/trace/{}", last[0].data["trace_id"].as_str().unwrap()), "ann").await;
    assert_eq!(
        trace["spans"][0]["attributes"]["chatd.context"]["dropped"], state["dropped"],
        "the trace records the trim"
    );
}

#[tokio::test]
async fn the_legacy_api_carries_the_same_run() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let message = "Legacy please [mock:tool=calculator {\"expression\": \"3*3\"}]";
    let canonical = app.chat("ann", json!({"message": message})).await;
    let response = app
        .client
        .post(app.url("/api/get_chat_response_stream"))
        .header("x-client-id", "ann")
        .json(&json!({"message": message}))
        .send()
        .await
        .unwrap();
    let legacy = read_frames(response).await;
    let kinds: Vec<&str> = legacy.iter().map(Frame::kind).collect();
    assert!(kinds.iter().all(|k| ["chunk", "tool_start", "tool_output", "tool_end", "done"].contains(k)), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"done"));
    let chunks: String =
        legacy.iter().filter(|f| f.kind() == "chunk").map(|f| f.data["content"].as_str().unwrap()).collect();
    assert_eq!(chunks, joined(&canonical, "text_delta"), "the same text as the canonical stream");
    let conversation = legacy.last().unwrap().data["conversation_id"].clone();
    assert!(legacy.iter().filter(|f| f.kind() == "chunk").all(|f| f.data["conversation_id"] == conversation));
    let tool_start = legacy.iter().find(|f| f.kind() == "tool_start").unwrap();
    assert_eq!(tool_start.data["tool_name"], "calculator");
    assert_eq!(tool_start.data["tool_args"], json!({"expression": "3*3"}));
    assert_eq!(legacy.iter().find(|f| f.kind() == "tool_end").unwrap().data["status"], "success");

    let message_id = legacy.last().unwrap().data["message_id"].as_str().unwrap().to_owned();
    app.call(Method::PUT, &format!("/api/messages/{message_id}/feedback"), "ann", Some(json!({"rating": "down"})))
        .await;
    let (status, loaded) =
        app.get(&format!("/api/load_conversation?conversation_id={}", conversation.as_str().unwrap()), "ann").await;
    assert_eq!(status, 200);
    assert_eq!(loaded["messages"][1]["feedback"], "down");
    assert_eq!(loaded["messages"][0]["role"], "user");
    let (_, listed) = app.get("/api/list_conversations?client_id=ann", "someone-else").await;
    let listed = listed["conversations"].as_array().unwrap();
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0]["conversation_id"], conversation, "newest first");
    assert!(listed[0]["last_message_at"].is_string() && listed[0]["title"].is_string());
    assert_eq!(app.get("/api/load_conversation?conversation_id=nope", "ann").await.0, 400);
}

#[tokio::test]
async fn titles_can_be_refined_in_the_background() {
    // The model's title comes quoted and over two lines: a title is one line.
    let rule = r#"text = "\"Planning a\n  Trip to Oslo\"\n""#;
    let app = TestApp::spawn(
        Backend::Sqlite,
        &format!(
            "[chat]\nrefine_titles = true\n[[providers.mock.rules]]\nwhen = \"trip to Oslo\"\n{rule}\nthinking = \"t\""
        ),
    )
    .await;
    let frames = app.chat("ann", json!({"message": "I want to plan a trip to Oslo next spring with my family"})).await;
    let conversation = frames[0].data["conversation_id"].as_str().unwrap().to_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        if loaded["title"] == "Planning a Trip to Oslo" {
            break;
        }
        assert_eq!(
            loaded["title"], "I want to plan a trip to Oslo next spring with my family",
            "until then, the first line"
        );
        assert!(std::time::Instant::now() < deadline, "the title was never refined");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn dropped_history_can_be_summarised() {
    let config = "[chat]\nsummarize_dropped = true\n[profiles.default]\ncontext_limit = 600\n";
    let app = TestApp::spawn(Backend::Sqlite, config).await;
    let long = "word ".repeat(60);
    let first = app.chat("ann", json!({"message": format!("one {long}")})).await;
    let conversation = first[0].data["conversation_id"].clone();
    let mut last = first;
    for n in 0..3 {
        last = app.chat("ann", json!({"message": format!("turn {n} {long}"), "conversation_id": conversation})).await;
    }
    assert_eq!(last.last().unwrap().kind(), "done");
    let (_, loaded) = app.get(&format!("/api/conversations/{}", conversation.as_str().unwrap()), "ann").await;
    let state = &loaded["context_state"];
    assert_eq!(state["strategy"], "trim_oldest_with_summary", "{state}");
    assert_eq!(state["summary"], "Mock reply: Summarise the conversation so far.");
    assert!(state["dropped"].as_u64().unwrap() > 0);
}
