//! A/B comparisons (CONTRACT.md §10): both sides over one stream, one side failing or
//! cancelled, votes and the leaderboard.

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
