//! Traces over OTLP (CONTRACT.md §18): chatd, a process of its own (the exporter is one per
//! process, configured by the standard `OTEL_*` variables or `telemetry.otlp_endpoint`),
//! exports to a receiver that decodes every request with OpenTelemetry's own protobuf
//! classes (tests/fixtures/otlp_receiver.py).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::helpers::*;

struct Collector {
    child: Child,
    port: u16,
    client: reqwest::Client,
}

impl Collector {
    async fn start(port: u16) -> Self {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let python = root.join("target/report/venv/bin/python");
        assert!(python.exists(), "opentelemetry-proto is not installed: run scripts/report-peers.sh");
        let child = Command::new(python)
            .arg(root.join("tests/fixtures/otlp_receiver.py"))
            .arg(port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the OTLP receiver starts");
        let collector = Self { child, port, client: reqwest::Client::new() };
        let deadline = Instant::now() + Duration::from_secs(20);
        while collector.client.get(collector.url("/spans")).send().await.is_err() {
            assert!(Instant::now() < deadline, "the OTLP receiver did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        collector
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    async fn spans(&self) -> Vec<Value> {
        self.client.get(self.url("/spans")).send().await.unwrap().json().await.unwrap()
    }

    async fn down(&self, down: bool) {
        self.client.post(self.url("/behaviour")).json(&json!({"down": down})).send().await.unwrap();
    }

    /// Waits (bounded) until the spans of the run `trace_id` (chatd's) arrived, `n` of them.
    async fn run(&self, trace_id: &str, n: usize) -> Vec<Value> {
        match self.exported(trace_id, n, Duration::from_secs(20)).await {
            Ok(spans) => spans,
            Err(spans) => panic!("the run {trace_id} was not exported whole: {spans:#?}"),
        }
    }

    /// The spans of the run `trace_id`, once `n` of them arrived within `wait`; else every
    /// span that did.
    async fn exported(&self, trace_id: &str, n: usize, wait: Duration) -> Result<Vec<Value>, Vec<Value>> {
        let deadline = Instant::now() + wait;
        loop {
            let spans = self.spans().await;
            let root = spans.iter().find(|s| s["attributes"]["chatd.trace_id"] == trace_id).cloned();
            if let Some(root) = root {
                let of_run: Vec<Value> = spans
                    .iter()
                    .filter(|s| s["span_id"] == root["span_id"] || s["parent_span_id"] == root["span_id"])
                    .cloned()
                    .collect();
                if of_run.len() >= n {
                    return Ok(of_run);
                }
            }
            if Instant::now() >= deadline {
                return Err(spans);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn chat(replica: &Replica, body: Value, traceparent: Option<&str>) -> Vec<Frame> {
    let mut request = reqwest::Client::new().post(format!("{}/api/chat/stream", replica.base)).json(&body);
    if let Some(traceparent) = traceparent {
        request = request.header("traceparent", traceparent);
    }
    let frames = read_frames(request.send().await.unwrap()).await;
    assert_eq!(frames.last().map(Frame::kind), Some("done"), "{frames:?}");
    frames
}

fn named<'a>(spans: &'a [Value], name: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["name"] == name).collect()
}

/// A run with a tool call, started with a `traceparent`: its spans join the caller's trace
/// under the caller's span, each model and tool call a child of the run's span, with the
/// GenAI attribute names. A run without one is a trace of its own, its id the run's.
#[tokio::test]
async fn runs_are_exported_as_otlp_traces_with_genai_attributes() {
    let collector = Collector::start(free_port()).await;
    let db = TestDb::new(Backend::Sqlite).await;
    let endpoint = collector.url("");
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let replica = Replica::start_with_env(&db.url, FAST_MOCK, &env).await;

    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{caller_trace}-00f067aa0ba902b7-01");
    let body = json!({"message": r#"Add [mock:tool=calculator {"expression": "2 + 40"}]"#});
    let frames = chat(&replica, body, Some(&traceparent)).await;
    let trace_id = frames[0].data["trace_id"].as_str().unwrap().to_owned();
    let conversation = frames[0].data["conversation_id"].as_str().unwrap().to_owned();
    let spans = collector.run(&trace_id, 4).await;
    let run = named(&spans, "invoke_agent default")[0];
    assert_eq!(run["trace_id"], caller_trace, "the caller's trace");
    assert_eq!(run["parent_span_id"], "00f067aa0ba902b7", "under the caller's span");
    assert_eq!(run["service_name"], "chatd");
    assert_eq!(run["scope"], "chatd");
    let a = &run["attributes"];
    assert_eq!(a["gen_ai.operation.name"], "invoke_agent");
    assert_eq!(a["gen_ai.provider.name"], "chatd.mock");
    assert_eq!(
        (a["gen_ai.request.model"].as_str(), a["gen_ai.response.model"].as_str()),
        (Some("mock-1"), Some("mock-1"))
    );
    assert_eq!(a["gen_ai.conversation.id"], conversation.as_str());
    assert!(a["gen_ai.usage.output_tokens"].as_i64().unwrap() > 0);
    assert_eq!(run["status"], 1, "ok");

    let calls = named(&spans, "chat mock-1");
    assert_eq!(calls.len(), 2, "the call that asked for the tool, and the answer: {spans:#?}");
    let tools = named(&spans, "execute_tool calculator");
    assert_eq!(tools.len(), 1);
    for child in calls.iter().chain(&tools) {
        assert_eq!(child["trace_id"], caller_trace);
        assert_eq!(child["parent_span_id"], run["span_id"], "a child of the run's span");
        assert!(child["start"].as_u64() >= run["start"].as_u64() && child["end"].as_u64() <= run["end"].as_u64());
    }
    let call = &calls[0]["attributes"];
    assert_eq!(call["gen_ai.operation.name"], "chat");
    assert_eq!(call["gen_ai.request.model"], "mock-1");
    assert_eq!(call["gen_ai.conversation.id"], conversation.as_str());
    assert!(call["gen_ai.usage.input_tokens"].as_i64().unwrap() > 0);
    assert_eq!(calls[0]["kind"], 3, "a client span");
    let tool = &tools[0]["attributes"];
    assert_eq!(tool["gen_ai.operation.name"], "execute_tool");
    assert_eq!(tool["gen_ai.tool.name"], "calculator");
    let call_id = frames.iter().find(|f| f.kind() == "tool_start").unwrap().data["tool_call_id"].clone();
    assert_eq!(tool["gen_ai.tool.call.id"], call_id);

    // No traceparent: the run's own trace id; a failed run's span says why.
    let frames = chat(&replica, json!({"message": "Fail [mock:error=unauthorized]"}), None).await;
    let failed = frames[0].data["trace_id"].as_str().unwrap().to_owned();
    let spans = collector.run(&failed, 1).await;
    let run = named(&spans, "invoke_agent default")[0];
    assert_eq!(run["trace_id"], failed.replace('-', ""), "the run's own trace id");
    assert_eq!(run["parent_span_id"], "", "a root");
    assert_eq!(run["status"], 2, "error");
    assert_eq!(run["attributes"]["error.type"], "UNAUTHORIZED");
    // A traceparent that is not one is ignored.
    let frames = chat(&replica, json!({"message": "Hello"}), Some("00-zz-00f067aa0ba902b7-01")).await;
    let own = frames[0].data["trace_id"].as_str().unwrap().to_owned();
    let spans = collector.run(&own, 2).await;
    assert_eq!(named(&spans, "invoke_agent default")[0]["trace_id"], own.replace('-', ""));
}

/// `telemetry.otlp_endpoint` is a base URL, as the variable is; a collector that is down
/// for a while costs no stream anything, and the runs after it is back are exported.
#[tokio::test]
async fn a_collector_that_is_down_loses_no_stream() {
    let collector = Collector::start(free_port()).await;
    collector.down(true).await;
    let db = TestDb::new(Backend::Sqlite).await;
    let config = format!(
        "{FAST_MOCK}\n[telemetry]\notlp_endpoint = \"{}/\"\n[limits]\nrequests_per_minute = 0\n",
        collector.url("")
    );
    let env = [("OTEL_BSP_SCHEDULE_DELAY", "100"), ("OTEL_BSP_MAX_QUEUE_SIZE", "64")];
    let replica = Replica::start_with_env(&db.url, &config, &env).await;
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", replica.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap().to_owned();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap()
    };
    chat(&replica, json!({"message": "Warm up"}), None).await;
    let before = rss();
    for n in 0..300 {
        let frames = chat(&replica, json!({"message": format!("While it is down {n}")}), None).await;
        assert_eq!(frames.iter().filter(|f| f.kind() == "complete").count(), 1);
    }
    let grown_kb = rss().saturating_sub(before);
    let refused: Value = collector.client.get(collector.url("/refused")).send().await.unwrap().json().await.unwrap();
    assert!(refused["refused"].as_u64().unwrap() > 0, "the exporter tried while it was down");
    eprintln!("RSS grew by {grown_kb} KB over 300 runs with the collector down");
    assert!(grown_kb < 64 * 1024, "spans are dropped, not kept: RSS grew by {grown_kb} KB");
    collector.down(false).await;
    // The spans of a run that ends while the queue still holds what was kept for the
    // collector (a full queue drops, by design) may go; a run soon after is exported whole.
    let mut spans = None;
    for n in 0..5 {
        let frames = chat(&replica, json!({"message": format!("It is back {n}")}), None).await;
        let trace_id = frames[0].data["trace_id"].as_str().unwrap().to_owned();
        if let Ok(exported) = collector.exported(&trace_id, 2, Duration::from_secs(8)).await {
            spans = Some(exported);
            break;
        }
    }
    let spans = spans.expect("a run after the collector is back is exported");
    let names: BTreeMap<&str, usize> = spans.iter().fold(BTreeMap::new(), |mut m, s| {
        *m.entry(s["name"].as_str().unwrap()).or_default() += 1;
        m
    });
    assert_eq!(names, BTreeMap::from([("chat mock-1", 1), ("invoke_agent default", 1)]));
}

/// A run that ends just before SIGTERM is exported before the process ends (the batch it
/// waits in would have gone out seconds later).
#[tokio::test]
async fn the_last_runs_are_exported_before_a_sigterm_ends_the_process() {
    let collector = Collector::start(free_port()).await;
    let db = TestDb::new(Backend::Sqlite).await;
    let endpoint = collector.url("");
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "60000")];
    let replica = Replica::start_with_env(&db.url, FAST_MOCK, &env).await;
    let frames = chat(&replica, json!({"message": "hi"}), None).await;
    let trace_id = frames[0].data["trace_id"].as_str().unwrap().to_owned();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(collector.exported(&trace_id, 1, Duration::ZERO).await.is_err(), "not sent before the batch's time");
    replica.signal("-TERM");
    let status = replica.exited().await;
    assert!(status.success(), "{status:?}");
    collector.run(&trace_id, 2).await;
}

/// A run the drain cancels (its grace over) is exported too, before the process ends.
#[tokio::test]
async fn a_run_the_drain_cancels_is_exported_before_the_process_ends() {
    let collector = Collector::start(free_port()).await;
    let db = TestDb::new(Backend::Sqlite).await;
    let endpoint = collector.url("");
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "60000"),
        ("CHATD_SERVER__SHUTDOWN_GRACE_SECS", "1"),
    ];
    let replica = Replica::start_with_env(&db.url, FAST_MOCK, &env).await;
    let body = json!({"message": "a long one [mock:words=400] [mock:delay=50]"});
    let response =
        reqwest::Client::new().post(format!("{}/api/chat/stream", replica.base)).json(&body).send().await.unwrap();
    let reading = tokio::spawn(read_frames(response));
    tokio::time::sleep(Duration::from_millis(500)).await;
    replica.signal("-TERM");
    let status = replica.exited().await;
    assert!(status.success(), "{status:?}");
    let frames = reading.await.unwrap();
    let trace_id = frames[0].data["trace_id"].as_str().unwrap().to_owned();
    assert!(frames.iter().any(|f| f.kind() == "cancelled" || f.kind() == "error"), "the drain ended it: {frames:?}");
    let spans = collector.run(&trace_id, 1).await;
    assert!(!spans.is_empty());
}
