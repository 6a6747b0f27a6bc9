//! A new message while a run of its conversation is going (CONTRACT.md §16): `reject`
//! refuses it (409 naming the run, nothing stored), `interrupt` cancels the run and follows
//! its partial answer, `rollback` also deletes that partial answer; never a message on a
//! branch that hides it. Loading a conversation lists its `active_runs`.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::*;
use crate::runs::{start, terminal_kinds};

const SLOW: &str = "A long one [mock:words=400] [mock:delay=15] [mock:think=off]";

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

        let (status, error) =
            app.post("/api/chat/stream", "ann", json!({"message": "Me too", "conversation_id": conversation})).await;
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
            .post("/api/chat/stream", "ann", json!({"message": "no", "conversation_id": conversation, "multitask": "enqueue"}))
            .await;
        assert_eq!((status, error["field"].as_str()), (StatusCode::BAD_REQUEST, Some("multitask")), "{error}");
        drop(third);
    }
}
