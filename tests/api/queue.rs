//! `multitask = "enqueue"`, the default (CONTRACT.md §16): a message sent while a run of its
//! conversation is going is stored at once, after that run's answer; its stream opens with
//! `status` "Queued" and its run starts once the runs ahead have ended, on their answers.
//! A queued run can be cancelled before it starts, survives a restart, and keeps its order
//! across replicas.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::runs::{Live, start, terminal_kinds};
use crate::waits::{assert_whole, trace_status};

const SLOW: &str = "A long one [mock:words=60] [mock:delay=10] [mock:think=off]";

async fn loaded(app: &TestApp, conversation: &str) -> Value {
    let (status, body) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body
}

/// The loaded branch as (role, content) pairs.
fn branch_of(conversation: &Value) -> Vec<(String, String)> {
    conversation["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["role"].as_str().unwrap().to_owned(), m["content"].as_str().unwrap().to_owned()))
        .collect()
}

/// The contents of the messages a run sent the model (its `complete`'s diagnostics).
fn sent_to_model(frames: &[Frame]) -> Vec<String> {
    let complete = frames.iter().find(|f| f.kind() == "complete").expect("complete");
    complete.data["payload"]["diagnostics"]["messages"]
        .as_array()
        .expect("diagnostics")
        .iter()
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect()
}

fn answer(frames: &[Frame]) -> String {
    let complete = frames.iter().find(|f| f.kind() == "complete").expect("complete");
    complete.data["payload"]["message"].as_str().unwrap().to_owned()
}

fn id_of(frames: &[Frame], field: &str) -> String {
    frames[0].data[field].as_str().unwrap().to_owned()
}

/// A conversation with one answered message.
async fn conversation(app: &TestApp) -> String {
    let first = app.chat("ann", json!({"message": "hello"})).await;
    id_of(&first, "conversation_id")
}

/// Asserts a queued run's stream: `start`, then `status` "Queued" before anything else.
fn opens_queued(frames: &[Frame]) {
    let kinds: Vec<&str> = frames.iter().take(2).map(Frame::kind).collect();
    assert_eq!(kinds, ["start", "status"], "{frames:?}");
    assert_eq!(frames[1].data["message"], "Queued");
}

both_backends! {
    async fn two_messages_sent_1_ms_apart_get_two_answers_in_order_on_one_branch(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let conversation = conversation(&app).await;
        let first = json!({"message": SLOW, "conversation_id": conversation, "diagnostics": true});
        let second = json!({"message": "And then? [mock:words=5]", "conversation_id": conversation, "diagnostics": true});
        let (first, second) = tokio::join!(start(&app, "ann", first), async {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            start(&app, "ann", second).await
        });
        let (first, second) = tokio::join!(first.rest(), second.rest());
        assert_whole(&first);
        assert_whole(&second);
        assert_eq!(terminal_kinds(&first), ["complete"]);
        assert_eq!(terminal_kinds(&second), ["complete"]);
        // The one that came second was queued, and ran after the first had answered.
        opens_queued(&second);
        assert_eq!(second[2].kind(), "step_start", "it started after waiting");
        assert_eq!(second[3].data["message"], "Thinking…");
        assert!(first.iter().all(|f| f.data["message"] != "Queued"), "the first did not wait");

        // One branch, in order: each question with its answer.
        let after = loaded(&app, &conversation).await;
        let branch = branch_of(&after);
        let roles: Vec<&str> = branch.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "user", "assistant", "user", "assistant"], "{after}");
        assert_eq!(branch[2].1, SLOW);
        assert_eq!(branch[3].1, answer(&first));
        assert_eq!(branch[4].1, "And then? [mock:words=5]");
        assert_eq!(branch[5].1, answer(&second));
        assert_eq!(after["active_runs"], json!([]));
        // Each saw the turn before it: the second was sent the first's whole answer.
        let seen = sent_to_model(&second);
        assert_eq!(seen, [branch[0].1.clone(), branch[1].1.clone(), SLOW.to_owned(), answer(&first), branch[4].1.clone()]);
        assert_eq!(sent_to_model(&first).len(), 3, "the first saw the turn before it");
    }

    async fn loading_shows_a_queued_message_after_the_answer_being_written(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let conversation = conversation(&app).await;
        let first = slow_run(&app, &conversation).await;
        let second = queue_behind(&app, &conversation, "Next").await;
        let third = queue_behind(&app, &conversation, "And last").await;

        let during = loaded(&app, &conversation).await;
        let roles: Vec<(String, String)> = branch_of(&during);
        let texts: Vec<&str> = roles.iter().map(|(_, t)| t.as_str()).collect();
        assert_eq!(texts[2..], [SLOW, "Next", "And last"], "the queued messages are on the branch: {during}");
        let active = during["active_runs"].as_array().unwrap();
        let statuses: Vec<&str> = active.iter().map(|r| r["status"].as_str().unwrap()).collect();
        assert_eq!(statuses, ["running", "queued", "queued"], "{during}");
        let messages = during["messages"].as_array().unwrap();
        // Each queued question follows the answer before it, which is being written.
        assert_eq!(messages[3]["parent_id"], active[0]["message_id"]);
        assert_eq!(active[1]["user_message_id"], messages[3]["id"]);
        assert_eq!(messages[4]["parent_id"], active[1]["message_id"]);
        assert_eq!(active[2]["user_message_id"], messages[4]["id"]);
        let (_, trace) = app.get(&format!("/api/trace/{}", active[2]["trace_id"].as_str().unwrap()), "ann").await;
        assert_eq!(trace["status"], "queued");

        for live in [first, second, third] {
            assert_eq!(terminal_kinds(&live.rest().await), ["complete"]);
        }
        let after = loaded(&app, &conversation).await;
        let roles: Vec<String> = branch_of(&after).into_iter().map(|(r, _)| r).collect();
        assert_eq!(roles, ["user", "assistant", "user", "assistant", "user", "assistant", "user", "assistant"]);
        assert_eq!(after["message_count"], 8);
    }

    async fn a_queued_run_can_be_cancelled_before_it_starts(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let conversation = conversation(&app).await;
        let first = slow_run(&app, &conversation).await;
        let queued = queue_behind(&app, &conversation, "Never mind").await;
        let trace_id = queued.seen()[0].data["trace_id"].as_str().unwrap().to_owned();
        let (status, body) = app.post("/api/cancel_stream", "ann", json!({"trace_id": trace_id})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["status"], "cancelled");
        let frames = queued.rest().await;
        assert_whole(&frames);
        let kinds: Vec<&str> = frames.iter().map(Frame::kind).collect();
        assert_eq!(kinds, ["start", "status", "cancelled", "done"], "it never ran");
        assert_eq!(frames[2].data["partial_text"], "");
        assert_eq!(trace_status(&app, &trace_id).await, "cancelled");
        // The run ahead was not touched.
        assert_eq!(terminal_kinds(&first.rest().await), ["complete"]);
        let after = loaded(&app, &conversation).await;
        let branch = branch_of(&after);
        assert_eq!(branch.len(), 5, "the unanswered message stays, after the answer: {after}");
        assert_eq!(branch[4], ("user".to_owned(), "Never mind".to_owned()));
        // The next message follows it.
        let next = app.chat("ann", json!({"message": "Now this", "conversation_id": conversation})).await;
        assert_eq!(terminal_kinds(&next), ["complete"]);
        assert_eq!(branch_of(&loaded(&app, &conversation).await).len(), 7);

        // Cancelling the conversation stops the running run and the queued ones, which never start.
        let running = slow_run(&app, &conversation).await;
        let waiting = queue_behind(&app, &conversation, "Behind").await;
        let (status, body) = app.post("/api/cancel_stream", "ann", json!({"conversation_id": conversation})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["trace_ids"].as_array().unwrap().len(), 2, "{body}");
        assert_eq!(terminal_kinds(&running.rest().await), ["cancelled"]);
        let waited: Vec<String> = waiting.rest().await.iter().map(|f| f.kind().to_owned()).collect();
        assert_eq!(waited, ["start", "status", "cancelled", "done"]);
        assert_eq!(loaded(&app, &conversation).await["active_runs"], json!([]));
    }

    async fn reject_and_interrupt_still_answer_when_a_request_asks_for_them(backend: Backend) {
        let app = TestApp::spawn(backend, "[chat]\nmultitask = \"reject\"").await;
        let conversation = conversation(&app).await;
        let first = slow_run(&app, &conversation).await;
        let (status, _) = app.post("/api/chat/stream", "ann", json!({"message": "no", "conversation_id": conversation})).await;
        assert_eq!(status, StatusCode::CONFLICT, "the configured reject");
        let queued = app
            .chat("ann", json!({"message": "queued", "conversation_id": conversation, "multitask": "enqueue"}))
            .await;
        opens_queued(&queued);
        assert_eq!(terminal_kinds(&queued), ["complete"]);
        assert_eq!(terminal_kinds(&first.rest().await), ["complete"]);
    }

    async fn a_queued_run_survives_a_restart_and_runs_after_the_run_ahead(backend: Backend) {
        let db = TestDb::new(backend).await;
        let config = "[tools]\nrequire_approval = [\"calculator\"]\n";
        let add = r#"Add [mock:tool=calculator {"expression": "1 + 2"}]"#;
        let app = TestApp::on(&db.url, config).await;
        let conversation = conversation(&app).await;
        let mut ahead = start(&app, "ann", json!({"message": add, "conversation_id": conversation})).await;
        let approval = ahead.until("tool_approval_request").await.data["approval_id"].as_str().unwrap().to_owned();
        let mut queued = start(&app, "ann", json!({"message": "After that [mock:words=4]", "conversation_id": conversation, "diagnostics": true})).await;
        queued.until("status").await;
        let trace_id = queued.seen()[0].data["trace_id"].as_str().unwrap().to_owned();
        app.stop.graceful().await;
        drop((ahead, queued));
        drop(app);

        let app = TestApp::on(&db.url, config).await;
        assert_eq!(trace_status(&app, &trace_id).await, "queued", "start-up left it queued");
        let resumed = crate::runs::resume(&app, "ann", &trace_id, None).await;
        let (status, body) = app.post(&format!("/api/approvals/{approval}"), "ann", json!({"approved": true})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let frames = resumed.rest().await;
        assert_whole(&frames);
        opens_queued(&frames);
        assert_eq!(terminal_kinds(&frames), ["complete"]);
        let seen = sent_to_model(&frames);
        assert!(seen.iter().any(|m| m.contains("calculator said 3")), "it ran on the answer before it: {seen:?}");
        let roles: Vec<String> = branch_of(&loaded(&app, &conversation).await).into_iter().map(|(r, _)| r).collect();
        assert_eq!(roles, ["user", "assistant", "user", "assistant", "user", "assistant"]);
    }

    async fn messages_sent_at_once_into_many_conversations_each_get_their_answer_on_the_branch(backend: Backend) {
        // Many messages at once, each conversation's runs ending while the next messages
        // are being started: a start that read its conversation just before a run's answer
        // was written, and its going runs just after, followed the question the answer
        // followed, and the answer was left off the branch (found by loadtest/waits.py).
        let app = TestApp::spawn(backend, AT_ONCE).await;
        sent_at_once(&[&app]).await;
    }
}

const AT_ONCE: &str = "[limits]\nrequests_per_minute = 0\nmax_concurrent_runs_per_user = 100\n";

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn messages_sent_at_once_to_two_replicas_each_get_their_answer_on_the_branch() {
    // A start that looked while another replica's run of its conversation had not begun,
    // and was written after that run had begun and ended, followed the answer before it,
    // beside it (found by loadtest/waits.py: most conversations forked).
    let db = TestDb::new(Backend::Postgres).await;
    let (a, b) = (TestApp::on(&db.url, AT_ONCE).await, TestApp::on(&db.url, AT_ONCE).await);
    sent_at_once(&[&a, &b]).await;
}

/// Sends 12 conversations 6 messages each at once, to `apps` in turn, four times: every
/// stream whole and answered, every message and answer on the conversation's one branch.
async fn sent_at_once(apps: &[&TestApp]) {
    const CONVERSATIONS: usize = 12;
    const MESSAGES: usize = 6;
    const WAVES: usize = 4;
    let mut conversations = Vec::new();
    for _ in 0..CONVERSATIONS {
        conversations.push(conversation(apps[0]).await);
    }
    for wave in 1..=WAVES {
        let sends = conversations.iter().flat_map(|c| (0..MESSAGES).map(move |k| (c, k))).map(|(c, k)| {
            let message = format!("m{k} [mock:words=3] [mock:delay=3] [mock:think=off]");
            let app = apps[k % apps.len()];
            async move { start(app, "ann", json!({"message": message, "conversation_id": c})).await.rest().await }
        });
        for frames in futures_util::future::join_all(sends).await {
            assert_whole(&frames);
            assert_eq!(terminal_kinds(&frames), ["complete"], "{frames:?}");
        }
        for c in &conversations {
            let branch = branch_of(&loaded(apps[0], c).await);
            let roles: Vec<&str> = branch.iter().map(|(r, _)| r.as_str()).collect();
            let expected = ["user", "assistant"].repeat(1 + wave * MESSAGES);
            assert_eq!(roles, expected, "an answer is off the branch: {branch:?}");
        }
    }
}

/// Sends `body` to `app` and opens its stream.
async fn send(app: &TestApp, body: Value) -> Live {
    start(app, "ann", body).await
}

/// A slow run of `conversation` on `app`, read until its answer streams.
async fn slow_run(app: &TestApp, conversation: &str) -> Live {
    let mut live = send(app, json!({"message": SLOW, "conversation_id": conversation})).await;
    live.until("text_delta").await;
    live
}

/// `text` sent to `conversation` on `app` behind its going run, read until its `status`.
async fn queue_behind(app: &TestApp, conversation: &str, text: &str) -> Live {
    let mut live = send(app, json!({"message": text, "conversation_id": conversation})).await;
    live.until("status").await;
    live
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn messages_queued_on_two_replicas_keep_one_order_and_one_branch() {
    let db = TestDb::new(Backend::Postgres).await;
    let a = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    let b = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    let conversation = conversation(&a).await;
    for round in 0..3 {
        // A run going on one replica; a message to the other queues behind it, and one
        // more to the first queues behind that.
        let first = slow_run(&a, &conversation).await;
        let mut second = send(
            &b,
            json!({"message": format!("second {round}"), "conversation_id": conversation, "diagnostics": true}),
        )
        .await;
        second.until("status").await;
        let third = send(
            &a,
            json!({"message": format!("third {round}"), "conversation_id": conversation, "diagnostics": true}),
        )
        .await;
        let (first, second, third) = tokio::join!(first.rest(), second.rest(), third.rest());
        for frames in [&first, &second, &third] {
            assert_whole(frames);
            assert_eq!(terminal_kinds(frames), ["complete"], "round {round}");
        }
        opens_queued(&second);
        opens_queued(&third);
        let to_third = sent_to_model(&third);
        let n = to_third.len();
        assert_eq!(
            to_third[n - 5..],
            [SLOW.to_owned(), answer(&first), format!("second {round}"), answer(&second), format!("third {round}")],
            "round {round}"
        );
    }
    // Two at once, one to each replica, while a run goes: both queue, one after the other,
    // on one branch.
    let going = slow_run(&a, &conversation).await;
    let (x, y) = tokio::join!(
        send(&a, json!({"message": "to a", "conversation_id": conversation, "diagnostics": true})),
        send(&b, json!({"message": "to b", "conversation_id": conversation, "diagnostics": true}))
    );
    let (going, x, y) = tokio::join!(going.rest(), x.rest(), y.rest());
    for frames in [&going, &x, &y] {
        assert_eq!(terminal_kinds(frames), ["complete"]);
    }
    let after = loaded(&b, &conversation).await;
    let branch = branch_of(&after);
    assert_eq!(branch.len(), 2 + 3 * 6 + 6, "every question and answer on one branch: {after}");
    let tail: Vec<&str> =
        branch[branch.len() - 4..].iter().map(|(_, t)| t.as_str()).filter(|t| t.starts_with("to ")).collect();
    assert_eq!(tail.len(), 2, "{branch:?}");
    // The later one saw the earlier one's answer.
    let (earlier, later) = if tail[0] == "to a" { (&x, &y) } else { (&y, &x) };
    assert!(sent_to_model(later).contains(&answer(earlier)));
    assert_eq!(after["active_runs"], json!([]));
}

/// POSTs `body` to `path` as ann; the response once its stream opened.
async fn open(app: &TestApp, path: &str, body: Value) -> reqwest::Response {
    let response = app.client.post(app.url(path)).header("x-client-id", "ann").json(&body).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK, "{path}");
    response
}

/// The `data:` of every event of a response, to its end.
async fn datas(response: reqwest::Response) -> Vec<String> {
    use eventsource_stream::Eventsource;
    use futures_util::StreamExt;
    let mut events = response.bytes_stream().eventsource();
    let mut all = Vec::new();
    while let Some(event) = events.next().await {
        all.push(event.expect("well-formed SSE").data);
    }
    all
}

both_backends! {
    async fn every_endpoint_that_starts_a_run_queues_behind_the_going_one(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let conversation = conversation(&app).await;
        let going = slow_run(&app, &conversation).await;
        // Each opens at once (queued), one behind the other, in the order sent.
        let legacy = open(&app, "/api/get_chat_response_stream", json!({"message": "legacy", "conversation_id": conversation})).await;
        let ab = open(&app, "/api/ab/stream", json!({"message": "compare", "conversation_id": conversation, "profile_a": "default", "profile_b": "other"})).await;
        let ui = open(&app, "/api/ui/chat", json!({"id": conversation, "messages": [{"id": "u1", "role": "user", "parts": [{"type": "text", "text": "ui"}]}]})).await;
        let agui = open(&app, "/api/agui", json!({"threadId": conversation, "runId": "r1", "messages": [{"id": "g1", "role": "user", "content": "agui"}]})).await;
        let (going, legacy, ab, ui, agui) = tokio::join!(going.rest(), datas(legacy), read_frames(ab), datas(ui), datas(agui));
        assert_eq!(terminal_kinds(&going), ["complete"]);
        assert!(legacy.last().unwrap().contains("\"done\""), "{legacy:?}");
        for variant in ["a", "b"] {
            let side: Vec<&Frame> = ab.iter().filter(|f| f.data["variant"] == variant).collect();
            assert_eq!(side[1].data["message"], "Queued", "side {variant}: {side:?}");
            assert!(side.iter().any(|f| f.kind() == "complete"), "side {variant}");
        }
        assert!(ui.iter().any(|d| d.contains(r#""type":"data-status","data":{"message":"Queued"}"#)), "{ui:?}");
        assert!(ui.iter().any(|d| d.contains(r#""type":"finish""#)), "{ui:?}");
        assert!(agui.iter().any(|d| d.contains(r#""name":"status","value":{"message":"Queued"}"#)), "{agui:?}");
        assert!(agui.last().unwrap().contains("RUN_FINISHED"), "{agui:?}");

        // One branch, in the order sent (the comparison's A answer on it).
        let after = loaded(&app, &conversation).await;
        let questions: Vec<String> =
            branch_of(&after).into_iter().filter(|(r, _)| r == "user").map(|(_, t)| t).collect();
        assert_eq!(questions, ["hello", SLOW, "legacy", "compare", "ui", "agui"], "{after}");
        let roles: Vec<String> = branch_of(&after).into_iter().map(|(r, _)| r).collect();
        assert_eq!(roles.len(), 12, "each question answered: {after}");
        assert!(roles.chunks(2).all(|pair| pair == ["user", "assistant"]), "{roles:?}");
    }
}

both_backends! {
    async fn queued_runs_do_not_count_against_the_running_runs_limit(backend: Backend) {
        let app = TestApp::spawn(backend, "[limits]\nmax_concurrent_runs_per_user = 1").await;
        let conversation = conversation(&app).await;
        let going = slow_run(&app, &conversation).await;
        let queued: Vec<Live> = futures_util::future::join_all(
            (0..3).map(|i| send(&app, json!({"message": format!("queued {i}"), "conversation_id": conversation}))),
        )
        .await;
        // A run that would run now is still refused.
        let (status, error) = app.post("/api/chat/stream", "ann", json!({"message": "a new chat"})).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{error}");
        assert_eq!(terminal_kinds(&going.rest().await), ["complete"]);
        for live in queued {
            let frames = live.rest().await;
            opens_queued(&frames);
            assert_eq!(terminal_kinds(&frames), ["complete"]);
        }
    }
}

both_backends! {
    async fn a_regenerate_sent_while_the_answer_streams_waits_for_it_and_becomes_the_branch(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let conversation = conversation(&app).await;
        let going = slow_run(&app, &conversation).await;
        let question = loaded(&app, &conversation).await["messages"][2]["id"].as_str().unwrap().to_owned();
        let again = app
            .chat("ann", json!({"message": SLOW, "conversation_id": conversation, "parent_message_id": question}))
            .await;
        let going = going.rest().await;
        // It did not run beside the first: it waited, then answered the same question.
        opens_queued(&again);
        assert_eq!(terminal_kinds(&again), ["complete"]);
        assert_eq!(terminal_kinds(&going), ["complete"]);
        let (_, first_trace) = app.get(&format!("/api/trace/{}", id_of(&going, "trace_id")), "ann").await;
        let (_, second_trace) = app.get(&format!("/api/trace/{}", id_of(&again, "trace_id")), "ann").await;
        let first_call = second_trace["spans"].as_array().unwrap().iter().find(|s| s["kind"] == "llm").unwrap();
        assert!(first_call["started_at"].as_str().unwrap() >= first_trace["ended_at"].as_str().unwrap());
        // The regenerated answer is the branch's end; the first is its sibling.
        let after = loaded(&app, &conversation).await;
        let messages = after["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 4, "{after}");
        assert_eq!(messages[3]["id"], id_of(&again, "message_id").as_str());
        let (_, siblings) = app.get(&format!("/api/messages/{}/siblings", messages[3]["id"].as_str().unwrap()), "ann").await;
        assert_eq!(siblings["siblings"].as_array().unwrap().len(), 2, "{siblings}");
    }
}
