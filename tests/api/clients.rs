//! The client libraries' endpoints (CONTRACT.md §13): how a client's chat or thread id and
//! message ids map onto conversations and branches, what is refused before a stream opens,
//! and cancel by conversation (§17). The client libraries themselves drive chatd in
//! tests/e2e (ai-sdk.test.js, agui.test.js).

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::*;

fn user_message(id: &str, text: &str) -> Value {
    json!({"id": id, "role": "user", "parts": [{"type": "text", "text": text}]})
}

/// Posts to /api/ui/chat and reads the chunks to `[DONE]`.
async fn ui_chat(app: &TestApp, user: &str, body: Value) -> Vec<Value> {
    let response =
        app.client.post(app.url("/api/ui/chat")).header("x-client-id", user).json(&body).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-vercel-ai-ui-message-stream"], "v1");
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut chunks = Vec::new();
    let mut events = response.bytes_stream().eventsource();
    while let Some(event) = events.next().await {
        let event = event.expect("well-formed SSE");
        if event.data == "[DONE]" {
            assert!(events.next().await.is_none(), "nothing after [DONE]");
            return chunks;
        }
        chunks.push(serde_json::from_str(&event.data).expect("JSON chunk"));
    }
    panic!("the stream ended without [DONE]: {chunks:?}");
}

/// The conversation a stream's metadata names, as loaded.
async fn conversation_of(app: &TestApp, user: &str, chunks: &[Value]) -> Value {
    let id = chunks
        .iter()
        .find_map(|c| c["messageMetadata"]["conversation_id"].as_str())
        .expect("the metadata names the conversation");
    let (status, conversation) = app.get(&format!("/api/conversations/{id}"), user).await;
    assert_eq!(status, StatusCode::OK);
    conversation
}

both_backends! {
    async fn a_chat_id_names_the_users_own_conversation_and_never_anothers(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        // Unknown: created, with the chat id as its external id.
        let first = ui_chat(&app, "ann", json!({"id": "chat-1", "messages": [user_message("m1", "Hello")], "trigger": "submit-message"})).await;
        let ann = conversation_of(&app, "ann", &first).await;
        assert_eq!(ann["external_id"], "chat-1");
        assert_eq!(ann["messages"][0]["client_id"], "m1");
        // Known: the same conversation, by its external id or by its own id.
        let again = ui_chat(&app, "ann", json!({"id": "chat-1", "messages": [user_message("m2", "Again")]})).await;
        assert_eq!(conversation_of(&app, "ann", &again).await["id"], ann["id"]);
        let by_id = ui_chat(&app, "ann", json!({"id": ann["id"], "messages": [user_message("m3", "Third")]})).await;
        let loaded = conversation_of(&app, "ann", &by_id).await;
        assert_eq!(loaded["id"], ann["id"]);
        assert_eq!(loaded["messages"].as_array().unwrap().len(), 6);

        // Another user's chat id, or another user's conversation id: a new conversation of
        // this user's, and ann's is untouched.
        for id in [json!("chat-1"), ann["id"].clone()] {
            let bob = ui_chat(&app, "bob", json!({"id": id, "messages": [user_message("b1", "Mine")]})).await;
            let bobs = conversation_of(&app, "bob", &bob).await;
            assert_ne!(bobs["id"], ann["id"]);
            assert_eq!(bobs["external_id"], id);
            assert_eq!(bobs["messages"].as_array().unwrap().len(), 2);
        }
        let (_, ann_after) = app.get(&format!("/api/conversations/{}", ann["id"].as_str().unwrap()), "ann").await;
        assert_eq!(ann_after["messages"].as_array().unwrap().len(), 6);
        // AG-UI's thread id is the same kind of name.
        let agui = app
            .client
            .post(app.url("/api/agui"))
            .header("x-client-id", "ann")
            .json(&json!({"threadId": "chat-1", "runId": "r1", "messages": [{"id": "a1", "role": "user", "content": "Via AG-UI"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(agui.status(), StatusCode::OK);
        let events = agui.text().await.unwrap();
        assert!(events.starts_with(r#"data: {"type":"RUN_STARTED","threadId":"chat-1","runId":"r1"}"#), "{events}");
        let (_, ann_agui) = app.get(&format!("/api/conversations/{}", ann["id"].as_str().unwrap()), "ann").await;
        assert_eq!(ann_agui["messages"][6]["content"], "Via AG-UI");
    }

    async fn what_is_refused_before_the_stream_opens(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let refusals = [
            (json!({"id": "c", "messages": []}), StatusCode::BAD_REQUEST, "messages"),
            (json!({"id": "c", "messages": [{"id": "a", "role": "assistant", "parts": [{"type": "text", "text": "hi"}]}]}), StatusCode::BAD_REQUEST, "messages"),
            (json!({"id": " ", "messages": [user_message("m", "hi")]}), StatusCode::BAD_REQUEST, "id"),
            (json!({"id": "c", "messages": [user_message("m", "   ")]}), StatusCode::BAD_REQUEST, "message"),
            (json!({"id": "c", "messages": [{"id": "m", "role": "user", "parts": [{"type": "file", "mediaType": "image/png", "url": "data:image/png;base64,AA=="}]}]}), StatusCode::BAD_REQUEST, "attachments"),
            (json!({"id": "c", "messages": [user_message("m", "hi")], "trigger": "resubmit"}), StatusCode::BAD_REQUEST, ""),
            (json!({"id": "c", "messages": [user_message("m", "hi")], "profile": "nope"}), StatusCode::NOT_FOUND, "profile"),
            (json!({"id": "c", "messages": [user_message("m", "hi")], "trigger": "submit-message", "messageId": "nowhere"}), StatusCode::NOT_FOUND, "messageId"),
            (json!({"id": "c", "messages": [user_message("m", "hi")], "trigger": "regenerate-message", "messageId": "nowhere"}), StatusCode::NOT_FOUND, "messageId"),
        ];
        for (body, status, field) in refusals {
            let (got, error) = app.post("/api/ui/chat", "ann", body.clone()).await;
            assert_eq!(got, status, "{body}: {error}");
            assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{error}");
            if !field.is_empty() {
                assert_eq!(error["field"], field, "{body}: {error}");
            }
        }
        // Nothing was half-written: no conversation for the refused chats.
        let (_, list) = app.get("/api/conversations", "ann").await;
        assert_eq!(list["conversations"], json!([]));
        // A messageId from another chat of the same user is not in this one.
        ui_chat(&app, "ann", json!({"id": "other", "messages": [user_message("o1", "Elsewhere")]})).await;
        ui_chat(&app, "ann", json!({"id": "this", "messages": [user_message("t1", "Here")]})).await;
        let (status, error) = app.post("/api/ui/chat", "ann", json!({"id": "this", "messages": [user_message("o1", "Edit")], "messageId": "o1"})).await;
        assert_eq!((status, error["field"].as_str()), (StatusCode::NOT_FOUND, Some("messageId")));
        // Fields the client library sends and chatd does not use are ignored here.
        let chunks = ui_chat(&app, "ann", json!({"id": "this", "messages": [{"id": "t2", "role": "user", "metadata": {"x": 1}, "parts": [{"type": "step-start"}, {"type": "text", "text": "More", "state": "done"}]}], "trigger": "submit-message", "extra": true})).await;
        assert_eq!(chunks.last().unwrap()["type"], "finish");
    }

    async fn resume_by_chat_id_and_cancel_by_conversation(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let (status, _) = app.get("/api/ui/chat/unknown/stream", "ann").await;
        assert_eq!(status, StatusCode::NO_CONTENT, "an unknown chat has no run");
        let response = app
            .client
            .post(app.url("/api/ui/chat"))
            .header("x-client-id", "ann")
            .json(&json!({"id": "slow", "messages": [user_message("m1", "Slow [mock:words=300] [mock:delay=20]")]}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let mut events = response.bytes_stream().eventsource();
        let mut conversation_id = None;
        while conversation_id.is_none() {
            let event = events.next().await.unwrap().unwrap();
            let chunk: Value = serde_json::from_str(&event.data).unwrap();
            conversation_id = chunk["messageMetadata"]["conversation_id"].as_str().map(str::to_owned);
        }
        let conversation_id = conversation_id.unwrap();
        // Another user neither resumes nor cancels it.
        let (status, _) = app.get("/api/ui/chat/slow/stream", "bob").await;
        assert_eq!(status, StatusCode::NO_CONTENT);
        let (status, _) = app.post("/api/cancel_stream", "bob", json!({"conversation_id": conversation_id})).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        // Its owner resumes it from its first chunk.
        let resumed = app.client.get(app.url("/api/ui/chat/slow/stream")).header("x-client-id", "ann").send().await.unwrap();
        assert_eq!(resumed.status(), StatusCode::OK);
        let mut resumed = resumed.bytes_stream().eventsource();
        let first: Value = serde_json::from_str(&resumed.next().await.unwrap().unwrap().data).unwrap();
        assert_eq!(first["type"], "start");
        let (status, cancelled) = app.post("/api/cancel_stream", "ann", json!({"conversation_id": conversation_id})).await;
        assert_eq!(status, StatusCode::OK, "{cancelled}");
        assert_eq!(cancelled["status"], "cancelled");
        assert_eq!(cancelled["conversation_id"], conversation_id.as_str());
        assert_eq!(cancelled["trace_ids"].as_array().unwrap().len(), 1);
        assert_eq!(cancelled["trace_ids"][0], cancelled["trace_id"]);
        let mut last = Vec::new();
        while let Some(event) = resumed.next().await {
            last.push(event.unwrap().data);
        }
        assert_eq!(last[last.len() - 2], r#"{"type":"abort"}"#);
        assert_eq!(last[last.len() - 1], "[DONE]");
        let (status, error) = app.post("/api/cancel_stream", "ann", json!({"conversation_id": conversation_id})).await;
        assert_eq!(status, StatusCode::CONFLICT, "{error}");
        let (status, _) = app.get("/api/ui/chat/slow/stream", "ann").await;
        assert_eq!(status, StatusCode::NO_CONTENT, "nothing runs any more");
    }
}

#[tokio::test]
async fn the_client_endpoints_ask_for_the_same_credentials_and_keep_the_same_limits() {
    let app = TestApp::spawn(
        Backend::Sqlite,
        "[auth]\nmode = \"token\"\n[auth.tokens]\n\"tok-ann\" = \"ann\"\n[limits]\nmax_message_chars = 10\n",
    )
    .await;
    let ui = json!({"id": "c", "messages": [user_message("m", "hi")]});
    let agui = json!({"threadId": "t", "runId": "r", "messages": [{"id": "m", "role": "user", "content": "hi"}]});
    for (path, body) in [("/api/ui/chat", &ui), ("/api/agui", &agui)] {
        for token in [None, Some("tok-wrong")] {
            let mut request = app.client.post(app.url(path)).json(body);
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{path}");
            let error: Value = response.json().await.unwrap();
            assert_eq!(error["code"], "UNAUTHORIZED");
        }
        let response = app.client.post(app.url(path)).bearer_auth("tok-ann").json(body).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        response.text().await.unwrap();
    }
    let response = app.client.get(app.url("/api/ui/chat/c/stream")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let long = json!({"id": "c", "messages": [user_message("m", "far more than ten characters")]});
    let response = app.client.post(app.url("/api/ui/chat")).bearer_auth("tok-ann").json(&long).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
}

/// A chat resumed after a model call failed mid-answer and was made again: the replay has
/// no voided text (CONTRACT.md §13.1), the live stream said so with `data-step-reset`.
#[tokio::test]
async fn a_resumed_chat_replays_no_voided_text() {
    use crate::fixture::{Fixture, Part, Scripted};
    let chunk = |text: &str| format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"content": text}}]}));
    let failing = Scripted::sse(&[
        chunk("Wrong words"),
        format!("data: {}\n\n", json!({"error": {"code": 502, "message": "crashed"}})),
    ]);
    let mut slow = Scripted::sse(&[chunk("Right ")]).then(Part::Pause(std::time::Duration::from_millis(1500)));
    for frame in [
        chunk("answer."),
        format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})),
        "data: [DONE]\n\n".to_owned(),
    ] {
        slow = slow.then(Part::Bytes(frame));
    }
    let fixture = Fixture::start(vec![failing, slow]).await;
    let config = format!(
        "[chat]\ndefault_profile = \"fx\"\n[providers.fx]\nkind = \"openai_compatible\"\nbase_url = \"{}/v1\"\n\
         max_retries = 1\nretry_base_secs = 0.01\n[profiles.fx]\nprovider = \"fx\"\nmodel = \"fx\"\n",
        fixture.base
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let response = app
        .client
        .post(app.url("/api/ui/chat"))
        .header("x-client-id", "ann")
        .json(&json!({"id": "retried", "messages": [user_message("m1", "go")]}))
        .send()
        .await
        .unwrap();
    let mut live = response.bytes_stream().eventsource();
    let mut seen = Vec::new();
    // Until the second try has said its first words.
    while !seen.iter().any(|c: &String| c.contains("Right")) {
        seen.push(live.next().await.unwrap().unwrap().data);
    }
    assert!(
        seen.iter().any(|c| c.contains(r#""type":"data-step-reset""#) && c.contains(r#""transient":true"#)),
        "{seen:?}"
    );
    assert!(seen.iter().any(|c| c.contains("Wrong words")), "the live stream had said it");
    let resumed =
        app.client.get(app.url("/api/ui/chat/retried/stream")).header("x-client-id", "ann").send().await.unwrap();
    let replay = ui_chunks(resumed).await;
    let text: String = replay
        .iter()
        .filter_map(|c| serde_json::from_str::<Value>(c).ok())
        .filter(|c| c["type"] == "text-delta")
        .map(|c| c["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, "Right answer.", "{replay:?}");
    assert!(!replay.iter().any(|c| c.contains("data-step-reset")));
}

/// The chunks of a UI stream as they come, to `[DONE]`.
async fn ui_chunks(response: reqwest::Response) -> Vec<String> {
    assert_eq!(response.status(), StatusCode::OK);
    let mut events = response.bytes_stream().eventsource();
    let mut chunks = Vec::new();
    while let Some(event) = events.next().await {
        chunks.push(event.expect("well-formed SSE").data);
    }
    chunks
}

#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn another_replica_resumes_a_chat_from_the_log_and_cancels_it_by_conversation() {
    let db = TestDb::new(Backend::Postgres).await;
    let a = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    let b = TestApp::on(&db.url, "[stream]\nflush_interval_ms = 20").await;
    let send = |chat: &str, text: &str| {
        a.client
            .post(a.url("/api/ui/chat"))
            .header("x-client-id", "ann")
            .json(&json!({"id": chat, "messages": [user_message("m1", text)]}))
            .send()
    };

    // B follows A's run through its event log: the same chunks, from the first.
    let on_a = send("shared", "Tell me [mock:words=40] [mock:delay=10]").await.unwrap();
    let own = tokio::spawn(ui_chunks(on_a));
    let resumed = loop {
        let response = b.client.get(b.url("/api/ui/chat/shared/stream")).header("x-client-id", "ann").send().await;
        let response = response.unwrap();
        if response.status() == StatusCode::OK {
            break response;
        }
        // (204 until A's start is committed.)
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    };
    let via_b = ui_chunks(resumed).await;
    let own = own.await.unwrap();
    assert_eq!(via_b, own, "the replica that does not run it replays it chunk for chunk");
    assert_eq!(own.last().map(String::as_str), Some("[DONE]"));

    // Cancel by conversation through B stops A's run.
    let on_a = send("stopped", "Long [mock:words=400] [mock:delay=20]").await.unwrap();
    let mut events = on_a.bytes_stream().eventsource();
    let mut conversation_id = None;
    while conversation_id.is_none() {
        let chunk: Value = serde_json::from_str(&events.next().await.unwrap().unwrap().data).unwrap();
        conversation_id = chunk["messageMetadata"]["conversation_id"].as_str().map(str::to_owned);
    }
    let (status, body) = b.post("/api/cancel_stream", "ann", json!({"conversation_id": conversation_id})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let mut rest = Vec::new();
    while let Some(event) = events.next().await {
        rest.push(event.unwrap().data);
    }
    assert_eq!(rest[rest.len() - 2..], [r#"{"type":"abort"}"#.to_owned(), "[DONE]".to_owned()]);
}

both_backends! {
    async fn two_first_messages_of_one_new_chat_at_once_land_in_one_conversation(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        for round in 0..5 {
            let chat = format!("twice-{round}");
            let post = |text: &'static str| {
                // The second, finding the first running, interrupts it (rather than queue behind it).
                let body = json!({"id": chat, "messages": [user_message(text, text)], "multitask": "interrupt"});
                ui_chat(&app, "ann", body)
            };
            let (one, two) = tokio::join!(post("one"), post("two"));
            let (a, b) = (conversation_of(&app, "ann", &one).await, conversation_of(&app, "ann", &two).await);
            assert_eq!(a["id"], b["id"], "one conversation for the chat");
            assert_eq!(a["external_id"], chat.as_str());
        }
        let (_, list) = app.get("/api/conversations", "ann").await;
        assert_eq!(list["conversations"].as_array().unwrap().len(), 5);
    }
}

#[tokio::test]
async fn with_on_disconnect_cancel_leaving_a_client_stream_cancels_its_run_as_the_native_one_does() {
    let app = TestApp::spawn(Backend::Sqlite, "[stream]\non_disconnect = \"cancel\"").await;
    let slow = "Slow [mock:words=400] [mock:delay=15] [mock:think=off]";
    let bodies = [
        ("/api/ui/chat", json!({"id": "leaving-ui", "messages": [user_message("m", slow)]})),
        (
            "/api/agui",
            json!({"threadId": "leaving-agui", "runId": "r", "messages": [{"id": "m", "role": "user", "content": slow}]}),
        ),
    ];
    for (path, body) in bodies {
        let response = app.client.post(app.url(path)).header("x-client-id", "ann").json(&body).send().await.unwrap();
        let mut events = response.bytes_stream().eventsource();
        // Read until some text has come, then leave.
        loop {
            let data = events.next().await.unwrap().unwrap().data;
            if data.contains("text-delta") || data.contains("TEXT_MESSAGE_CONTENT") {
                break;
            }
        }
        drop(events);
        let (_, list) = app.get("/api/conversations", "ann").await;
        let conversation = list["conversations"][0]["id"].as_str().unwrap().to_owned();
        let path = format!("/api/conversations/{conversation}");
        let loaded = crate::runs::poll_until(&app, "ann", &path, |loaded| loaded["messages"][1].is_object()).await;
        let answer = &loaded["messages"][1];
        assert_eq!(answer["cancelled"], true, "{path}: {answer}");
        let trace = crate::runs::ended_trace(&app, "ann", answer["trace_id"].as_str().unwrap()).await;
        assert_eq!(trace["status"], "cancelled");
    }
}

#[tokio::test]
async fn ag_ui_context_entries_reach_the_system_prompt() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    // The mock counts the tokens of what it was sent, system prompt included.
    let input_tokens = |context: Value| {
        let body = json!({"threadId": format!("ctx-{}", context.as_array().unwrap().len()), "runId": "r",
            "messages": [{"id": "m", "role": "user", "content": "Hello [mock:think=off]"}], "context": context});
        let request = app.client.post(app.url("/api/agui")).header("x-client-id", "ann").json(&body).send();
        async move {
            let text = request.await.unwrap().text().await.unwrap();
            let finished = text
                .lines()
                .filter_map(|line| line.strip_prefix("data: "))
                .map(|data| serde_json::from_str::<Value>(data).unwrap())
                .find(|event| event["type"] == "RUN_FINISHED")
                .expect("the run finished");
            finished["result"]["usage"]["input_tokens"].as_u64().unwrap()
        }
    };
    let without = input_tokens(json!([])).await;
    let page = "the reports page, ".repeat(100);
    let with = input_tokens(json!([{"description": "current_page", "value": page}])).await;
    assert!(with > without + 300, "the context entry was in the prompt: {with} vs {without} tokens");
}

both_backends! {
    /// Issue 34: a 20 MB chat id, a 10 MB thread id and a 100 KB message id were stored as
    /// they came (and listed back with every conversation). Every id and name a client library
    /// sends is bounded: a 400 names the field, and nothing is stored.
    async fn ids_and_names_past_the_bound_are_refused_naming_the_field(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let long = "x".repeat(257);
        let at_bound = "y".repeat(256);
        let ui = |body: Value| {
            let request = app.client.post(app.url("/api/ui/chat")).header("x-client-id", "ann").json(&body);
            async move {
                let response = request.send().await.unwrap();
                (response.status(), response.json::<Value>().await.unwrap_or(Value::Null))
            }
        };
        for (body, field) in [
            (json!({"id": long, "messages": [user_message("m1", "Hello")]}), "id"),
            (json!({"id": "chat", "messages": [user_message(&long, "Hello")]}), "messages"),
            (json!({"id": "chat", "messageId": long, "messages": [user_message("m1", "Hello")]}), "messageId"),
            (json!({"id": "chat", "profile": long, "messages": [user_message("m1", "Hello")]}), "profile"),
            (json!({"id": "chat", "client_tools": [{"name": long}], "messages": [user_message("m1", "Hello")]}), "client_tools"),
        ] {
            let (status, error) = ui(body).await;
            assert_eq!((status, error["code"].as_str(), error["field"].as_str()), (StatusCode::BAD_REQUEST, Some("VALIDATION_ERROR"), Some(field)), "{error}");
            assert!(error["message"].as_str().unwrap().contains("longer than 256 characters"), "{error}");
        }
        let agui = |input: Value| app.post("/api/agui", "ann", input);
        let message = json!({"id": "m1", "role": "user", "content": "Hello"});
        for (input, field) in [
            (json!({"threadId": long, "runId": "r", "messages": [message]}), "threadId"),
            (json!({"threadId": "t", "runId": long, "messages": [message]}), "runId"),
            (json!({"threadId": "t", "runId": "r", "messages": [{"id": long, "role": "user", "content": "Hello"}]}), "messages"),
            (json!({"threadId": "t", "runId": "r", "messages": [message], "tools": [{"name": long}]}), "tools"),
            (json!({"threadId": "t", "runId": "r", "messages": [message], "forwardedProps": {"profile": long}}), "forwardedProps"),
            (json!({"threadId": "t", "runId": "r", "messages": [message], "resume": [{"interruptId": long, "status": "resolved"}]}), "resume"),
        ] {
            let (status, error) = agui(input).await;
            assert_eq!((status, error["field"].as_str()), (StatusCode::BAD_REQUEST, Some(field)), "{error}");
        }
        let (_, listed) = app.get("/api/conversations", "ann").await;
        assert_eq!(listed["conversations"], json!([]), "nothing was stored");
        // At the bound, an id is taken as it is.
        let chunks = ui_chat(&app, "ann", json!({"id": at_bound, "messages": [user_message(&at_bound, "Hello")]})).await;
        assert_eq!(conversation_of(&app, "ann", &chunks).await["external_id"], at_bound.as_str());
    }
}
