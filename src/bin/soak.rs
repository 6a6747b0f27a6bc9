//! A soak of a running chatd: `--runs` runs spread over `--minutes`, `--concurrency` at a
//! time, each with a random provider fault (the mock model's directives: errors before any
//! output, a failure mid-stream, a tool call, a slow answer) and a random client (reads to
//! `done`; leaves after a few events, sometimes coming back with `Last-Event-ID`; cancels
//! after a few events). It samples chatd's RSS (`--pid`) as it goes. At the end it checks
//! every run: its trace is not `running`, and its logged stream, replayed from the start,
//! holds exactly one terminal event (`complete`, `cancelled` or `error`) and ends with
//! `done`. Prints one JSON line; exits 1 if any run breaks that.
//!
//! `soak --base http://127.0.0.1:8080 --runs 1000 --minutes 10 --pid 1234`

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

#[derive(Parser)]
struct Args {
    /// chatd's base URL.
    #[arg(long)]
    base: String,
    #[arg(long, default_value_t = 1000)]
    runs: usize,
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    #[arg(long, default_value_t = 24)]
    concurrency: usize,
    /// chatd's process id, to sample its resident memory.
    #[arg(long)]
    pid: Option<u32>,
    /// A name for this run in the output.
    #[arg(long, default_value = "soak")]
    label: String,
}

/// What the model is asked to do.
const FAULTS: [(&str, &str); 8] = [
    ("answer", "[mock:words=40] [mock:delay=5]"),
    ("slow", "[mock:words=120] [mock:delay=20]"),
    ("unavailable", "[mock:error=unavailable]"),
    ("network", "[mock:error=network]"),
    ("rate_limited", "[mock:error=rate_limited]"),
    ("parse", "[mock:error=parse]"),
    ("fail_after", "[mock:words=60] [mock:delay=5] [mock:fail_after=4]"),
    ("tool", r#"[mock:tool=calculator {"expression": "6 * 7"}] [mock:delay=5]"#),
];

/// What the client does.
#[derive(Clone, Copy, Debug)]
enum Client {
    ReadAll,
    Leave { after: usize, resume: bool },
    Cancel { after: usize },
}

struct Outcome {
    trace_id: Option<String>,
    user: String,
    fault: &'static str,
    client: Client,
    error: Option<String>,
}

async fn one(http: reqwest::Client, base: Arc<str>, i: usize) -> Outcome {
    let (fault, directives) = FAULTS[fastrand::usize(..FAULTS.len())];
    let client = match fastrand::u8(..10) {
        0..=5 => Client::ReadAll,
        6 | 7 => Client::Leave { after: fastrand::usize(1..8), resume: fastrand::bool() },
        _ => Client::Cancel { after: fastrand::usize(1..6) },
    };
    // Users in a small pool: the per-user limit of running runs is met now and then.
    let user = format!("soak-{}", i % 16);
    let mut outcome = Outcome { trace_id: None, user: user.clone(), fault, client, error: None };
    let body = json!({"message": format!("run {i} {directives}")});
    let response =
        match http.post(format!("{base}/api/chat/stream")).header("x-client-id", &user).json(&body).send().await {
            Ok(r) => r,
            Err(e) => {
                outcome.error = Some(format!("request: {e}"));
                return outcome;
            }
        };
    if !response.status().is_success() {
        // Refused before it started (429 at the per-user limit): no run to check.
        return outcome;
    }
    let mut events = response.bytes_stream().eventsource();
    let mut seen = 0usize;
    let mut last_id = 0u64;
    while let Some(event) = events.next().await {
        let Ok(event) = event else { break };
        seen += 1;
        last_id = event.id.parse().unwrap_or(last_id);
        let data: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
        if data["type"] == "start" {
            outcome.trace_id = data["trace_id"].as_str().map(str::to_owned);
        }
        if data["type"] == "done" {
            return outcome;
        }
        match client {
            Client::Leave { after, resume } if seen >= after => {
                drop(events);
                if resume {
                    if let Some(trace_id) = &outcome.trace_id {
                        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..200))).await;
                        let resumed = http
                            .get(format!("{base}/api/chat/stream/{trace_id}"))
                            .header("x-client-id", &user)
                            .header("last-event-id", last_id.to_string())
                            .send()
                            .await;
                        if let Ok(r) = resumed {
                            let mut rest = r.bytes_stream().eventsource();
                            while rest.next().await.is_some() {}
                        }
                    }
                }
                return outcome;
            }
            Client::Cancel { after } if seen == after => {
                if let Some(trace_id) = &outcome.trace_id {
                    let _ = http
                        .post(format!("{base}/api/cancel_stream"))
                        .header("x-client-id", &user)
                        .json(&json!({"trace_id": trace_id}))
                        .send()
                        .await;
                }
            }
            _ => {}
        }
    }
    outcome
}

/// Resident memory of `pid` in KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A finished run's trace status, and what is wrong with it or its replayed log (`None`
/// when they are as they must be).
async fn check(http: &reqwest::Client, base: &str, trace_id: &str, user: &str) -> (String, Option<String>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        let trace: Value = match http
            .get(format!("{base}/api/trace/{trace_id}"))
            .header("x-client-id", user)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
        {
            Ok(r) => r.json().await.unwrap_or(Value::Null),
            Err(e) => return ("unknown".into(), Some(format!("trace: {e}"))),
        };
        let status = trace["status"].as_str().unwrap_or("unknown").to_owned();
        if status != "running" {
            break status;
        }
        if Instant::now() > deadline {
            return (status, Some("trace still running a minute after the soak".into()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let replay =
        match http.get(format!("{base}/api/chat/stream/{trace_id}?after=0")).header("x-client-id", user).send().await {
            Ok(r) => r,
            Err(e) => return (status, Some(format!("replay: {e}"))),
        };
    let mut kinds = Vec::new();
    let mut events = replay.bytes_stream().eventsource();
    while let Some(Ok(event)) = events.next().await {
        let data: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
        kinds.push(data["type"].as_str().unwrap_or("?").to_owned());
    }
    let terminals = kinds.iter().filter(|k| matches!(k.as_str(), "complete" | "cancelled" | "error")).count();
    if terminals != 1 || kinds.last().map(String::as_str) != Some("done") {
        let problem = format!(
            "replayed stream ends {:?} with {terminals} terminal events",
            kinds.iter().rev().take(3).collect::<Vec<_>>()
        );
        return (status, Some(problem));
    }
    (status, None)
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().expect("client");
    let base: Arc<str> = args.base.trim_end_matches('/').into();
    let gate = Arc::new(Semaphore::new(args.concurrency.max(1)));
    let spacing = Duration::from_secs_f64(args.minutes * 60.0 / args.runs.max(1) as f64);
    let started = Instant::now();

    // (seconds since the start, KiB) every 5 s.
    let samples = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sampler = args.pid.map(|pid| {
        let samples = samples.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(5));
            loop {
                every.tick().await;
                match rss_kib(pid) {
                    Some(kib) => samples.lock().expect("samples").push((started.elapsed().as_secs(), kib)),
                    None => return,
                }
            }
        })
    });

    let mut pace = tokio::time::interval(spacing.max(Duration::from_millis(1)));
    let mut tasks = Vec::with_capacity(args.runs);
    for i in 0..args.runs {
        pace.tick().await;
        let permit = gate.clone().acquire_owned().await.expect("open gate");
        let (http, base) = (http.clone(), base.clone());
        tasks.push(tokio::spawn(async move {
            let outcome = one(http, base, i).await;
            drop(permit);
            outcome
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for task in tasks {
        outcomes.push(task.await.expect("run task"));
    }
    let driven = started.elapsed();

    let mut violations = Vec::new();
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    let mut faults: BTreeMap<&str, usize> = BTreeMap::new();
    let (mut refused, mut client_errors) = (0, 0);
    for outcome in &outcomes {
        *faults.entry(outcome.fault).or_default() += 1;
        if outcome.error.is_some() {
            client_errors += 1;
        }
        let Some(trace_id) = &outcome.trace_id else {
            refused += 1;
            continue;
        };
        let (status, problem) = check(&http, &base, trace_id, &outcome.user).await;
        if let Some(problem) = problem {
            violations.push(json!({"trace_id": trace_id, "fault": outcome.fault, "client": format!("{:?}", outcome.client), "problem": problem}));
        }
        *statuses.entry(status).or_default() += 1;
    }
    if let Some(sampler) = sampler {
        sampler.abort();
    }
    let mut rss = samples.lock().expect("samples").clone();
    if let Some(pid) = args.pid {
        rss.extend(rss_kib(pid).map(|kib| (started.elapsed().as_secs(), kib)));
    }
    let minute = |from: u64, to: u64| -> Option<u64> {
        let mut window: Vec<u64> = rss.iter().filter(|(t, _)| *t >= from && *t < to).map(|(_, k)| *k).collect();
        window.sort_unstable();
        window.get(window.len() / 2).copied()
    };
    let end = driven.as_secs();
    let summary = json!({
        "label": args.label,
        "runs": outcomes.len(),
        "started": outcomes.len() - refused,
        "refused_before_start": refused,
        "client_errors": client_errors,
        "driven_secs": driven.as_secs_f64(),
        "faults": faults,
        "statuses": statuses,
        "violations": violations.len(),
        "first_violations": violations.iter().take(5).collect::<Vec<_>>(),
        "rss_kib": {
            "first_minute_median": minute(0, 60),
            "last_minute_median": minute(end.saturating_sub(60), end + 1),
            "max": rss.iter().map(|(_, k)| *k).max(),
            "samples": rss.len(),
        },
    });
    println!("{summary}");
    if !violations.is_empty() || statuses.contains_key("running") {
        std::process::exit(1);
    }
}
