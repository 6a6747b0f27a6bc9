//! A new message while a run of its conversation is going (CONTRACT.md §16): `reject`
//! refuses it (409 naming the run, nothing stored), `interrupt` cancels the run and follows
//! its partial answer, `rollback` also deletes that partial answer; never a message on a
//! branch that hides it. Loading a conversation lists its `active_runs`.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::runs::{start, terminal_kinds};

const SLOW: &str = "A long one [mock:words=400] [mock:delay=15] [mock:think=off]";

/// A chat request as `ann` with an `Idempotency-Key`, ready to send.
fn keyed_post(app: &TestApp, key: &str, body: &Value) -> reqwest::RequestBuilder {
    app.client.post(app.url("/api/chat/stream")).header("x-client-id", "ann").header("idempotency-key", key).json(body)
}

async fn loaded(app: &TestApp, conversation: &str) -> Value {
    app.get(&format!("/api/conversations/{conversation}"), "ann").await.1
}

/// The roles and the first words of the loaded branch.
fn branch_of(conversation: &Value) -> Vec<(String, String)> {
    conversation["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let words: String = m["content"].as_str().unwrap().split_whitespace().take(2).collect::<Vec<_>>().join(" ");
            (m["role"].as_str().unwrap().to_owned(), words)
        })
        .collect()
}

both_backends! {
    async fn reject_refuses_a_message_while_a_run_is_going_and_stores_nothing(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let mut first = start(&app, "ann", json!({"message": SLOW})).await;
        first.until("text_delta").await;
        let conversation = first.seen()[0].data["conversation_id"].as_str().unwrap().to_owned();
        let trace_id = first.seen()[0].data["trace_id"].as_str().unwrap().to_owned();

        // Loading shows the run that is going, and how far it got.
        let during = loaded(&app, &conversation).await;
        let active = during["active_runs"].as_array().unwrap();
        assert_eq!(active.len(), 1, "{during}");
        assert_eq!(active[0]["trace_id"], trace_id.as_str());
        assert_eq!(active[0]["status"], "running");
        assert!(active[0]["last_seq"].as_u64().unwrap() >= 3, "{active:?}");

        let (status, error) = app
            .post("/api/chat/stream", "ann", json!({"message": "Me too", "conversation_id": conversation, "multitask": "reject"}))
            .await;
        assert_eq!(status, StatusCode::CONFLICT, "{error}");
        assert_eq!(error["code"], "CONFLICT");
        assert!(error["message"].as_str().unwrap().contains(&trace_id), "names the running trace: {error}");
        // The first run goes on untouched.
        let frames = first.rest().await;
        assert_eq!(terminal_kinds(&frames), ["complete"]);
        let after = loaded(&app, &conversation).await;
        assert_eq!(branch_of(&after).len(), 2, "the refused message was not stored: {after}");
        assert_eq!(after["active_runs"], json!([]));
        // Once it ended, the next message goes.
        let next = app.chat("ann", json!({"message": "Now", "conversation_id": conversation})).await;
        assert_eq!(terminal_kinds(&next), ["complete"]);
    }

    async fn interrupt_cancels_the_run_keeps_its_partial_and_the_new_run_sees_it(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let mut first = start(&app, "ann", json!({"message": SLOW})).await;
        first.until("text_delta").await;
        let conversation = first.seen()[0].data["conversation_id"].as_str().unwrap().to_owned();
        let second = app
            .chat("ann", json!({"message": "Stop, tell me this", "conversation_id": conversation, "multitask": "interrupt", "diagnostics": true}))
            .await;
        assert_eq!(terminal_kinds(&second), ["complete"]);
        let first = first.rest().await;
        assert_eq!(terminal_kinds(&first), ["cancelled"], "the first run was cancelled");
        let partial = joined(&first, "text_delta");
        assert!(!partial.is_empty());

        // One branch: the question, its partial answer, the new question, its answer.
        let after = loaded(&app, &conversation).await;
        let branch = branch_of(&after);
        let roles: Vec<&str> = branch.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "user", "assistant"], "{after}");
        assert_eq!(after["messages"][1]["cancelled"], true);
        assert!(after["messages"][1]["content"].as_str().unwrap().starts_with(partial.trim_end()));
        // The new run was sent the partial answer.
        let complete = second.iter().find(|f| f.kind() == "complete").unwrap();
        let sent = &complete.data["payload"]["diagnostics"]["messages"];
        let sent: Vec<&str> = sent.as_array().unwrap().iter().map(|m| m["content"].as_str().unwrap()).collect();
        assert!(sent.iter().any(|m| m.starts_with(partial.trim_end())), "{sent:?}");
    }

    async fn rollback_leaves_no_trace_of_the_cancelled_answer(backend: Backend) {
        let app = TestApp::spawn(backend, "[chat]\nmultitask = \"rollback\"").await;
        let mut first = start(&app, "ann", json!({"message": SLOW})).await;
        first.until("text_delta").await;
        let conversation = first.seen()[0].data["conversation_id"].as_str().unwrap().to_owned();
        let cancelled_answer = first.seen()[0].data["message_id"].as_str().unwrap().to_owned();
        let second = app.chat("ann", json!({"message": "Instead this", "conversation_id": conversation})).await;
        assert_eq!(terminal_kinds(&second), ["complete"]);
        assert_eq!(terminal_kinds(&first.rest().await), ["cancelled"]);
        let after = loaded(&app, &conversation).await;
        let branch = branch_of(&after);
        assert_eq!(
            branch,
            [
                ("user".to_owned(), "A long".to_owned()),
                ("user".to_owned(), "Instead this".to_owned()),
                ("assistant".to_owned(), "Mock reply:".to_owned()),
            ],
            "{after}"
        );
        assert_eq!(after["message_count"], 3);
        assert!(!after.to_string().contains(&cancelled_answer), "the cancelled answer is gone");
        // A request may still choose for itself: reject, against the configured rollback.
        let mut third = start(&app, "ann", json!({"message": SLOW, "conversation_id": conversation})).await;
        third.until("text_delta").await;
        let (status, _) = app
            .post("/api/chat/stream", "ann", json!({"message": "no", "conversation_id": conversation, "multitask": "reject"}))
            .await;
        assert_eq!(status, StatusCode::CONFLICT);
        let (status, error) = app
            .post("/api/chat/stream", "ann", json!({"message": "no", "conversation_id": conversation, "multitask": "later"}))
            .await;
        assert_eq!((status, error["field"].as_str()), (StatusCode::BAD_REQUEST, Some("multitask")), "{error}");
        drop(third);
    }
}

/// A conversation's stream (`GET /api/conversations/{id}/stream`), read event by event.
struct ConversationStream {
    events: std::pin::Pin<Box<dyn futures_util::Stream<Item = (String, Value)> + Send>>,
}

impl ConversationStream {
    async fn open(app: &TestApp, conversation: &str) -> Self {
        use eventsource_stream::Eventsource;
        use futures_util::StreamExt;
        let response = app
            .client
            .get(app.url(&format!("/api/conversations/{conversation}/stream")))
            .header("x-client-id", "ann")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let events = response
            .bytes_stream()
            .eventsource()
            .map(|e| e.expect("well-formed SSE"))
            .map(|e| (e.id, serde_json::from_str(&e.data).expect("JSON data")));
        Self { events: Box::pin(events) }
    }

    /// The events up to and with the `done` of the next run that ends.
    async fn next_run(&mut self) -> Vec<(String, Value)> {
        use futures_util::StreamExt;
        let mut run = Vec::new();
        loop {
            let event = tokio::time::timeout(std::time::Duration::from_secs(20), self.events.next())
                .await
                .expect("an event within 20 s")
                .expect("the stream goes on");
            let done = event.1["type"] == "done";
            run.push(event);
            if done {
                return run;
            }
        }
    }
}

impl ConversationStream {
    /// The events left, once the stream has ended (within 10 s).
    async fn ended(mut self) -> Vec<Value> {
        use futures_util::StreamExt;
        let mut left = Vec::new();
        let ends = async {
            while let Some((_, event)) = self.events.next().await {
                left.push(event);
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), ends).await.expect("the stream ends within 10 s");
        left
    }
}

/// Checks a run's events as the conversation stream gave them: one run, from its `start`
/// (seq 1) to its `done`, numbered without a gap, each tagged with the run.
fn one_whole_run(events: &[(String, Value)]) -> String {
    let trace_id = events[0].1["trace_id"].as_str().unwrap().to_owned();
    assert_eq!(events[0].1["type"], "start");
    for (i, (id, event)) in events.iter().enumerate() {
        assert_eq!(event["trace_id"], trace_id.as_str());
        assert_eq!(event["seq"], i as u64 + 1);
        assert_eq!(id, &format!("{trace_id}:{}", i + 1));
    }
    trace_id
}

both_backends! {
    async fn a_conversation_stream_shows_every_run_of_the_conversation_as_it_goes(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let first = app.chat("ann", json!({"message": "hello"})).await;
        let conversation = first[0].data["conversation_id"].as_str().unwrap().to_owned();
        let mut tab = ConversationStream::open(&app, &conversation).await;
        // Another tab sends; this one sees the run whole.
        let sent = app.chat("ann", json!({"message": "from the other tab [mock:words=12]", "conversation_id": conversation})).await;
        let seen = tab.next_run().await;
        assert_eq!(one_whole_run(&seen), sent[0].data["trace_id"].as_str().unwrap());
        let texts: Vec<Value> = seen.iter().map(|(_, e)| e.clone()).filter(|e| e["type"] == "text_delta").collect();
        assert_eq!(texts.iter().map(|e| e["text"].as_str().unwrap()).collect::<String>(), joined(&sent, "text_delta"));
        // A run that is going when a tab opens the stream: from its first event.
        let mut going = crate::runs::start(&app, "ann", json!({"message": SLOW, "conversation_id": conversation})).await;
        going.until("text_delta").await;
        let mut late = ConversationStream::open(&app, &conversation).await;
        let (_, cancelled) = app.post("/api/cancel_stream", "ann", json!({"conversation_id": conversation})).await;
        assert_eq!(cancelled["status"], "cancelled");
        let seen = late.next_run().await;
        assert_eq!(one_whole_run(&seen), going.seen()[0].data["trace_id"].as_str().unwrap());
        assert!(seen.iter().any(|(_, e)| e["type"] == "cancelled"));
        // And the first tab sees it too, after the one before.
        assert_eq!(one_whole_run(&tab.next_run().await), going.seen()[0].data["trace_id"].as_str().unwrap());
        // Another user's conversation is not found.
        let (status, _) = app.get(&format!("/api/conversations/{conversation}/stream"), "bob").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_conversation_stream_on_one_replica_shows_a_run_started_on_another() {
    let db = TestDb::new(Backend::Postgres).await;
    let a = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    let b = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    let first = a.chat("ann", json!({"message": "hello"})).await;
    let conversation = first[0].data["conversation_id"].as_str().unwrap().to_owned();
    let mut tab = ConversationStream::open(&a, &conversation).await;
    for round in 0..3 {
        let sent = b
            .chat("ann", json!({"message": format!("round {round} [mock:words=8]"), "conversation_id": conversation}))
            .await;
        let seen = tab.next_run().await;
        assert_eq!(one_whole_run(&seen), sent[0].data["trace_id"].as_str().unwrap(), "round {round}");
        let kinds: Vec<&str> = seen.iter().map(|(_, e)| e["type"].as_str().unwrap()).collect();
        let sent_kinds: Vec<&str> = sent.iter().map(Frame::kind).collect();
        assert_eq!(kinds, sent_kinds, "round {round}: the same events");
    }
}

both_backends! {
    async fn an_interrupt_at_the_run_limit_goes_and_a_keyed_retry_of_the_going_run_gets_it(backend: Backend) {
        let app = TestApp::spawn(backend, "[limits]\nmax_concurrent_runs_per_user = 1").await;
        let mut first = start(&app, "ann", json!({"message": SLOW})).await;
        first.until("text_delta").await;
        let conversation = first.seen()[0].data["conversation_id"].as_str().unwrap().to_owned();
        // The run it cancels does not count against the limit of one.
        let second = app
            .chat("ann", json!({"message": "Stop [mock:words=3]", "conversation_id": conversation, "multitask": "interrupt"}))
            .await;
        assert_eq!(terminal_kinds(&second), ["complete"]);
        assert_eq!(terminal_kinds(&first.rest().await), ["cancelled"]);

        // A retry of the request whose run is going gets that run: no 409, nothing stopped.
        let body = json!({"message": SLOW, "conversation_id": conversation});
        let keyed = || keyed_post(&app, "retry-me", &body);
        let mut going = crate::runs::Live::open(keyed().send().await.unwrap()).await;
        going.until("text_delta").await;
        let retry = keyed().send().await.unwrap();
        assert_eq!(retry.status(), StatusCode::OK);
        let mut again = crate::runs::Live::open(retry).await;
        assert_eq!(again.until("start").await.data["trace_id"], going.seen()[0].data["trace_id"]);
        let (_, cancelled) = app.post("/api/cancel_stream", "ann", json!({"conversation_id": conversation})).await;
        assert_eq!(cancelled["status"], "cancelled", "the run was still going: {cancelled}");
    }
}

#[tokio::test]
async fn a_keyed_retry_sent_while_its_first_try_still_starts_is_the_same_run_never_a_409() {
    // A server that never starts holds new runs for `mcp_start_wait_secs`: the first try's
    // client gives up while its start waits there, and the retry comes while it still does.
    let config = "[mcp_servers.hung]\ncommand = \"sleep\"\nargs = [\"600\"]\n[tools]\nmcp_start_wait_secs = 2\n";
    let app = TestApp::spawn(Backend::Sqlite, config).await;
    let (_, conversation) = app.post("/api/conversations", "ann", json!({"title": "retries"})).await;
    let conversation = conversation["id"].as_str().unwrap().to_owned();
    let body = json!({"message": SLOW, "conversation_id": conversation});
    let send = || keyed_post(&app, "flaky-network", &body);
    let gave_up = send().timeout(std::time::Duration::from_millis(300)).send().await;
    assert!(gave_up.is_err(), "the first try's client gives up before the start");
    let retry = send().send().await.unwrap();
    assert_eq!(retry.status(), StatusCode::OK, "a retry is never refused as a second message");
    let mut retry = crate::runs::Live::open(retry).await;
    let trace_id = retry.until("start").await.data["trace_id"].as_str().unwrap().to_owned();
    let during = loaded(&app, &conversation).await;
    let active: Vec<&str> =
        during["active_runs"].as_array().unwrap().iter().map(|r| r["trace_id"].as_str().unwrap()).collect();
    assert_eq!(active, [trace_id.as_str()], "one run: {during}");
    let (_, cancelled) = app.post("/api/cancel_stream", "ann", json!({"conversation_id": conversation})).await;
    assert_eq!(cancelled["status"], "cancelled");
    assert_eq!(terminal_kinds(&retry.rest().await), ["cancelled"]);
}

/// Issue 34: with the notice listener's connection killed, a replica heard the others once
/// more and never again (the listener's stream ended at its first error), until a restart.
/// Now it listens again every time, each follower reads the database again, and `/readyz`
/// says when it cannot.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn replicas_hear_each_other_again_each_time_their_listeners_are_killed() {
    use sqlx::Connection;
    let db = TestDb::new(Backend::Postgres).await;
    let name = db.url.rsplit('/').next().unwrap().split('?').next().unwrap().to_owned();
    let mut admin = sqlx::PgConnection::connect(&std::env::var("CHATD_TEST_POSTGRES_URL").unwrap()).await.unwrap();
    let a = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    let b = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    let first = a.chat("ann", json!({"message": "hello"})).await;
    let conversation = first[0].data["conversation_id"].as_str().unwrap().to_owned();
    let mut tab = ConversationStream::open(&a, &conversation).await;
    let listeners = "select pid from pg_stat_activity where datname = $1 and query like 'LISTEN%'";
    let mut killed: Vec<i32> = Vec::new();
    for round in 0..3 {
        // Both replicas' listeners, as a killed backend or a restarted server would lose them.
        let pids: Vec<(i32,)> = sqlx::query_as(listeners).bind(&name).fetch_all(&mut admin).await.unwrap();
        assert_eq!(pids.len(), 2, "round {round}: one listener per replica");
        for (pid,) in &pids {
            sqlx::query("select pg_terminate_backend($1)").bind(pid).execute(&mut admin).await.unwrap();
            killed.push(*pid);
        }
        // Both listen again, on new connections.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let now: Vec<(i32,)> = sqlx::query_as(listeners).bind(&name).fetch_all(&mut admin).await.unwrap();
            if now.len() == 2 && now.iter().all(|(pid,)| !killed.contains(pid)) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "round {round}: the listeners did not come back: {now:?}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        // What one replica does, a stream on the other sees.
        let sent = b
            .chat("ann", json!({"message": format!("round {round} [mock:words=8]"), "conversation_id": conversation}))
            .await;
        assert_eq!(one_whole_run(&tab.next_run().await), sent[0].data["trace_id"].as_str().unwrap(), "round {round}");
    }
    // While the listener cannot connect again, the replica is not ready, and says why.
    sqlx::query(&format!("alter database {name} with allow_connections false")).execute(&mut admin).await.unwrap();
    sqlx::query("select pg_terminate_backend(pid) from pg_stat_activity where datname = $1")
        .bind(&name)
        .execute(&mut admin)
        .await
        .unwrap();
    let readiness = |app: &TestApp| {
        let request = app.client.get(app.url("/readyz"));
        async move {
            let response = request.send().await.unwrap();
            (response.status(), response.text().await.unwrap())
        }
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let (status, body) = readiness(&a).await;
        if status == StatusCode::SERVICE_UNAVAILABLE && body.contains("notice listener") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "/readyz did not report the listener down: {status} {body}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    sqlx::query(&format!("alter database {name} with allow_connections true")).execute(&mut admin).await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while readiness(&a).await.0 != StatusCode::OK {
        assert!(std::time::Instant::now() < deadline, "/readyz did not come back");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let sent =
        b.chat("ann", json!({"message": "after the outage [mock:words=8]", "conversation_id": conversation})).await;
    assert_eq!(one_whole_run(&tab.next_run().await), sent[0].data["trace_id"].as_str().unwrap());
}

both_backends! {
    /// Issue 34: after `DELETE`, a conversation's open streams went on with keep-alives for
    /// good. They end: one following a run after that run's last events, an idle one at once.
    async fn a_conversation_stream_ends_when_its_conversation_is_deleted(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let first = app.chat("ann", json!({"message": "hello"})).await;
        let conversation = first[0].data["conversation_id"].as_str().unwrap().to_owned();
        let tab = ConversationStream::open(&app, &conversation).await;
        let mut busy = ConversationStream::open(&app, &conversation).await;
        let mut going = start(&app, "ann", json!({"message": SLOW, "conversation_id": conversation})).await;
        going.until("text_delta").await;
        while futures_util::StreamExt::next(&mut busy.events).await.expect("the run's events").1["type"] != "text_delta" {}
        let deleted = app.call(reqwest::Method::DELETE, &format!("/api/conversations/{conversation}"), "ann", None).await;
        assert_eq!(deleted.0, StatusCode::NO_CONTENT);
        for stream in [tab, busy] {
            let last: Vec<String> = stream.ended().await.iter().map(|e| e["type"].as_str().unwrap().to_owned()).collect();
            assert_eq!(last.iter().rev().take(2).collect::<Vec<_>>(), ["done", "cancelled"], "{last:?}");
        }
        // A stream with nothing going ends at once.
        let (_, other) = app.post("/api/conversations", "ann", json!({"title": "idle"})).await;
        let other = other["id"].as_str().unwrap().to_owned();
        let idle = ConversationStream::open(&app, &other).await;
        app.call(reqwest::Method::DELETE, &format!("/api/conversations/{other}"), "ann", None).await;
        assert_eq!(idle.ended().await, Vec::<Value>::new());
        assert_eq!(terminal_kinds(&going.rest().await), ["cancelled"]);
    }
}

/// The same across replicas: a stream on one ends when the other deletes its conversation.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn a_conversation_stream_ends_when_another_replica_deletes_its_conversation() {
    let db = TestDb::new(Backend::Postgres).await;
    let a = TestApp::on(&db.url, "").await;
    let b = TestApp::on(&db.url, "").await;
    let first = a.chat("ann", json!({"message": "hello"})).await;
    let conversation = first[0].data["conversation_id"].as_str().unwrap().to_owned();
    let tab = ConversationStream::open(&a, &conversation).await;
    let deleted = b.call(reqwest::Method::DELETE, &format!("/api/conversations/{conversation}"), "ann", None).await;
    assert_eq!(deleted.0, StatusCode::NO_CONTENT);
    assert_eq!(tab.ended().await, Vec::<Value>::new());
}
