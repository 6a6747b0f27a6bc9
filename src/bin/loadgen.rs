//! A load generator for SSE chat endpoints: opens N concurrent streams, parses every event,
//! and prints one JSON line of figures: time to first event, gaps between events, total
//! time, bytes, events, errors, and whether every stream ended properly (`done` for chatd,
//! `[DONE]` for OpenAI-style servers and the AI SDK's stream, `RUN_FINISHED` for AG-UI, the terminal event for the Responses API). With `--verify`, also checks that chatd persisted each
//! answer.
//!
//! With `--probes`, once every stream has its first event (the burst of starts is over), it
//! opens that many more streams one by one at a steady pace and reports their time to first
//! event on its own: the latency a new request sees while the others stream.
//!
//! Each stream's time to its first token is reported beside its time to first event: the
//! first event that carries the answer's text (chatd's first `start` goes out before the model
//! is called; an OpenAI-style server's first chunk holds the role, not a token).
//!
//! `loadgen --url http://127.0.0.1:8080/api/chat/stream --body '{"message":"go"}' --streams 64`
//!
//! `--sources N` spreads the streams over N loopback source addresses (127.0.0.1 to
//! 127.0.0.N, or from `--source-base` on): past ~28,000 streams one address runs out of
//! ephemeral ports. The output says how many streams were open at once at most (`peak_open`).
//!
//! `--http2 N` speaks HTTP/2 without TLS (prior knowledge) instead, N streams to a
//! connection: what a proxy in front of chatd does, and 50,000 streams in a few hundred
//! descriptors.
//!
//! `{n}` in the body is replaced by the stream's number, for bodies that must differ (the
//! AI SDK's chat id: `--body '{"id":"bench-{n}","messages":[…]}'`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::{Notify, Semaphore};

#[derive(Parser)]
struct Args {
    #[arg(long)]
    url: String,
    /// The JSON body POSTed for each stream; `{n}` becomes the stream's number.
    #[arg(long)]
    body: String,
    #[arg(long, default_value_t = 1)]
    streams: usize,
    /// Extra headers, `Name: value`.
    #[arg(long)]
    header: Vec<String>,
    /// Spread the streams over this many users (stream n is user `bench-<n mod users>`, named
    /// in `X-Client-Id`, which chatd without auth takes as the user; the mock ignores it);
    /// 0: no `X-Client-Id`, every stream the one local user.
    #[arg(long, default_value_t = 0)]
    users: usize,
    /// A name for this run in the output.
    #[arg(long, default_value = "run")]
    label: String,
    /// chatd's base URL: check that each answer was persisted.
    #[arg(long)]
    verify: Option<String>,
    /// Start streams at most this many at a time (opening 10,000 at once floods the listener).
    #[arg(long, default_value_t = 512)]
    ramp: usize,
    /// Streams opened one by one after the first ones all stream, timed on their own.
    #[arg(long, default_value_t = 0)]
    probes: usize,
    /// Milliseconds between two probes.
    #[arg(long, default_value_t = 20)]
    probe_every_ms: u64,
    /// Milliseconds to wait, once every stream has its first event, before the first probe.
    #[arg(long, default_value_t = 500)]
    settle_ms: u64,
    /// Loopback source addresses the streams are spread over (127.0.0.1, 127.0.0.2, …): one
    /// address has ~28,000 ephemeral ports to one server, so 50,000 streams need two or more.
    #[arg(long, default_value_t = 1)]
    sources: u8,
    /// The first source address is 127.0.0.(1 + this). A socket bound to an address before
    /// it connects takes a port no other socket of that address holds, those in TIME_WAIT
    /// included: two runs one after the other want different addresses.
    #[arg(long, default_value_t = 0)]
    source_base: u8,
    /// HTTP/2 with prior knowledge, this many streams to a connection (0: HTTP/1.1, a
    /// connection to each stream).
    #[arg(long, default_value_t = 0)]
    http2: usize,
}

#[derive(Default)]
struct Stream {
    first_event: Option<Duration>,
    first_token: Option<Duration>,
    /// When the last event carrying text came, from the stream's start.
    last_token: Option<Duration>,
    /// From the last event carrying text to the event that ends the stream (chatd: the
    /// run's end written, then its terminal event and `done`).
    end_wait: Option<Duration>,
    max_gap: Duration,
    gaps: Vec<Duration>,
    total: Duration,
    bytes: usize,
    events: usize,
    ended: bool,
    error: Option<String>,
    conversation_id: Option<String>,
    /// The user it ran as, where `--users` spreads them.
    user: Option<String>,
}

/// Counts the streams that have their first event, and those open at once.
#[derive(Default)]
struct Started {
    count: AtomicUsize,
    changed: Notify,
    /// Streams between their first event and their end.
    open: AtomicUsize,
    /// The most that were open at once.
    peak: AtomicUsize,
}

impl Started {
    /// Notes one more stream past its start (with its first event, or failed).
    fn note(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.changed.notify_waiters();
    }
}

/// `request` with the extra headers (`Name: value`) and, where `--users` spreads the
/// streams, its user's `X-Client-Id`.
fn with_headers(
    mut request: reqwest::RequestBuilder,
    headers: &[String],
    user: Option<&str>,
) -> reqwest::RequestBuilder {
    for header in headers {
        if let Some((name, value)) = header.split_once(':') {
            request = request.header(name.trim(), value.trim());
        }
    }
    match user {
        Some(user) => request.header("x-client-id", user),
        None => request,
    }
}

async fn one(
    client: reqwest::Client,
    args: Arc<Args>,
    number: usize,
    start_gate: Arc<Semaphore>,
    started_all: Arc<Started>,
) -> Stream {
    let mut stream = Stream::default();
    let permit = start_gate.acquire_owned().await.expect("open semaphore");
    let started = Instant::now();
    let body = args.body.replace("{n}", &number.to_string());
    stream.user = (args.users > 0).then(|| format!("bench-{}", number % args.users));
    let request = client.post(&args.url).header("content-type", "application/json").body(body);
    let request = with_headers(request, &args.header, stream.user.as_deref());
    let response = match request.send().await {
        Ok(r) if r.status().is_success() => Ok(r),
        Ok(r) => Err(format!("status {}", r.status())),
        Err(e) => Err(e.to_string()),
    };
    let response = match response {
        Ok(r) => r,
        Err(e) => {
            stream.error = Some(e);
            started_all.note();
            return stream;
        }
    };
    drop(permit);
    let mut last = Instant::now();
    let mut events = response.bytes_stream().eventsource();
    while let Some(event) = events.next().await {
        let now = Instant::now();
        match event {
            Ok(event) => {
                stream.events += 1;
                stream.bytes += event.data.len();
                if stream.first_event.is_none() {
                    stream.first_event = Some(now - started);
                    started_all.note();
                    let open = started_all.open.fetch_add(1, Ordering::Relaxed) + 1;
                    started_all.peak.fetch_max(open, Ordering::Relaxed);
                } else {
                    let gap = now - last;
                    stream.max_gap = stream.max_gap.max(gap);
                    stream.gaps.push(gap);
                }
                last = now;
                if event.data == "[DONE]" {
                    stream.end(now - started);
                } else if let Ok(data) = serde_json::from_str::<Value>(&event.data) {
                    if carries_text(&data) {
                        stream.first_token.get_or_insert(now - started);
                        stream.last_token = Some(now - started);
                    }
                    if data["type"] == "start" {
                        stream.conversation_id = data["conversation_id"].as_str().map(str::to_owned);
                    }
                    // chatd's `done`; AG-UI's run ends with its RUN_FINISHED or RUN_ERROR; a
                    // Responses stream with its terminal event.
                    let last = [
                        "done",
                        "RUN_FINISHED",
                        "RUN_ERROR",
                        "response.completed",
                        "response.failed",
                        "response.incomplete",
                    ];
                    if data["type"].as_str().is_some_and(|t| last.contains(&t)) {
                        stream.end(now - started);
                    }
                }
            }
            Err(e) => {
                stream.error = Some(e.to_string());
                break;
            }
        }
    }
    match stream.first_event {
        None => started_all.note(),
        Some(_) => {
            started_all.open.fetch_sub(1, Ordering::Relaxed);
        }
    }
    stream.total = started.elapsed();
    stream
}

impl Stream {
    /// The stream's end came `at` from its start: the first event that ends it counts.
    fn end(&mut self, at: Duration) {
        if !self.ended {
            self.ended = true;
            self.end_wait = self.last_token.map(|token| at - token);
        }
    }
}

/// Whether an event carries some of the answer's text (or thinking), in any of the
/// vocabularies measured: chatd's, the AI SDK's UI stream, AG-UI, the Responses API, and an
/// OpenAI-style chunk.
fn carries_text(data: &Value) -> bool {
    const TEXT: [&str; 8] = [
        "text_delta",
        "thinking_delta",
        "text-delta",
        "reasoning-delta",
        "TEXT_MESSAGE_CONTENT",
        "REASONING_MESSAGE_CONTENT",
        "response.output_text.delta",
        "response.reasoning_summary_text.delta",
    ];
    if let Some(kind) = data["type"].as_str() {
        return TEXT.contains(&kind);
    }
    let delta = &data["choices"][0]["delta"];
    ["content", "reasoning_content"].iter().any(|k| delta[k].as_str().is_some_and(|t| !t.is_empty()))
}

/// A sorted sample's median, 90th and 99th percentiles, mean and maximum: a p99 of a few
/// hundred probes rests on their two or three slowest, the p90 and the mean on all of them.
fn spread(sorted: &[f64]) -> Value {
    let mean = sorted.iter().sum::<f64>() / sorted.len().max(1) as f64;
    json!({"p50": percentile(sorted, 50.0), "p90": percentile(sorted, 90.0), "p99": percentile(sorted, 99.0),
           "mean": mean, "max": sorted.last()})
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() {
    let args = Arc::new(Args::parse());
    // One address and no base: not bound, the kernel picks each port for its destination.
    let bind = args.sources > 1 || args.source_base > 0;
    // Over HTTP/1.1 a client per source address, a connection per stream; over HTTP/2 a client
    // (one connection) per `http2` streams, probes included, spread over the addresses.
    let connections = match args.http2 {
        0 => usize::from(args.sources.max(1)),
        per => (args.streams + args.probes).div_ceil(per).max(1),
    };
    let clients: Vec<reqwest::Client> = (0..connections)
        .map(|i| {
            let n = u8::try_from(i % usize::from(args.sources.max(1))).expect("at most 255 sources") + 1;
            let source = bind.then(|| std::net::IpAddr::from([127, 0, 0, args.source_base.saturating_add(n)]));
            let builder = reqwest::Client::builder().local_address(source);
            let builder =
                if args.http2 > 0 { builder.http2_prior_knowledge() } else { builder.pool_max_idle_per_host(0) };
            builder.build().expect("client")
        })
        .collect();
    let client = &clients[0];
    let gate = Arc::new(Semaphore::new(args.ramp.max(1)));
    let started = Instant::now();
    let started_all = Arc::new(Started::default());
    let tasks: Vec<_> = (0..args.streams)
        .map(|n| {
            tokio::spawn(one(clients[n % clients.len()].clone(), args.clone(), n, gate.clone(), started_all.clone()))
        })
        .collect();
    let mut probes = Vec::with_capacity(args.probes);
    if args.probes > 0 {
        loop {
            let changed = started_all.changed.notified();
            if started_all.count.load(Ordering::Relaxed) >= args.streams {
                break;
            }
            changed.await;
        }
        tokio::time::sleep(Duration::from_millis(args.settle_ms)).await;
        // A gate with room for every probe (they never wait for each other), and a count no
        // one waits on.
        let (gate, ignored) = (Arc::new(Semaphore::new(args.probes)), Arc::new(Started::default()));
        let mut pace = tokio::time::interval(Duration::from_millis(args.probe_every_ms.max(1)));
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for n in args.streams..args.streams + args.probes {
            pace.tick().await;
            let client = if args.http2 > 0 { &clients[n % clients.len()] } else { client };
            probes.push(tokio::spawn(one(client.clone(), args.clone(), n, gate.clone(), ignored.clone())));
        }
    }
    let mut streams = Vec::with_capacity(tasks.len() + probes.len());
    for task in tasks {
        streams.push(task.await.expect("stream task"));
    }
    let (mut probe_ttfe, mut probe_ttft) = (Vec::with_capacity(probes.len()), Vec::with_capacity(probes.len()));
    for task in probes {
        let probe = task.await.expect("probe task");
        probe_ttfe.extend(probe.first_event);
        probe_ttft.extend(probe.first_token);
        streams.push(probe);
    }
    let wall = started.elapsed();
    // For whoever measures the server's CPU over the streams alone: the check below reads.
    eprintln!("streams ended");

    let mut persisted = None;
    if let Some(base) = &args.verify {
        let mut ok = 0;
        for (id, user) in streams.iter().filter_map(|s| Some((s.conversation_id.as_ref()?, s.user.as_ref()))) {
            let url = format!("{base}/api/conversations/{id}");
            let request = with_headers(client.get(url), &args.header, user.map(String::as_str));
            let loaded: Option<Value> = match request.send().await {
                Ok(r) => r.json().await.ok(),
                Err(_) => None,
            };
            if loaded.is_some_and(|c| c["messages"][1]["content"].as_str().is_some_and(|t| !t.is_empty())) {
                ok += 1;
            }
        }
        persisted = Some(ok);
    }

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut ttfe: Vec<f64> = streams[..args.streams].iter().filter_map(|s| s.first_event.map(ms)).collect();
    ttfe.sort_by(f64::total_cmp);
    let mut ttft: Vec<f64> = streams[..args.streams].iter().filter_map(|s| s.first_token.map(ms)).collect();
    ttft.sort_by(f64::total_cmp);
    let mut probe_ttfe: Vec<f64> = probe_ttfe.into_iter().map(ms).collect();
    probe_ttfe.sort_by(f64::total_cmp);
    let mut probe_ttft: Vec<f64> = probe_ttft.into_iter().map(ms).collect();
    probe_ttft.sort_by(f64::total_cmp);
    let mut gaps: Vec<f64> = streams.iter().flat_map(|s| s.gaps.iter().copied().map(ms)).collect();
    gaps.sort_by(f64::total_cmp);
    let mut end_waits: Vec<f64> = streams[..args.streams].iter().filter_map(|s| s.end_wait.map(ms)).collect();
    end_waits.sort_by(f64::total_cmp);
    let mut totals: Vec<f64> = streams.iter().map(|s| ms(s.total)).collect();
    totals.sort_by(f64::total_cmp);
    let events: usize = streams.iter().map(|s| s.events).sum();
    let errors: Vec<&String> = streams.iter().filter_map(|s| s.error.as_ref()).collect();
    println!(
        "{}",
        json!({
            "label": args.label,
            "streams": streams.len(),
            "peak_open": started_all.peak.load(Ordering::Relaxed),
            "ended": streams.iter().filter(|s| s.ended).count(),
            "errors": errors.len(),
            "first_error": errors.first(),
            "persisted": persisted,
            "events": events,
            "bytes": streams.iter().map(|s| s.bytes).sum::<usize>(),
            "wall_ms": ms(wall),
            "events_per_sec": events as f64 / wall.as_secs_f64(),
            "ttfe_ms": {"p50": percentile(&ttfe, 50.0), "p99": percentile(&ttfe, 99.0), "max": ttfe.last()},
            "ttft_ms": {"p50": percentile(&ttft, 50.0), "p99": percentile(&ttft, 99.0), "max": ttft.last()},
            "probes": probe_ttfe.len(),
            "probe_ttfe_ms": spread(&probe_ttfe),
            "probe_ttft_ms": spread(&probe_ttft),
            "gap_ms": {"p50": percentile(&gaps, 50.0), "p99": percentile(&gaps, 99.0)},
            "max_gap_ms": streams.iter().map(|s| ms(s.max_gap)).fold(0.0, f64::max),
            "end_wait_ms": spread(&end_waits),
            "total_ms": {"p50": percentile(&totals, 50.0), "p99": percentile(&totals, 99.0)},
        })
    );
}
