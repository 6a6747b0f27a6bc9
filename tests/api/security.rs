//! Auth in all three modes (another user's ids answer 404 on every route), JWT validation,
//! limits and rate limiting, CORS, metrics, and a grep for the API key in everything a full
//! run says or logs.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::{Method, RequestBuilder, StatusCode};
use serde_json::{Value, json};

use crate::fixture::*;
use crate::helpers::*;

const SECRET: &str = "hs256-test-secret-not-for-production";

fn fixtures(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name).display().to_string()
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

fn hs256(claims: Value, secret: &str) -> String {
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(secret.as_bytes())).unwrap()
}

fn rs256(claims: Value) -> String {
    let pem = std::fs::read(fixtures("jwt-test-private.pem")).unwrap();
    jsonwebtoken::encode(&Header::new(Algorithm::RS256), &claims, &EncodingKey::from_rsa_pem(&pem).unwrap()).unwrap()
}

/// How a test authenticates as a user in one auth mode.
#[derive(Clone, Copy)]
enum Mode {
    None,
    Token,
    Jwt,
}

impl Mode {
    fn config(self) -> String {
        match self {
            Mode::None => String::new(),
            Mode::Token => {
                "[auth]\nmode = \"token\"\n[auth.tokens]\n\"tok-ann\" = \"ann\"\n\"tok-bob\" = \"bob\"\n".to_owned()
            }
            Mode::Jwt => format!(
                "[auth]\nmode = \"jwt\"\n[auth.jwt]\npublic_key_file = \"{}\"\n",
                fixtures("jwt-test-public.pem")
            ),
        }
    }

    fn auth(self, request: RequestBuilder, user: &str) -> RequestBuilder {
        match self {
            Mode::None => request.header("x-client-id", user),
            Mode::Token => request.bearer_auth(format!("tok-{user}")),
            Mode::Jwt => request.bearer_auth(rs256(json!({"sub": user, "exp": now() + 600}))),
        }
    }
}

async fn send(
    app: &TestApp,
    mode: Mode,
    user: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, String) {
    let mut request = mode.auth(app.client.request(method, app.url(path)), user);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    (response.status(), response.text().await.unwrap())
}

async fn every_route_hides_other_users_data(mode: Mode) {
    let app = TestApp::spawn(Backend::Sqlite, &mode.config()).await;
    let chat = mode
        .auth(app.client.post(app.url("/api/chat/stream")), "ann")
        .json(&json!({"message": "mine"}))
        .send()
        .await
        .unwrap();
    let frames = read_frames(chat).await;
    let start = &frames[0].data;
    let (conversation, message, trace) = (
        start["conversation_id"].as_str().unwrap(),
        start["message_id"].as_str().unwrap(),
        start["trace_id"].as_str().unwrap(),
    );
    let ab = mode
        .auth(app.client.post(app.url("/api/ab/stream")), "ann")
        .json(&json!({"message": "ab", "profile_a": "default", "profile_b": "other", "conversation_id": conversation}))
        .send()
        .await
        .unwrap();
    let comparison = read_frames(ab).await[0].data["comparison_id"].as_str().unwrap().to_owned();

    let routes: Vec<(Method, String, Option<Value>)> = vec![
        (Method::GET, format!("/api/conversations/{conversation}"), None),
        (Method::PATCH, format!("/api/conversations/{conversation}"), Some(json!({"title": "taken"}))),
        (Method::DELETE, format!("/api/conversations/{conversation}"), None),
        (Method::PUT, format!("/api/messages/{message}/feedback"), Some(json!({"rating": "down"}))),
        (Method::GET, format!("/api/messages/{message}/siblings"), None),
        (Method::POST, format!("/api/messages/{message}/activate"), Some(json!({}))),
        (Method::GET, format!("/api/trace/{trace}"), None),
        (Method::GET, format!("/api/trace/by_message/{message}"), None),
        (Method::GET, format!("/api/chat/stream/{trace}"), None),
        (Method::POST, "/api/cancel_stream".to_owned(), Some(json!({"trace_id": trace}))),
        (Method::POST, "/api/cancel_stream".to_owned(), Some(json!({"comparison_id": comparison}))),
        (Method::POST, "/api/chat/stream".to_owned(), Some(json!({"message": "x", "conversation_id": conversation}))),
        (
            Method::POST,
            "/api/get_chat_response_stream".to_owned(),
            Some(json!({"message": "x", "conversation_id": conversation})),
        ),
        (Method::GET, format!("/api/load_conversation?conversation_id={conversation}"), None),
        (Method::GET, format!("/api/ab/{comparison}"), None),
        (Method::POST, format!("/api/ab/{comparison}/vote"), Some(json!({"preference": "a"}))),
        (Method::PUT, format!("/api/ab/{comparison}/vote"), Some(json!({"preference": "b"}))),
    ];
    for (method, path, body) in &routes {
        let (status, text) = send(&app, mode, "bob", method.clone(), path, body.clone()).await;
        assert_eq!(status, 404, "{method} {path}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["code"], "NOT_FOUND");
    }
    let (_, listed) = send(&app, mode, "bob", Method::GET, "/api/conversations", None).await;
    assert_eq!(serde_json::from_str::<Value>(&listed).unwrap()["conversations"], json!([]));
    // The owner still has everything, untouched.
    let (status, text) =
        send(&app, mode, "ann", Method::GET, &format!("/api/conversations/{conversation}"), None).await;
    assert_eq!(status, 200);
    let loaded: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(loaded["title"], "mine");
    assert_eq!(loaded["messages"][1]["feedback"], Value::Null);
}

#[tokio::test]
async fn every_route_hides_other_users_data_in_mode_none() {
    every_route_hides_other_users_data(Mode::None).await;
}

#[tokio::test]
async fn every_route_hides_other_users_data_in_mode_token() {
    every_route_hides_other_users_data(Mode::Token).await;
}

#[tokio::test]
async fn every_route_hides_other_users_data_in_mode_jwt() {
    every_route_hides_other_users_data(Mode::Jwt).await;
}

#[tokio::test]
async fn jwts_are_checked_for_signature_expiry_audience_and_issuer() {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, SECRET).unwrap();
    let config = format!(
        "[auth]\nmode = \"jwt\"\n[auth.jwt]\nsecret_file = \"{}\"\naudience = \"chatd\"\nissuer = \"https://id.example\"\n",
        secret_file.display()
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let claims = |extra: Value| {
        let mut claims = json!({"sub": "carol", "exp": now() + 600, "aud": "chatd", "iss": "https://id.example"});
        for (k, v) in extra.as_object().unwrap() {
            claims[k] = v.clone();
        }
        claims
    };
    let status = |token: Option<String>| {
        let app = &app;
        async move {
            let mut request = app.client.get(app.url("/api/conversations"));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.unwrap();
            let status = response.status();
            let body: Value = response.json().await.unwrap();
            if status == 401 {
                assert_eq!(body["code"], "UNAUTHORIZED");
            }
            status.as_u16()
        }
    };
    assert_eq!(status(Some(hs256(claims(json!({})), SECRET))).await, 200);
    assert_eq!(status(None).await, 401, "missing");
    assert_eq!(status(Some("not.a.jwt".into())).await, 401, "garbage");
    assert_eq!(status(Some(hs256(claims(json!({})), "another-secret"))).await, 401, "forged");
    assert_eq!(status(Some(hs256(claims(json!({"exp": now() - 3600})), SECRET))).await, 401, "expired");
    assert_eq!(
        status(Some(hs256(json!({"sub": "carol", "aud": "chatd", "iss": "https://id.example"}), SECRET))).await,
        401,
        "no exp"
    );
    assert_eq!(status(Some(hs256(claims(json!({"aud": "other"})), SECRET))).await, 401, "audience");
    assert_eq!(status(Some(hs256(claims(json!({"iss": "https://evil.example"})), SECRET))).await, 401, "issuer");
    assert_eq!(status(Some(rs256(claims(json!({}))))).await, 401, "another algorithm");
    let without = |claim: &str| {
        let mut claims = claims(json!({}));
        claims.as_object_mut().unwrap().remove(claim);
        hs256(claims, SECRET)
    };
    assert_eq!(status(Some(without("aud"))).await, 401, "no aud while one is configured");
    assert_eq!(status(Some(without("iss"))).await, 401, "no iss while one is configured");
    assert_eq!(status(Some(hs256(claims(json!({"nbf": now() + 3600})), SECRET))).await, 401, "not yet valid");
    assert_eq!(status(Some(hs256(claims(json!({"nbf": now() - 10})), SECRET))).await, 200, "valid since");
    for sub in ["ca\0rol".to_owned(), "tab\there".to_owned(), "x".repeat(201)] {
        assert_eq!(status(Some(hs256(claims(json!({"sub": sub})), SECRET))).await, 401, "sub {sub:?}");
    }
}

#[tokio::test]
async fn concurrent_runs_and_request_rates_are_limited_per_user() {
    let app = TestApp::spawn(Backend::Sqlite, "[limits]\nmax_concurrent_runs_per_user = 1\n").await;
    let slow = app
        .client
        .post(app.url("/api/chat/stream"))
        .header("x-client-id", "ann")
        .json(&json!({"message": "[mock:words=50] [mock:delay=20]"}))
        .send()
        .await
        .unwrap();
    let response = app
        .client
        .post(app.url("/api/chat/stream"))
        .header("x-client-id", "ann")
        .json(&json!({"message": "another"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert!(response.headers().get("retry-after").is_some());
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["code"], "RATE_LIMITED");
    assert_eq!(app.chat("bob", json!({"message": "others are not affected"})).await.last().unwrap().kind(), "done");
    read_frames(slow).await;

    let app = TestApp::spawn(Backend::Sqlite, "[limits]\nrequests_per_minute = 3\n").await;
    for _ in 0..3 {
        assert_eq!(app.get("/api/conversations", "ann").await.0, 200);
    }
    let response = app.client.get(app.url("/api/conversations")).header("x-client-id", "ann").send().await.unwrap();
    assert_eq!(response.status(), 429);
    let wait: u64 = response.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&wait), "{wait}");
    assert_eq!(app.get("/api/conversations", "bob").await.0, 200, "per user");
}

#[tokio::test]
async fn cors_answers_configured_origins() {
    let app = TestApp::spawn(Backend::Sqlite, "[server]\ncors_origins = [\"http://localhost:5173\"]\n").await;
    let preflight = app
        .client
        .request(Method::OPTIONS, app.url("/api/chat/stream"))
        .header("origin", "http://localhost:5173")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "content-type,last-event-id")
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.headers()["access-control-allow-origin"], "http://localhost:5173");
    let other = app.client.get(app.url("/healthz")).header("origin", "http://evil.example").send().await.unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none());
}

#[tokio::test]
async fn metrics_change_after_a_run() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let value = |text: &str, series: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let (before, _) = (app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap(), ());
    app.chat("ann", json!({"message": "count me [mock:tool=calculator {\"expression\": \"1+1\"}]"})).await;
    // The run's last events are flushed to the log after `done` goes out, so that series may
    // grow a moment after the stream ends.
    let flushes = "chatd_event_log_flush_seconds_count";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let after = loop {
        let after = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
        if value(&after, flushes) > value(&before, flushes) || std::time::Instant::now() > deadline {
            break after;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    for series in [
        "chatd_runs_total{status=\"completed\"}",
        "chatd_tool_calls_total{tool=\"calculator\",status=\"success\"}",
        "chatd_tokens_total{model=\"mock-1\",direction=\"output\"}",
        "chatd_time_to_first_token_seconds_count{model=\"mock-1\"}",
        flushes,
    ] {
        assert!(value(&after, series) > value(&before, series), "{series} did not grow:\n{after}");
    }
    assert!(
        after.contains("chatd_http_requests_total{method=\"POST\",route=\"/api/chat/stream\",status=\"200\"}"),
        "{after}"
    );
}

#[tokio::test]
async fn the_api_key_never_leaves_chatd() {
    const KEY: &str = "sk-live-7f3a9c2e-never-print-me";
    let answer = vec![
        data(json!({"choices": [{"index": 0, "delta": {"content": "Fine."}, "finish_reason": "stop"}]})),
        "data: [DONE]\n\n".to_owned(),
    ];
    let provider = Fixture::start(vec![
        Scripted::sse(&answer),
        Scripted::json(401, json!({"error": {"message": format!("Incorrect API key provided: {KEY}")}})),
        Scripted::json(500, json!({"error": {"message": format!("key {KEY} exploded")}})),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = dir.path().join("chatd.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nport = {port}\n[database]\nurl = \"sqlite://{}/chatd.db\"\n[providers.real]\nkind = \"openai\"\n\
             base_url = \"{}/v1\"\napi_key_env = \"CHATD_TEST_LEAK_KEY\"\nmax_retries = 0\n\
             [profiles.default]\nprovider = \"real\"\nmodel = \"gpt-x\"\n",
            dir.path().display(),
            provider.base
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_chatd"))
        .arg("--config")
        .arg(&config)
        .env("CHATD_TEST_LEAK_KEY", KEY)
        .env("RUST_LOG", "trace")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its logs are read as they come: a pipe nobody reads fills (64 KiB) and blocks chatd.
    let drain = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while client.get(format!("{base}/healthz")).send().await.is_err() {
        assert!(std::time::Instant::now() < deadline, "chatd did not start");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut said = String::new();
    for message in ["hello", "again", "and again"] {
        let response = client
            .post(format!("{base}/api/chat/stream"))
            .json(&json!({"message": message, "diagnostics": true}))
            .send()
            .await
            .unwrap();
        let frames = read_frames(response).await;
        said.push_str(&frames.iter().map(|f| f.data.to_string()).collect::<String>());
        let trace = frames[0].data["trace_id"].as_str().unwrap();
        said.push_str(&client.get(format!("{base}/api/trace/{trace}")).send().await.unwrap().text().await.unwrap());
    }
    for path in ["/api/profiles", "/api/tools", "/api/conversations", "/metrics", "/openapi.json"] {
        said.push_str(&client.get(format!("{base}{path}")).send().await.unwrap().text().await.unwrap());
    }
    assert!(said.contains("Fine."), "the run happened");
    assert!(
        provider.received()[0].headers["authorization"].to_str().unwrap().ends_with(KEY),
        "the provider got the key"
    );
    let _ = std::process::Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    let output = tokio::task::spawn_blocking(move || {
        let _ = child.wait();
        stdout.join().unwrap() + &stderr.join().unwrap()
    })
    .await
    .unwrap();
    assert!(output.lines().count() > 20, "trace logging was on: {output}");
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_chatd"))
        .args(["--config", config.to_str().unwrap(), "check-config"])
        .env("CHATD_TEST_LEAK_KEY", KEY)
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&check.stdout).to_string();
    assert!(printed.contains("\"kind\": \"openai\""), "{printed}");
    for (what, text) in [("responses", &said), ("logs", &output), ("check-config", &printed)] {
        assert!(!text.contains(KEY), "the key leaked into the {what}");
        assert!(!text.contains("7f3a9c2e"), "part of the key leaked into the {what}");
    }
}

#[tokio::test]
async fn failed_logins_lock_out_their_address_only() {
    let config = format!("{}[limits]\nfailed_auth_per_minute = 5\n", Mode::Token.config());
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let from = |ip: [u8; 4]| reqwest::Client::builder().local_address(std::net::IpAddr::from(ip)).build().unwrap();
    let (guesser, other) = (from([127, 0, 0, 1]), from([127, 0, 0, 2]));
    let status = |client: &reqwest::Client, token: &str| {
        let request = client.get(app.url("/api/conversations")).bearer_auth(token);
        async move {
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.headers().get("retry-after").is_some())
        }
    };
    for i in 0..5 {
        assert_eq!(status(&guesser, &format!("guess-{i}")).await, (401, false), "guess {i}");
    }
    assert_eq!(status(&guesser, "guess-5").await, (429, true), "the budget is used up");
    assert_eq!(status(&guesser, "tok-ann").await, (429, true), "even a right token, while locked out");
    assert_eq!(status(&other, "tok-ann").await, (200, false), "another address is not affected");
    assert_eq!(status(&other, "wrong").await, (401, false));
}
