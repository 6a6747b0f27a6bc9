//! Auth modes `none` (X-Client-Id, else "local") and `token` (bearer tokens from config and
//! from a tokens file).

use serde_json::json;

use crate::helpers::*;

#[tokio::test]
async fn without_a_client_id_the_user_is_local() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let response = app.client.post(app.url("/api/conversations")).json(&json!({"title": "t"})).send().await.unwrap();
    assert_eq!(response.status(), 201);
    let (_, local) = app.get("/api/conversations", "local").await;
    assert_eq!(local["conversations"].as_array().unwrap().len(), 1);
    let (_, other) = app.get("/api/conversations", "someone").await;
    assert_eq!(other["conversations"], json!([]));
}

#[tokio::test]
async fn token_mode_maps_bearer_tokens_to_users() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens");
    std::fs::write(&file, "# token user\ntok-from-file carol\n").unwrap();
    let config = format!(
        "[auth]\nmode = \"token\"\ntokens_file = \"{}\"\n[auth.tokens]\n\"tok-alice\" = \"alice\"\n",
        file.display()
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let send = |token: Option<&str>| {
        let mut request = app.client.post(app.url("/api/conversations")).json(&json!({"title": "t"}));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        // X-Client-Id means nothing in token mode.
        request.header("x-client-id", "alice").send()
    };
    for token in [None, Some("tok-wrong")] {
        let response = send(token).await.unwrap();
        assert_eq!(response.status(), 401);
        let error: serde_json::Value = response.json().await.unwrap();
        assert_eq!(error["code"], "UNAUTHORIZED");
    }
    let created: serde_json::Value = send(Some("tok-alice")).await.unwrap().json().await.unwrap();
    assert_eq!(send(Some("tok-from-file")).await.unwrap().status(), 201);

    let list = |token: &'static str| {
        let app = &app;
        async move {
            let response = app.client.get(app.url("/api/conversations")).bearer_auth(token).send().await.unwrap();
            response.json::<serde_json::Value>().await.unwrap()
        }
    };
    let alice = list("tok-alice").await;
    assert_eq!(alice["conversations"].as_array().unwrap().len(), 1);
    assert_eq!(alice["conversations"][0]["id"], created["id"]);
    let carol = list("tok-from-file").await;
    assert_eq!(carol["conversations"].as_array().unwrap().len(), 1);
    assert_ne!(carol["conversations"][0]["id"], created["id"]);
}
