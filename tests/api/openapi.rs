//! The OpenAPI document: served, committed, and in step with the code.

use crate::helpers::*;

#[tokio::test]
async fn the_served_document_is_the_committed_one() {
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json")).unwrap();
    let generated = chatd::http::openapi::document();
    assert_eq!(
        committed.trim(),
        generated.trim(),
        "docs/openapi.json is stale: run `cargo run -- openapi > docs/openapi.json` (and scripts/typescript-types.sh)"
    );
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let response = app.client.get(app.url("/openapi.json")).send().await.unwrap();
    assert_eq!(response.headers()["content-type"], "application/json");
    let served: serde_json::Value = response.json().await.unwrap();
    assert_eq!(served["openapi"], "3.1.0");
    assert_eq!(served, serde_json::from_str::<serde_json::Value>(&generated).unwrap());
    let docs = app.client.get(app.url("/docs")).send().await.unwrap();
    let csp = docs.headers()["content-security-policy"].to_str().unwrap().to_owned();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    let docs = docs.text().await.unwrap();
    assert!(docs.contains("/openapi.json") && docs.contains(r#"src="/assets/docs.js""#));
    assert!(!docs.contains("https://"), "nothing from another host: {docs}");
    let script = app.client.get(app.url("/assets/docs.js")).send().await.unwrap().text().await.unwrap();
    assert!(script.contains(r#"fetch("/openapi.json")"#));
}

#[test]
fn every_route_is_documented() {
    let document: serde_json::Value = serde_json::from_str(&chatd::http::openapi::document()).unwrap();
    let paths = document["paths"].as_object().unwrap();
    for (method, path) in [
        ("post", "/api/chat/stream"),
        ("get", "/api/chat/stream/{id}"),
        ("post", "/api/cancel_stream"),
        ("get", "/api/conversations"),
        ("post", "/api/conversations"),
        ("get", "/api/conversations/{id}"),
        ("patch", "/api/conversations/{id}"),
        ("delete", "/api/conversations/{id}"),
        ("put", "/api/messages/{id}/feedback"),
        ("get", "/api/messages/{id}/siblings"),
        ("post", "/api/messages/{id}/activate"),
        ("get", "/api/trace/{id}"),
        ("get", "/api/trace/by_message/{id}"),
        ("post", "/api/ab/stream"),
        ("get", "/api/ab/{id}"),
        ("post", "/api/ab/{id}/vote"),
        ("put", "/api/ab/{id}/vote"),
        ("get", "/api/ab/leaderboard"),
        ("get", "/api/profiles"),
        ("get", "/api/tools"),
        ("post", "/api/get_chat_response_stream"),
        ("get", "/api/load_conversation"),
        ("get", "/api/list_conversations"),
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/metrics"),
        ("get", "/api/usage"),
        ("get", "/api/webhooks/deliveries"),
    ] {
        assert!(paths.get(path).and_then(|p| p.get(method)).is_some(), "{method} {path} is not in the document");
    }
    let events = &document["components"]["schemas"]["Event"]["oneOf"];
    assert!(events.as_array().unwrap().len() >= 15, "the SSE event union is a schema: {events}");
}
