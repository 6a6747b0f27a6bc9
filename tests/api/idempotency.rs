//! `Idempotency-Key` (CONTRACT.md §16) over real HTTP: requests that repeat a key get the
//! run it started, from its first event, never a second run: twenty at once, a retry after
//! the end, on the AI SDK's and the A/B endpoints, and on two replicas of one Postgres.

use futures_util::future::join_all;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::*;

/// POSTs `body` to `path` with `key`, reading the whole answer: its status and SSE frames.
async fn keyed(app: &TestApp, user: &str, path: &str, key: &str, body: &Value) -> (StatusCode, String) {
    let response = app
        .client
        .post(app.url(path))
        .header("x-client-id", user)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    (status, response.text().await.unwrap())
}

/// The `data:` lines of an SSE body, in order.
fn data_lines(body: &str) -> Vec<Value> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).filter_map(|d| serde_json::from_str(d).ok()).collect()
}

async fn traces_of(app: &TestApp, user: &str) -> Vec<Value> {
    let (_, list) = app.get("/api/conversations", user).await;
    let mut messages = Vec::new();
    for conversation in list["conversations"].as_array().unwrap() {
        let (_, loaded) = app.get(&format!("/api/conversations/{}", conversation["id"].as_str().unwrap()), user).await;
        messages.extend(loaded["messages"].as_array().unwrap().iter().cloned());
    }
    messages
}

both_backends! {
    async fn twenty_identical_requests_at_once_are_one_run_and_twenty_identical_streams(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let body = json!({"message": "Once only [mock:words=40] [mock:delay=2]"});
        let answers =
            join_all((0..20).map(|_| keyed(&app, "ann", "/api/chat/stream", "key-twenty", &body))).await;
        let first = data_lines(&answers[0].1);
        assert_eq!(first.last().unwrap()["type"], "done");
        assert_eq!(first.iter().filter(|e| e["type"] == "complete").count(), 1);
        for (status, text) in &answers {
            assert_eq!(*status, StatusCode::OK);
            assert_eq!(data_lines(text), first, "every stream is the same run's, from its first event");
        }
        // One run: one conversation, one question, one answer.
        let (_, list) = app.get("/api/conversations", "ann").await;
        assert_eq!(list["conversations"].as_array().unwrap().len(), 1);
        assert_eq!(traces_of(&app, "ann").await.len(), 2);
    }

    async fn a_retry_after_the_end_replays_the_run_and_another_body_is_refused(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let body = json!({"message": "Retry me [mock:words=5]"});
        let (_, first) = keyed(&app, "ann", "/api/chat/stream", "key-1", &body).await;
        let (status, again) = keyed(&app, "ann", "/api/chat/stream", "key-1", &body).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(data_lines(&again), data_lines(&first), "the whole run again, from its log");
        assert_eq!(traces_of(&app, "ann").await.len(), 2, "no second run");

        let other = json!({"message": "Something else"});
        let (status, error) = keyed(&app, "ann", "/api/chat/stream", "key-1", &other).await;
        let error: Value = serde_json::from_str(&error).unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
        assert_eq!((error["code"].as_str(), error["field"].as_str()), (Some("VALIDATION_ERROR"), Some("Idempotency-Key")));
        // The same body on another endpoint is another request too.
        let (status, _) = keyed(&app, "ann", "/api/get_chat_response_stream", "key-1", &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        // Another user's key is theirs alone.
        let (status, bobs) = keyed(&app, "bob", "/api/chat/stream", "key-1", &body).await;
        assert_eq!(status, StatusCode::OK);
        assert_ne!(data_lines(&bobs)[0]["trace_id"], data_lines(&first)[0]["trace_id"]);
        // A bad key is refused before anything is stored.
        let (status, _) = keyed(&app, "ann", "/api/chat/stream", "has space", &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(traces_of(&app, "ann").await.len(), 2);
    }

    async fn a_key_names_its_run_for_a_day_only(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let body = json!({"message": "Yesterday [mock:words=3]"});
        let (_, first) = keyed(&app, "ann", "/api/chat/stream", "old-key", &body).await;
        // A day and a minute later.
        age_keys(&app.db_url, backend).await;
        let (_, second) = keyed(&app, "ann", "/api/chat/stream", "old-key", &body).await;
        assert_ne!(data_lines(&second)[0]["trace_id"], data_lines(&first)[0]["trace_id"], "a new run");
    }

    async fn the_ai_sdk_and_ab_endpoints_repeat_their_runs_too(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let ui = json!({"id": "chat-k", "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": "hi [mock:words=4]"}]}]});
        let answers = join_all((0..3).map(|_| keyed(&app, "ann", "/api/ui/chat", "ui-key", &ui))).await;
        for (status, text) in &answers {
            assert_eq!(*status, StatusCode::OK);
            assert_eq!(data_lines(text), data_lines(&answers[0].1));
        }
        assert_eq!(data_lines(&answers[0].1)[0]["type"], "start");
        let ab = json!({"message": "compare [mock:words=3]", "profile_a": "default", "profile_b": "other"});
        let (_, first) = keyed(&app, "ann", "/api/ab/stream", "ab-key", &ab).await;
        let (_, again) = keyed(&app, "ann", "/api/ab/stream", "ab-key", &ab).await;
        let comparison = |text: &str| data_lines(text).into_iter().find(|e| e["type"] == "comparison").unwrap()["comparison_id"].clone();
        assert_eq!(comparison(&again), comparison(&first));
        let complete = |text: &str| data_lines(text).into_iter().filter(|e| e["type"] == "complete").count();
        assert_eq!((complete(&first), complete(&again)), (2, 2));
    }
}

/// Makes every idempotency key of the database a day and a minute old.
async fn age_keys(url: &str, backend: Backend) {
    let old = chrono::Utc::now() - chrono::Duration::minutes(24 * 60 + 1);
    match backend {
        Backend::Sqlite => {
            let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(url).await.unwrap();
            sqlx::query("update idempotency_keys set created_at = $1").bind(old).execute(&mut conn).await.unwrap();
        }
        Backend::Postgres => {
            let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(url).await.unwrap();
            sqlx::query("update idempotency_keys set created_at = $1").bind(old).execute(&mut conn).await.unwrap();
        }
    }
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn one_key_sent_to_two_replicas_at_once_is_one_run() {
    let db = TestDb::new(Backend::Postgres).await;
    let a = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    let b = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    for round in 0..5 {
        let key = format!("replicas-{round}");
        let body = json!({"message": format!("Two doors {round} [mock:words=20] [mock:delay=2]")});
        let (on_a, on_b) = tokio::join!(
            keyed(&a, "ann", "/api/chat/stream", &key, &body),
            keyed(&b, "ann", "/api/chat/stream", &key, &body)
        );
        assert_eq!((on_a.0, on_b.0), (StatusCode::OK, StatusCode::OK));
        let (frames_a, frames_b) = (data_lines(&on_a.1), data_lines(&on_b.1));
        assert_eq!(frames_a[0]["trace_id"], frames_b[0]["trace_id"], "round {round}: one run");
        assert_eq!(frames_a, frames_b, "round {round}: the same stream on both replicas");
    }
    let (_, list) = a.get("/api/conversations", "ann").await;
    assert_eq!(list["conversations"].as_array().unwrap().len(), 5, "five runs for five keys");
}
