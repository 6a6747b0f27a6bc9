//! Runs that outlive their server (CONTRACT.md §19), with real processes killed with
//! `kill -9`: on SQLite the restart continues the run; on Postgres another replica, already
//! running, takes it over once the dead one's heartbeat lapses. Each continued run ends in
//! one `complete` and `done`, its clients resume it as one coherent answer, and its tools
//! ran at most once (again only when idempotent).

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::fixture::*;
use crate::helpers::*;
use crate::runs::terminal_kinds;

const SLOW: &str = "[mock:words=300] [mock:delay=15] [mock:think=off]";

/// Quick beats, so that a replica's death is noticed within a second.
const RUNS: &str = "[runs]\nheartbeat_secs = 0.2\ntakeover_after_secs = 1\n";

/// Where a killed replica's runs go on: the restart of a SQLite process, or the other replica
/// of a Postgres cluster, running beside it all along.
struct Setup {
    db: TestDb,
    backend: Backend,
    extra: String,
    other: Option<Replica>,
}

impl Setup {
    async fn new(backend: Backend, extra: &str) -> (Self, Replica) {
        let extra = format!("{RUNS}{extra}");
        let extra = extra.as_str();
        let db = TestDb::new(backend).await;
        let first = Replica::start(&db.url, extra).await;
        let other = match backend {
            Backend::Postgres => Some(Replica::start(&db.url, extra).await),
            Backend::Sqlite => None,
        };
        (Self { db, backend, extra: extra.to_owned(), other }, first)
    }

    /// The replica that continues the runs of the one killed.
    async fn survivor(&mut self) -> Replica {
        match self.other.take() {
            Some(other) => other,
            None => Replica::start(&self.db.url, &self.extra).await,
        }
    }

    fn continued_status(&self) -> &'static str {
        match self.backend {
            Backend::Postgres => "Continued on another server",
            Backend::Sqlite => "Continued after a restart",
        }
    }
}

/// The frames a client saw before its server died, and after it resumed elsewhere, are one
/// coherent stream: seqs only grow, one terminal event, then `done`.
fn assert_one_stream(before: &[Frame], after: &[Frame]) {
    let seqs: Vec<u64> = before.iter().chain(after).map(|f| f.id).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "no seq twice, none going back: {seqs:?}");
    let all: Vec<Frame> = before.iter().chain(after).cloned().collect();
    assert_eq!(terminal_kinds(&all), ["complete"]);
    assert_eq!(all.last().unwrap().kind(), "done");
}

both_backends! {
    async fn a_run_whose_server_is_killed_mid_answer_is_continued_as_one_answer(backend: Backend) {
        let (mut setup, first) = Setup::new(backend, "").await;
        let mut live = first.post_stream(json!({"message": SLOW})).await;
        let start = live.until("start").await.data.clone();
        let trace_id = start["trace_id"].as_str().unwrap().to_owned();
        live.until("text_delta").await;
        first.until_logged(&trace_id, |e| e["type"] == "text_delta").await;
        // A few more words reach the client, some of them perhaps never logged.
        for _ in 0..5 {
            live.until("text_delta").await;
        }
        let killed_at = Instant::now();
        first.kill_9();
        let before = live.seen().to_vec();
        let seen_up_to = before.last().unwrap().id;

        let survivor = setup.survivor().await;
        let after = survivor.resume(&trace_id, seen_up_to).await;
        let continued_in = killed_at.elapsed();
        assert_one_stream(&before, &after);
        // What the dead process logged beyond what the client read comes first (a slow
        // client), then the continuation: the step it saw in part is void, then the status.
        let resets: Vec<usize> = (0..after.len()).filter(|&i| after[i].kind() == "step_reset").collect();
        assert_eq!(resets.len(), 1, "{:?}", after.iter().map(Frame::kind).collect::<Vec<_>>());
        let reset = resets[0];
        assert_eq!(after[reset].data["step"], 0);
        let voided = after[..reset].iter().all(|f| matches!(f.kind(), "text_delta" | "step_start" | "status"));
        assert!(voided, "only the voided step's events before it");
        assert_eq!(after[reset + 1].data, json!({"type": "status", "message": setup.continued_status()}));
        let all: Vec<Frame> = before.iter().chain(&after).cloned().collect();
        let complete = &all.iter().find(|f| f.kind() == "complete").unwrap().data["payload"];
        let answer = complete["message"].as_str().unwrap();
        assert_eq!(answer.split_whitespace().count(), 300, "the whole answer, once: {answer}");
        assert_eq!(surviving_text(&all), answer, "the client's text is the answer");
        let conversation = start["conversation_id"].as_str().unwrap();
        let stored = survivor.get(&format!("/api/conversations/{conversation}")).await;
        assert_eq!(stored["messages"][1]["content"], answer);
        assert_eq!(stored["messages"][1]["cancelled"], false);
        let trace = survivor.get(&format!("/api/trace/{trace_id}")).await;
        assert_eq!(trace["status"], "completed");
        // A client that resumes from the start reads the same answer from the log.
        let replayed = survivor.resume(&trace_id, 0).await;
        assert_eq!(surviving_text(&replayed), answer);
        eprintln!("{backend:?}: kill -9 to the continued run's end in {continued_in:?}");
    }
}

both_backends! {
    async fn a_run_whose_server_is_killed_mid_tool_call_runs_it_again_only_if_idempotent(backend: Backend) {
        // Three HTTP tools, each its own server: one answers at once (it completes before the
        // kill), two answer slowly (the kill comes while they run); of those, one is
        // idempotent. Each request is answered in turn: a call run again gets the next answer.
        let answer = |text: &str| Scripted::json(200, json!({"text": text}));
        let slow = |text: &str| answer(text).then(Part::Pause(Duration::from_secs(3)));
        let quick = Fixture::start(vec![answer("quick done"), answer("quick again")]).await;
        let once = Fixture::start(vec![slow("once done"), answer("once again")]).await;
        let again = Fixture::start(vec![slow("again done"), answer("again again")]).await;
        let tool = |name: &str, base: &str, idempotent: bool| {
            format!(
                "[http_tools.{name}]\nurl = \"{base}/{name}\"\ndescription = \"{name}\"\nidempotent = {idempotent}\n\
                 input_schema = {{ type = \"object\", properties = {{ q = {{ type = \"string\" }} }} }}\n"
            )
        };
        let config = [tool("quick", &quick.base, true), tool("once", &once.base, false), tool("again", &again.base, true)]
            .concat();
        let (mut setup, first) = Setup::new(backend, &config).await;
        let message = r#"Three tools [mock:tool=quick {"q": "a"}] [mock:tool=once {"q": "b"}] [mock:tool=again {"q": "c"}] [mock:think=off]"#;
        let mut live = first.post_stream(json!({"message": message})).await;
        let start = live.until("start").await.data.clone();
        let trace_id = start["trace_id"].as_str().unwrap().to_owned();
        // The quick call has completed (and is kept), the slow ones are running.
        first.until_logged(&trace_id, |e| e["type"] == "tool_complete" && e["data"]["tool"] == "quick").await;
        live.until("tool_complete").await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while once.received().is_empty() || again.received().is_empty() {
            assert!(Instant::now() < deadline, "the slow tools were called");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        first.kill_9();
        let before = live.seen().to_vec();
        let seen_up_to = before.last().unwrap().id;

        let survivor = setup.survivor().await;
        let after = survivor.resume(&trace_id, seen_up_to).await;
        assert_one_stream(&before, &after);
        let continued = json!({"type": "status", "message": setup.continued_status()});
        assert!(after.iter().any(|f| f.data == continued), "{after:?}");
        assert!(!after.iter().any(|f| f.kind() == "step_reset"), "no model call was going: nothing to void");
        assert_eq!(quick.received().len(), 1, "a completed call is never run again");
        assert_eq!(once.received().len(), 1, "a call whose tool is not idempotent is not run again");
        let calls = again.received();
        assert_eq!(calls.len(), 2, "an idempotent tool's interrupted call runs again");
        let key = |r: &Received| r.headers["idempotency-key"].to_str().unwrap().to_owned();
        assert_eq!(key(&calls[0]), key(&calls[1]), "with the same key");
        assert!(key(&calls[0]).starts_with(&format!("{trace_id}:")), "{}", key(&calls[0]));

        let all: Vec<Frame> = before.iter().chain(&after).cloned().collect();
        let complete = &all.iter().find(|f| f.kind() == "complete").unwrap().data["payload"];
        let history = complete["tool_history"].as_array().unwrap();
        let outputs: Vec<(&str, bool)> =
            history.iter().map(|h| (h["output"].as_str().unwrap(), h["is_error"].as_bool().unwrap())).collect();
        assert_eq!(outputs[0], ("quick done", false));
        assert!(outputs[1].0.starts_with("The server stopped while this tool call ran"), "{outputs:?}");
        assert!(outputs[1].1);
        assert_eq!(outputs[2], ("again again", false));
        let text = complete["message"].as_str().unwrap();
        assert!(text.contains("once said Error: The server stopped while this tool call ran"), "the model was told: {text}");
        assert_eq!(surviving_text(&all), text);
        let completes: Vec<&Value> =
            all.iter().filter(|f| f.kind() == "tool_complete").map(|f| &f.data).collect();
        assert_eq!(completes.len(), 3, "each call completes once in the client's stream: {completes:?}");
        let conversation = start["conversation_id"].as_str().unwrap();
        let stored = survivor.get(&format!("/api/conversations/{conversation}")).await;
        assert_eq!(stored["messages"][1]["content"], text);
        assert_eq!(stored["messages"][1]["tool_history"], complete["tool_history"]);
    }
}

both_backends! {
    async fn a_call_that_may_not_run_twice_starts_once_the_step_that_asked_for_it_is_written(backend: Backend) {
        // A tool that is not idempotent, slow: the kill comes while it runs.
        let once = Fixture::start(vec![
            Scripted::json(200, json!({"text": "once done"})).then(Part::Pause(Duration::from_secs(3))),
            Scripted::json(200, json!({"text": "once again"})),
        ])
        .await;
        let config = format!(
            "{RUNS}[http_tools.once]\nurl = \"{}/once\"\ndescription = \"once\"\nidempotent = false\n\
             input_schema = {{ type = \"object\", properties = {{ q = {{ type = \"string\" }} }} }}\n",
            once.base
        );
        let db = TestDb::new(backend).await;
        // Its log writes what it holds every 5 s: the step is in the database by the kill only
        // if the run waited for it before the call.
        let first = Replica::start_with_env(&db.url, &config, &[("CHATD_STREAM__FLUSH_INTERVAL_MS", "5000")]).await;
        let other = match backend {
            Backend::Postgres => Some(Replica::start(&db.url, &config).await),
            Backend::Sqlite => None,
        };
        let mut live = first.post_stream(json!({"message": r#"One tool [mock:tool=once {"q": "b"}] [mock:think=off]"#})).await;
        let trace_id = live.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
        let deadline = Instant::now() + Duration::from_secs(10);
        while once.received().is_empty() {
            assert!(Instant::now() < deadline, "the tool was called");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        first.kill_9();
        let survivor = match other {
            Some(other) => other,
            None => Replica::start(&db.url, &config).await,
        };
        let all = survivor.resume(&trace_id, 0).await;
        assert_eq!(terminal_kinds(&all), ["complete"], "{all:?}");
        assert_eq!(once.received().len(), 1, "the call is not made again, nor the model asked again");
        let complete = &all.iter().find(|f| f.kind() == "complete").unwrap().data["payload"];
        let history = complete["tool_history"].as_array().unwrap();
        assert_eq!(history.len(), 1, "{history:?}");
        let output = history[0]["output"].as_str().unwrap();
        assert!(output.starts_with("The server stopped while this tool call ran"), "{output}");
    }
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn sigterm_hands_running_runs_over_to_a_live_replica_instead_of_cancelling_them() {
    let (mut setup, mut first) = Setup::new(Backend::Postgres, "").await;
    let mut live = first.post_stream(json!({"message": SLOW})).await;
    let start = live.until("start").await.data.clone();
    let trace_id = start["trace_id"].as_str().unwrap().to_owned();
    live.until("text_delta").await;
    let asked_at = Instant::now();
    first.signal("-TERM");
    // Its stream here ends when the replica stops, without an end of the run.
    let before = live.rest().await;
    assert!(
        terminal_kinds(&before).is_empty(),
        "not cancelled: {:?}",
        before.iter().map(Frame::kind).collect::<Vec<_>>()
    );
    let exited = tokio::task::spawn_blocking(move || first.child.wait().map(|s| s.success())).await.unwrap().unwrap();
    assert!(exited, "the replica exited cleanly after handing its run over");
    let drained_in = asked_at.elapsed();
    assert!(drained_in < Duration::from_secs(8), "the drain's grace is short when it hands over: {drained_in:?}");

    let survivor = setup.survivor().await;
    let after = survivor.resume(&trace_id, before.last().unwrap().id).await;
    assert_one_stream(&before, &after);
    let reset = after.iter().position(|f| f.kind() == "step_reset").expect("the step it saw in part is void");
    assert_eq!(after[reset + 1].data, json!({"type": "status", "message": "Continued on another server"}));
    let all: Vec<Frame> = before.iter().chain(&after).cloned().collect();
    let answer =
        all.iter().find(|f| f.kind() == "complete").unwrap().data["payload"]["message"].as_str().unwrap().to_owned();
    assert_eq!(answer.split_whitespace().count(), 300);
    assert_eq!(surviving_text(&all), answer);
    eprintln!("SIGTERM: drained in {drained_in:?}, continued to the end in {:?}", asked_at.elapsed());
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_rolling_restart_of_two_replicas_under_50_runs_loses_none() {
    let extra = "[limits]\nmax_concurrent_runs_per_user = 500\nrequests_per_minute = 0\n\
                 [tools]\nrequire_approval = [\"calculator\"]\n";
    let (mut setup, a) = Setup::new(Backend::Postgres, extra).await;
    let b = setup.other.take().unwrap();
    let client = reqwest::Client::new();
    let first_event = async |replica: &Replica, body: Value, kind: &str| {
        let mut live = replica.post_stream(body).await;
        let start = live.until("start").await.data.clone();
        let event = live.until(kind).await.data.clone();
        (start, event)
    };
    // 40 answers streaming, half on each replica; 5 runs queued behind 5 of them; 5 waiting
    // for an approval.
    let (mut answers, mut queued) = (Vec::new(), Vec::new());
    for i in 0..40 {
        let replica = if i % 2 == 0 { &a } else { &b };
        let message = format!("Answer {i} [mock:words=250] [mock:delay=40] [mock:think=off]");
        let answer = first_event(replica, json!({"message": message}), "text_delta").await.0;
        if i < 5 {
            let conversation_id = answer["conversation_id"].clone();
            let body =
                json!({"message": "Then this [mock:words=20] [mock:think=off]", "conversation_id": conversation_id});
            let (start, status) = first_event(&b, body, "status").await;
            assert_eq!(status["message"], "Queued");
            queued.push(start);
        }
        answers.push(answer);
    }
    let mut waiting = Vec::new();
    for i in 0..5 {
        let body = json!({"message": format!(r#"Count {i} [mock:tool=calculator {{"expression": "{i} + 1"}}] [mock:think=off]"#)});
        let (start, request) = first_event(&a, body, "tool_approval_request").await;
        waiting.push((start, request["approval_id"].as_str().unwrap().to_owned()));
    }

    // The rolling restart: each replica in turn drains (handing its runs over) and comes back.
    let stop = async |mut replica: Replica| {
        replica.signal("-TERM");
        let exited = tokio::task::spawn_blocking(move || replica.child.wait().map(|s| s.success())).await.unwrap();
        assert!(exited.unwrap(), "a replica exits cleanly once it handed its runs over");
    };
    stop(a).await;
    let a = Replica::start(&setup.db.url, &setup.extra).await;
    stop(b).await;
    let b = Replica::start(&setup.db.url, &setup.extra).await;

    for (_, approval) in &waiting {
        let response = client
            .post(format!("{}/api/approvals/{approval}", b.base))
            .json(&json!({"approved": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    }
    let runs: Vec<&Value> = answers.iter().chain(&queued).chain(waiting.iter().map(|(start, _)| start)).collect();
    assert_eq!(runs.len(), 50);
    let deadline = Instant::now() + Duration::from_secs(90);
    for run in &runs {
        let trace_id = run["trace_id"].as_str().unwrap();
        loop {
            let trace = a.get(&format!("/api/trace/{trace_id}")).await;
            if trace["status"] != "running" && trace["status"] != "queued" && trace["status"] != "waiting" {
                assert_eq!(trace["status"], "completed", "{trace_id}: {}", trace["error"]);
                break;
            }
            assert!(Instant::now() < deadline, "{trace_id} never ended: {}", trace["status"]);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for (i, answer) in answers.iter().enumerate() {
        let conversation = b.get(&format!("/api/conversations/{}", answer["conversation_id"].as_str().unwrap())).await;
        let text = conversation["messages"][1]["content"].as_str().unwrap();
        assert_eq!(text.split_whitespace().count(), 250, "answer {i} whole, once: {text}");
        if i < 5 {
            assert_eq!(conversation["messages"].as_array().unwrap().len(), 4, "its queued message answered after it");
            assert_eq!(conversation["messages"][3]["content"].as_str().unwrap().split_whitespace().count(), 20);
        }
    }
    let mut continued = 0;
    for run in &runs {
        let trace = a.get(&format!("/api/trace/{}", run["trace_id"].as_str().unwrap())).await;
        let events = trace["events"].as_array().unwrap();
        continued += usize::from(events.iter().any(|e| e["data"]["message"] == "Continued on another server"));
    }
    assert!(continued > 0, "the restarts handed runs over");
    eprintln!("rolling restart: {continued} of 50 runs continued on another replica");
    for (i, (start, _)) in waiting.iter().enumerate() {
        let conversation = b.get(&format!("/api/conversations/{}", start["conversation_id"].as_str().unwrap())).await;
        let answer = &conversation["messages"][1];
        assert_eq!(answer["tool_history"][0]["output"], (i + 1).to_string(), "{answer}");
    }
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_replica_that_stalls_past_the_take_over_stops_the_runs_the_other_took() {
    let (mut setup, first) = Setup::new(Backend::Postgres, "").await;
    let mut live = first.post_stream(json!({"message": SLOW})).await;
    let start = live.until("start").await.data.clone();
    let trace_id = start["trace_id"].as_str().unwrap().to_owned();
    live.until("text_delta").await;
    first.until_logged(&trace_id, |e| e["type"] == "text_delta").await;
    // Frozen (as a process starved of CPU, or paused by its host) past the take-over.
    first.signal("-STOP");
    let survivor = setup.survivor().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let events = survivor.get(&format!("/api/trace/{trace_id}")).await["events"].clone();
        if events.as_array().unwrap().iter().any(|e| e["data"]["message"] == "Continued on another server") {
            break;
        }
        assert!(Instant::now() < deadline, "taken over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    first.signal("-CONT");
    let after = survivor.resume(&trace_id, 0).await;
    assert_eq!(terminal_kinds(&after), ["complete"]);
    let answer =
        after.iter().find(|f| f.kind() == "complete").unwrap().data["payload"]["message"].as_str().unwrap().to_owned();
    assert_eq!(surviving_text(&after), answer);
    assert_eq!(answer.split_whitespace().count(), 300);
    // The stalled one, back, stopped its copy without an end of its own: one answer stored.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let conversation =
        survivor.get(&format!("/api/conversations/{}", start["conversation_id"].as_str().unwrap())).await;
    assert_eq!(conversation["messages"].as_array().unwrap().len(), 2, "{conversation}");
    assert_eq!(conversation["messages"][1]["content"], answer.as_str());
    let trace = survivor.get(&format!("/api/trace/{trace_id}")).await;
    let ends = trace["events"].as_array().unwrap().iter().filter(|e| e["type"] == "done").count();
    assert_eq!(ends, 1, "one end in the log");
}
