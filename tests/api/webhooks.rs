//! Webhooks (CONTRACT.md §18): every delivery is received by a server that verifies it with
//! the Standard Webhooks specification's own Python library (tests/fixtures/
//! webhook_receiver.py); the outbox is read back through `GET /api/webhooks/deliveries`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;

/// A Standard Webhooks secret (`whsec_` + base64 of 24 bytes).
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

fn python() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/report/venv");
    assert!(
        root.join(".chatd-installed").exists(),
        "the webhook receiver's library is not installed: run scripts/report-peers.sh"
    );
    root.join("bin/python")
}

/// The receiver, a process of its own, verifying with `standardwebhooks`.
pub struct Receiver {
    child: Child,
    pub port: u16,
    client: reqwest::Client,
}

impl Receiver {
    pub async fn start(port: u16) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/webhook_receiver.py");
        let child = Command::new(python())
            .arg(script)
            .arg(port.to_string())
            .arg(SECRET)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the webhook receiver starts");
        let receiver = Self { child, port, client: reqwest::Client::new() };
        let deadline = Instant::now() + Duration::from_secs(20);
        while receiver.client.get(receiver.url("/attempts")).send().await.is_err() {
            assert!(Instant::now() < deadline, "the webhook receiver did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        receiver
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// How the next `times` requests are answered (`ok`, `fail`, `close`, `slow`, `gone`).
    pub async fn behave(&self, behaviour: Value) {
        let response = self.client.post(self.url("/behaviour")).json(&behaviour).send().await.unwrap();
        assert_eq!(response.status(), 204);
    }

    pub async fn attempts(&self) -> Vec<Value> {
        self.client.get(self.url("/attempts")).send().await.unwrap().json().await.unwrap()
    }

    /// Waits (bounded) until `n` messages were answered `ok` or `slow`, and returns every
    /// attempt.
    pub async fn until_accepted(&self, n: usize, within: Duration) -> Vec<Value> {
        let deadline = Instant::now() + within;
        loop {
            let attempts = self.attempts().await;
            if accepted(&attempts).len() >= n {
                return attempts;
            }
            assert!(Instant::now() < deadline, "{} of {n} accepted: {attempts:#?}", accepted(&attempts).len());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn accepted(attempts: &[Value]) -> Vec<&Value> {
    attempts.iter().filter(|a| a["answered"] == "ok").collect()
}

/// Config for one endpoint `hooks` at `url` taking `events`, its secret in a file.
pub fn endpoint(url: &str, events: &[&str], extra: &str) -> String {
    named_endpoint("hooks", url, events, extra)
}

/// The same, for the endpoint `id`.
pub fn named_endpoint(id: &str, url: &str, events: &[&str], extra: &str) -> String {
    let dir = tempfile::tempdir().unwrap().keep();
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    format!(
        "[auth]\nadmins = [\"root\"]\n[webhooks]\n{extra}\n[webhooks.{id}]\nurl = \"{url}\"\nevents = {events:?}\nsecret_file = \"{}\"\n",
        secret.display()
    )
}

async fn deliveries(app: &TestApp, query: &str) -> Vec<Value> {
    let (status, body) = app.get(&format!("/api/webhooks/deliveries{query}"), "root").await;
    assert_eq!(status, 200, "{body}");
    body["deliveries"].as_array().unwrap().clone()
}

both_backends! {
    /// A receiver that fails its first three answers: the message is tried again with the
    /// same webhook-id, every attempt verifies, and it is accepted exactly once.
    async fn a_delivery_is_signed_and_tried_again_until_accepted(backend: Backend) {
        let receiver = Receiver::start(free_port()).await;
        receiver.behave(json!({"mode": "fail", "times": 3})).await;
        // An endpoint id of this test's own: the metrics are the process's.
        let id = format!("signed_{backend:?}");
        let config = named_endpoint(&id, &receiver.url("/hooks"), &["run.completed"], "retry_base_secs = 0.2");
        let app = TestApp::spawn(backend, &config).await;
        let frames = app.chat("ann", json!({"message": "Report me"})).await;
        let trace_id = frames[0].data["trace_id"].as_str().unwrap().to_owned();
        let attempts = receiver.until_accepted(1, Duration::from_secs(30)).await;
        assert_eq!(attempts.len(), 4, "three failures, then the one accepted: {attempts:#?}");
        assert!(attempts.iter().all(|a| a["verified"] == true), "every attempt verifies: {attempts:#?}");
        let ids: std::collections::BTreeSet<&str> = attempts.iter().map(|a| a["webhook_id"].as_str().unwrap()).collect();
        assert_eq!(ids.len(), 1, "the same webhook-id on every attempt");
        let body = &accepted(&attempts)[0]["body"];
        assert_eq!(body["type"], "run.completed");
        assert_eq!(body["data"]["trace_id"], trace_id.as_str());
        assert_eq!(body["data"]["user_id"], "ann");
        assert_eq!(body["data"]["status"], "completed");
        assert_eq!(body["data"]["model"], "mock-1");
        assert!(body["data"]["usage"]["output_tokens"].as_u64().unwrap() > 0);
        assert!(body["timestamp"].as_str().unwrap().ends_with('Z'));

        // The outbox says so too, to admins only.
        let delivery = all_delivered(&app).await[0].clone();
        assert_eq!(delivery["id"], *ids.iter().next().unwrap());
        assert_eq!((delivery["type"].as_str(), delivery["attempts"].as_u64()), (Some("run.completed"), Some(4)));
        assert_eq!(delivery["last_status"], 204);
        assert!(delivery["delivered_at"].is_string() && delivery["next_attempt_at"].is_null());
        let (status, _) = app.get("/api/webhooks/deliveries", "ann").await;
        assert_eq!(status, 404, "not an admin");
        assert_eq!(deliveries(&app, "?status=failed").await.len(), 0);
        let (status, body) = app.get("/api/webhooks/deliveries?status=lost", "root").await;
        assert_eq!((status.as_u16(), body["field"].as_str()), (400, Some("status")));
        let metrics = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
        let counted = |outcome: &str| format!("chatd_webhook_deliveries_total{{endpoint=\"{id}\",outcome=\"{outcome}\"}}");
        assert!(metrics.contains(&format!("{} 1\n", counted("delivered"))), "{metrics}");
        assert!(metrics.contains(&format!("{} 3\n", counted("retry"))), "{metrics}");
        assert!(metrics.contains("chatd_webhook_outbox_depth"), "{metrics}");
    }

    /// Each event reported, in its own shape: a run that fails, one that is cancelled, one
    /// that waits for an approval, a vote and feedback; an event no endpoint takes is not
    /// written at all.
    async fn each_event_is_reported(backend: Backend) {
        let receiver = Receiver::start(free_port()).await;
        let events = ["run.failed", "run.cancelled", "run.waiting", "comparison.voted", "feedback.created"];
        let config = endpoint(&receiver.url("/hooks"), &events, "retry_base_secs = 0.2")
            + "[tools]\nrequire_approval = [\"calculator\"]\n[providers.mock]\nmax_retries = 0\n";
        let app = TestApp::spawn(backend, &config).await;
        // Not taken: no message.
        let answered = app.chat("ann", json!({"message": "Fine"})).await;
        let message_id = answered.last().unwrap().data["message_id"].as_str().unwrap().to_owned();
        app.chat("ann", json!({"message": "Fail [mock:error=unavailable]"})).await;
        let waiting = app
            .client
            .post(app.url("/api/chat/stream"))
            .header("x-client-id", "ann")
            .json(&json!({"message": r#"Add [mock:tool=calculator {"expression": "1 + 2"}]"#}))
            .send()
            .await
            .unwrap();
        let mut waiting = crate::runs::Live::open(waiting).await;
        let waiting_trace = waiting.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        waiting.until("tool_approval_request").await;
        let (status, _) = app
            .call(Method::PUT, &format!("/api/messages/{message_id}/feedback"), "ann", Some(json!({"rating": "down", "comment": "wrong"})))
            .await;
        assert_eq!(status, 200);
        let (status, _) =
            app.call(Method::PUT, &format!("/api/messages/{message_id}/feedback"), "ann", Some(json!({"rating": null}))).await;
        assert_eq!(status, 200, "cleared: not reported");
        let ab = app
            .client
            .post(app.url("/api/ab/stream"))
            .header("x-client-id", "ann")
            .json(&json!({"message": "Compare", "profile_a": "default", "profile_b": "other"}))
            .send()
            .await
            .unwrap();
        let frames = read_frames(ab).await;
        let comparison_id = frames[0].data["comparison_id"].as_str().unwrap().to_owned();
        let (status, _) = app.post(&format!("/api/ab/{comparison_id}/vote"), "ann", json!({"preference": "b"})).await;
        assert_eq!(status, 200);
        let attempts = receiver.until_accepted(4, Duration::from_secs(30)).await;
        let bodies: Vec<&Value> = accepted(&attempts).iter().map(|a| &a["body"]).collect();
        let of = |kind: &str| bodies.iter().find(|b| b["type"] == kind).copied().unwrap_or_else(|| panic!("no {kind}: {bodies:#?}"));
        assert_eq!(bodies.len(), 4, "failed, waiting, feedback, vote; nothing for the completed runs: {bodies:#?}");
        assert_eq!(of("run.failed")["data"]["error"]["code"], "SERVICE_UNAVAILABLE");
        assert_eq!(of("run.failed")["data"]["status"], "error");
        assert_eq!(of("run.waiting")["data"]["waiting_for"], json!(["approval"]));
        assert_eq!(of("feedback.created")["data"]["feedback"]["rating"], "down");
        assert_eq!(of("feedback.created")["data"]["message_id"], message_id.as_str());
        let vote = &of("comparison.voted")["data"];
        assert_eq!((vote["preference"].as_str(), vote["model_b"].as_str()), (Some("b"), Some("mock-2")));
        assert_eq!(vote["comparison_id"], comparison_id.as_str());
        assert!(attempts.iter().all(|a| a["verified"] == true));
        assert_eq!(deliveries(&app, "").await.len(), 4, "written only for what an endpoint takes");
        let (status, _) = app.post("/api/cancel_stream", "ann", json!({"trace_id": waiting_trace})).await;
        assert_eq!(status, 200);
        let attempts = receiver.until_accepted(5, Duration::from_secs(30)).await;
        let cancelled = accepted(&attempts).into_iter().find(|a| a["body"]["type"] == "run.cancelled").expect("run.cancelled");
        assert_eq!(cancelled["body"]["data"]["trace_id"], waiting_trace.as_str());
        assert_eq!(cancelled["body"]["data"]["status"], "cancelled");
    }
}

/// A receiver that closes the connection, one that answers too slowly, and one that
/// answers 500: each message is tried again and accepted once.
#[tokio::test]
async fn a_closed_connection_a_timeout_and_a_500_are_each_tried_again() {
    let receiver = Receiver::start(free_port()).await;
    let config = endpoint(&receiver.url("/hooks"), &["run.completed"], "retry_base_secs = 0.2\ntimeout_secs = 1");
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    for (n, behaviour) in [
        json!({"mode": "close", "times": 1}),
        json!({"mode": "slow", "secs": 3, "times": 1}),
        json!({"mode": "fail", "times": 1}),
    ]
    .into_iter()
    .enumerate()
    {
        receiver.behave(behaviour.clone()).await;
        app.chat("ann", json!({"message": format!("Run {n}")})).await;
        receiver.until_accepted(n + 1, Duration::from_secs(30)).await;
        let list = all_delivered(&app).await;
        let newest = &list[0];
        assert_eq!(newest["attempts"], 2, "{behaviour}: {newest}");
    }
    let list = deliveries(&app, "").await;
    let errors: Vec<&str> = list.iter().map(|d| d["last_error"].as_str().unwrap_or("")).collect();
    assert!(list.iter().all(|d| d["status"] == "delivered"), "{list:#?}");
    // The error of the failed attempt is kept until the message is delivered; then the
    // last attempt (a success) has none.
    assert!(errors.iter().all(|e| e.is_empty()), "{errors:?}");
}

/// Past `webhooks.max_attempts` a message is `failed`, with the last error; a 410 disables
/// the endpoint (its later messages are not sent) until its configuration changes.
#[tokio::test]
async fn failed_after_max_attempts_and_disabled_by_410_until_the_config_changes() {
    let receiver = Receiver::start(free_port()).await;
    let db = TestDb::new(Backend::Sqlite).await;
    receiver.behave(json!({"mode": "fail"})).await;
    let extra = "retry_base_secs = 0.1\nmax_attempts = 3";
    let app = TestApp::on(&db.url, &endpoint(&receiver.url("/hooks"), &["run.completed"], extra)).await;
    app.chat("ann", json!({"message": "Never taken"})).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let failed = loop {
        let list = deliveries(&app, "?status=failed").await;
        if let Some(failed) = list.first() {
            break failed.clone();
        }
        assert!(Instant::now() < deadline, "{:#?}", deliveries(&app, "").await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(failed["attempts"], 3);
    assert_eq!(failed["last_status"], 500);
    assert!(failed["last_error"].as_str().unwrap().contains("attempt 3 of 3: HTTP 500"), "{failed}");
    assert_eq!(receiver.attempts().await.len(), 3);

    receiver.behave(json!({"mode": "gone"})).await;
    app.chat("ann", json!({"message": "Gone"})).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while deliveries(&app, "?status=disabled").await.is_empty() {
        assert!(Instant::now() < deadline, "{:#?}", deliveries(&app, "").await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    receiver.behave(json!({"mode": "ok"})).await;
    app.chat("ann", json!({"message": "Not sent: the endpoint is disabled"})).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(receiver.attempts().await.len(), 4, "nothing sent after the 410");
    assert_eq!(deliveries(&app, "?status=disabled").await.len(), 2);
    app.stop.graceful().await;
    drop(app);

    // The same configuration: still disabled. Another URL: enabled again.
    let again = TestApp::on(&db.url, &endpoint(&receiver.url("/hooks"), &["run.completed"], extra)).await;
    again.chat("ann", json!({"message": "Still disabled"})).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(receiver.attempts().await.len(), 4);
    again.stop.graceful().await;
    drop(again);
    let changed = TestApp::on(&db.url, &endpoint(&receiver.url("/hooks/v2"), &["run.completed"], extra)).await;
    changed.chat("ann", json!({"message": "Enabled again"})).await;
    receiver.until_accepted(1, Duration::from_secs(20)).await;
}

/// A receiver down for a minute gets the message once it is back: the waits double.
#[tokio::test]
async fn a_receiver_down_for_a_minute_gets_the_message_after() {
    let port = free_port();
    let config = endpoint(&format!("http://127.0.0.1:{port}/hooks"), &["run.completed"], "retry_base_secs = 2");
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let started = Instant::now();
    app.chat("ann", json!({"message": "While it is down"})).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    let list = deliveries(&app, "").await;
    assert_eq!(list[0]["status"], "pending", "{list:#?}");
    let tried = list[0]["attempts"].as_u64().unwrap();
    assert!((3..=6).contains(&tried), "waits of about 2, 4, 8, 16, 32 s: {tried} attempts in a minute");
    assert!(list[0]["last_error"].as_str().unwrap().contains("could not connect"), "{list:#?}");
    let receiver = Receiver::start(port).await;
    let attempts = receiver.until_accepted(1, Duration::from_secs(90)).await;
    assert_eq!(attempts.len(), 1, "its first answer accepts it");
    eprintln!("delivered {:.0} s after the run, after {} attempts", started.elapsed().as_secs_f64(), tried + 1);
}

/// Messages not delivered when chatd stops are delivered by the next process.
#[tokio::test]
async fn undelivered_messages_are_delivered_after_a_restart() {
    let port = free_port();
    let db = TestDb::new(Backend::Sqlite).await;
    let config = endpoint(&format!("http://127.0.0.1:{port}/hooks"), &["run.completed"], "retry_base_secs = 0.5");
    let app = TestApp::on(&db.url, &config).await;
    for n in 0..3 {
        app.chat("ann", json!({"message": format!("Before the restart {n}")})).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while deliveries(&app, "").await.iter().any(|d| d["attempts"] == 0) {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    app.stop.graceful().await;
    drop(app);
    let receiver = Receiver::start(port).await;
    let again = TestApp::on(&db.url, &config).await;
    let attempts = receiver.until_accepted(3, Duration::from_secs(30)).await;
    let ids: std::collections::BTreeSet<&str> = attempts.iter().map(|a| a["webhook_id"].as_str().unwrap()).collect();
    assert_eq!((attempts.len(), ids.len()), (3, 3), "each once: {attempts:#?}");
    all_delivered(&again).await;
}

/// The outbox's deliveries once every one is `delivered`, within 10 s: each is marked so a
/// moment after its receiver has answered (and the receiver records the attempt before).
async fn all_delivered(app: &TestApp) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let list = deliveries(app, "").await;
        if list.iter().all(|d| d["status"] == "delivered") {
            return list;
        }
        assert!(Instant::now() < deadline, "{list:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two replicas on one Postgres database, each delivering: every message is delivered
/// once, whichever replica's run wrote it.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn two_replicas_deliver_each_message_once() {
    let receiver = Receiver::start(free_port()).await;
    let db = TestDb::new(Backend::Postgres).await;
    let config = endpoint(&receiver.url("/hooks"), &["run.completed"], "retry_base_secs = 0.2");
    let (a, b) = (TestApp::on(&db.url, &config).await, TestApp::on(&db.url, &config).await);
    let users: Vec<String> = (0..20).map(|n| format!("user{n}")).collect();
    let runs = users.iter().enumerate().map(|(n, user)| {
        let app = if n % 2 == 0 { &a } else { &b };
        app.chat(user, json!({"message": format!("Run {n}")}))
    });
    futures_util::future::join_all(runs).await;
    let attempts = receiver.until_accepted(20, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let attempts_after = receiver.attempts().await;
    let ids: std::collections::BTreeSet<&str> =
        attempts_after.iter().map(|a| a["webhook_id"].as_str().unwrap()).collect();
    assert_eq!((attempts_after.len(), ids.len()), (20, 20), "each message once: {attempts:#?}");
}

/// `secret_env` names the variable of the secret: one that is not set stops the start,
/// naming it (`chatd check-config`, a process of its own).
#[test]
fn a_secret_variable_that_is_not_set_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("chatd.toml");
    std::fs::write(
        &config,
        "[webhooks.billing]\nurl = \"http://127.0.0.1:9/\"\nevents = [\"run.completed\"]\nsecret_env = \"CHATD_TEST_WEBHOOK_SECRET\"\n",
    )
    .unwrap();
    let check = |secret: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_chatd"));
        command.arg("--config").arg(&config).arg("check-config").env_remove("CHATD_TEST_WEBHOOK_SECRET");
        if let Some(secret) = secret {
            command.env("CHATD_TEST_WEBHOOK_SECRET", secret);
        }
        command.output().unwrap()
    };
    let missing = check(None);
    assert!(!missing.status.success());
    let said = String::from_utf8_lossy(&missing.stderr);
    assert!(said.contains("webhooks.billing.secret_env names CHATD_TEST_WEBHOOK_SECRET, which is not set"), "{said}");
    let bad = check(Some("whsec_not base64!"));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("is not whsec_<base64>"), "{bad:?}");
    let set = check(Some(SECRET));
    assert!(set.status.success(), "{set:?}");
    assert!(!String::from_utf8_lossy(&set.stdout).contains("MfKQ9r8"), "the secret is never printed");
}
