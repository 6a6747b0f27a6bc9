//! Context management: trimming a long conversation at the threshold, tool pairs intact,
//! and summarising what was dropped.

use serde_json::json;

use crate::fixture::*;
use crate::helpers::*;

#[tokio::test]
async fn a_long_conversation_is_trimmed_at_the_threshold_with_tool_pairs_intact() {
    let turn = |text: &str| {
        vec![
            data(json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop"}]})),
            "data: [DONE]\n\n".to_owned(),
        ]
    };
    let tool_call = vec![
        data(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": "{\"expression\": \"2+2\"}"}}]}, "finish_reason": "tool_calls"}]})),
        "data: [DONE]\n\n".to_owned(),
    ];
    let long = "word ".repeat(60); // about 75 tokens
    let mut script = vec![Scripted::sse(&tool_call), Scripted::sse(&turn(&long))];
    for _ in 0..4 {
        script.push(Scripted::sse(&turn(&long)));
    }
    let provider = Fixture::start(script).await;
    let config = format!(
        "[chat]\ndefault_profile = \"fx\"\n[tools]\nbuiltins = [\"calculator\"]\n[providers.fx]\nkind = \"openai_compatible\"\nbase_url = \"{}/v1\"\n\
         [profiles.fx]\nprovider = \"fx\"\nmodel = \"m\"\nsystem_prompt = \"S\"\ncontext_limit = 1000\n",
        provider.base
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let first = app.chat("ann", json!({"message": format!("compute {long}")})).await;
    let conversation = first[0].data["conversation_id"].clone();
    let mut last = first;
    for n in 0..4 {
        last = app.chat("ann", json!({"message": format!("turn {n} {long}"), "conversation_id": conversation})).await;
    }
    let requests = provider.received();
    let sizes: Vec<usize> = requests.iter().map(|r| r.body["messages"].as_array().unwrap().len()).collect();
    // Untrimmed the history grows by two each turn; trimmed it stops growing.
    assert!(sizes.last().unwrap() < &(sizes[1] + 8), "{sizes:?}");
    for request in &requests {
        let messages = request.body["messages"].as_array().unwrap();
        assert_eq!(messages[0]["role"], "system", "the system prompt is always kept");
        assert_eq!(messages[1]["role"], "user", "history starts with the user");
        for (i, m) in messages.iter().enumerate() {
            if m.get("tool_calls").is_some() {
                assert_eq!(messages[i + 1]["role"], "tool", "a call keeps its result");
            }
            if m["role"] == "tool" {
                assert!(messages[i - 1].get("tool_calls").is_some(), "a result keeps its call");
            }
        }
    }
    let (_, loaded) = app.get(&format!("/api/conversations/{}", conversation.as_str().unwrap()), "ann").await;
    let state = &loaded["context_state"];
    assert_eq!(state["strategy"], "trim_oldest", "{loaded}");
    assert!(state["dropped"].as_u64().unwrap() > 0);
    assert!(state["estimate"].as_u64().unwrap() <= 700);
    let (_, trace) = app.get(&format!("/api/trace/{}", last[0].data["trace_id"].as_str().unwrap()), "ann").await;
    assert_eq!(
        trace["spans"][0]["attributes"]["chatd.context"]["dropped"], state["dropped"],
        "the trace records the trim"
    );
}

#[tokio::test]
async fn dropped_history_can_be_summarised() {
    let config = "[chat]\nsummarize_dropped = true\n[profiles.default]\ncontext_limit = 600\n";
    let app = TestApp::spawn(Backend::Sqlite, config).await;
    let long = "word ".repeat(60);
    let first = app.chat("ann", json!({"message": format!("one {long}")})).await;
    let conversation = first[0].data["conversation_id"].clone();
    let mut last = first;
    for n in 0..3 {
        last = app.chat("ann", json!({"message": format!("turn {n} {long}"), "conversation_id": conversation})).await;
    }
    assert_eq!(last.last().unwrap().kind(), "done");
    let (_, loaded) = app.get(&format!("/api/conversations/{}", conversation.as_str().unwrap()), "ann").await;
    let state = &loaded["context_state"];
    assert_eq!(state["strategy"], "trim_oldest_with_summary", "{state}");
    assert_eq!(state["summary"], "Mock reply: Summarise the conversation so far.");
    assert!(state["dropped"].as_u64().unwrap() > 0);
}

both_backends! {
    /// A turn that needs no trim clears the state a trim stored (aside from the model call,
    /// but before the run's end is told).
    async fn a_turn_that_fits_clears_the_stored_trim(backend: Backend) {
        let config = "[profiles.default]\ncontext_limit = 600\n[profiles.roomy]\nprovider = \"mock\"\nmodel = \"mock\"\n";
        let app = TestApp::spawn(backend, config).await;
        let long = "word ".repeat(60);
        let first = app.chat("ann", json!({"message": format!("one {long}")})).await;
        let conversation = first[0].data["conversation_id"].clone();
        for n in 0..3 {
            app.chat("ann", json!({"message": format!("turn {n} {long}"), "conversation_id": conversation})).await;
        }
        let path = format!("/api/conversations/{}", conversation.as_str().unwrap());
        let (_, loaded) = app.get(&path, "ann").await;
        assert_eq!(loaded["context_state"]["strategy"], "trim_oldest", "{loaded}");
        let events =
            app.chat("ann", json!({"message": "short", "conversation_id": conversation, "profile": "roomy"})).await;
        assert_eq!(events.last().unwrap().kind(), "done");
        let (_, loaded) = app.get(&path, "ann").await;
        assert!(loaded["context_state"].is_null(), "the turn that fits cleared it: {}", loaded["context_state"]);
    }
}
