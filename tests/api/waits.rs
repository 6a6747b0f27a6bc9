//! Runs that wait (CONTRACT.md §15): tool approvals and client tools, on the native stream.
//! A waiting run is in the database: it survives a restart, any replica continues it, and
//! its stream (or a resumed one) follows it through the wait to its one terminal event.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::runs::{resume, start};

const APPROVE_CALCULATOR: &str = "[tools]\nrequire_approval = [\"calculator\"]\n";
const ADD: &str = r#"Add [mock:tool=calculator {"expression": "1 + 2"}]"#;

fn of<'a>(frames: &'a [Frame], kind: &str) -> Vec<&'a Value> {
    frames.iter().filter(|f| f.kind() == kind).map(|f| &f.data).collect()
}

/// Asserts what every stream promises, through a wait too: seqs 1, 2, 3… without a gap,
/// exactly one terminal event, then `done`, last.
pub(crate) fn assert_whole(frames: &[Frame]) {
    let ids: Vec<u64> = frames.iter().map(|f| f.id).collect();
    let expected: Vec<u64> = (1..=frames.len() as u64).collect();
    assert_eq!(ids, expected, "seqs with a gap or a repeat");
    let terminal = frames.iter().filter(|f| matches!(f.kind(), "complete" | "cancelled" | "error")).count();
    assert_eq!(terminal, 1, "{frames:?}");
    assert_eq!(frames.last().map(Frame::kind), Some("done"));
    assert_eq!(frames.iter().filter(|f| f.kind() == "done").count(), 1);
}

pub(crate) async fn trace_status(app: &TestApp, trace_id: &str) -> String {
    let (status, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
    assert_eq!(status, StatusCode::OK, "{trace}");
    trace["status"].as_str().unwrap().to_owned()
}

both_backends! {
    async fn an_approved_call_runs_and_the_same_stream_goes_on_to_the_answer(backend: Backend) {
        let app = TestApp::spawn(backend, APPROVE_CALCULATOR).await;
        let mut live = start(&app, "ann", json!({"message": ADD})).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        let request = live.until("tool_approval_request").await.data.clone();
        assert_eq!(request["tool"], "calculator");
        assert_eq!(request["input"], json!({"expression": "1 + 2"}));
        assert_eq!(request["index"], 0);
        assert_eq!(of(live.seen(), "tool_start")[0]["tool_call_id"], request["tool_call_id"]);
        assert!(of(live.seen(), "tool_output").is_empty(), "the call ran before its approval");
        let expires: chrono::DateTime<chrono::Utc> = request["expires_at"].as_str().unwrap().parse().unwrap();
        let left = expires - chrono::Utc::now();
        assert!(left > chrono::Duration::hours(23) && left <= chrono::Duration::hours(24), "{left}");
        assert_eq!(trace_status(&app, &trace_id).await, "waiting");

        let approval = request["approval_id"].as_str().unwrap();
        let path = format!("/api/approvals/{approval}");
        let (status, body) = app.post(&path, "bob", json!({"approved": true})).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "another user decided: {body}");
        assert_eq!(body["code"], "NOT_FOUND");
        let (status, body) = app.post(&path, "ann", json!({"approved": true})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body, json!({"approval_id": approval, "trace_id": trace_id, "status": "approved"}));
        let (status, body) = app.post(&path, "ann", json!({"approved": false})).await;
        assert_eq!(status, StatusCode::CONFLICT, "decided twice: {body}");

        let frames = live.rest().await;
        assert_whole(&frames);
        let completes = of(&frames, "tool_complete");
        assert_eq!(completes.len(), 1);
        assert_eq!(completes[0]["status"], "success");
        assert_eq!(of(&frames, "tool_output")[0]["output"], "3");
        let payload = &of(&frames, "complete")[0]["payload"];
        let text = payload["message"].as_str().unwrap();
        assert!(text.contains("[[tool:0]]") && text.contains("calculator said 3"), "{text}");
        assert_eq!(text, joined(&frames, "text_delta"));
        assert_eq!(trace_status(&app, &trace_id).await, "completed");

        // What was stored is what the stream said, and a replay of the log is the stream.
        let conversation = frames[0].data["conversation_id"].as_str().unwrap();
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        assert_eq!(loaded["messages"][1]["content"], text);
        assert_eq!(loaded["messages"][1]["tool_history"][0]["output"], "3");
        let replayed = resume(&app, "ann", &trace_id, None).await.rest().await;
        let kinds = |frames: &[Frame]| frames.iter().map(|f| f.data.clone()).collect::<Vec<_>>();
        assert_eq!(kinds(&replayed), kinds(&frames));
    }

    async fn a_denied_call_does_not_run_and_the_model_is_told_why(backend: Backend) {
        let app = TestApp::spawn(backend, APPROVE_CALCULATOR).await;
        let mut live = start(&app, "ann", json!({"message": ADD})).await;
        let request = live.until("tool_approval_request").await.data.clone();
        let approval = request["approval_id"].as_str().unwrap().to_owned();
        let (status, body) =
            app.post(&format!("/api/approvals/{approval}"), "ann", json!({"approved": false, "reason": "too risky"})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["status"], "denied");
        let frames = live.rest().await;
        assert_whole(&frames);
        assert!(of(&frames, "tool_output").is_empty(), "a denied call has no output");
        assert_eq!(of(&frames, "tool_complete")[0]["status"], "denied");
        let text = of(&frames, "complete")[0]["payload"]["message"].as_str().unwrap().to_owned();
        assert!(text.contains("calculator said Error: The user denied this tool call: too risky"), "{text}");
    }

    async fn the_calls_that_need_nobody_run_at_once_and_the_turn_waits_for_the_rest(backend: Backend) {
        let app = TestApp::spawn(backend, "[tools]\nrequire_approval = [\"current_time\"]\n").await;
        let message = r#"Both [mock:tool=calculator {"expression": "2 * 3"}] [mock:tool=current_time {"utc_offset": "+01:00"}]"#;
        let mut live = start(&app, "ann", json!({"message": message})).await;
        let request = live.until("tool_approval_request").await.data.clone();
        // The calculator ran while the clock waits for its approval.
        let completes = of(live.seen(), "tool_complete");
        assert_eq!(completes.len(), 1);
        assert_eq!((completes[0]["tool"].as_str(), completes[0]["status"].as_str()), (Some("calculator"), Some("success")));
        assert_eq!((request["tool"].as_str(), request["index"].as_u64()), (Some("current_time"), Some(1)));
        let approval = request["approval_id"].as_str().unwrap();
        let (status, _) = app.post(&format!("/api/approvals/{approval}"), "ann", json!({"approved": true})).await;
        assert_eq!(status, StatusCode::OK);
        let frames = live.rest().await;
        assert_whole(&frames);
        let text = of(&frames, "complete")[0]["payload"]["message"].as_str().unwrap().to_owned();
        assert!(text.contains("calculator said 6") && text.contains("current_time said {"), "{text}");
        assert!(text.contains("[[tool:0]]") && text.contains("[[tool:1]]"), "{text}");
        let usage = of(&frames, "usage").len();
        assert_eq!(usage, 2, "one model call asked, one answered once both were settled");
    }

    async fn a_client_tool_waits_for_the_frontend_and_its_result_goes_to_the_model(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let body = json!({
            "message": "Where am I? [mock:tool=get_location {\"precision\": \"city\"}]",
            "client_tools": [{"name": "get_location", "description": "The browser's location",
                              "parameters": {"type": "object", "properties": {"precision": {"type": "string"}}}}],
        });
        let mut live = start(&app, "ann", body).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        let request = live.until("tool_result_request").await.data.clone();
        assert_eq!(request["tool"], "get_location");
        assert_eq!(request["input"], json!({"precision": "city"}));
        assert_eq!(of(live.seen(), "tool_start")[0]["tool_call_id"], request["tool_call_id"]);
        let call = request["tool_call_id"].as_str().unwrap();
        let path = format!("/api/runs/{trace_id}/tool_results");

        let (status, body) = app.post(&path, "ann", json!({"tool_call_id": "nope", "output": "x"})).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
        let (status, _) = app.post(&path, "bob", json!({"tool_call_id": call, "output": "x"})).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "another user's run");
        // An approval endpoint does not take a client tool's call.
        let (status, body) = app.post(&path, "ann", json!({"tool_call_id": call, "output": {"city": "Oslo"}})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body, json!({"trace_id": trace_id, "tool_call_id": call, "status": "accepted"}));
        let (status, _) = app.post(&path, "ann", json!({"tool_call_id": call, "output": "again"})).await;
        assert_eq!(status, StatusCode::CONFLICT);

        let frames = live.rest().await;
        assert_whole(&frames);
        assert_eq!(of(&frames, "tool_output")[0]["output"], r#"{"city":"Oslo"}"#);
        assert_eq!(of(&frames, "tool_complete")[0]["status"], "success");
        let text = of(&frames, "complete")[0]["payload"]["message"].as_str().unwrap().to_owned();
        assert!(text.contains(r#"get_location said {"city":"Oslo"}"#), "{text}");
    }

    async fn a_client_tool_may_report_an_error(backend: Backend) {
        let app = TestApp::spawn(backend, "[client_tools.read_page]\ndescription = \"The page's selection\"\n").await;
        let mut live = start(&app, "ann", json!({"message": "Read it [mock:tool=read_page {}]"})).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        let request = live.until("tool_result_request").await.data.clone();
        let call = request["tool_call_id"].as_str().unwrap().to_owned();
        let body = json!({"tool_call_id": call, "output": "nothing is selected", "is_error": true});
        let (status, _) = app.post(&format!("/api/runs/{trace_id}/tool_results"), "ann", body).await;
        assert_eq!(status, StatusCode::OK);
        let frames = live.rest().await;
        assert_whole(&frames);
        assert_eq!(of(&frames, "tool_complete")[0]["status"], "error");
        let text = of(&frames, "complete")[0]["payload"]["message"].as_str().unwrap().to_owned();
        assert!(text.contains("read_page said Error: nothing is selected"), "{text}");
    }

    async fn an_approval_nobody_decides_expires_as_denied(backend: Backend) {
        let app = TestApp::spawn(backend, "[tools]\nrequire_approval = [\"calculator\"]\napproval_timeout_secs = 1\n").await;
        let mut live = start(&app, "ann", json!({"message": ADD})).await;
        let request = live.until("tool_approval_request").await.data.clone();
        let approval = request["approval_id"].as_str().unwrap().to_owned();
        let frames = live.rest().await;
        assert_whole(&frames);
        assert_eq!(of(&frames, "tool_complete")[0]["status"], "denied");
        let text = of(&frames, "complete")[0]["payload"]["message"].as_str().unwrap().to_owned();
        assert!(text.contains("The user denied this tool call: approval expired"), "{text}");
        let (status, body) = app.post(&format!("/api/approvals/{approval}"), "ann", json!({"approved": true})).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert!(body["message"].as_str().unwrap().contains("expired"), "{body}");
    }

    async fn a_waiting_run_is_cancelled_and_keeps_what_it_said(backend: Backend) {
        let app = TestApp::spawn(backend, APPROVE_CALCULATOR).await;
        let mut live = start(&app, "ann", json!({"message": ADD})).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        let request = live.until("tool_approval_request").await.data.clone();
        let approval = request["approval_id"].as_str().unwrap().to_owned();
        let conversation = live.seen()[0].data["conversation_id"].as_str().unwrap().to_owned();
        let (status, body) = app.post("/api/cancel_stream", "ann", json!({"conversation_id": conversation})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["trace_id"], trace_id.as_str());
        let frames = live.rest().await;
        assert_whole(&frames);
        assert_eq!(of(&frames, "cancelled").len(), 1);
        assert_eq!(trace_status(&app, &trace_id).await, "cancelled");
        let (status, _) = app.post(&format!("/api/approvals/{approval}"), "ann", json!({"approved": true})).await;
        assert_eq!(status, StatusCode::CONFLICT, "a cancelled run's approval");
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        let answer = &loaded["messages"][1];
        assert_eq!(answer["cancelled"], true);
        // The call that never ran is not left unanswered in the stored turns.
        assert_eq!(answer["tool_calls"], json!([]));
    }

    async fn a_client_that_leaves_resumes_the_waiting_run_and_gets_the_rest(backend: Backend) {
        let app = TestApp::spawn(backend, APPROVE_CALCULATOR).await;
        let mut live = start(&app, "ann", json!({"message": ADD})).await;
        live.until("tool_approval_request").await;
        let seen = live.seen().to_vec();
        drop(live);
        let trace_id = seen[0].data["trace_id"].as_str().unwrap().to_owned();
        let approval = seen.last().unwrap().data["approval_id"].as_str().unwrap().to_owned();
        let after = seen.last().unwrap().id;
        let resumed = resume(&app, "ann", &trace_id, Some(after)).await;
        let (status, _) = app.post(&format!("/api/approvals/{approval}"), "ann", json!({"approved": true})).await;
        assert_eq!(status, StatusCode::OK);
        let rest = resumed.rest().await;
        assert_eq!(rest.first().map(|f| f.id), Some(after + 1));
        let all: Vec<Frame> = seen.into_iter().chain(rest).collect();
        assert_whole(&all);
        assert_eq!(of(&all, "complete").len(), 1);
    }

    async fn a_waiting_run_survives_a_restart_and_the_next_process_finishes_it(backend: Backend) {
        let db = TestDb::new(backend).await;
        let first = TestApp::on(&db.url, APPROVE_CALCULATOR).await;
        let mut live = start(&first, "ann", json!({"message": ADD})).await;
        live.until("tool_approval_request").await;
        let seen = live.seen().to_vec();
        let trace_id = seen[0].data["trace_id"].as_str().unwrap().to_owned();
        let approval = seen.last().unwrap().data["approval_id"].as_str().unwrap().to_owned();
        first.stop.graceful().await;
        drop(live);
        drop(first);

        let second = TestApp::on(&db.url, APPROVE_CALCULATOR).await;
        assert_eq!(trace_status(&second, &trace_id).await, "waiting", "start-up recovery left it waiting");
        let mut resumed = resume(&second, "ann", &trace_id, None).await;
        resumed.until("tool_approval_request").await;
        let before: Vec<&Value> = resumed.seen().iter().map(|f| &f.data).collect();
        assert_eq!(before, seen.iter().map(|f| &f.data).collect::<Vec<_>>(), "the log kept what the first process sent");
        let (status, body) = second.post(&format!("/api/approvals/{approval}"), "ann", json!({"approved": true})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let all = resumed.rest().await;
        assert_whole(&all);
        let text = of(&all, "complete")[0]["payload"]["message"].as_str().unwrap().to_owned();
        assert!(text.contains("calculator said 3"), "{text}");
        assert_eq!(trace_status(&second, &trace_id).await, "completed");
    }
}

both_backends! {
    async fn an_approval_expires_after_a_restart_too(backend: Backend) {
        let db = TestDb::new(backend).await;
        let config = "[tools]\nrequire_approval = [\"calculator\"]\napproval_timeout_secs = 1\n";
        let first = TestApp::on(&db.url, config).await;
        let mut live = start(&first, "ann", json!({"message": ADD})).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        live.until("tool_approval_request").await;
        // Gone before its approval's time is up: the next process expires it.
        first.stop.graceful().await;
        drop(live);
        drop(first);

        let second = TestApp::on(&db.url, config).await;
        let frames = resume(&second, "ann", &trace_id, None).await.rest().await;
        assert_whole(&frames);
        assert_eq!(of(&frames, "tool_complete")[0]["status"], "denied");
        let text = of(&frames, "complete")[0]["payload"]["message"].as_str().unwrap().to_owned();
        assert!(text.contains("The user denied this tool call: approval expired"), "{text}");
        assert_eq!(trace_status(&second, &trace_id).await, "completed");
    }
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn another_replica_takes_the_decision_and_the_first_replicas_stream_gets_the_answer() {
    let db = TestDb::new(Backend::Postgres).await;
    let config = format!("{APPROVE_CALCULATOR}[stream]\nflush_interval_ms = 20\n");
    let a = TestApp::on(&db.url, &config).await;
    let b = TestApp::on(&db.url, &config).await;
    let mut live = start(&a, "ann", json!({"message": ADD})).await;
    let request = live.until("tool_approval_request").await.data.clone();
    let approval = request["approval_id"].as_str().unwrap().to_owned();
    let path = format!("/api/approvals/{approval}");
    // Two decisions at once, one on each replica: exactly one wins.
    let (on_a, on_b) =
        tokio::join!(a.post(&path, "ann", json!({"approved": true})), b.post(&path, "ann", json!({"approved": true})));
    let mut statuses = [on_a.0, on_b.0];
    statuses.sort();
    assert_eq!(statuses, [StatusCode::OK, StatusCode::CONFLICT], "{on_a:?} {on_b:?}");
    let frames = live.rest().await;
    assert_whole(&frames);
    let text = of(&frames, "complete")[0]["payload"]["message"].as_str().unwrap().to_owned();
    assert!(text.contains("calculator said 3"), "{text}");
}

#[tokio::test]
async fn a_client_tool_with_a_server_tools_name_or_no_name_is_refused_before_the_stream() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    for (tool, why) in [
        (json!({"name": "calculator"}), "server tool"),
        (json!({"name": "two words"}), "not a tool name"),
        (json!({"name": ""}), "not a tool name"),
    ] {
        let (status, body) =
            app.post("/api/chat/stream", "ann", json!({"message": "hi", "client_tools": [tool]})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["field"], "client_tools");
        assert!(body["message"].as_str().unwrap().contains(why), "{body}");
    }
    let (_, list) = app.get("/api/conversations", "ann").await;
    assert_eq!(list["conversations"], json!([]), "a refused request left a conversation");
}
