//! The OpenAI Responses API across replicas (CONTRACT.md §20): the SDKs themselves drive
//! the rest (tests/e2e/test/openai.test.js); here a background response started on one
//! Postgres replica is read on another, its events numbered as on the first.

use std::time::Duration;

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::helpers::*;

/// The events of `GET /v1/responses/{id}?stream=true[&starting_after=N]` on `app`.
async fn events(app: &TestApp, id: &str, starting_after: Option<u64>) -> Vec<Value> {
    let mut url = app.url(&format!("/v1/responses/{id}?stream=true"));
    if let Some(n) = starting_after {
        url.push_str(&format!("&starting_after={n}"));
    }
    let response = app.client.get(url).header("x-client-id", "ann").send().await.unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream().eventsource();
    let mut events = Vec::new();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(30), stream.next()).await.expect("events") {
        let event = event.expect("well-formed SSE");
        let data: Value = serde_json::from_str(&event.data).unwrap();
        assert_eq!(event.event, data["type"].as_str().unwrap(), "the event line names its type");
        events.push(data);
    }
    events
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_background_response_is_read_on_another_replica_with_the_same_numbers() {
    let db = TestDb::new(Backend::Postgres).await;
    let (a, b) = (TestApp::on(&db.url, "").await, TestApp::on(&db.url, "").await);
    let body = json!({"model": "default", "input": "Slowly [mock:words=40] [mock:delay=30]", "background": true});
    let (status, begun) = a.post("/v1/responses", "ann", body).await;
    assert_eq!(status, 200, "{begun}");
    assert_eq!((begun["status"].as_str(), begun["background"].as_bool()), (Some("in_progress"), Some(true)));
    let id = begun["id"].as_str().unwrap();
    // On the other replica, after event 6, while the run goes on; then whole, on the first.
    let after = events(&b, id, Some(6)).await;
    let whole = events(&a, id, None).await;
    let numbers: Vec<u64> = whole.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
    assert_eq!(numbers, (0..whole.len() as u64).collect::<Vec<_>>(), "dense from 0");
    assert_eq!(after, whole[7..].to_vec(), "exactly the events after 6, as numbered on the first");
    assert_eq!(whole.last().unwrap()["type"], "response.completed");
    let (_, other) = b.get(&format!("/v1/responses/{id}"), "bob").await;
    assert_eq!(other["error"]["type"], "not_found_error", "another user's: {other}");
}

/// A response read while its log is behind its stream is the one the stream says: read
/// before the log has its first event, it is that response, in progress; read right after
/// its stream ended, on the replica that ran it or on another, it has ended as the stream
/// did. (The log is held back by a lock on its table: the live stream does not wait for the
/// log; a read of a run that ended waits for its end to be logged.)
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_response_read_while_its_log_is_behind_is_the_one_streamed() {
    let db = TestDb::new(Backend::Postgres).await;
    let (a, b) = (TestApp::on(&db.url, "").await, TestApp::on(&db.url, "").await);
    let hold = db.hold_logs().await;
    let body = json!({"model": "default", "input": "Soon [mock:words=20] [mock:delay=10]", "background": true});
    let (status, begun) = a.post("/v1/responses", "ann", body).await;
    assert_eq!(status, 200, "{begun}");
    let id = begun["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/responses/{id}");
    for app in [&a, &b] {
        let (status, early) = app.get(&path, "ann").await;
        assert_eq!(status, 200, "{early}");
        assert_eq!(early["status"], "in_progress", "{early}");
        for field in ["id", "created_at", "model", "conversation"] {
            assert_eq!(early[field], begun[field], "{field}: {early}");
        }
    }
    let streamed = events(&a, &id, None).await;
    let ended = &streamed.last().unwrap()["response"];
    assert_eq!(ended["status"], "completed", "the stream is live, not from the log");
    let release = hold.release_after(Duration::from_millis(300));
    let (here, there) = tokio::join!(a.get(&path, "ann"), b.get(&path, "ann"));
    for (status, read) in [here, there] {
        assert_eq!(status, 200, "{read}");
        assert_eq!(read["status"], "completed", "{read}");
        assert_eq!(read["output"], ended["output"]);
    }
    release.await.unwrap();
}

/// `instructions`, `max_output_tokens` and `temperature` reach the model for that response
/// only (an OpenAI-compatible server of the fixture records each request).
#[tokio::test]
async fn a_responses_settings_reach_the_model_for_that_response_only() {
    use crate::fixture::*;
    let answer = || {
        Scripted::sse(&[
            data(json!({"choices": [{"index": 0, "delta": {"content": "Sure."}, "finish_reason": "stop"}]})),
            data(json!({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 2}})),
            "data: [DONE]\n\n".to_owned(),
        ])
    };
    let fixture = Fixture::start(vec![answer(), answer()]).await;
    let config = format!(
        "[providers.fx]\nkind = \"openai_compatible\"\nbase_url = \"{}/v1\"\n\
         [profiles.fx]\nprovider = \"fx\"\nmodel = \"small\"\nmax_tokens = 500\ntemperature = 0.9\nsystem_prompt = \"Be kind.\"\n",
        fixture.base
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let body = json!({"model": "fx", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 77, "temperature": 0.25});
    let (status, first) = app.post("/v1/responses", "ann", body).await;
    assert_eq!(status, 200, "{first}");
    let (status, _) = app
        .post("/v1/responses", "ann", json!({"model": "fx", "input": "Again", "previous_response_id": first["id"]}))
        .await;
    assert_eq!(status, 200);
    let received = fixture.received();
    let (asked, next) = (&received[0].body, &received[1].body);
    assert_eq!((asked["max_tokens"].as_u64(), asked["temperature"].as_f64()), (Some(77), Some(0.25)));
    let system = asked["messages"][0]["content"].as_str().unwrap();
    assert!(system.contains("## Identity\nBe kind.") && system.contains("## Instructions\nBe brief."), "{system}");
    assert_eq!((next["max_tokens"].as_u64(), next["temperature"].as_f64()), (Some(500), Some(0.9)));
    assert!(!next["messages"][0]["content"].as_str().unwrap().contains("Be brief."), "for that response only");
    let (status, refused) =
        app.post("/v1/responses", "ann", json!({"model": "fx", "input": "x", "temperature": 3})).await;
    assert_eq!((status.as_u16(), refused["error"]["param"].as_str()), (400, Some("temperature")));
}

/// A client tool's call ends a response on one Postgres replica; its output, sent to the
/// other, continues the same run there, as a response of its own (`resp_<trace>_<seq>`),
/// numbered from 0 and read the same on either replica. A seq where no wait ended names no
/// response.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_client_tools_output_continues_the_run_on_another_replica() {
    let db = TestDb::new(Backend::Postgres).await;
    let (a, b) = (TestApp::on(&db.url, "").await, TestApp::on(&db.url, "").await);
    let clock = json!({"type": "function", "name": "clock", "parameters": {"type": "object", "properties": {}}});
    let body =
        json!({"model": "default", "input": "Time? [mock:tool=clock {}]", "tools": [clock], "metadata": {"desk": "7"}});
    let (status, first) = a.post("/v1/responses", "ann", body).await;
    assert_eq!(status, 200, "{first}");
    let call = first["output"].as_array().unwrap().last().unwrap().clone();
    assert_eq!((call["type"].as_str(), call["name"].as_str()), (Some("function_call"), Some("clock")));
    assert_eq!(first["status"], "completed");

    let output = json!([{"type": "function_call_output", "call_id": call["call_id"], "output": "noon"}]);
    let (status, refused) = b.post("/v1/responses", "ann", json!({"model": "default", "input": output})).await;
    assert_eq!(status, 400, "no response named: {refused}");
    assert_eq!(refused["error"]["param"], "previous_response_id");
    let body = json!({"model": "default", "input": output, "previous_response_id": first["id"]});
    let (status, second) = b.post("/v1/responses", "ann", body).await;
    assert_eq!(status, 200, "{second}");
    let id = second["id"].as_str().unwrap();
    assert!(id.starts_with(&format!("{}_", first["id"].as_str().unwrap())), "{id}");
    assert_eq!(second["metadata"], json!({"desk": "7"}), "the run's metadata, on each of its responses");
    let text =
        second["output"].as_array().unwrap().iter().find(|i| i["type"] == "message").unwrap()["content"][0]["text"]
            .clone();
    assert!(text.as_str().unwrap().contains("clock said noon"), "{second}");

    // Each response, read on the other replica, is as it was answered; its events too.
    let (_, first_again) = b.get(&format!("/v1/responses/{}", first["id"].as_str().unwrap()), "ann").await;
    assert_eq!(first_again["output"], first["output"]);
    let (_, second_again) = a.get(&format!("/v1/responses/{id}"), "ann").await;
    assert_eq!(second_again["output"], second["output"]);
    let whole = events(&a, id, None).await;
    let numbers: Vec<u64> = whole.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
    assert_eq!(numbers, (0..whole.len() as u64).collect::<Vec<_>>(), "dense from 0");
    assert_eq!(whole.last().unwrap()["response"]["output"], second["output"]);
    assert_eq!(events(&b, id, Some(2)).await, whole[3..].to_vec());
    let first_events = events(&b, first["id"].as_str().unwrap(), None).await;
    assert_eq!(first_events.last().unwrap()["type"], "response.completed");
    assert_eq!(first_events.last().unwrap()["response"]["output"], first["output"]);

    let seq: u64 = id.rsplit('_').next().unwrap().parse().unwrap();
    let (status, _) = a.get(&format!("/v1/responses/{}_{}", first["id"].as_str().unwrap(), seq - 1), "ann").await;
    assert_eq!(status, 404, "no wait ended at {}", seq - 1);
}

/// The official Python SDK, set up as the README says, against a real chatd: a plain answer,
/// the stream helper, a function tool continued in the same run, and the typed errors.
#[tokio::test]
async fn the_python_sdk_works_as_the_readme_sets_it_up() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("target/report/venv/bin/python");
    assert!(python.exists(), "the openai Python SDK is not installed: run scripts/report-peers.sh");
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let output = tokio::process::Command::new(python)
        .arg(root.join("tests/fixtures/openai_client.py"))
        .arg(app.url("/v1"))
        .arg("py")
        .output()
        .await
        .expect("python runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();

    let plain = &report["plain"];
    assert_eq!(
        (plain["status"].as_str(), plain["text"].as_str()),
        (Some("completed"), Some("Mock reply: Hello from Python"))
    );
    let conversation =
        uuid::Uuid::parse_str(plain["conversation"].as_str().unwrap().trim_start_matches("conv_")).unwrap();
    let (_, conversation) = app.get(&format!("/api/conversations/{conversation}"), "py").await;
    assert_eq!(conversation["messages"][1]["content"], plain["text"]);

    let streamed = &report["streamed"];
    let numbers: Vec<u64> = streamed["numbers"].as_array().unwrap().iter().map(|n| n.as_u64().unwrap()).collect();
    assert_eq!(numbers, (0..numbers.len() as u64).collect::<Vec<_>>(), "dense from 0");
    let (_, again) = app.get(&format!("/v1/responses/{}", streamed["id"].as_str().unwrap()), "py").await;
    assert_eq!(
        again["output"].as_array().unwrap().iter().find(|i| i["type"] == "message").unwrap()["content"][0]["text"],
        streamed["text"]
    );

    let function = &report["function"];
    assert_eq!((function["name"].as_str(), &function["arguments"]), (Some("clock"), &json!({"zone": "UTC"})));
    assert!(function["second"].as_str().unwrap().starts_with(function["first"].as_str().unwrap()), "{function}");
    assert!(function["text"].as_str().unwrap().contains("clock said noon UTC"), "{function}");

    let errors = &report["errors"];
    assert_eq!(errors["unknown model"], json!({"class": "NotFoundError", "status": 404, "param": "model"}));
    assert_eq!(errors["store false"], json!({"class": "BadRequestError", "status": 400, "param": "store"}));
    assert_eq!(errors["empty input"], json!({"class": "BadRequestError", "status": 400, "param": "input"}));
}

/// A request sent again with its `Idempotency-Key` (as a client's retry) gets the response
/// its first try started, not a second run.
#[tokio::test]
async fn a_retry_with_the_same_idempotency_key_gets_the_same_response() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let send = || async {
        let response = app
            .client
            .post(app.url("/v1/responses"))
            .header("x-client-id", "ann")
            .header("idempotency-key", "retry-1")
            .json(&json!({"model": "default", "input": "Once only"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.json::<Value>().await.unwrap()
    };
    let (first, second) = (send().await, send().await);
    assert_eq!(first["id"], second["id"]);
    assert_eq!(first["output"], second["output"]);
    let conversation = first["conversation"]["id"].as_str().unwrap().trim_start_matches("conv_");
    let (_, stored) =
        app.get(&format!("/api/conversations/{}", uuid::Uuid::parse_str(conversation).unwrap()), "ann").await;
    assert_eq!(stored["messages"].as_array().unwrap().len(), 2, "one question, one answer");
}

/// `/v1` asks for the same credentials and keeps the same limits and budgets as every other
/// start, each refusal in OpenAI's shape with the status the SDKs map to their typed errors.
#[tokio::test]
async fn the_responses_api_keeps_the_same_credentials_limits_and_budgets() {
    let config = "[auth]\nmode = \"token\"\n[auth.tokens]\n\"tok-ann\" = \"ann\"\n\
                  [limits]\nmax_message_chars = 40\nbudget_tokens_per_day = 1\nrequests_per_minute = 0\n";
    let app = TestApp::spawn(Backend::Sqlite, config).await;
    let send = |token: Option<&'static str>, input: &'static str| {
        let mut request = app.client.post(app.url("/v1/responses")).json(&json!({"model": "default", "input": input}));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move {
            let response = request.send().await.unwrap();
            let (status, retry_after) = (response.status(), response.headers().get("retry-after").cloned());
            (status, retry_after, response.json::<Value>().await.unwrap())
        }
    };
    for token in [None, Some("tok-wrong")] {
        let (status, _, body) = send(token, "Hi").await;
        assert_eq!(status, 401);
        assert_eq!(
            (body["error"]["type"].as_str(), body["error"]["code"].as_str()),
            (Some("authentication_error"), Some("unauthorized"))
        );
    }
    let (status, _, body) = send(Some("tok-ann"), "A message far longer than forty characters, refused").await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(
        (body["error"]["type"].as_str(), body["error"]["param"].as_str()),
        (Some("invalid_request_error"), Some("input"))
    );
    // A day's budget of one token: a start cannot hold what an answer may take.
    let (status, retry_after, body) = send(Some("tok-ann"), "Hi").await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(
        (body["error"]["type"].as_str(), body["error"]["code"].as_str()),
        (Some("rate_limit_error"), Some("quota_exceeded"))
    );
    assert!(retry_after.is_some(), "Retry-After kept");
}

/// A response whose run waits on two calls is answered for both at once: answers for one
/// are refused before anything is settled, naming what is missing.
#[tokio::test]
async fn every_call_a_response_waits_on_is_answered_at_once() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let clock = json!({"type": "function", "name": "clock", "parameters": {"type": "object", "properties": {}}});
    let body = json!({"model": "default", "input": "Two [mock:tool=clock {\"n\": 1}] [mock:tool=clock {\"n\": 2}]", "tools": [clock]});
    let (status, first) = app.post("/v1/responses", "ann", body).await;
    assert_eq!(status, 200, "{first}");
    let calls: Vec<String> = first["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "function_call")
        .map(|i| i["call_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(calls.len(), 2, "{first}");
    let output = |call: &str| json!({"type": "function_call_output", "call_id": call, "output": "noon"});
    let one = json!({"model": "default", "previous_response_id": first["id"], "input": [output(&calls[0])]});
    let (status, refused) = app.post("/v1/responses", "ann", one).await;
    assert_eq!(status, 400, "{refused}");
    assert_eq!(refused["error"]["param"], "input");
    assert!(refused["error"]["message"].as_str().unwrap().contains(&calls[1]), "{refused}");
    let both = json!({"model": "default", "previous_response_id": first["id"], "input": [output(&calls[0]), output(&calls[1])]});
    let (status, second) = app.post("/v1/responses", "ann", both).await;
    assert_eq!((status.as_u16(), second["status"].as_str()), (200, Some("completed")), "{second}");
}
