//! The legacy vocabulary (CONTRACT.md §11) carries the same runs and records.

use reqwest::Method;
use serde_json::json;

use crate::helpers::*;

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
