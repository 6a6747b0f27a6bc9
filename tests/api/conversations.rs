//! Conversations and messages (CONTRACT.md §3, §8) and cross-user isolation.

use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;

both_backends! {
    async fn conversations_are_created_renamed_and_deleted(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let (status, created) = app
            .post("/api/conversations", "ann", json!({"title": "Plans", "metadata": {"project": 7}}))
            .await;
        assert_eq!(status, 201);
        assert_eq!(created["title"], "Plans");
        assert_eq!(created["message_count"], 0);
        assert_eq!(created["messages"], json!([]));
        let id = created["id"].as_str().unwrap().to_owned();
        let path = format!("/api/conversations/{id}");

        let (status, patched) = app.call(Method::PATCH, &path, "ann", Some(json!({"title": " Better plans "}))).await;
        assert_eq!(status, 200);
        assert_eq!(patched["title"], "Better plans");
        assert_eq!(patched["metadata"], json!({"project": 7}), "fields not sent stay");

        let (status, error) = app.call(Method::PATCH, &path, "ann", Some(json!({"title": ""}))).await;
        assert_eq!((status.as_u16(), error["field"].as_str()), (400, Some("title")));
        let (status, error) = app.call(Method::PATCH, &path, "ann", Some(json!({"profile": "nope"}))).await;
        assert_eq!((status.as_u16(), error["field"].as_str()), (404, Some("profile")));
        let (status, error) = app.call(Method::PATCH, &path, "ann", Some(json!({"colour": "red"}))).await;
        assert_eq!((status.as_u16(), error["code"].as_str()), (400, Some("VALIDATION_ERROR")));

        let frames = app.chat("ann", json!({"message": "hello", "conversation_id": id})).await;
        let trace_id = frames[0].data["trace_id"].as_str().unwrap().to_owned();
        let (status, _) = app.call(Method::DELETE, &path, "ann", None).await;
        assert_eq!(status, 204);
        assert_eq!(app.get(&path, "ann").await.0, 404);
        assert_eq!(app.get(&format!("/api/trace/{trace_id}"), "ann").await.0, 404, "traces go with it");
        assert_eq!(app.call(Method::DELETE, &path, "ann", None).await.0, 404);
    }

    async fn the_list_is_newest_first_and_pages_with_a_cursor(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let mut ids = Vec::new();
        for n in 0..5 {
            let (_, created) = app.post("/api/conversations", "ann", json!({"title": format!("c{n}")})).await;
            ids.push(created["id"].as_str().unwrap().to_owned());
        }
        // Writing to the oldest makes it the newest.
        app.chat("ann", json!({"message": "bump", "conversation_id": ids[0]})).await;
        let expected = vec![ids[0].clone(), ids[4].clone(), ids[3].clone(), ids[2].clone(), ids[1].clone()];

        let mut seen = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let path = match &cursor {
                Some(c) => format!("/api/conversations?limit=2&cursor={c}"),
                None => "/api/conversations?limit=2".to_owned(),
            };
            let (status, page) = app.get(&path, "ann").await;
            assert_eq!(status, 200, "{page}");
            let batch = page["conversations"].as_array().unwrap();
            assert!(batch.len() <= 2);
            seen.extend(batch.iter().map(|c| c["id"].as_str().unwrap().to_owned()));
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => break,
            }
        }
        assert_eq!(seen, expected);

        for bad in ["/api/conversations?limit=0", "/api/conversations?limit=1000", "/api/conversations?cursor=zzz"] {
            let (status, error) = app.get(bad, "ann").await;
            assert_eq!(status, 400, "{bad}");
            assert_eq!(error["code"], "VALIDATION_ERROR");
        }
        let (_, others) = app.get("/api/conversations", "bob").await;
        assert_eq!(others["conversations"], json!([]));
    }

    async fn feedback_is_stored_and_returned_on_load(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let frames = app.chat("ann", json!({"message": "rate me"})).await;
        let message = frames[0].data["message_id"].as_str().unwrap().to_owned();
        let conversation = frames[0].data["conversation_id"].as_str().unwrap().to_owned();
        let path = format!("/api/messages/{message}/feedback");

        let (status, body) = app.call(Method::PUT, &path, "ann", Some(json!({"rating": "up", "comment": "nice"}))).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["feedback"]["rating"], "up");
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        let feedback = &loaded["messages"][1]["feedback"];
        assert_eq!(feedback["rating"], "up");
        assert_eq!(feedback["comment"], "nice");
        assert!(feedback["at"].is_string());

        let (status, error) = app.call(Method::PUT, &path, "ann", Some(json!({"rating": "meh"}))).await;
        assert_eq!((status.as_u16(), error["field"].as_str()), (400, Some("rating")));
        let (status, _) = app.call(Method::PUT, &path, "bob", Some(json!({"rating": "down"}))).await;
        assert_eq!(status, 404, "another user's message does not exist for them");

        let (status, body) = app.call(Method::PUT, &path, "ann", Some(json!({"rating": null}))).await;
        assert_eq!(status, 200);
        assert_eq!(body["feedback"], Value::Null);
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        assert_eq!(loaded["messages"][1]["feedback"], Value::Null);
    }

    async fn another_users_ids_answer_not_found(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let frames = app.chat("ann", json!({"message": "private"})).await;
        let conversation = frames[0].data["conversation_id"].as_str().unwrap().to_owned();
        let path = format!("/api/conversations/{conversation}");
        for (method, body) in [(Method::GET, None), (Method::PATCH, Some(json!({"title": "mine now"}))), (Method::DELETE, None)] {
            let (status, error) = app.call(method.clone(), &path, "bob", body).await;
            assert_eq!(status, 404, "{method}");
            assert_eq!(error["code"], "NOT_FOUND");
        }
        let (status, loaded) = app.get(&path, "ann").await;
        assert_eq!(status, 200);
        assert_eq!(loaded["title"], "private", "bob changed nothing");
        assert_eq!(loaded["messages"].as_array().unwrap().len(), 2);
    }
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
