//! Property tests of the Responses stream: for any run, the events are well formed as the
//! Responses API defines them, and the `openai` SDK's own stream helper and accumulator
//! (pinned in tests/e2e) rebuild from them the answer the run sent.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use serde_json::Value;

use super::stream::{ResponseEvents, ResponsesSse};
use crate::chat::Frame;
use crate::events::Event;
use crate::events::arbitrary::{assert_parts_of, run_events, waiting_run_events};
use crate::http::sse::Encoder;

/// The Responses events of `events`, parsed.
fn responses_events(events: &[Event]) -> Vec<Value> {
    let (mut translated, mut out) = (ResponseEvents::new(), Vec::new());
    for event in events {
        translated.translate(event, &mut out);
    }
    translated.end(&mut out);
    out.iter().map(|(_, data)| serde_json::from_str(data).unwrap()).collect()
}

/// The text and the thinking a run's events sent and did not void (a `step_reset` voids its
/// model call's), without tool markers.
fn kept(events: &[Event]) -> (String, String) {
    let (mut kept, mut step) = ((String::new(), String::new()), (String::new(), String::new()));
    for event in events {
        match event {
            Event::StepStart { .. } => {
                kept.0.push_str(&std::mem::take(&mut step.0));
                kept.1.push_str(&std::mem::take(&mut step.1));
            }
            Event::StepReset { .. } => step = Default::default(),
            Event::TextDelta { text } if !crate::events::parts::is_tool_marker(text) => step.0.push_str(text),
            Event::ThinkingDelta { text } => step.1.push_str(text),
            _ => {}
        }
    }
    (kept.0 + &step.0, kept.1 + &step.1)
}

/// The texts of a response's items of `kind` (`message`: their text; `reasoning`: their
/// summary), in order.
fn texts(output: &Value, kind: &str) -> Vec<String> {
    let items = output.as_array().unwrap().iter().filter(|item| item["type"] == kind);
    let part = if kind == "message" { "content" } else { "summary" };
    items.map(|item| item[part][0]["text"].as_str().unwrap().to_owned()).collect()
}

proptest! {
    #[test]
    fn every_run_is_a_well_formed_responses_stream(events in run_events()) {
        let streamed = responses_events(&events);
        assert_eq!(streamed[0]["type"], "response.created");
        assert_eq!(streamed[1]["type"], "response.in_progress");
        let (mut added, mut done) = (Vec::<Value>::new(), Vec::<Option<Value>>::new());
        let mut open_text = None::<(String, String)>;
        for (n, event) in streamed.iter().enumerate() {
            assert_eq!(event["sequence_number"], n as u64, "dense from 0");
            let kind = event["type"].as_str().unwrap();
            let terminal = matches!(kind, "response.completed" | "response.failed" | "response.incomplete");
            assert_eq!(terminal, n == streamed.len() - 1, "one terminal event, the last: {kind}");
            match kind {
                "response.output_item.added" => {
                    assert_eq!(event["output_index"], added.len());
                    assert!(done.iter().all(Option::is_some), "one item at a time");
                    added.push(event["item"].clone());
                    done.push(None);
                }
                "response.output_item.done" => {
                    let index = event["output_index"].as_u64().unwrap() as usize;
                    assert_eq!(event["item"]["id"], added[index]["id"]);
                    assert!(done[index].replace(event["item"].clone()).is_none(), "done once");
                }
                "response.output_text.delta" | "response.reasoning_summary_text.delta" => {
                    let index = event["output_index"].as_u64().unwrap() as usize;
                    assert_eq!(event["item_id"], added[index]["id"], "a delta names its item");
                    assert!(done[index].is_none(), "a delta of an open item");
                    let id = event["item_id"].as_str().unwrap().to_owned();
                    let delta = event["delta"].as_str().unwrap();
                    match &mut open_text {
                        Some((open, text)) if *open == id => text.push_str(delta),
                        _ => open_text = Some((id, delta.to_owned())),
                    }
                }
                "response.output_text.done" | "response.reasoning_summary_text.done" => {
                    let (id, text) = open_text.take().unwrap_or_default();
                    if !id.is_empty() {
                        assert_eq!(event["item_id"], id.as_str());
                        assert_eq!(event["text"], text.as_str(), "the text is its deltas");
                    }
                }
                _ => {}
            }
            if terminal {
                assert!(done.iter().all(Option::is_some), "every item done before the end");
                // The output is the items done, in order, without those a `step_reset` voided
                // (their text is checked below).
                let mut items = done.iter().flatten();
                for item in event["response"]["output"].as_array().unwrap() {
                    assert!(items.any(|done| done == item), "{item} is an item done, in order");
                }
            }
        }
        let last = streamed.last().unwrap();
        let (text, thinking) = kept(&events);
        assert_eq!(texts(&last["response"]["output"], "message").concat(), text, "the answer's text, as sent");
        assert_parts_of(&texts(&last["response"]["output"], "reasoning"), &thinking);
        let status = match events[events.len() - 2] {
            Event::Complete { .. } => "completed",
            Event::Cancelled(_) => "cancelled",
            _ => "failed",
        };
        assert_eq!(last["response"]["status"], status);
    }
}

proptest! {
    #[test]
    fn a_run_that_waits_ends_its_response_completed_with_its_requests(events in waiting_run_events()) {
        let streamed = responses_events(&events);
        let numbers: Vec<u64> = streamed.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(numbers, (0..streamed.len() as u64).collect::<Vec<_>>());
        let last = streamed.last().unwrap();
        assert_eq!(last["type"], "response.completed");
        let output = last["response"]["output"].as_array().unwrap();
        let requests: Vec<&Event> =
            events.iter().filter(|e| matches!(e, Event::ToolResultRequest(_) | Event::ToolApprovalRequest(_))).collect();
        let tail = &output[output.len() - requests.len()..];
        for (item, request) in tail.iter().zip(requests) {
            match request {
                Event::ToolResultRequest(r) => {
                    assert_eq!((item["type"].as_str(), item["call_id"].as_str()), (Some("function_call"), Some(r.tool_call_id.as_str())));
                    assert_eq!(serde_json::from_str::<Value>(item["arguments"].as_str().unwrap()).unwrap(), r.input);
                }
                Event::ToolApprovalRequest(r) => {
                    assert_eq!((item["type"].as_str(), item["name"].as_str()), (Some("mcp_approval_request"), Some("mcp:deploy")));
                    assert_eq!(item["server_label"], "mcp");
                    assert!(item["id"].as_str().unwrap().ends_with(&r.approval_id.replace('-', "")));
                }
                _ => unreachable!(),
            }
        }
        // A call that waits for approval is not an `mcp_call` yet.
        assert!(!output.iter().any(|item| item["type"] == "mcp_call" && item["name"] == "mcp:deploy"));
        assert_eq!(texts(&last["response"]["output"], "message").concat(), kept(&events).0);
    }
}

/// Runs the SDK's stream helper and accumulator (tests/e2e/support/accumulate.mjs) over SSE
/// bodies: for each, what the helper finished with and what the accumulator rebuilt.
fn accumulated(bodies: &[String]) -> Vec<Value> {
    use std::io::Write;
    let e2e = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e");
    assert!(
        e2e.join("node_modules/openai").exists(),
        "the openai SDK is not installed: run `npm ci` in tests/e2e (scripts/browser-tests.sh does)"
    );
    let mut node = std::process::Command::new("node")
        .arg(e2e.join("support/accumulate.mjs"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("node runs");
    let mut stdin = node.stdin.take().unwrap();
    for body in bodies {
        writeln!(stdin, "{}", serde_json::to_string(body).unwrap()).unwrap();
    }
    drop(stdin);
    let output = node.wait_with_output().unwrap();
    assert!(output.status.success());
    String::from_utf8(output.stdout).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect()
}

#[test]
fn the_openai_sdk_rebuilds_every_runs_answer_from_its_stream() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let runs: Vec<Vec<Event>> = (0..160).map(|_| run_events().new_tree(&mut runner).unwrap().current()).collect();
    let bodies: Vec<String> = runs
        .iter()
        .map(|events| {
            let mut sse = ResponsesSse::new(ResponseEvents::new(), None);
            let mut body = String::new();
            for (seq, event) in (1..).zip(events) {
                sse.encode(&Frame::new(seq, event.clone()), &mut body);
            }
            sse.end(&mut body);
            body
        })
        .collect();
    let results = accumulated(&bodies);
    assert_eq!(results.len(), runs.len());
    for (events, result) in runs.iter().zip(&results) {
        assert!(result["error"].is_null(), "the SDK refused a stream: {result}\n{events:#?}");
        assert_eq!(result["mismatches"], serde_json::json!([]), "a text's deltas add up to it");
        let (output, rebuilt) = (&result["final"]["output"], &result["rebuilt"]);
        // What the accumulator made of the deltas is what the terminal event says, item by
        // item (voided items, streamed but not in the output, aside).
        for item in output.as_array().unwrap() {
            let same = rebuilt.as_array().unwrap().iter().find(|r| r["id"] == item["id"]);
            assert_eq!(same, Some(item), "rebuilt {rebuilt}\nfinal {output}");
        }
        assert_eq!(result["final"]["output_text"], kept(events).0, "the SDK's text is the answer's");
    }
}
