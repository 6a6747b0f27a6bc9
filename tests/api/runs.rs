//! Runs that survive: cancel (mid-text, mid-tool, after the end, racing completion), resume
//! with Last-Event-ID, several followers, two replicas on one Postgres, batched event log
//! writes, graceful SIGTERM drain, and recovery after kill -9.

use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures_util::{Stream, StreamExt};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::fixture::*;
use crate::helpers::*;

/// A live SSE stream read frame by frame.
pub(crate) struct Live {
    frames: std::pin::Pin<Box<dyn Stream<Item = Frame> + Send>>,
    seen: Vec<Frame>,
}

impl Live {
    pub(crate) async fn open(response: reqwest::Response) -> Self {
        assert_eq!(response.status(), StatusCode::OK);
        let frames = response.bytes_stream().eventsource().map(|event| {
            let event = event.expect("well-formed SSE");
            Frame { id: event.id.parse().unwrap(), data: serde_json::from_str(&event.data).unwrap() }
        });
        Self { frames: Box::pin(frames), seen: Vec::new() }
    }

    /// Reads until a frame of `kind` (inclusive).
    pub(crate) async fn until(&mut self, kind: &str) -> &Frame {
        while let Some(frame) = self.frames.next().await {
            let hit = frame.kind() == kind;
            self.seen.push(frame);
            if hit {
                return self.seen.last().unwrap();
            }
        }
        panic!("the stream ended without {kind}: {:?}", self.seen.iter().map(Frame::kind).collect::<Vec<_>>());
    }

    /// The frames read so far.
    pub(crate) fn seen(&self) -> &[Frame] {
        &self.seen
    }

    pub(crate) async fn rest(mut self) -> Vec<Frame> {
        while let Some(frame) = self.frames.next().await {
            self.seen.push(frame);
        }
        self.seen
    }
}

pub(crate) async fn start(app: &TestApp, user: &str, body: Value) -> Live {
    open(app, user, "/api/chat/stream", body).await
}

/// POSTs `body` to a streaming endpoint and reads its frames.
async fn open(app: &TestApp, user: &str, path: &str, body: Value) -> Live {
    let response = app.client.post(app.url(path)).header("x-client-id", user).json(&body).send().await.unwrap();
    Live::open(response).await
}

pub(crate) async fn resume(app: &TestApp, user: &str, trace_id: &str, last_event_id: Option<u64>) -> Live {
    let mut request = app.client.get(app.url(&format!("/api/chat/stream/{trace_id}"))).header("x-client-id", user);
    if let Some(id) = last_event_id {
        request = request.header("last-event-id", id.to_string());
    }
    Live::open(request.send().await.unwrap()).await
}

pub(crate) fn terminal_kinds(frames: &[Frame]) -> Vec<&str> {
    frames.iter().map(Frame::kind).filter(|k| matches!(*k, "complete" | "cancelled" | "error")).collect()
}

const SLOW: &str = "[mock:words=400] [mock:delay=15] [mock:think=off]";

both_backends! {
    async fn cancel_mid_text_keeps_the_partial_answer(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let mut live = start(&app, "ann", json!({"message": SLOW})).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        live.until("text_delta").await;
        live.until("text_delta").await;
        let (status, body) = app.post("/api/cancel_stream", "ann", json!({"trace_id": trace_id})).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["status"], "cancelled");
        assert_eq!(body["trace_id"], trace_id);
        let frames = live.rest().await;
        assert_eq!(terminal_kinds(&frames), ["cancelled"]);
        assert_eq!(frames.last().unwrap().kind(), "done");
        let cancelled = &frames.iter().find(|f| f.kind() == "cancelled").unwrap().data;
        let partial = joined(&frames, "text_delta");
        assert!(!partial.is_empty() && partial.len() < 400 * 4, "stopped early: {} chars", partial.len());
        assert_eq!(cancelled["partial_text"], partial);

        let conversation = frames[0].data["conversation_id"].as_str().unwrap();
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        let message = &loaded["messages"][1];
        assert_eq!(message["cancelled"], true);
        assert_eq!(message["content"], format!("{partial}\n\n[cancelled]"));
        let (_, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
        assert_eq!(trace["status"], "cancelled");

        let (status, error) = app.post("/api/cancel_stream", "ann", json!({"trace_id": trace_id})).await;
        assert_eq!((status.as_u16(), error["code"].as_str()), (409, Some("CONFLICT")), "a second cancel finds it ended");
    }

    async fn disconnect_then_resume_gives_exactly_the_missed_events(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let message = "[mock:words=60] [mock:delay=10]";
        let mut live = start(&app, "ann", json!({"message": message})).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        live.until("text_delta").await;
        live.until("text_delta").await;
        let before = live.seen.clone();
        drop(live); // the client goes away mid-answer; the run goes on

        let last = before.last().unwrap().id;
        let after = resume(&app, "ann", &trace_id, Some(last)).await.rest().await;
        assert_eq!(after.first().unwrap().id, last + 1, "nothing missed, nothing repeated");
        let ids: Vec<u64> = before.iter().chain(&after).map(|f| f.id).collect();
        assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>());
        assert_eq!(after.last().unwrap().kind(), "done");
        let resumed_text = format!("{}{}", joined(&before, "text_delta"), joined(&after, "text_delta"));

        let whole = app.chat("ann", json!({"message": message})).await;
        assert_eq!(resumed_text, joined(&whole, "text_delta"), "the same text as an uninterrupted run");
        let complete = &after.iter().find(|f| f.kind() == "complete").unwrap().data["payload"];
        assert_eq!(complete["message"], resumed_text);

        // A finished run replays from its log, from any point, to `done`.
        let replay = resume(&app, "ann", &trace_id, None).await.rest().await;
        let replayed: Vec<(u64, Value)> = replay.iter().map(|f| (f.id, f.data.clone())).collect();
        let original: Vec<(u64, Value)> = before.iter().chain(&after).map(|f| (f.id, f.data.clone())).collect();
        assert_eq!(replayed, original);
        let tail = app.client.get(app.url(&format!("/api/chat/stream/{trace_id}?after={}", ids.len() - 2))).header("x-client-id", "ann").send().await.unwrap();
        let tail = read_frames(tail).await;
        assert_eq!(tail.iter().map(Frame::kind).collect::<Vec<_>>(), ["complete", "done"]);
    }

    async fn a_listener_that_joins_a_long_run_late_gets_every_event_from_the_log_then_live(backend: Backend) {
        // A run keeps only its newest frames once its log has them: a listener that joins
        // after hundreds of tokens reads the first ones from the log, then follows live.
        let app = TestApp::spawn(backend, "[stream]\nflush_interval_ms = 20\n").await;
        let mut live = start(&app, "ann", json!({"message": "[mock:words=300] [mock:delay=4] [mock:think=off]"})).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        for _ in 0..150 {
            live.until("text_delta").await;
        }
        let (from_start, from_ten) = tokio::join!(
            async { resume(&app, "ann", &trace_id, None).await.rest().await },
            async { resume(&app, "ann", &trace_id, Some(10)).await.rest().await },
        );
        let whole = live.rest().await;
        crate::waits::assert_whole(&whole);
        let ids = |frames: &[Frame]| frames.iter().map(|f| f.id).collect::<Vec<_>>();
        assert_eq!(ids(&from_start), ids(&whole), "the late listener missed or repeated events");
        assert_eq!(ids(&from_ten), ids(&whole)[10..].to_vec());
        assert_eq!(joined(&from_start, "text_delta"), joined(&whole, "text_delta"));
        assert_eq!(joined(&whole, "text_delta").split_whitespace().count(), 300);
    }
}

#[tokio::test]
async fn cancel_mid_tool_closes_the_call_and_the_conversation_goes_on() {
    let tool = Fixture::start(vec![Scripted::json(200, json!({})).then(Part::Stall)]).await;
    let config = format!("[http_tools.slow]\nurl = \"{}/slow\"\ndescription = \"never answers\"\n", tool.base);
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let mut live = start(&app, "ann", json!({"message": "[mock:tool=slow {}]"})).await;
    let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
    live.until("tool_start").await;
    let (status, _) =
        app.post("/api/cancel_stream", "ann", json!({"message_id": live.seen[0].data["message_id"]})).await;
    assert_eq!(status, 200);
    let frames = live.rest().await;
    let complete = frames.iter().find(|f| f.kind() == "tool_complete").unwrap();
    assert_eq!(complete.data["status"], "cancelled");
    assert_eq!(terminal_kinds(&frames), ["cancelled"]);
    let conversation = frames[0].data["conversation_id"].as_str().unwrap().to_owned();
    let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
    let message = &loaded["messages"][1];
    assert_eq!(message["cancelled"], true);
    assert!(message["content"].as_str().unwrap().ends_with("[cancelled]"));
    assert_eq!(message["tool_history"][0]["is_error"], true);
    let (_, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
    assert_eq!(trace["status"], "cancelled");
    // The closed call lets the conversation continue.
    let next = app.chat("ann", json!({"message": "and now?", "conversation_id": conversation})).await;
    assert_eq!(terminal_kinds(&next), ["complete"]);
}

#[tokio::test]
async fn cancel_answers_not_found_and_bad_requests_properly() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let frames = app.chat("ann", json!({"message": "done already"})).await;
    let trace_id = frames[0].data["trace_id"].clone();
    let (status, error) = app.post("/api/cancel_stream", "ann", json!({"trace_id": trace_id})).await;
    assert_eq!((status.as_u16(), error["code"].as_str()), (409, Some("CONFLICT")));
    let (status, _) = app.post("/api/cancel_stream", "bob", json!({"trace_id": trace_id})).await;
    assert_eq!(status, 404, "another user's run does not exist for them");
    let (status, _) = app.post("/api/cancel_stream", "ann", json!({"trace_id": uuid::Uuid::now_v7()})).await;
    assert_eq!(status, 404);
    let (status, error) = app.post("/api/cancel_stream", "ann", json!({})).await;
    assert_eq!((status.as_u16(), error["field"].as_str()), (400, Some("trace_id")));
    let (status, _) = app.get(&format!("/api/chat/stream/{}", trace_id.as_str().unwrap()), "bob").await;
    assert_eq!(status, 404, "nor can they resume it");
}

#[tokio::test]
async fn cancel_racing_completion_ends_with_exactly_one_terminal_event() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let (mut cancelled, mut completed) = (0, 0);
    for round in 0..30u64 {
        let mut live = start(&app, "ann", json!({"message": "[mock:words=6] [mock:delay=2] [mock:think=off]"})).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        // Cancel at a different moment each round, from right away to around the end; every
        // fifth round right as `complete` arrives, so the race is run from both sides
        // however fast or loaded the machine is.
        if round % 5 == 4 {
            live.until("complete").await;
        } else {
            tokio::time::sleep(Duration::from_micros(round * 300)).await;
        }
        let (status, body) = app.post("/api/cancel_stream", "ann", json!({"trace_id": trace_id})).await;
        let frames = live.rest().await;
        let terminal = terminal_kinds(&frames);
        assert_eq!(terminal.len(), 1, "{terminal:?}");
        assert_eq!(frames.last().unwrap().kind(), "done");
        match status.as_u16() {
            200 => {
                assert_eq!(terminal, ["cancelled"], "{body}");
                cancelled += 1;
            }
            409 => {
                assert_eq!(terminal, ["complete"], "{body}");
                completed += 1;
            }
            other => panic!("cancel answered {other}: {body}"),
        }
    }
    assert!(
        cancelled > 0 && completed > 0,
        "both sides of the race were exercised: {cancelled} cancelled, {completed} completed"
    );
}

#[tokio::test]
async fn several_followers_see_the_same_run() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let mut live = start(&app, "ann", json!({"message": "[mock:words=30] [mock:delay=5]"})).await;
    let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
    let (a, b) = tokio::join!(async { resume(&app, "ann", &trace_id, Some(0)).await.rest().await }, async {
        resume(&app, "ann", &trace_id, Some(1)).await.rest().await
    },);
    let own = live.rest().await;
    let ids = |frames: &[Frame]| frames.iter().map(|f| f.id).collect::<Vec<_>>();
    assert_eq!(ids(&a), ids(&own));
    assert_eq!(ids(&b), ids(&own)[1..].to_vec());
    assert_eq!(joined(&a, "text_delta"), joined(&own, "text_delta"));
}

/// GETs `path` until `ready` holds for the body (or 10 s have passed); returns the last body.
pub(crate) async fn poll_until(app: &TestApp, user: &str, path: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = app.get(path, user).await;
        if ready(&body) || Instant::now() > deadline {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A run's trace once it is no longer running.
pub(crate) async fn ended_trace(app: &TestApp, user: &str, trace_id: &str) -> Value {
    poll_until(app, user, &format!("/api/trace/{trace_id}"), |trace| trace["status"] != "running").await
}

#[tokio::test]
async fn with_on_disconnect_cancel_a_client_leaving_cancels_its_runs_on_every_stream() {
    let app = TestApp::spawn(Backend::Sqlite, "[stream]\non_disconnect = \"cancel\"").await;
    let mut live = start(&app, "ann", json!({"message": SLOW})).await;
    let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
    live.until("text_delta").await;
    drop(live);
    let trace = ended_trace(&app, "ann", &trace_id).await;
    assert_eq!(trace["status"], "cancelled", "the run stopped when its client left");

    // The legacy stream is the same run in other words: leaving it cancels the run too.
    let mut legacy = open(&app, "ann", "/api/get_chat_response_stream", json!({"message": SLOW})).await;
    let conversation = legacy.until("chunk").await.data["conversation_id"].as_str().unwrap().to_owned();
    drop(legacy);
    let path = format!("/api/conversations/{conversation}");
    let loaded = poll_until(&app, "ann", &path, |loaded| loaded["messages"][1].is_object()).await;
    let answer = &loaded["messages"][1];
    assert_eq!(answer["cancelled"], true, "{answer}");
    assert!(answer["content"].as_str().unwrap().ends_with("[cancelled]"), "{answer}");

    // Leaving an A/B stream cancels both of its runs.
    let body = json!({"message": SLOW, "profile_a": "default", "profile_b": "other"});
    let mut both = open(&app, "ann", "/api/ab/stream", body).await;
    let sides = both.until("comparison").await.data.clone();
    both.until("text_delta").await;
    drop(both);
    for side in ["a", "b"] {
        let trace = ended_trace(&app, "ann", sides[side]["trace_id"].as_str().unwrap()).await;
        assert_eq!(trace["status"], "cancelled", "side {side}");
    }
}

#[tokio::test]
async fn by_default_a_client_leaving_does_not_stop_its_run() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let mut live = start(&app, "ann", json!({"message": "[mock:words=40] [mock:delay=10]"})).await;
    let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
    live.until("text_delta").await;
    drop(live);
    let trace = ended_trace(&app, "ann", &trace_id).await;
    assert_eq!(trace["status"], "completed");
}

#[tokio::test]
async fn clients_that_leave_while_their_start_is_written_leave_no_run_behind() {
    // A start that is written is run, even when its request is gone by the time the write
    // returns: no question may stay with a run persisted as running that nobody runs.
    let app =
        TestApp::spawn(Backend::Sqlite, "[limits]\nmax_concurrent_runs_per_user = 100\nrequests_per_minute = 0").await;
    let leaving = (0..60u64).map(|i| {
        let body = json!({"message": format!("leaving {i} [mock:words=3]")});
        let request = app.client.post(app.url("/api/chat/stream")).header("x-client-id", "ann").json(&body).send();
        // Each gives up a little later than the one before: some before their start is
        // written, some while it is, some after.
        tokio::time::timeout(Duration::from_micros(200 * i), request)
    });
    futures_util::future::join_all(leaving).await;
    // Starts are written in the order they come: once this one's answer is in, every start
    // of those that left is written.
    let stayed = app.chat("ann", json!({"message": "stayed [mock:words=3]"})).await;
    assert_eq!(stayed.last().unwrap().kind(), "done");
    let answered = |page: &Value| page["conversations"].as_array().unwrap().iter().all(|c| c["message_count"] == 2);
    let page = poll_until(&app, "ann", "/api/conversations?limit=100", answered).await;
    assert!(answered(&page), "a question was left without its answer: {page}");
}

#[tokio::test]
async fn a_long_answer_is_logged_in_few_batches() {
    let app = TestApp::spawn(Backend::Sqlite, "[providers.mock]\nchunk_chars = 3").await;
    let before = app.log.batches_written();
    let started = Instant::now();
    let frames = app.chat("ann", json!({"message": "[mock:words=2000] [mock:think=off]"})).await;
    let elapsed = started.elapsed();
    let deltas = frames.iter().filter(|f| f.kind() == "text_delta").count();
    assert!(deltas > 2000, "{deltas} deltas");
    // Wait for the run's final flush to be counted (it happens before `done` is logged).
    let trace_id = frames[0].data["trace_id"].as_str().unwrap();
    let (_, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
    assert_eq!(trace["events"].as_array().unwrap().len(), frames.len(), "every event is in the log");
    let batches = app.log.batches_written() - before;
    let bound = 2 + (elapsed.as_millis() / 100) as u64;
    assert!(batches <= bound, "{batches} batches for {} events over {elapsed:?} (bound {bound})", frames.len());
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn two_replicas_on_one_postgres_cancel_and_resume_each_others_runs() {
    let db = TestDb::new(Backend::Postgres).await;
    let a = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    let b = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;

    // Resume through B follows A's live run to the end.
    let mut on_a = start(&a, "ann", json!({"message": "[mock:words=40] [mock:delay=10]"})).await;
    let trace_id = on_a.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
    on_a.until("text_delta").await;
    let via_b = resume(&b, "ann", &trace_id, Some(0)).await.rest().await;
    let own = on_a.rest().await;
    assert_eq!(via_b.last().unwrap().kind(), "done");
    assert_eq!(joined(&via_b, "text_delta"), joined(&own, "text_delta"));
    assert_eq!(via_b.len(), own.len());

    // Cancel through B stops A's run.
    let mut on_a = start(&a, "ann", json!({"message": SLOW})).await;
    let trace_id = on_a.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
    on_a.until("text_delta").await;
    let (status, body) = b.post("/api/cancel_stream", "ann", json!({"trace_id": trace_id})).await;
    assert_eq!(status, 200, "{body}");
    let frames = on_a.rest().await;
    assert_eq!(terminal_kinds(&frames), ["cancelled"]);
    let (_, trace) = b.get(&format!("/api/trace/{trace_id}"), "ann").await;
    assert_eq!(trace["status"], "cancelled");
}

/// A run's log is written a moment after its stream ends (held back here by a lock on the
/// log's table): its trace, read right after, on the replica that ran it and on another, is
/// whole all the same, with exactly what the stream sent.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_trace_read_right_after_its_stream_is_whole_on_any_replica() {
    let db = TestDb::new(Backend::Postgres).await;
    let (a, b) = (TestApp::on(&db.url, "").await, TestApp::on(&db.url, "").await);
    let hold = db.hold_logs().await;
    let frames = a.chat("ann", json!({"message": "[mock:words=20] [mock:delay=5]"})).await;
    assert_eq!(terminal_kinds(&frames), ["complete"]);
    let trace_id = frames[0].data["trace_id"].as_str().unwrap().to_owned();
    let release = hold.release_after(Duration::from_millis(300));
    let path = format!("/api/trace/{trace_id}");
    let (here, there) = tokio::join!(a.get(&path, "ann"), b.get(&path, "ann"));
    let sent: Vec<(u64, Value)> = frames.iter().map(|f| (f.id, f.data.clone())).collect();
    for (status, trace) in [here, there] {
        assert_eq!(status, 200, "{trace}");
        assert_eq!(trace["status"], "completed");
        let logged: Vec<(u64, Value)> = trace["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["seq"].as_u64().unwrap(), e["data"].clone()))
            .collect();
        assert_eq!(logged, sent, "the trace holds exactly what was sent");
    }
    release.await.unwrap();
}

#[tokio::test]
async fn graceful_shutdown_lets_runs_finish_and_refuses_new_ones() {
    let app = TestApp::spawn(Backend::Sqlite, "[server]\nshutdown_grace_secs = 10").await;
    let mut live = start(&app, "ann", json!({"message": "[mock:words=40] [mock:delay=10]"})).await;
    live.until("text_delta").await;
    let stop = app.stop.clone();
    let draining = tokio::spawn(async move { stop.graceful().await });
    // The drain flag is set at once; poll until a new run is refused.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, error) = app.post("/api/chat/stream", "ann", json!({"message": "too late"})).await;
        if status == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(error["code"], "SERVICE_UNAVAILABLE");
            break;
        }
        assert!(Instant::now() < deadline, "new runs were never refused");
        // A run that got in before the flag: let it finish, it is part of the drain.
        tokio::task::yield_now().await;
    }
    let (status, body) = app.get("/readyz", "ann").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "not ready while draining: {body}");
    assert_eq!(app.get("/healthz", "ann").await.0, StatusCode::OK, "but alive");
    let frames = live.rest().await;
    assert_eq!(terminal_kinds(&frames), ["complete"], "the running answer finished");
    draining.await.unwrap();
}

#[tokio::test]
async fn graceful_shutdown_cancels_what_outlives_the_grace_period() {
    let app = TestApp::spawn(Backend::Sqlite, "[server]\nshutdown_grace_secs = 0").await;
    let mut live = start(&app, "ann", json!({"message": SLOW})).await;
    let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
    live.until("text_delta").await;
    app.stop.graceful().await;
    let frames = live.rest().await;
    assert_eq!(terminal_kinds(&frames), ["cancelled"]);
    assert_eq!(frames.last().unwrap().kind(), "done");
    // The stopped server answers no more: read what it left through a new one.
    let after = TestApp::on(&app.db_url, "").await;
    let conversation = frames[0].data["conversation_id"].as_str().unwrap();
    let (_, loaded) = after.get(&format!("/api/conversations/{conversation}"), "ann").await;
    assert_eq!(loaded["messages"][1]["cancelled"], true, "the partial answer is kept");
    let (_, trace) = after.get(&format!("/api/trace/{trace_id}"), "ann").await;
    assert_eq!(trace["status"], "cancelled");
}

/// A chatd process of the real binary on a SQLite file.
/// A chatd process on a SQLite file in `dir`.
async fn sqlite_process(dir: &std::path::Path, extra: &str) -> Replica {
    Replica::start(&format!("sqlite://{}/chatd.db", dir.display()), extra).await
}

#[tokio::test]
async fn sigterm_drains_the_real_binary() {
    let dir = tempfile::tempdir().unwrap();
    let process = sqlite_process(dir.path(), "").await;
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/api/chat/stream", process.base))
        .json(&json!({"message": "[mock:words=40] [mock:delay=10]"}))
        .send()
        .await
        .unwrap();
    let mut live = Live::open(response).await;
    live.until("text_delta").await;
    process.signal("-TERM");
    let frames = live.rest().await;
    assert_eq!(terminal_kinds(&frames), ["complete"], "the answer in flight finished");
    assert!(process.exited().await.success(), "chatd exited cleanly after draining");
}

#[tokio::test]
async fn without_continue_after_restart_a_run_killed_with_kill_9_is_marked_interrupted_keeping_its_text() {
    // (With `runs.continue_after_restart`, the default, the restart continues it: see
    // `takeover`.)
    let dir = tempfile::tempdir().unwrap();
    let no_continuing = "[runs]\ncontinue_after_restart = false\n";
    let process = sqlite_process(dir.path(), no_continuing).await;
    let client = reqwest::Client::new();
    let response =
        client.post(format!("{}/api/chat/stream", process.base)).json(&json!({"message": SLOW})).send().await.unwrap();
    let mut live = Live::open(response).await;
    let start = live.until("start").await.data.clone();
    let trace_id = start["trace_id"].as_str().unwrap().to_owned();
    // Wait (bounded) until some text is in the log, then kill without warning.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        live.until("text_delta").await;
        let trace: Value =
            client.get(format!("{}/api/trace/{trace_id}", process.base)).send().await.unwrap().json().await.unwrap();
        if trace["events"].as_array().is_some_and(|e| e.iter().any(|e| e["type"] == "text_delta")) {
            break;
        }
        assert!(Instant::now() < deadline);
    }
    process.signal("-KILL");
    drop(process);
    drop(live);

    let restarted = sqlite_process(dir.path(), no_continuing).await;
    let trace: Value =
        client.get(format!("{}/api/trace/{trace_id}", restarted.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(trace["status"], "interrupted");
    let logged: String = trace["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "text_delta")
        .map(|e| e["data"]["text"].as_str().unwrap())
        .collect();
    assert!(!logged.is_empty());
    let conversation = start["conversation_id"].as_str().unwrap();
    let loaded: Value = client
        .get(format!("{}/api/conversations/{conversation}", restarted.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let message = &loaded["messages"][1];
    assert_eq!(message["content"], format!("{logged}\n\n[interrupted]"));
    assert_eq!(message["cancelled"], true);

    // Its stream, resumed, ends the way the contract promises: one error, then done.
    let resumed = client
        .get(format!("{}/api/chat/stream/{trace_id}", restarted.base))
        .header("last-event-id", "1")
        .send()
        .await
        .unwrap();
    let frames = read_frames(resumed).await;
    let ending: Vec<&Value> = frames.iter().rev().take(2).rev().map(|f| &f.data).collect();
    assert_eq!(terminal_kinds(&frames), ["error"]);
    assert_eq!(ending[0]["code"], "SERVICE_UNAVAILABLE");
    assert_eq!(ending[0]["message"], "The server stopped during the run");
    assert_eq!(ending[0]["trace_id"], trace_id.as_str());
    assert_eq!(ending[1]["type"], "done");
    assert_eq!(ending[1]["conversation_id"], conversation);

    // Read as a response (CONTRACT.md §20), it failed with that error: not in progress.
    let id = format!("resp_{}", trace_id.replace('-', ""));
    let response: Value =
        client.get(format!("{}/v1/responses/{id}", restarted.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(response["status"], "failed", "{response}");
    assert_eq!(response["error"]["message"], "The server stopped during the run", "{response}");
}

both_backends! {
    async fn resuming_past_the_end_of_a_finished_run_invents_nothing(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let frames = app.chat("ann", json!({"message": "hello"})).await;
        let done = frames.last().unwrap();
        assert_eq!(done.kind(), "done");
        let trace_id = done.data["trace_id"].as_str().unwrap();
        app.log.flush().await.unwrap();
        let path = format!("/api/chat/stream/{trace_id}");
        let seen_all = app
            .client
            .get(app.url(&path))
            .header("x-client-id", "ann")
            .header("last-event-id", done.id.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(seen_all.status(), StatusCode::NO_CONTENT, "the client saw `done`: nothing to replay");
        assert_eq!(seen_all.text().await.unwrap(), "");
        let last = resume(&app, "ann", trace_id, Some(done.id - 1)).await.rest().await;
        assert_eq!(last.iter().map(|f| (f.id, f.kind())).collect::<Vec<_>>(), [(done.id, "done")]);
        for after in ["18446744073709551615", "9223372036854775808"] {
            let (status, body) = app.get(&format!("{path}?after={after}"), "ann").await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{after}: {body}");
            assert_eq!(body["code"], "VALIDATION_ERROR");
        }
        let (_, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
        assert_eq!(trace["status"], "completed");
    }
}

both_backends! {
    async fn simultaneous_requests_never_pass_the_running_limit(backend: Backend) {
        let app = TestApp::spawn(backend, "[limits]\nmax_concurrent_runs_per_user = 4\n").await;
        let slow = json!({"message": "[mock:words=200] [mock:delay=20]"});
        let requests = (0..20).map(|_| {
            app.client.post(app.url("/api/chat/stream")).header("x-client-id", "ann").json(&slow).send()
        });
        let responses = futures_util::future::join_all(requests).await;
        let statuses: Vec<u16> = responses.iter().map(|r| r.as_ref().unwrap().status().as_u16()).collect();
        assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 4, "{statuses:?}");
        assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 16, "{statuses:?}");

        // Three of four running: a comparison's two runs do not fit.
        drop(responses);
        let app = TestApp::spawn(backend, "[limits]\nmax_concurrent_runs_per_user = 4\n").await;
        let mut live = Vec::new();
        for _ in 0..3 {
            live.push(start(&app, "bob", slow.clone()).await);
        }
        let ab = json!({"message": "both", "profile_a": "default", "profile_b": "other"});
        let (status, body) = app.post("/api/ab/stream", "bob", ab.clone()).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
        assert_eq!(body["code"], "RATE_LIMITED");
        for run in &mut live {
            run.until("start").await;
        }
    }
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn the_running_limit_holds_across_replicas() {
    let db = TestDb::new(Backend::Postgres).await;
    let config = "[limits]\nmax_concurrent_runs_per_user = 3\n";
    let (one, two) = (TestApp::on(&db.url, config).await, TestApp::on(&db.url, config).await);
    let slow = json!({"message": "[mock:words=200] [mock:delay=20]"});
    let requests = (0..12).map(|i| {
        let app = if i % 2 == 0 { &one } else { &two };
        app.client.post(app.url("/api/chat/stream")).header("x-client-id", "ann").json(&slow).send()
    });
    let responses = futures_util::future::join_all(requests).await;
    let statuses: Vec<u16> = responses.iter().map(|r| r.as_ref().unwrap().status().as_u16()).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 3, "{statuses:?}");
    assert!(statuses.iter().all(|s| *s == 200 || *s == 429), "{statuses:?}");
}

both_backends! {
    async fn of_simultaneous_cancels_exactly_one_succeeds(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let mut live = start(&app, "ann", json!({"message": SLOW})).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        live.until("text_delta").await;
        let cancels = (0..10).map(|_| app.post("/api/cancel_stream", "ann", json!({"trace_id": trace_id})));
        let answers = futures_util::future::join_all(cancels).await;
        let statuses: Vec<u16> = answers.iter().map(|(s, _)| s.as_u16()).collect();
        assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 1, "{statuses:?}");
        assert!(answers.iter().all(|(s, body)| *s == 200 || (*s == 409 && body["code"] == "CONFLICT")), "{answers:?}");
        assert_eq!(terminal_kinds(&live.rest().await), ["cancelled"]);
    }
}
