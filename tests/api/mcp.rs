//! MCP servers for real, no mocks: mcp-server-time (PyPI) and server-everything (npm), over
//! stdio and streamable HTTP, installed under target/mcp by scripts/mcp-servers.sh.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chatd::config::McpServerSettings;
use chatd::tools::mcp::{McpManager, McpServerStatus, McpState};
use chatd::tools::{Tool, ToolCallContext, ToolProgress};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const EVERYTHING: &str = "node_modules/@modelcontextprotocol/server-everything/dist/index.js";
const LONG_RUNNING: &str = "trigger-long-running-operation";

/// A file of the installed servers, or a failure that says how to install them.
fn installed(relative: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/mcp");
    let marker = root.join(relative.split('/').next().unwrap_or_default()).join(".chatd-installed");
    let path = root.join(relative);
    assert!(
        marker.exists() && path.exists(),
        "the MCP test servers are not installed ({} is missing): run scripts/mcp-servers.sh",
        path.display()
    );
    path
}

fn stdio(command: impl Into<String>, args: &[&str]) -> McpServerSettings {
    McpServerSettings {
        command: Some(command.into()),
        args: args.iter().map(|a| a.to_string()).collect(),
        env: BTreeMap::new(),
        url: None,
        global: true,
        idempotent: false,
    }
}

fn time_server() -> McpServerSettings {
    let python = installed("venv/bin/python");
    let python = python.to_str().expect("utf-8 path");
    stdio(python, &["-m", "mcp_server_time", "--local-timezone", "UTC"])
}

fn everything_server() -> McpServerSettings {
    let script = installed(&format!("node/{EVERYTHING}"));
    stdio("node", &[script.to_str().expect("utf-8 path"), "stdio"])
}

/// A manager for one test; its servers are shut down when it is dropped.
struct Servers {
    manager: Arc<McpManager>,
    shutdown: CancellationToken,
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Servers {
    async fn start(servers: Vec<(&str, McpServerSettings)>) -> Self {
        let servers: BTreeMap<String, McpServerSettings> =
            servers.into_iter().map(|(id, s)| (id.to_owned(), s)).collect();
        let shutdown = CancellationToken::new();
        let manager = McpManager::start(&servers, Duration::from_secs(30), shutdown.clone());
        manager.wait_ready(Duration::from_secs(15)).await;
        Self { manager, shutdown }
    }

    fn status(&self, id: &str) -> McpServerStatus {
        self.manager.status().into_iter().find(|s| s.id == id).unwrap_or_else(|| panic!("no status for {id}"))
    }

    fn tool(&self, name: &str) -> Arc<dyn Tool> {
        self.manager
            .tools()
            .into_iter()
            .find(|(_, tool)| tool.spec().name == name)
            .map(|(_, tool)| tool)
            .unwrap_or_else(|| panic!("no tool {name}; status: {:?}", self.manager.status()))
    }

    /// Polls until `done` holds for the server's status, failing after `within`.
    async fn until(
        &self,
        id: &str,
        within: Duration,
        mut done: impl FnMut(&McpServerStatus) -> bool,
    ) -> McpServerStatus {
        let deadline = Instant::now() + within;
        loop {
            let status = self.status(id);
            if done(&status) {
                return status;
            }
            assert!(Instant::now() < deadline, "gave up waiting; last status: {status:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A call's context, the progress it reports, and its cancel token.
fn context() -> (ToolCallContext, mpsc::UnboundedReceiver<ToolProgress>, CancellationToken) {
    let (progress, reports) = mpsc::unbounded_channel();
    let cancel = CancellationToken::new();
    let ctx = ToolCallContext { progress, cancel: cancel.clone(), idempotency_key: None };
    (ctx, reports, cancel)
}

async fn call(tool: &Arc<dyn Tool>, input: Value) -> Result<String, chatd::tools::ToolError> {
    let (ctx, _reports, _cancel) = context();
    tokio::time::timeout(Duration::from_secs(10), tool.call(input, ctx))
        .await
        .expect("the call answers")
        .map(|output| output.text)
}

/// Whether a process runs (a zombie is dead: it only waits to be reaped).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()), Some('Z' | 'X')),
        Err(_) => false,
    }
}

#[tokio::test]
async fn servers_become_ready_and_list_their_tools_with_schemas() {
    let mut everything = everything_server();
    everything.global = false;
    let servers = Servers::start(vec![("time", time_server()), ("everything", everything)]).await;

    for id in ["time", "everything"] {
        let status = servers.status(id);
        assert_eq!(status.state, McpState::Ready, "{status:?}");
        assert_eq!(status.transport, "stdio");
        assert_eq!(status.restarts, 0);
        assert_eq!(status.last_error, None);
    }
    assert!(servers.manager.is_global("time"));
    assert!(!servers.manager.is_global("everything"));
    assert!(!servers.manager.is_global("nope"));

    let time = servers.status("time");
    assert!(time.tools.contains(&"get_current_time".to_owned()), "{time:?}");
    assert!(time.tools.contains(&"convert_time".to_owned()), "{time:?}");

    let spec = servers.tool("get_current_time").spec();
    assert!(!spec.description.is_empty());
    assert_eq!(spec.input_schema["type"], "object");
    assert_eq!(spec.input_schema["properties"]["timezone"]["type"], "string");
    assert!(spec.input_schema["required"].as_array().is_some_and(|r| r.contains(&json!("timezone"))));

    let echo = servers.tool("echo").spec();
    assert_eq!(echo.input_schema["properties"]["message"]["type"], "string");
    let long = servers.tool(LONG_RUNNING).spec();
    assert!(long.input_schema["properties"]["steps"].is_object(), "{long:?}");

    // Every tool is reported under its own server.
    for (server, tool) in servers.manager.tools() {
        assert!(servers.status(&server).tools.contains(&tool.spec().name));
    }
    let body = serde_json::to_value(servers.manager.status()).expect("serializes");
    assert_eq!(body[0]["state"], "ready");
}

#[tokio::test]
async fn get_current_time_answers_for_a_timezone() {
    let servers = Servers::start(vec![("time", time_server())]).await;
    let tool = servers.tool("get_current_time");

    let text = call(&tool, json!({"timezone": "Asia/Tokyo"})).await.expect("time");
    let answer: Value = serde_json::from_str(&text).expect("JSON text");
    assert_eq!(answer["timezone"], "Asia/Tokyo");
    let datetime = answer["datetime"].as_str().expect("datetime");
    assert!(datetime.ends_with("+09:00"), "{datetime}");

    // A tool error (`isError`) is the tool's answer, not a reason to retry.
    let error = call(&tool, json!({"timezone": "Mars/Olympus_Mons"})).await.expect_err("bad zone");
    assert!(error.message.contains("Invalid timezone"), "{error:?}");
    assert!(!error.retryable);
}

#[tokio::test]
async fn a_call_carries_its_idempotency_key_in_meta_and_the_server_config_says_whether_it_may_run_twice() {
    // A server of the official Python SDK that answers with the `_meta` it was sent.
    let python = installed("venv/bin/python");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mcp_meta_server.py");
    let settings =
        |idempotent| McpServerSettings { idempotent, ..stdio(python.to_str().unwrap(), &[script.to_str().unwrap()]) };
    let servers = Servers::start(vec![("meta", settings(false))]).await;
    let tool = servers.tool("request_meta");
    assert!(!tool.idempotent(), "a server's tools may not run twice unless its config says so");
    let (mut ctx, _reports, _cancel) = context();
    ctx.idempotency_key = Some("trace-1:call-7".into());
    let output = tokio::time::timeout(Duration::from_secs(10), tool.call(json!({}), ctx)).await.unwrap().unwrap();
    let meta: Value = serde_json::from_str(&output.text).unwrap();
    assert_eq!(meta["idempotency_key"], "trace-1:call-7", "{meta}");
    assert!(meta.get("progress_token").is_some(), "progress still has its token: {meta}");
    drop(servers);
    let servers = Servers::start(vec![("meta", settings(true))]).await;
    assert!(servers.tool("request_meta").idempotent());
}

#[tokio::test]
async fn echo_round_trips_and_structured_content_becomes_the_payload() {
    let mut everything = everything_server();
    everything.env.insert("CHATD_MCP_TEST_MARKER".into(), "marker-5150".into());
    let servers = Servers::start(vec![("everything", everything)]).await;

    let text = call(&servers.tool("echo"), json!({"message": "héllo, wörld"})).await.expect("echo");
    assert_eq!(text, "Echo: héllo, wörld");

    let (ctx, _reports, _cancel) = context();
    let output = servers
        .tool("get-structured-content")
        .call(json!({"location": "Chicago"}), ctx)
        .await
        .expect("structured content");
    let payload = output.payload.expect("structuredContent as payload");
    assert_eq!(payload["temperature"], 36);
    assert!(output.text.contains("drizzle"), "{}", output.text);

    // The settings' env reaches the child, with PATH but not the rest of chatd's environment
    // (where its API keys are).
    let env = call(&servers.tool("get-env"), json!({})).await.expect("env");
    let env: BTreeMap<String, String> = serde_json::from_str(&env).expect("JSON env");
    assert_eq!(env["CHATD_MCP_TEST_MARKER"], "marker-5150");
    assert!(env.contains_key("PATH"));
    let ours = std::env::vars().filter(|(k, _)| k.starts_with("CARGO") || k.ends_with("_KEY"));
    for (name, _) in ours {
        assert!(!env.contains_key(&name), "{name} leaked to the MCP server");
    }

    // Arguments that are not an object are refused before they reach the server.
    let error = call(&servers.tool("echo"), json!("hi")).await.expect_err("not an object");
    assert!(!error.retryable);
}

#[tokio::test]
async fn progress_notifications_arrive_in_order() {
    let servers = Servers::start(vec![("everything", everything_server())]).await;
    let (ctx, mut reports, _cancel) = context();

    let output = servers.tool(LONG_RUNNING).call(json!({"duration": 1, "steps": 5}), ctx).await.expect("completes");
    assert!(output.text.contains("completed"), "{}", output.text);

    let mut seen = Vec::new();
    while let Ok(report) = reports.try_recv() {
        seen.push(report.progress.expect("total known"));
    }
    let expected = [0.2, 0.4, 0.6, 0.8, 1.0];
    assert_eq!(seen.len(), expected.len(), "{seen:?}");
    for (got, want) in seen.iter().zip(expected) {
        assert!((got - want).abs() < 1e-9, "{seen:?}");
    }
}

#[tokio::test]
async fn cancelling_a_call_returns_at_once_and_tells_the_server() {
    // The server's stdin is copied to a file, to see what chatd sent it.
    let dir = tempfile::tempdir().expect("temp dir");
    let sent = dir.path().join("sent.jsonl");
    let script = installed(&format!("node/{EVERYTHING}"));
    let tapped = stdio(
        "sh",
        &[
            "-c",
            r#"tee -a "$0" | exec node "$1" stdio"#,
            sent.to_str().expect("utf-8 path"),
            script.to_str().expect("utf-8 path"),
        ],
    );
    let servers = Servers::start(vec![("everything", tapped)]).await;
    let (ctx, mut reports, cancel) = context();
    let tool = servers.tool(LONG_RUNNING);
    let call = tokio::spawn(async move { tool.call(json!({"duration": 20, "steps": 40}), ctx).await });

    // Running for sure once its first progress arrives.
    tokio::time::timeout(Duration::from_secs(5), reports.recv()).await.expect("progress").expect("a report");
    let cancelled_at = Instant::now();
    cancel.cancel();
    let result = tokio::time::timeout(Duration::from_secs(1), call).await.expect("returns at once").expect("no panic");
    assert!(cancelled_at.elapsed() < Duration::from_millis(500));
    let error = result.expect_err("cancelled");
    assert_eq!(error.message, "cancelled");
    assert!(!error.retryable);

    // The server was sent notifications/cancelled for that very request.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let messages: Vec<Value> = std::fs::read_to_string(&sent)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect();
        let request = messages
            .iter()
            .find(|m| m["method"] == "tools/call" && m["params"]["name"] == LONG_RUNNING)
            .expect("the call was sent");
        let told = messages
            .iter()
            .any(|m| m["method"] == "notifications/cancelled" && m["params"]["requestId"] == request["id"]);
        if told {
            break;
        }
        assert!(Instant::now() < deadline, "no notifications/cancelled in {messages:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // The session is unharmed.
    let text = call_echo(&servers).await;
    assert_eq!(text, "Echo: still here");
    assert_eq!(servers.status("everything").restarts, 0);
}

async fn call_echo(servers: &Servers) -> String {
    call(&servers.tool("echo"), json!({"message": "still here"})).await.expect("echo")
}

#[tokio::test]
async fn a_killed_server_is_restarted_and_its_call_in_flight_is_retryable() {
    let servers = Servers::start(vec![("everything", everything_server())]).await;
    let pid = servers.manager.pid("everything").expect("a child pid");
    assert!(alive(pid));

    let (ctx, mut reports, _cancel) = context();
    let tool = servers.tool(LONG_RUNNING);
    let in_flight = tokio::spawn(async move { tool.call(json!({"duration": 20, "steps": 40}), ctx).await });
    tokio::time::timeout(Duration::from_secs(5), reports.recv()).await.expect("progress").expect("a report");

    let killed = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().expect("kill runs");
    assert!(killed.success());

    let result = tokio::time::timeout(Duration::from_secs(5), in_flight)
        .await
        .expect("the call ends with its server")
        .expect("no panic");
    let error = result.expect_err("lost");
    assert!(error.retryable, "{error:?}");

    let mut saw_restarting = false;
    let status = servers
        .until("everything", Duration::from_secs(8), |s| {
            if s.state == McpState::Restarting {
                saw_restarting = true;
                assert!(s.tools.is_empty(), "{s:?}");
                assert!(servers.manager.tools().is_empty());
            }
            s.state == McpState::Ready && s.restarts >= 1
        })
        .await;
    assert!(saw_restarting, "{status:?}");
    assert!(status.last_error.is_some(), "{status:?}");
    let new_pid = servers.manager.pid("everything").expect("a new child");
    assert_ne!(new_pid, pid);
    assert_eq!(call_echo(&servers).await, "Echo: still here");
}

#[tokio::test]
async fn a_server_that_cannot_start_fails_without_blocking_the_others() {
    let started = Instant::now();
    let servers = Servers::start(vec![
        ("ghost", stdio("/nonexistent/chatd-mcp-ghost", &["--stdio"])),
        (
            "nowhere",
            McpServerSettings {
                command: None,
                args: Vec::new(),
                env: BTreeMap::new(),
                url: None,
                global: true,
                idempotent: false,
            },
        ),
        ("everything", everything_server()),
    ])
    .await;
    assert!(started.elapsed() < Duration::from_secs(10));

    let ghost = servers.status("ghost");
    assert!(matches!(ghost.state, McpState::Failed | McpState::Restarting), "{ghost:?}");
    let error = ghost.last_error.expect("why it failed");
    assert!(error.contains("/nonexistent/chatd-mcp-ghost"), "{error}");
    assert!(ghost.tools.is_empty());

    let nowhere = servers.status("nowhere");
    assert_eq!(nowhere.state, McpState::Failed);
    assert!(nowhere.last_error.is_some_and(|e| e.contains("command")));

    assert_eq!(servers.status("everything").state, McpState::Ready);
    assert!(servers.manager.tools().iter().all(|(server, _)| server == "everything"));
    assert_eq!(call_echo(&servers).await, "Echo: still here");

    // It keeps being retried, with backoff.
    servers.until("ghost", Duration::from_secs(5), |s| s.restarts >= 2).await;
}

#[tokio::test]
async fn shutdown_stops_the_child_processes() {
    let servers = Servers::start(vec![("time", time_server()), ("everything", everything_server())]).await;
    let pids: Vec<u32> =
        ["time", "everything"].iter().map(|id| servers.manager.pid(id).expect("a child pid")).collect();
    assert!(pids.iter().all(|pid| alive(*pid)));

    servers.shutdown.cancel();
    let deadline = Instant::now() + Duration::from_secs(8);
    while pids.iter().any(|pid| alive(*pid)) {
        assert!(Instant::now() < deadline, "children still running: {pids:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for id in ["time", "everything"] {
        servers.until(id, Duration::from_secs(2), |s| s.tools.is_empty()).await;
    }
    assert!(servers.manager.tools().is_empty());
}

#[tokio::test]
async fn a_streamable_http_server_works() {
    let script = installed(&format!("node/{EVERYTHING}"));
    let port = crate::helpers::free_port();
    let _server = tokio::process::Command::new("node")
        .arg(&script)
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("node starts");

    let settings = McpServerSettings {
        command: None,
        args: Vec::new(),
        env: BTreeMap::new(),
        url: Some(format!("http://127.0.0.1:{port}/mcp")),
        global: true,
        idempotent: false,
    };
    // The first attempts may find the port closed while node starts: they are retried.
    let servers = Servers::start(vec![("remote", settings)]).await;
    let status = servers.until("remote", Duration::from_secs(8), |s| s.state == McpState::Ready).await;
    assert_eq!(status.transport, "http");
    assert!(status.tools.contains(&"echo".to_owned()), "{status:?}");
    assert_eq!(call_echo(&servers).await, "Echo: still here");

    let (ctx, mut reports, _cancel) = context();
    servers.tool(LONG_RUNNING).call(json!({"duration": 0.3, "steps": 3}), ctx).await.expect("completes");
    let mut seen = 0;
    while reports.try_recv().is_ok() {
        seen += 1;
    }
    assert_eq!(seen, 3);
}

/// TOML for an MCP server entry, from the settings the tests above use.
fn toml_server(id: &str, settings: &McpServerSettings) -> String {
    let args: Vec<String> = settings.args.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "[mcp_servers.{id}]\ncommand = {:?}\nargs = [{}]\n",
        settings.command.as_deref().unwrap_or_default(),
        args.join(", ")
    )
}

/// Polls `GET /api/tools` (bounded) until every MCP server is ready.
async fn until_ready(app: &crate::helpers::TestApp) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_, tools) = app.get("/api/tools", "ann").await;
        let servers = tools["mcp_servers"].as_array().cloned().unwrap_or_default();
        if !servers.is_empty() && servers.iter().all(|s| s["state"] == "ready") {
            return tools;
        }
        assert!(std::time::Instant::now() < deadline, "MCP servers not ready: {tools}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn through_chatd_mcp_tools_stream_progress_and_clashing_names_get_the_server_prefix() {
    use crate::helpers::{Backend, Frame, TestApp};
    let config = format!(
        "{}{}{}",
        toml_server("everything", &everything_server()),
        toml_server("time", &time_server()),
        toml_server("clock", &time_server()),
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let tools = until_ready(&app).await;
    let names: Vec<&str> = tools["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"get_current_time"), "{names:?}");
    let clashing = if names.contains(&"clock_get_current_time") { "clock" } else { "time" };
    let renamed = format!("{clashing}_get_current_time");
    assert!(names.contains(&renamed.as_str()), "the second server's tool is prefixed: {names:?}");
    let source =
        tools["tools"].as_array().unwrap().iter().find(|t| t["name"] == renamed.as_str()).unwrap()["source"].clone();
    assert_eq!(source, json!({"kind": "mcp", "server": clashing}));

    let message = format!(
        r#"[mock:tool={LONG_RUNNING} {{"duration": 1, "steps": 4}}] [mock:tool={renamed} {{"timezone": "Europe/Paris"}}]"#
    );
    let frames = app.chat("ann", json!({"message": message})).await;
    let progress: Vec<f64> =
        frames.iter().filter(|f| f.kind() == "tool_progress").map(|f| f.data["progress"].as_f64().unwrap()).collect();
    assert_eq!(progress, [0.25, 0.5, 0.75, 1.0], "progress in order, from 0 to 1");
    let completes: Vec<&Frame> = frames.iter().filter(|f| f.kind() == "tool_complete").collect();
    assert_eq!(completes.len(), 2);
    assert!(completes.iter().all(|c| c.data["status"] == "success"), "{completes:?}");
    let paris = frames
        .iter()
        .find(|f| f.kind() == "tool_output" && f.data["output"].as_str().unwrap().contains("Europe/Paris"));
    assert!(paris.is_some(), "the renamed tool reached the right server");
}

#[tokio::test]
async fn a_run_sent_while_mcp_servers_start_waits_for_their_tools_and_readiness_says_so() {
    use crate::helpers::{Backend, TestApp};
    // A server that takes a while to start: its command waits before it becomes the server.
    let time = time_server();
    let mut slow = stdio("sh", &["-c", "sleep 1.5; exec \"$0\" \"$@\""]);
    slow.args.push(time.command.clone().unwrap());
    slow.args.extend(time.args.clone());
    let app = TestApp::spawn(Backend::Sqlite, &toml_server("time", &slow)).await;

    let (status, body) = app.get("/readyz", "ann").await;
    assert_eq!(status, reqwest::StatusCode::SERVICE_UNAVAILABLE, "not ready while a server starts: {body}");
    let frames = app.chat("ann", json!({"message": r#"[mock:tool=get_current_time {"timezone": "UTC"}]"#})).await;
    let complete = frames.iter().find(|f| f.kind() == "tool_complete").expect("the tool ran");
    assert_eq!(complete.data["status"], "success", "{frames:?}");
    assert_eq!(app.get("/readyz", "ann").await.0, reqwest::StatusCode::OK);
}

#[tokio::test]
async fn a_server_that_never_starts_holds_readiness_for_the_start_wait_only() {
    use crate::helpers::{Backend, TestApp};
    let hung = stdio("sleep", &["600"]);
    let config = format!("{}[tools]\nmcp_start_wait_secs = 1\n", toml_server("hung", &hung));
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    assert_eq!(app.get("/readyz", "ann").await.0, reqwest::StatusCode::SERVICE_UNAVAILABLE);
    let frames = app.chat("ann", json!({"message": "hello"})).await;
    assert!(frames.iter().any(|f| f.kind() == "complete"), "the run goes on without the server's tools");
    assert_eq!(app.get("/readyz", "ann").await.0, reqwest::StatusCode::OK);
}

#[tokio::test]
async fn a_server_pattern_gates_every_tool_of_that_server_and_no_other() {
    use crate::helpers::{Backend, TestApp};
    let config = format!("{}[tools]\nrequire_approval = [\"time:*\"]\n", toml_server("time", &time_server()));
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    let message = r#"[mock:tool=get_current_time {"timezone": "UTC"}] [mock:tool=calculator {"expression": "2 + 2"}]"#;
    let mut live = crate::runs::start(&app, "ann", json!({"message": message})).await;
    let request = live.until("tool_approval_request").await.data.clone();
    assert_eq!(request["tool"], "get_current_time", "the server's tool waits");
    let ran: Vec<&str> =
        live.seen().iter().filter(|f| f.kind() == "tool_complete").map(|f| f.data["tool"].as_str().unwrap()).collect();
    assert_eq!(ran, ["calculator"], "a built-in is not the server's: it ran at once");
    let approval = request["approval_id"].as_str().unwrap();
    let (status, _) = app.post(&format!("/api/approvals/{approval}"), "ann", json!({"approved": true})).await;
    assert_eq!(status, reqwest::StatusCode::OK);
    let frames = live.rest().await;
    let completes: Vec<(&str, &str)> = frames
        .iter()
        .filter(|f| f.kind() == "tool_complete")
        .map(|f| (f.data["tool"].as_str().unwrap(), f.data["status"].as_str().unwrap()))
        .collect();
    assert_eq!(completes, [("calculator", "success"), ("get_current_time", "success")]);
    assert!(frames.iter().any(|f| f.kind() == "complete"));
}
