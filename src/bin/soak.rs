//! A soak of a running chatd: `--runs` runs spread over `--minutes`, `--concurrency` at a
//! time, each with a random provider fault (the mock model's directives: errors before any
//! output, a failure mid-stream, a tool call, a slow answer) and a random client (reads to
//! `done`; leaves after a few events, sometimes coming back with `Last-Event-ID`; cancels
//! after a few events). It samples chatd's RSS (`--pid`) as it goes. At the end it checks
//! every run: its trace is not `running`, and its logged stream, replayed from the start,
//! holds exactly one terminal event (`complete`, `cancelled` or `error`) and ends with
//! `done`.
//!
//! Beside the runs, two users race over shared files for as long as the runs go: one
//! uploads bytes, then deletes her file while the other uploads the same bytes; his file
//! must read back whole, and a run that attaches it must answer with it. With
//! `--kill-postgres ADMIN_URL --database NAME`, every 15–45 s every connection chatd holds to
//! its database is killed (its pool and its notice listener), as a failover would.
//!
//! Prints one JSON line; exits 1 if any run breaks its rules or any file is lost.
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
    /// An admin URL of the Postgres server chatd uses: its connections there are killed now
    /// and then (with `--database`).
    #[arg(long, requires = "database")]
    kill_postgres: Option<String>,
    /// chatd's database on that server.
    #[arg(long)]
    database: Option<String>,
}

/// What the shared-file race saw.
#[derive(Default)]
struct FileRounds {
    rounds: usize,
    /// Files whose upload was answered 201 and that did not read back whole.
    lost: Vec<String>,
    /// Runs that attached a file and did not answer with it.
    unread: Vec<String>,
    /// Requests that failed otherwise (a 503 while the database's connections were killed).
    refused: usize,
}

/// Rounds of the shared-file race until `stop`: Ann's file of fresh bytes; then at once Ann
/// deletes it and Bob uploads the same bytes; Bob's must read back whole; every fifth round
/// a run attaches it; then Bob deletes it.
async fn race_files(http: reqwest::Client, base: Arc<str>, stop: tokio_util::sync::CancellationToken) -> FileRounds {
    let mut seen = FileRounds::default();
    // The body a browser's form sends (one part), written out: the bins have no multipart
    // client.
    let upload = |user: &'static str, bytes: Vec<u8>| {
        let mut body =
            b"--soak-boundary\r\ncontent-disposition: form-data; name=\"file\"; filename=\"shared.txt\"\r\n\r\n"
                .to_vec();
        body.extend_from_slice(&bytes);
        body.extend_from_slice(b"\r\n--soak-boundary--\r\n");
        http.post(format!("{base}/api/files"))
            .header("x-client-id", user)
            .header("content-type", "multipart/form-data; boundary=soak-boundary")
            .body(body)
            .send()
    };
    while !stop.is_cancelled() {
        seen.rounds += 1;
        let bytes = format!("shared note {} {}\n", seen.rounds, fastrand::u64(..)).into_bytes();
        let anns = match upload("soak-ann", bytes.clone()).await {
            Ok(r) if r.status() == reqwest::StatusCode::CREATED => r.json::<Value>().await.unwrap_or(Value::Null),
            _ => {
                seen.refused += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let delete = http
            .delete(format!("{base}/api/files/{}", anns["id"].as_str().unwrap_or_default()))
            .header("x-client-id", "soak-ann")
            .send();
        let (_, bobs) = tokio::join!(delete, upload("soak-bob", bytes.clone()));
        let bobs = match bobs {
            Ok(r) if r.status() == reqwest::StatusCode::CREATED => r.json::<Value>().await.unwrap_or(Value::Null),
            _ => {
                seen.refused += 1;
                continue;
            }
        };
        let id = bobs["id"].as_str().unwrap_or_default().to_owned();
        let read = http.get(format!("{base}/api/files/{id}")).header("x-client-id", "soak-bob").send().await;
        match read {
            Ok(r) if r.status().is_success() => {
                if r.bytes().await.ok().as_deref() != Some(&bytes[..]) {
                    seen.lost.push(id.clone());
                }
            }
            Ok(r) if r.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE => {
                // A database blip, or lost bytes: tell them apart once it is over.
                tokio::time::sleep(Duration::from_secs(2)).await;
                let again = http.get(format!("{base}/api/files/{id}")).header("x-client-id", "soak-bob").send().await;
                match again {
                    Ok(r) if r.status().is_success() => {
                        if r.bytes().await.ok().as_deref() != Some(&bytes[..]) {
                            seen.lost.push(id.clone());
                        }
                    }
                    Ok(r) if r.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE => seen.lost.push(id.clone()),
                    _ => seen.refused += 1,
                }
            }
            // Refused for the rate (a 429), or another answer than the bytes: say which.
            Ok(r) if r.status() == reqwest::StatusCode::TOO_MANY_REQUESTS => seen.refused += 1,
            Ok(_) => seen.lost.push(id.clone()),
            Err(_) => seen.refused += 1,
        }
        if seen.rounds % 5 == 0 {
            let body = json!({"message": "What is in the file? [mock:words=5]", "attachments": [{"file_id": id}]});
            let answer =
                http.post(format!("{base}/api/chat/stream")).header("x-client-id", "soak-bob").json(&body).send().await;
            if let Ok(answer) = answer.and_then(reqwest::Response::error_for_status) {
                let text = answer.text().await.unwrap_or_default();
                if !text.contains("[1 text file shared.txt") && !text.contains("\"type\":\"error\"") {
                    seen.unread.push(id.clone());
                }
            }
        }
        let _ = http.delete(format!("{base}/api/files/{id}")).header("x-client-id", "soak-bob").send().await;
    }
    seen
}

/// Kills every connection chatd holds to `database` every 15–45 s until `stop`; how many
/// times, and how many connections in all.
async fn kill_connections(admin: String, database: String, stop: tokio_util::sync::CancellationToken) -> (usize, u64) {
    use sqlx::Connection;
    let (mut times, mut killed) = (0, 0);
    loop {
        let pause = Duration::from_secs(fastrand::u64(15..45));
        tokio::select! {
            () = stop.cancelled() => return (times, killed),
            () = tokio::time::sleep(pause) => {}
        }
        let Ok(mut conn) = sqlx::PgConnection::connect(&admin).await else { continue };
        let gone: Result<Vec<(bool,)>, _> = sqlx::query_as(
            "select pg_terminate_backend(pid) from pg_stat_activity where datname = $1 and pid <> pg_backend_pid()",
        )
        .bind(&database)
        .fetch_all(&mut conn)
        .await;
        if let Ok(gone) = gone {
            times += 1;
            killed += gone.len() as u64;
        }
        let _ = conn.close().await;
    }
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

    let stop = tokio_util::sync::CancellationToken::new();
    let files = tokio::spawn(race_files(http.clone(), base.clone(), stop.clone()));
    let kills = match (args.kill_postgres.clone(), args.database.clone()) {
        (Some(admin), Some(database)) => Some(tokio::spawn(kill_connections(admin, database, stop.clone()))),
        _ => None,
    };

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
    stop.cancel();
    let files = files.await.expect("file race task");
    let kills = match kills {
        Some(kills) => Some(kills.await.expect("kill task")),
        None => None,
    };

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
        "shared_files": {
            "rounds": files.rounds,
            "lost": files.lost.len(),
            "first_lost": files.lost.iter().take(5).collect::<Vec<_>>(),
            "runs_without_their_file": files.unread.len(),
            "refused": files.refused,
        },
        "postgres_kills": kills.map(|(times, connections)| json!({"times": times, "connections": connections})),
        "rss_kib": {
            "first_minute_median": minute(0, 60),
            "last_minute_median": minute(end.saturating_sub(60), end + 1),
            "max": rss.iter().map(|(_, k)| *k).max(),
            "median_by_minute": (0..end.div_ceil(60)).filter_map(|m| minute(m * 60, m * 60 + 60)).collect::<Vec<_>>(),
            "samples": rss.len(),
        },
    });
    println!("{summary}");
    if !violations.is_empty() || statuses.contains_key("running") || !files.lost.is_empty() || !files.unread.is_empty()
    {
        std::process::exit(1);
    }
}
