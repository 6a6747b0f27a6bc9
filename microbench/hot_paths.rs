//! Criterion benchmarks of the per-token hot paths, each beside a baseline measured in the
//! same run, so the figures read as ratios:
//!
//! - `parse/*`: provider SSE bytes to provider events (chatd's SSE parser + our decoders), per
//!   wire format, against `parse/forward` (handing the same reads on untouched); and the SSE
//!   frames alone, by chatd's parser (`parse/frames`) and by eventsource-stream
//!   (`parse/frames-eventsource-stream`, what chatd used before).
//! - `clean`: provider events to client events (`<think>` splitting, control characters,
//!   markers), against `clean/concat` (only appending each text to the answer).
//! - `serialize`: client events to their JSON text, once per event.
//! - `event_log/*`: a flush of 1,000 events from 10 runs into a SQLite file, as chatd writes it
//!   (one chunk row per run) and as it used to (one row per event).
//! - `sqlite_writer/*`: one small write transaction after another, sent as one query, on a
//!   connection behind a lock (chatd's SQLite writer) and on a pool of one connection with
//!   sqlx's defaults (the writer as it was: a ping before each use and on each return).
//!
//! Run: `cargo bench --bench hot_paths` (figures only; nothing here asserts on time).

use std::hint::black_box;
use std::sync::Arc;

use bytes::Bytes;
use chatd::chat::run::turn::Turn;
use chatd::domain::{Conversation, Message, Role, Trace, now};
use chatd::events::Event;
use chatd::providers::{ProviderEvent, WireFormat, decode_sse};
use chatd::store::{self, NewEvent, RunStart, Store};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use futures_util::StreamExt;
use serde_json::{Value, json};

const TOKENS: usize = 1_000;
/// Bytes per network read, as a provider's HTTP/1.1 chunks arrive.
const READ: usize = 1024;

fn token(i: usize) -> String {
    format!(" tok{}", i % 97)
}

fn openai_body() -> String {
    let mut body = String::new();
    for i in 0..TOKENS {
        let frame = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": token(i)}, "finish_reason": null}]});
        body.push_str(&format!("data: {frame}\n\n"));
    }
    let last = json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
    body.push_str(&format!("data: {last}\n\ndata: [DONE]\n\n"));
    body
}

/// OpenAI's own frames, in its order, each with a random `obfuscation` of random length
/// (a side-channel mitigation that pads every frame).
fn openai_obfuscated_body() -> String {
    let mut body = String::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    for i in 0..TOKENS {
        let mut obfuscation = String::new();
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        for k in 0..(seed % 16) {
            obfuscation.push(
                b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"[((seed >> (k * 4)) % 62) as usize]
                    as char,
            );
        }
        body.push_str(&format!(
            "data: {{\"id\":\"chatcmpl-B9MBs8\",\"object\":\"chat.completion.chunk\",\"created\":1741569952,\
             \"model\":\"gpt-4o-mini-2024-07-18\",\"service_tier\":\"default\",\"system_fingerprint\":\"fp_06737a9306\",\
             \"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"logprobs\":null,\"finish_reason\":null}}],\
             \"obfuscation\":\"{obfuscation}\"}}\n\n",
            json!(token(i))
        ));
    }
    let last = json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
    body.push_str(&format!("data: {last}\n\ndata: [DONE]\n\n"));
    body
}

fn anthropic_body() -> String {
    let frame = |v: Value| format!("event: {}\ndata: {v}\n\n", v["type"].as_str().unwrap());
    let mut body =
        frame(json!({"type": "message_start", "message": {"usage": {"input_tokens": 5, "output_tokens": 1}}}));
    body.push_str(&frame(
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ));
    for i in 0..TOKENS {
        let delta =
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": token(i)}});
        body.push_str(&frame(delta));
    }
    body.push_str(&frame(json!({"type": "content_block_stop", "index": 0})));
    body.push_str(&frame(
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": TOKENS}}),
    ));
    body.push_str(&frame(json!({"type": "message_stop"})));
    body
}

fn google_body() -> String {
    let mut body = String::new();
    for i in 0..TOKENS {
        let mut candidate = json!({"content": {"role": "model", "parts": [{"text": token(i)}]}, "index": 0});
        if i + 1 == TOKENS {
            candidate["finishReason"] = json!("STOP");
        }
        let usage = json!({"promptTokenCount": 8, "candidatesTokenCount": i + 1, "totalTokenCount": i + 9});
        body.push_str(&format!("data: {}\r\n\r\n", json!({"candidates": [candidate], "usageMetadata": usage})));
    }
    body
}

fn reads(body: &str) -> Vec<Bytes> {
    body.as_bytes().chunks(READ).map(Bytes::copy_from_slice).collect()
}

async fn decode(format: WireFormat, chunks: Vec<Bytes>) -> Vec<ProviderEvent> {
    let stream = decode_sse(format, futures_util::stream::iter(chunks.into_iter().map(Ok::<_, std::io::Error>)));
    stream.map(|event| event.expect("decodes")).collect().await
}

fn parse(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut group = c.benchmark_group("parse");
    group.throughput(Throughput::Elements(TOKENS as u64));
    let openai = openai_body();
    group.bench_function("forward", |b| {
        b.iter_batched(
            || reads(&openai),
            |chunks| {
                let mut sink = Vec::with_capacity(READ);
                for chunk in chunks {
                    sink.clear();
                    sink.extend_from_slice(&chunk);
                    black_box(&sink);
                }
            },
            BatchSize::SmallInput,
        )
    });
    let frames = |chunks: Vec<Bytes>| futures_util::stream::iter(chunks.into_iter().map(Ok::<_, std::io::Error>));
    group.bench_function("frames", |b| {
        b.iter_batched(
            || reads(&openai),
            |chunks| {
                let (mut parser, mut read) = (chatd::providers::sse::Parser::default(), 0usize);
                for chunk in chunks {
                    let fed = parser.feed(&chunk, &mut |frame| {
                        read += black_box(frame.data).len();
                        Ok::<_, ()>(())
                    });
                    assert!(fed.is_ok());
                }
                read
            },
            BatchSize::SmallInput,
        )
    });
    group.bench_function("frames-eventsource-stream", |b| {
        use eventsource_stream::Eventsource;
        b.iter_batched(
            || reads(&openai),
            |chunks| runtime.block_on(frames(chunks).eventsource().map(|f| f.is_ok()).collect::<Vec<_>>()),
            BatchSize::SmallInput,
        )
    });
    for (name, format, body) in [
        ("openai", WireFormat::OpenAi, openai),
        ("openai-obfuscated", WireFormat::OpenAi, openai_obfuscated_body()),
        ("anthropic", WireFormat::Anthropic, anthropic_body()),
        ("google", WireFormat::Google, google_body()),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched(|| reads(&body), |chunks| runtime.block_on(decode(format, chunks)), BatchSize::SmallInput)
        });
    }
    group.finish();
}

/// One OpenAI frame of `megabytes` of text, read 16 KiB at a time, then the stream's end:
/// decoding must cost time linear in the frame's size.
fn large_frame(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut group = c.benchmark_group("large_frame");
    group.sample_size(10);
    for megabytes in [1, 2, 4, 8] {
        let text = "x".repeat(megabytes * 1024 * 1024 - 512);
        let frame = json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]});
        let end = json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
        let body = format!("data: {frame}\n\ndata: {end}\n\ndata: [DONE]\n\n");
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function(format!("{megabytes}MB"), |b| {
            b.iter_batched(
                || body.as_bytes().chunks(16 * 1024).map(Bytes::copy_from_slice).collect(),
                |chunks| runtime.block_on(decode(WireFormat::OpenAi, chunks)),
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

fn provider_events() -> Vec<ProviderEvent> {
    let mut events: Vec<ProviderEvent> = (0..TOKENS).map(|i| ProviderEvent::Text(token(i).into())).collect();
    events[10] = ProviderEvent::Text("<thi".into());
    events[11] = ProviderEvent::Text("nk>".into());
    events[500] = ProviderEvent::Text("</think>".into());
    events.push(ProviderEvent::Finish("stop".into()));
    events
}

fn clean(c: &mut Criterion) {
    let mut group = c.benchmark_group("clean");
    group.throughput(Throughput::Elements(TOKENS as u64));
    let events = provider_events();
    group.bench_function("concat", |b| {
        b.iter_batched(
            || events.clone(),
            |events| {
                let mut answer = String::new();
                for event in events {
                    if let ProviderEvent::Text(text) = event {
                        answer.push_str(&text);
                    }
                }
                black_box(answer)
            },
            BatchSize::SmallInput,
        )
    });
    group.bench_function("turn", |b| {
        b.iter_batched(
            || events.clone(),
            |events| {
                let mut turn = Turn::new(0, vec!["SUGGESTED_VALUES:".into(), "SUGGESTED_ACTIONS:".into()]);
                let mut out = Vec::with_capacity(events.len());
                for event in events {
                    turn.apply(event, &mut out);
                }
                black_box(out)
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

fn serialize(c: &mut Criterion) {
    let mut group = c.benchmark_group("serialize");
    group.throughput(Throughput::Elements(TOKENS as u64));
    let events: Vec<Event> = (0..TOKENS).map(|i| Event::TextDelta { text: token(i).into() }).collect();
    group.bench_function("text_delta", |b| {
        b.iter(|| {
            for event in &events {
                black_box(serde_json::to_string(event).expect("serializes"));
            }
        })
    });
    group.finish();
}

/// A store with `runs` running traces, in a fresh SQLite file.
async fn store_with_runs(dir: &std::path::Path, runs: usize) -> (Arc<dyn Store>, Vec<chatd::ids::TraceId>) {
    let store = store::connect(&format!("sqlite://{}/bench.db", dir.display()), 4).await.expect("store opens");
    let mut traces = Vec::new();
    for _ in 0..runs {
        let conversation = Conversation::new(&chatd::ids::UserId::new("bench"), "bench".into());
        let user_message = Message::new(conversation.id, None, Role::User, "go".into());
        let trace = Trace::start(&conversation.user_id, &user_message, "m", "p");
        traces.push(trace.trace_id);
        let start = RunStart {
            new_conversation: Some(conversation),
            user_message,
            user_message_is_new: true,
            traces: vec![trace],
            comparison: None,
            replica_id: "bench".into(),
            max_running: None,
            idempotency_key: None,
            asked: None,
            seen: None,
            budget: None,
        };
        store.start_run(&start).await.expect("run starts");
    }
    (store, traces)
}

/// A flush's batch: `each` events of every one of `traces`, interleaved as tokens arrive,
/// each run's from `seq` on.
fn flush_of(traces: &[chatd::ids::TraceId], each: usize, seq: i64) -> Vec<NewEvent> {
    let runs = traces.len();
    (0..runs * each)
        .map(|i| {
            let text = json!({"type": "text_delta", "text": token(i)}).to_string();
            NewEvent {
                trace_id: traces[i % runs],
                seq: seq + (i / runs) as i64,
                at: now(),
                kind: "text_delta",
                data: chatd::events::Sent::text(&text),
            }
        })
        .collect()
}

fn event_log(c: &mut Criterion) {
    const RUNS: usize = 10;
    const EVENTS: usize = 1_000;
    const PACED_RUNS: usize = 50;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (store, traces) = runtime.block_on(store_with_runs(dir.path(), RUNS + PACED_RUNS));
    let paced_traces = traces[RUNS..].to_vec();
    // The table as chatd wrote the log before chunks: a row per event.
    let legacy = runtime.block_on(async {
        let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}/bench.db", dir.path().display())).await.unwrap();
        sqlx::query(
            "create table per_event (trace_id blob not null, seq integer not null, at text not null, \
             type text not null, data text not null, primary key (trace_id, seq)) without rowid",
        )
        .execute(&pool)
        .await
        .unwrap();
        pool
    });
    let mut seq = 0_i64;
    // Every batch continues each run's sequence, as a run's flushes do.
    let mut batch = move || -> Vec<NewEvent> {
        seq += (EVENTS / RUNS) as i64;
        flush_of(&traces[..RUNS], EVENTS / RUNS, seq)
    };
    let mut group = c.benchmark_group("event_log");
    group.throughput(Throughput::Elements(EVENTS as u64));
    group.sample_size(20);
    group.bench_function("row_per_event", |b| {
        b.iter_batched(
            &mut batch,
            |events| {
                runtime.block_on(async {
                    let mut tx = legacy.begin().await.unwrap();
                    let mut query = sqlx::QueryBuilder::<sqlx::Sqlite>::new(
                        "insert into per_event (trace_id, seq, at, type, data) ",
                    );
                    query.push_values(&events, |mut row, e| {
                        row.push_bind(e.trace_id)
                            .push_bind(e.seq)
                            .push_bind(e.at)
                            .push_bind(e.kind)
                            .push_bind(e.data.json());
                    });
                    query.build().execute(&mut *tx).await.unwrap();
                    tx.commit().await.unwrap();
                })
            },
            BatchSize::SmallInput,
        )
    });
    group.bench_function("chunk_per_run", |b| {
        b.iter_batched(
            &mut batch,
            |events| runtime.block_on(store.append_events(&events, &[])).expect("appends"),
            BatchSize::SmallInput,
        )
    });
    // A flush at (b)'s pace: a few events from each of 40 to 50 runs (a token every 20 ms, a
    // flush every 100 ms), the number of runs changing from one flush to the next as runs
    // start and end.
    const EACH: usize = 5;
    let (mut seq, mut flush) = (1_000_000_i64, 0_usize);
    let mut paced = move || -> Vec<NewEvent> {
        seq += EACH as i64;
        flush += 1;
        flush_of(&paced_traces[..PACED_RUNS - flush % 11], EACH, seq)
    };
    group.throughput(Throughput::Elements((PACED_RUNS * EACH) as u64));
    group.bench_function("chunk_per_run_paced", |b| {
        b.iter_batched(
            &mut paced,
            |events| runtime.block_on(store.append_events(&events, &[])).expect("appends"),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

fn sqlite_writer(c: &mut Criterion) {
    use sqlx::{ConnectOptions, Connection};

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let options: sqlx::sqlite::SqliteConnectOptions = format!("sqlite://{}/writer.db", dir.path().display())
        .parse::<sqlx::sqlite::SqliteConnectOptions>()
        .unwrap()
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Normal);
    let (locked, pool) = runtime.block_on(async {
        let mut connection = options.connect().await.unwrap();
        sqlx::query("create table w (id integer primary key, v text not null)").execute(&mut connection).await.unwrap();
        let pool =
            sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect_with(options.clone()).await.unwrap();
        (tokio::sync::Mutex::new(connection), pool)
    });
    const WRITE: &str = "BEGIN IMMEDIATE; insert into w (v) values ('a start'); COMMIT";
    let mut group = c.benchmark_group("sqlite_writer");
    group.throughput(Throughput::Elements(1));
    group.bench_function("pool_of_one", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let mut connection = pool.acquire().await.unwrap();
                sqlx::query(WRITE).execute(&mut *connection).await.unwrap();
            })
        })
    });
    group.bench_function("locked_connection", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let mut connection = locked.lock().await;
                sqlx::query(WRITE).execute(&mut *connection).await.unwrap();
            })
        })
    });
    group.finish();
    runtime.block_on(async move {
        pool.close().await;
        locked.into_inner().close().await.unwrap();
    });
}

criterion_group!(benches, parse, large_frame, clean, serialize, event_log, sqlite_writer);
criterion_main!(benches);
