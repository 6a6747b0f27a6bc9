//! The agent loop and its tools: built-ins, HTTP tools, parallel calls, errors fed back,
//! timeouts, retries, max_iterations, markers and payloads, page-scoped tools, diagnostics
//! and server actions.

use std::time::Duration;

use serde_json::{Value, json};

use crate::fixture::*;
use crate::helpers::*;

fn of<'a>(frames: &'a [Frame], kind: &str) -> Vec<&'a Value> {
    frames.iter().filter(|f| f.kind() == kind).map(|f| &f.data).collect()
}

fn complete(frames: &[Frame]) -> &Value {
    &frames.iter().find(|f| f.kind() == "complete").expect("complete").data["payload"]
}

fn http_tool(name: &str, base: &str, global: bool) -> String {
    format!(
        "[http_tools.{name}]\nurl = \"{base}/{name}\"\ndescription = \"{name} over HTTP\"\nglobal = {global}\n\
         input_schema = {{ type = \"object\", properties = {{ q = {{ type = \"string\" }} }} }}\n"
    )
}

both_backends! {
    async fn a_two_tool_turn_runs_both_and_the_answer_is_persisted(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let message = r#"Do both [mock:tool=calculator {"expression": "1 + 2"}] [mock:tool=current_time {"utc_offset": "+02:00"}]"#;
        let frames = app.chat("ann", json!({"message": message})).await;
        let starts = of(&frames, "tool_start");
        assert_eq!(starts.len(), 2);
        assert_eq!((starts[0]["tool"].as_str(), starts[0]["index"].as_u64()), (Some("calculator"), Some(0)));
        assert_eq!((starts[1]["tool"].as_str(), starts[1]["index"].as_u64()), (Some("current_time"), Some(1)));
        assert_eq!(starts[0]["input"], json!({"expression": "1 + 2"}));
        let completes = of(&frames, "tool_complete");
        assert!(completes.iter().all(|c| c["status"] == "success"), "{completes:?}");
        let status: Vec<&str> = of(&frames, "status").iter().map(|s| s["message"].as_str().unwrap()).collect();
        assert!(status.contains(&"Running calculator, current_time…"), "{status:?}");

        let payload = complete(&frames);
        let text = payload["message"].as_str().unwrap();
        assert!(text.contains("[[tool:0]]") && text.contains("[[tool:1]]"), "{text}");
        assert!(text.contains("The tools answered: calculator said 3; current_time said {"), "{text}");
        assert_eq!(text, joined(&frames, "text_delta"));
        let history = payload["tool_history"].as_array().unwrap();
        assert_eq!(history.len(), 2);
        assert_eq!(history[0]["output"], "3");
        assert!(history[1]["output"].as_str().unwrap().contains("+02:00"));
        assert_eq!(payload["finish_reason"], "stop");
        let llm_calls = of(&frames, "usage").len();
        assert_eq!(llm_calls, 2, "one call asked for the tools, one answered");

        let conversation = frames[0].data["conversation_id"].as_str().unwrap();
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        let stored = &loaded["messages"][1];
        assert_eq!(stored["content"], text);
        assert_eq!(stored["tool_history"], payload["tool_history"]);
        assert_eq!(stored["tool_calls"].as_array().unwrap().len(), 2);
        let (_, trace) = app.get(&format!("/api/trace/{}", frames[0].data["trace_id"].as_str().unwrap()), "ann").await;
        let tool_spans: Vec<&Value> = trace["spans"].as_array().unwrap().iter().filter(|s| s["kind"] == "tool").collect();
        assert_eq!(tool_spans.len(), 2);
        assert_eq!(tool_spans[0]["attributes"]["gen_ai.tool.name"], "calculator");
    }
}

#[tokio::test]
async fn a_failing_tool_goes_back_to_the_model_and_the_run_goes_on() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let frames = app
        .chat("ann", json!({"message": r#"[mock:tool=calculator {"expression": "1 / 0"}] [mock:tool=no_such_tool]"#}))
        .await;
    let completes = of(&frames, "tool_complete");
    assert_eq!(completes[0]["status"], "error");
    assert_eq!(completes[1]["status"], "error");
    let payload = complete(&frames);
    assert_eq!(payload["tool_history"][0]["is_error"], true);
    let text = payload["message"].as_str().unwrap();
    assert!(text.contains("calculator said Error: Division by zero"), "{text}");
    assert!(text.contains("no_such_tool said Error: No such tool is available"), "{text}");
}

#[tokio::test]
async fn parallel_http_tools_overlap_and_a_slow_one_times_out() {
    let fast =
        Fixture::start(vec![Scripted::json(200, json!({"hits": 3})).then(Part::Pause(Duration::from_millis(200)))])
            .await;
    let slow = Fixture::start(vec![Scripted::json(200, json!({})).then(Part::Stall)]).await;
    let config = format!(
        "{}{}[tools]\ntimeout_secs = 1\n",
        http_tool("fast", &fast.base, true),
        http_tool("slow", &slow.base, true)
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let frames =
        app.chat("ann", json!({"message": r#"[mock:tool=fast {"q": "x"}] [mock:tool=slow {"q": "y"}]"#})).await;
    let kinds: Vec<&str> = frames.iter().map(Frame::kind).collect();
    let last_start = kinds.iter().rposition(|k| *k == "tool_start").unwrap();
    let first_output = kinds.iter().position(|k| *k == "tool_output").unwrap();
    assert!(last_start < first_output, "both calls start before either ends: {kinds:?}");
    let completes = of(&frames, "tool_complete");
    let status = |tool: &str| completes.iter().find(|c| c["tool"] == tool).unwrap()["status"].clone();
    assert_eq!(status("fast"), "success");
    assert_eq!(status("slow"), "timeout");
    assert_eq!(fast.received()[0].body, json!({"q": "x"}), "the model's arguments are POSTed as JSON");
    let text = complete(&frames)["message"].as_str().unwrap().to_owned();
    assert!(text.contains("fast said {\"hits\":3}") && text.contains("slow said Error:"), "{text}");
}

#[tokio::test]
async fn a_retryable_tool_failure_is_retried_and_long_output_is_cut() {
    let tool = Fixture::start(vec![
        Scripted::error(503, json!({"error": {"message": "busy"}})),
        Scripted::json(200, json!({"text": "abcdefghijklmnopqrstuvwxyz", "payload": {"type": "letters", "data": {"n": 26}, "summary": "The alphabet"}})),
    ])
    .await;
    let config = format!("{}[tools]\nmax_output_chars = 10\nmax_retries = 1\n", http_tool("letters", &tool.base, true));
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let frames = app.chat("ann", json!({"message": "[mock:tool=letters {}]"})).await;
    assert_eq!(tool.received().len(), 2, "one retry after the 503");
    // Both tries carry the call's one key (CONTRACT.md §19): the tool can tell a retry.
    let call_id = of(&frames, "tool_start")[0]["tool_call_id"].as_str().unwrap().to_owned();
    let key = format!("{}:{call_id}", frames[0].data["trace_id"].as_str().unwrap());
    for received in tool.received() {
        assert_eq!(received.headers["idempotency-key"], key.as_str());
    }
    let output = of(&frames, "tool_output")[0];
    assert_eq!(output["output"], "abcdefghij");
    assert_eq!(output["truncated"], true);
    assert_eq!(output["full_length"], 26);
    let payload = complete(&frames);
    assert_eq!(payload["tool_history"][0]["output"], "abcdefghijklmnopqrstuvwxyz", "history keeps it whole");
    assert_eq!(payload["custom_payload"]["type"], "letters");
    assert_eq!(payload["custom_payload"]["data"], json!({"n": 26}));
    assert_eq!(payload["custom_payload"]["summary"], "The alphabet");
    let conversation = frames[0].data["conversation_id"].as_str().unwrap();
    let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
    assert_eq!(loaded["messages"][1]["payloads"][0]["type"], "letters");
}

#[tokio::test]
async fn the_loop_stops_at_max_iterations() {
    let app = TestApp::spawn(Backend::Sqlite, "[profiles.default]\nmax_iterations = 3").await;
    let frames =
        app.chat("ann", json!({"message": r#"forever [mock:loop] [mock:tool=calculator {"expression": "2"}]"#})).await;
    assert_eq!(of(&frames, "usage").len(), 3, "three model calls");
    assert_eq!(of(&frames, "tool_start").len(), 3);
    let indexes: Vec<u64> = of(&frames, "tool_complete").iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(indexes, [0, 1, 2]);
    let payload = complete(&frames);
    assert_eq!(payload["finish_reason"], "max_iterations");
    assert_eq!(payload["tool_history"].as_array().unwrap().len(), 3);
    assert_eq!(frames.last().unwrap().kind(), "done");
}

#[tokio::test]
async fn markers_become_fields_under_any_chunking_and_never_reach_the_text() {
    let reply = r#"Here is a plan.\n\nSUGGESTED_VALUES: [{\"label\": \"Yes, proceed\", \"value\": \"yes\"}, \"No\"]\nSUGGESTED_ACTIONS: [{\"label\": \"Apply\", \"action\": \"apply_schema\", \"handler\": \"server\", \"data\": {\"schema_id\": 123}, \"style\": \"primary\"}]\nSCHEMA_PROPOSAL: {\"fields\": [\"title\", \"year\"], \"summary\": \"Two fields\"}"#;
    for chunk in [1, 2, 3, 7, 50] {
        let config = format!(
            "[providers.mock]\nchunk_chars = {chunk}\n[[providers.mock.rules]]\nwhen = \"plan\"\ntext = \"{reply}\"\n\
             [payload_types.schema_proposal]\nsource = \"llm\"\nparse_marker = \"SCHEMA_PROPOSAL:\"\nis_global = true\n\
             llm_instructions = \"Propose a schema.\"\nschema = {{ type = \"object\", required = [\"fields\"] }}\n"
        );
        let app = TestApp::spawn(Backend::Sqlite, &config).await;
        let frames = app.chat("ann", json!({"message": "a plan please"})).await;
        let text = joined(&frames, "text_delta");
        assert_eq!(text, "Here is a plan.", "chunk {chunk}");
        let payload = complete(&frames);
        assert_eq!(payload["message"], "Here is a plan.");
        assert_eq!(
            payload["suggested_values"],
            json!([{"label": "Yes, proceed", "value": "yes"}, {"label": "No", "value": "No"}])
        );
        assert_eq!(payload["suggested_actions"][0]["data"], json!({"schema_id": 123}));
        assert_eq!(payload["custom_payload"]["type"], "schema_proposal");
        assert_eq!(payload["custom_payload"]["summary"], "Two fields");
        let conversation = frames[0].data["conversation_id"].as_str().unwrap();
        let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
        let stored = &loaded["messages"][1];
        assert_eq!(stored["suggested_values"], payload["suggested_values"]);
        assert_eq!(stored["suggested_actions"], payload["suggested_actions"]);
        assert_eq!(stored["payloads"][0]["payload_id"], payload["custom_payload"]["payload_id"]);
    }
}

#[tokio::test]
async fn invalid_marker_json_stays_in_the_text_with_a_warning() {
    let config = "[[providers.mock.rules]]\nwhen = \"broken\"\ntext = \"Pick. SUGGESTED_VALUES: [oops]\"\n";
    let app = TestApp::spawn(Backend::Sqlite, config).await;
    let frames = app.chat("ann", json!({"message": "broken"})).await;
    assert_eq!(complete(&frames)["message"], "Pick. SUGGESTED_VALUES: [oops]");
    assert_eq!(complete(&frames)["suggested_values"], json!([]));
    let (_, trace) = app.get(&format!("/api/trace/{}", frames[0].data["trace_id"].as_str().unwrap()), "ann").await;
    let warnings = &trace["spans"][0]["attributes"]["chatd.warnings"];
    assert!(warnings[0].as_str().unwrap().contains("SUGGESTED_VALUES: [oops]"), "{warnings}");
}

#[tokio::test]
async fn page_tools_are_offered_only_on_their_page_and_filtered_by_profile() {
    let provider = Fixture::start(vec![]).await;
    let config = format!(
        "{}{}[pages.reports]\nidentity = \"You help with reports.\"\ntools = [\"search_articles\"]\n\
         [pages.reports.tabs.articles]\ntools = [\"tab_tool\"]\n[profiles.narrow]\nprovider = \"mock\"\nmodel = \"m\"\ntools = [\"calculator\", \"search_articles\"]\n",
        http_tool("search_articles", &provider.base, false),
        http_tool("tab_tool", &provider.base, false),
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let names = |path: &'static str| {
        let app = &app;
        async move {
            let (status, body) = app.get(path, "ann").await;
            assert_eq!(status, 200, "{body}");
            body["for_request"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_owned()).collect::<Vec<_>>()
        }
    };
    assert_eq!(names("/api/tools?profile=default").await, ["current_time", "calculator"]);
    assert_eq!(names("/api/tools?page=reports").await, ["current_time", "calculator", "search_articles"]);
    assert_eq!(
        names("/api/tools?page=reports&tab=articles").await,
        ["current_time", "calculator", "search_articles", "tab_tool"]
    );
    assert_eq!(names("/api/tools?page=reports&tab=articles&profile=narrow").await, ["calculator", "search_articles"]);
    let (_, all) = app.get("/api/tools", "ann").await;
    let search = all["tools"].as_array().unwrap().iter().find(|t| t["name"] == "search_articles").unwrap();
    assert_eq!(search["source"]["kind"], "http");
    assert_eq!(search["global"], false);

    // A model asking for a tool its page does not offer gets an error result, not the tool.
    let frames = app.chat("ann", json!({"message": "[mock:tool=search_articles {}]"})).await;
    assert_eq!(of(&frames, "tool_complete")[0]["status"], "error");
    assert!(provider.received().is_empty());
}

#[tokio::test]
async fn diagnostics_come_when_asked_and_allowed() {
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let frames =
        app.chat("ann", json!({"message": "diag", "diagnostics": true, "context": {"current_page": "home"}})).await;
    let diagnostics = &complete(&frames)["diagnostics"];
    assert_eq!(diagnostics["model"], "mock-1");
    assert_eq!(diagnostics["max_iterations"], 5);
    assert_eq!(diagnostics["tools"], json!(["current_time", "calculator"]));
    assert!(!diagnostics["system_prompt"].as_str().unwrap().contains("## Context"));
    assert!(diagnostics["notes"].as_str().unwrap().starts_with("## Context"), "{diagnostics}");
    assert_eq!(diagnostics["context"], json!({"current_page": "home"}));
    assert_eq!(diagnostics["messages"][0]["content"], "diag");
    assert_eq!(diagnostics["raw_llm_response"], "Mock reply: diag");
    let frames = app.chat("ann", json!({"message": "no diag"})).await;
    assert!(complete(&frames).get("diagnostics").is_none());

    let app = TestApp::spawn(Backend::Sqlite, "[chat]\nallow_diagnostics = false").await;
    let frames = app.chat("ann", json!({"message": "diag", "diagnostics": true})).await;
    assert!(complete(&frames).get("diagnostics").is_none(), "config forbids them");
}

#[tokio::test]
async fn an_executed_server_action_reaches_the_model_as_context() {
    let handler = Fixture::start(vec![Scripted::json(200, json!({"applied": true, "schema_id": 123}))]).await;
    let provider = Fixture::start(vec![Scripted::sse(&[
        data(json!({"choices": [{"index": 0, "delta": {"content": "Applied."}, "finish_reason": "stop"}]})),
        "data: [DONE]\n\n".to_owned(),
    ])])
    .await;
    let config = format!(
        "[chat]\ndefault_profile = \"fx\"\n[providers.fx]\nkind = \"openai_compatible\"\nbase_url = \"{}/v1\"\n\
         [profiles.fx]\nprovider = \"fx\"\nmodel = \"m\"\n[actions.apply_schema]\ndescription = \"Applies a schema\"\nurl = \"{}/apply\"\n",
        provider.base, handler.base
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let body = json!({"message": "Apply", "interaction_type": "action_executed", "action": {"action": "apply_schema", "data": {"schema_id": 123}}, "context": {"current_page": "schemas"}});
    let frames = app.chat("ann", body).await;
    assert_eq!(complete(&frames)["message"], "Applied.");
    let call = &handler.received()[0];
    assert_eq!(call.path, "/apply");
    assert_eq!(call.body["action"], "apply_schema");
    assert_eq!(call.body["data"], json!({"schema_id": 123}));
    assert_eq!(call.body["context"]["current_page"], "schemas");
    let messages = provider.received()[0].body["messages"].as_array().unwrap().clone();
    let system = messages[0]["content"].as_str().unwrap().to_owned();
    assert!(system.contains("- apply_schema: Applies a schema"), "{system}");
    // The action's result and the page are this request's alone: they follow the question
    // (CONTRACT.md §21), and the system prompt stays as the next turn will send it.
    assert!(!system.contains("## Action result") && !system.contains("schemas"), "{system}");
    let question = messages.last().unwrap()["content"].as_str().unwrap().to_owned();
    assert!(question.starts_with("Apply\n\n## Context\n"), "{question}");
    assert!(question.contains("## Action result"), "{question}");
    assert!(question.contains(r#"{"applied":true,"schema_id":123}"#), "{question}");
}

#[tokio::test]
async fn earlier_payloads_are_listed_after_the_next_question() {
    let tool = Fixture::start(vec![Scripted::json(
        200,
        json!({"text": "ok", "payload": {"type": "report", "data": {}, "summary": "Q3 report"}}),
    )])
    .await;
    let provider = Fixture::start(vec![Scripted::sse(&[
        data(json!({"choices": [{"index": 0, "delta": {"content": "Seen."}, "finish_reason": "stop"}]})),
        "data: [DONE]\n\n".to_owned(),
    ])])
    .await;
    let config = format!(
        "{}[providers.fx]\nkind = \"openai_compatible\"\nbase_url = \"{}/v1\"\n[profiles.fx]\nprovider = \"fx\"\nmodel = \"m\"\n",
        http_tool("make_report", &tool.base, true),
        provider.base
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let first = app.chat("ann", json!({"message": "[mock:tool=make_report {}]"})).await;
    let payload_id = complete(&first)["custom_payload"]["payload_id"].as_str().unwrap().to_owned();
    let conversation = first[0].data["conversation_id"].clone();
    app.chat("ann", json!({"message": "what reports do we have?", "conversation_id": conversation, "profile": "fx"}))
        .await;
    let messages = provider.received()[0].body["messages"].as_array().unwrap().clone();
    let question = messages.last().unwrap()["content"].as_str().unwrap().to_owned();
    assert!(question.starts_with("what reports do we have?\n\n## Payloads in this conversation"), "{question}");
    assert!(question.contains(&format!("- {payload_id} (report): Q3 report")), "{question}");
    assert!(!messages[0]["content"].as_str().unwrap().contains("Payloads"));
}

#[tokio::test]
async fn control_characters_in_tool_output_are_cleaned_as_text_is() {
    let tool =
        Fixture::start(vec![Scripted::json(200, json!({"text": "\u{1b}[31mred\u{1b}[0m\u{1}\u{0}\tok\nnext"}))]).await;
    let app = TestApp::spawn(Backend::Sqlite, &http_tool("shell", &tool.base, true)).await;
    let frames = app.chat("ann", json!({"message": "[mock:tool=shell {}]"})).await;
    assert_eq!(of(&frames, "tool_output")[0]["output"], "[31mred[0m\tok\nnext");
    assert_eq!(complete(&frames)["tool_history"][0]["output"], "[31mred[0m\tok\nnext");
}
