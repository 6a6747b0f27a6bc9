//! Databases written by the release before the renovation of issue 20 (SQLite and Postgres,
//! made by `tests/fixtures/compat/make.py` with that release's binary) open with this code
//! and answer every request that release answered about them, exactly as it did:
//! conversations, messages, branches and feedback, traces, comparisons and votes, the legacy
//! endpoints, and resumes of every run (whole, from its middle, and 204 once `done` was seen).

use std::path::Path;

use reqwest::StatusCode;
use serde::Deserialize;
use serde_json::Value;

use crate::helpers::*;

/// One request the release answered, and its answer.
#[derive(Deserialize)]
struct Check {
    path: String,
    status: u16,
    /// A JSON answer.
    body: Option<Value>,
    /// An SSE answer: each frame's id and event.
    frames: Option<Vec<(String, Value)>>,
}

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/compat").join(name)
}

async fn answers_as_the_release_did(app: &TestApp, checks: &str) {
    let checks: Vec<Check> = serde_json::from_str(&std::fs::read_to_string(fixture(checks)).unwrap()).unwrap();
    assert!(checks.len() > 30, "the fixture reads back every kind of record");
    for check in checks {
        let response = app.client.get(app.url(&check.path)).header("x-client-id", "ann").send().await.unwrap();
        assert_eq!(response.status(), StatusCode::from_u16(check.status).unwrap(), "{}", check.path);
        if let Some(frames) = check.frames {
            let got: Vec<(String, Value)> =
                read_frames(response).await.into_iter().map(|f| (f.id.to_string(), f.data)).collect();
            assert_eq!(got, frames, "{}", check.path);
        } else {
            let text = response.text().await.unwrap();
            let mut got = if text.is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap() };
            // Fields added since, empty here, are not answers that changed.
            if got.get("active_runs").is_some_and(|runs| runs == &Value::Array(Vec::new())) {
                got.as_object_mut().unwrap().remove("active_runs");
            }
            assert_eq!(got, check.body.unwrap_or(Value::Null), "{}", check.path);
        }
    }
}

#[tokio::test]
async fn a_sqlite_file_of_the_release_before_opens_and_answers_as_it_did() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chatd.db");
    std::fs::copy(fixture("sqlite.db"), &file).unwrap();
    let app = TestApp::on(&format!("sqlite://{}", file.display()), "").await;
    answers_as_the_release_did(&app, "sqlite.json").await;
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_postgres_database_of_the_release_before_opens_and_answers_as_it_did() {
    let db = TestDb::new(Backend::Postgres).await;
    let dump = std::fs::read_to_string(fixture("postgres.sql")).unwrap();
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url).await.unwrap();
    sqlx::raw_sql(&dump).execute(&mut conn).await.unwrap();
    drop(conn);
    let app = TestApp::on(&db.url, "").await;
    answers_as_the_release_did(&app, "postgres.json").await;
}
