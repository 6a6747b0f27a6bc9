//! What runs cost, and the prompt cache that cuts it (CONTRACT.md §18, §21): prices from the
//! genai-prices table, asked of it directly here; the cache markers of each wire format; the
//! sums of `/api/usage`; and a 30-turn conversation against a server that caches prompts
//! the way Anthropic documents it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use genai_prices::{Calculator, PriceRequest, UsageKey};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::fixture::{Fixture, Scripted, data, event};
use crate::helpers::*;

fn complete(frames: &[Frame]) -> &Value {
    &frames.iter().find(|f| f.kind() == "complete").expect("a complete event").data["payload"]
}

/// An Anthropic answer whose `message_start` reports `usage`.
fn anthropic_answer(text: &str, usage: Value) -> Scripted {
    Scripted::sse(&[
        event(json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
            "content": [], "model": "claude-sonnet-4-5", "stop_reason": null, "stop_sequence": null, "usage": usage}})),
        event(json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
        event(json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})),
        event(json!({"type": "content_block_stop", "index": 0})),
        event(json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 50}})),
        event(json!({"type": "message_stop"})),
    ])
}

fn openai_answer() -> Scripted {
    Scripted::sse(&[
        data(json!({"choices": [{"index": 0, "delta": {"content": "Sure."}, "finish_reason": "stop"}]})),
        data(json!({"choices": [], "usage": {"prompt_tokens": 2000, "completion_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 1536}}})),
        "data: [DONE]\n\n".to_owned(),
    ])
}

/// chatd with a profile `fx` (model `model`) of a provider of `kind` at `base`.
async fn app_on(kind: &str, base: &str, model: &str, profile_extra: &str, extra: &str) -> TestApp {
    let config = format!(
        "[chat]\ndefault_profile = \"fx\"\n[providers.fx]\nkind = \"{kind}\"\nbase_url = \"{base}\"\n\
         [profiles.fx]\nprovider = \"fx\"\nmodel = \"{model}\"\n{profile_extra}\n{extra}"
    );
    TestApp::spawn(Backend::Sqlite, &config).await
}

/// The table's own price of these counts, at the time given.
fn table_price(provider: &str, model: &str, counts: &[(UsageKey, f64)], at: chrono::DateTime<chrono::Utc>) -> f64 {
    let usage = genai_prices::Usage::from_iter(counts.iter().cloned());
    let request =
        PriceRequest::new(model, &usage).with_provider_id(provider).with_timestamp(std::time::SystemTime::from(at));
    Calculator::bundled().calculate(&request).unwrap().total_price
}

#[tokio::test]
async fn a_runs_cost_is_the_price_tables_for_its_cache_reads_writes_and_output() {
    let usage = json!({"input_tokens": 100, "cache_creation_input_tokens": 2000, "cache_read_input_tokens": 8000, "output_tokens": 1});
    let fixture = Fixture::start(vec![anthropic_answer("Cached.", usage)]).await;
    let app = app_on("anthropic", &fixture.base, "claude-sonnet-4-5", "", "").await;
    let frames = app.chat("ann", json!({"message": "hello"})).await;
    let payload = complete(&frames);
    assert_eq!(payload["usage"]["input_tokens"], 10_100, "every input token, cached or not");
    assert_eq!(
        (payload["usage"]["cache_read_tokens"].as_u64(), payload["usage"]["cache_write_tokens"].as_u64()),
        (Some(8000), Some(2000))
    );
    let expected = table_price(
        "anthropic",
        "claude-sonnet-4-5",
        &[
            (UsageKey::INPUT_TOKENS, 10_100.0),
            (UsageKey::CACHE_READ_TOKENS, 8000.0),
            (UsageKey::CACHE_WRITE_TOKENS, 2000.0),
            (UsageKey::OUTPUT_TOKENS, 50.0),
        ],
        chrono::Utc::now(),
    );
    let cost = payload["cost_usd"].as_f64().expect("a cost");
    assert!((cost - expected).abs() < 1e-12, "{cost} != {expected}");
    // Cheaper than the same tokens uncached: reads cost a tenth.
    let uncached = table_price(
        "anthropic",
        "claude-sonnet-4-5",
        &[(UsageKey::INPUT_TOKENS, 10_100.0), (UsageKey::OUTPUT_TOKENS, 50.0)],
        chrono::Utc::now(),
    );
    assert!(cost < uncached * 0.5, "{cost} vs {uncached}");
    assert!(payload.get("cost_estimated").is_none());
    // The stored answer, the trace and the model call's span say the same.
    let conversation = frames[0].data["conversation_id"].as_str().unwrap();
    let (_, loaded) = app.get(&format!("/api/conversations/{conversation}"), "ann").await;
    assert_eq!(loaded["messages"][1]["cost_usd"].as_f64(), Some(cost));
    let trace_id = payload["trace_id"].as_str().unwrap();
    let (_, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
    assert_eq!(trace["cost_usd"].as_f64(), Some(cost));
    let span = &trace["spans"][0]["attributes"];
    assert_eq!(span["chatd.cost_usd"].as_f64(), Some(cost));
    assert_eq!(span["gen_ai.usage.cache_read.input_tokens"], 8000);
    assert_eq!(span["gen_ai.usage.cache_creation.input_tokens"], 2000);
    assert!(span["chatd.prompt_cache.prefix_tokens"].as_u64().unwrap() > 0, "{span}");
}

#[tokio::test]
async fn no_price_means_no_cost_and_a_configured_price_adds_one() {
    // The mock has no price in the table: no cost at all, never 0.
    let app = TestApp::spawn(Backend::Sqlite, "").await;
    let frames = app.chat("ann", json!({"message": "hello"})).await;
    assert!(complete(&frames).get("cost_usd").is_none(), "{}", complete(&frames));
    // A price in config prices it.
    let app =
        TestApp::spawn(Backend::Sqlite, "[pricing.\"mock-1\"]\ninput_per_mtok = 2.0\noutput_per_mtok = 10.0\n").await;
    let frames = app.chat("ann", json!({"message": "hello"})).await;
    let payload = complete(&frames);
    let (input, output) =
        (payload["usage"]["input_tokens"].as_f64().unwrap(), payload["usage"]["output_tokens"].as_f64().unwrap());
    let cost = payload["cost_usd"].as_f64().unwrap();
    assert!((cost - (input * 2.0 + output * 10.0) / 1e6).abs() < 1e-12, "{payload}");
    // A server that reports no usage: the counts are estimated, and so is their cost.
    let fixture = Fixture::start(vec![Scripted::sse(&[
        data(json!({"choices": [{"index": 0, "delta": {"content": "Hi."}, "finish_reason": "stop"}]})),
        "data: [DONE]\n\n".to_owned(),
    ])])
    .await;
    let app = app_on(
        "openai_compatible",
        &format!("{}/v1", fixture.base),
        "local-model",
        "",
        "[pricing.\"local-model\"]\ninput_per_mtok = 1.0\noutput_per_mtok = 1.0\n",
    )
    .await;
    let frames = app.chat("ann", json!({"message": "hello"})).await;
    let payload = complete(&frames);
    assert_eq!(payload["usage"]["estimated"], true);
    assert_eq!(payload["cost_estimated"], true);
    assert!(payload["cost_usd"].as_f64().unwrap() > 0.0);
}

#[tokio::test]
async fn anthropic_marks_the_stable_prefix_with_its_ttl_and_not_at_all_when_off() {
    let usage = json!({"input_tokens": 10, "output_tokens": 1});
    // One hour, and a page context: the context follows the question, past the mark.
    let fixture = Fixture::start(vec![anthropic_answer("A.", usage.clone())]).await;
    let app = app_on("anthropic", &fixture.base, "claude-sonnet-4-5", "prompt_cache_ttl = \"1h\"", "").await;
    app.chat("ann", json!({"message": "hello", "context": {"current_page": "reports", "now": "10:31"}})).await;
    let body = &fixture.received()[0].body;
    let hour = json!({"type": "ephemeral", "ttl": "1h"});
    assert_eq!(body["system"][0]["cache_control"], hour);
    let question = &body["messages"][0]["content"];
    assert_eq!(question[0], json!({"type": "text", "text": "hello", "cache_control": hour}));
    assert!(question[1]["text"].as_str().unwrap().starts_with("## Context\n"), "{question}");
    assert!(question[1].get("cache_control").is_none());
    assert_eq!(question.as_array().unwrap().len(), 2);
    assert!(
        !body["system"][0]["text"].as_str().unwrap().contains("reports"),
        "nothing of the request before the history"
    );

    // Off: no mark anywhere, and the system prompt as plain text.
    let fixture = Fixture::start(vec![anthropic_answer("A.", usage)]).await;
    let app = app_on("anthropic", &fixture.base, "claude-sonnet-4-5", "prompt_cache = \"off\"", "").await;
    app.chat("ann", json!({"message": "hello"})).await;
    let body = &fixture.received()[0].body;
    assert!(body["system"].is_string());
    assert!(!body.to_string().contains("cache_control"), "{body}");
}

#[tokio::test]
async fn openai_gets_the_conversation_as_its_cache_key_and_servers_of_its_format_do_not() {
    let fixture = Fixture::start(vec![openai_answer(), openai_answer(), openai_answer(), openai_answer()]).await;
    let base = format!("{}/v1", fixture.base);
    let app = app_on("openai", &base, "gpt-4o", "prompt_cache_ttl = \"1h\"", "").await;
    let frames = app.chat("ann", json!({"message": "hello", "context": {"current_page": "home"}})).await;
    let conversation = frames[0].data["conversation_id"].as_str().unwrap().to_owned();
    let body = &fixture.received()[0].body;
    assert_eq!(body["prompt_cache_key"], conversation);
    assert_eq!(body["prompt_cache_retention"], "24h");
    let question = body["messages"].as_array().unwrap().last().unwrap()["content"].as_str().unwrap().to_owned();
    assert!(question.starts_with("hello\n\n## Context\n"), "{question}");
    // OpenAI reports what it read from its cache, and the price table prices it.
    let payload = complete(&frames);
    assert_eq!(payload["usage"]["cache_read_tokens"], 1536);
    let expected = table_price(
        "openai",
        "gpt-4o",
        &[(UsageKey::INPUT_TOKENS, 2000.0), (UsageKey::CACHE_READ_TOKENS, 1536.0), (UsageKey::OUTPUT_TOKENS, 10.0)],
        chrono::Utc::now(),
    );
    assert!((payload["cost_usd"].as_f64().unwrap() - expected).abs() < 1e-12);
    // Five minutes is the API's default: no retention is sent.
    let app = app_on("openai", &base, "gpt-4o", "", "").await;
    app.chat("ann", json!({"message": "hello"})).await;
    assert!(fixture.received()[1].body.get("prompt_cache_retention").is_none());
    assert!(fixture.received()[1].body["prompt_cache_key"].is_string());
    // Off, or a server that only speaks the format: neither field.
    let app = app_on("openai", &base, "gpt-4o", "prompt_cache = \"off\"", "").await;
    app.chat("ann", json!({"message": "hello"})).await;
    let app = app_on("openai_compatible", &base, "llama", "", "").await;
    app.chat("ann", json!({"message": "hello"})).await;
    for got in &fixture.received()[2..] {
        assert!(got.body.get("prompt_cache_key").is_none() && got.body.get("prompt_cache_retention").is_none());
    }
}

#[tokio::test]
async fn usage_sums_by_group_for_the_user_and_for_admins_everyone() {
    let app = TestApp::spawn(
        Backend::Sqlite,
        "[auth]\nadmins = [\"root\"]\n[pricing.\"mock-1\"]\ninput_per_mtok = 1.0\noutput_per_mtok = 1.0\n\
         [profiles.default]\nprovider = \"mock\"\nmodel = \"mock-1\"\n[profiles.other]\nprovider = \"mock\"\nmodel = \"mock-2\"\n",
    )
    .await;
    for (user, profile) in [("ann", "default"), ("ann", "other"), ("ann", "other"), ("bob", "default")] {
        app.chat(user, json!({"message": "hello", "profile": profile})).await;
    }
    let (status, mine) = app.get("/api/usage?group_by=profile", "ann").await;
    assert_eq!(status, StatusCode::OK, "{mine}");
    let groups: Vec<(&str, u64)> = mine["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (g["key"].as_str().unwrap(), g["runs"].as_u64().unwrap()))
        .collect();
    assert_eq!(groups, [("default", 1), ("other", 2)]);
    assert_eq!(mine["total"]["runs"], 3);
    assert!(mine["total"]["input_tokens"].as_u64().unwrap() > 0);
    // mock-2 has no price: the sum is of the priced runs.
    assert!(mine["groups"][0]["cost_usd"].as_f64().unwrap() > 0.0);
    assert!(mine["groups"][1].get("cost_usd").is_none(), "{mine}");
    // By day: today.
    let (_, days) = app.get("/api/usage", "ann").await;
    assert_eq!(days["group_by"], "day");
    assert_eq!(days["groups"][0]["key"], chrono::Utc::now().format("%Y-%m-%d").to_string());
    // Another user sees only their own; an admin everyone's, or one user's.
    let (_, bobs) = app.get("/api/usage?group_by=user", "bob").await;
    assert_eq!(bobs["groups"].as_array().unwrap().len(), 1);
    assert_eq!(bobs["groups"][0]["key"], "bob");
    let (status, _) = app.get("/api/usage?user=ann", "bob").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, all) = app.get("/api/usage?group_by=user", "root").await;
    let users: Vec<&str> = all["groups"].as_array().unwrap().iter().map(|g| g["key"].as_str().unwrap()).collect();
    assert_eq!(users, ["ann", "bob"]);
    let (_, anns) = app.get("/api/usage?user=ann&group_by=model", "root").await;
    assert_eq!(anns["total"]["runs"], 3);
    // Bad parameters: the envelope, naming the field.
    for (query, field) in [
        ("group_by=week", "group_by"),
        ("from=2026-02-01T00:00:00Z&to=2026-01-01T00:00:00Z", "from"),
        ("from=yesterday", "from"),
        ("colour=red", ""),
    ] {
        let (status, body) = app.get(&format!("/api/usage?{query}"), "ann").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {body}");
        assert_eq!(body["code"], "VALIDATION_ERROR");
        if !field.is_empty() {
            assert_eq!(body["field"], field, "{body}");
        }
    }
    // A period with no runs: no groups, a zero total.
    let (_, empty) = app.get("/api/usage?from=2020-01-01T00:00:00Z&to=2020-02-01T00:00:00Z", "ann").await;
    assert_eq!(empty["groups"], json!([]));
    assert_eq!(empty["total"]["runs"], 0);
}

/// A server that caches prompts as Anthropic documents: a request's prefix up to a block
/// marked `cache_control` is written to the cache; a later request reads the longest cached
/// prefix ending at one of its marks or at one of the 20 block boundaries before each.
/// Tokens are four characters of a block's JSON.
#[derive(Clone, Default)]
struct CachingServer {
    cached: Arc<Mutex<HashSet<u64>>>,
    /// Each request's (input, read from the cache, the hash of its prefix up to the first
    /// history message kept).
    seen: Arc<Mutex<Vec<(u64, u64, u64)>>>,
}

fn blocks_of(body: &Value) -> Vec<(Value, bool)> {
    // Each block without its mark, and whether it had one; a message's blocks with its role.
    let unmarked = |block: &Value| {
        let mut block = block.clone();
        let marked = block.as_object_mut().and_then(|o| o.remove("cache_control")).is_some();
        (block, marked)
    };
    let mut blocks: Vec<(Value, bool)> = body["tools"].as_array().into_iter().flatten().map(unmarked).collect();
    match &body["system"] {
        Value::String(text) => blocks.push((json!({"type": "text", "text": text}), false)),
        Value::Array(system) => blocks.extend(system.iter().map(unmarked)),
        _ => {}
    }
    for message in body["messages"].as_array().unwrap() {
        for block in message["content"].as_array().unwrap() {
            let (block, marked) = unmarked(block);
            blocks.push((json!({"role": message["role"], "block": block}), marked));
        }
    }
    blocks
}

fn tokens(block: &Value) -> u64 {
    (block.to_string().len() as u64).div_ceil(4)
}

async fn caching_answer(State(server): State<CachingServer>, body: axum::body::Bytes) -> Response {
    use std::hash::{Hash, Hasher};
    let body: Value = serde_json::from_slice(&body).unwrap();
    let blocks = blocks_of(&body);
    // Hash and size of every prefix, block by block.
    let (mut hashes, mut sizes) = (Vec::new(), Vec::new());
    let (mut hasher, mut size) = (std::collections::hash_map::DefaultHasher::new(), 0);
    for (block, _) in &blocks {
        block.to_string().hash(&mut hasher);
        size += tokens(block);
        hashes.push(hasher.finish());
        sizes.push(size);
    }
    let input = size;
    let marks: Vec<usize> = blocks.iter().enumerate().filter(|(_, (_, m))| *m).map(|(i, _)| i).collect();
    let mut cached = server.cached.lock().unwrap();
    let read = marks
        .iter()
        .flat_map(|&m| (m.saturating_sub(20)..=m).rev())
        .filter(|&i| cached.contains(&hashes[i]))
        .map(|i| sizes[i])
        .max()
        .unwrap_or(0);
    let written = marks.last().map_or(0, |&m| sizes[m].saturating_sub(read));
    for &m in &marks {
        cached.insert(hashes[m]);
    }
    drop(cached);
    // The prefix up to the first message: what stays put while the trim point holds.
    let first_message = blocks.iter().position(|(b, _)| b.get("role").is_some()).unwrap_or(0);
    server.seen.lock().unwrap().push((input, read, hashes[first_message]));
    let usage = json!({"input_tokens": input - read - written, "cache_read_input_tokens": read,
        "cache_creation_input_tokens": written, "output_tokens": 1});
    let answer = "An answer of some length, ".repeat(12);
    let frames = [
        event(json!({"type": "message_start", "message": {"id": "msg", "type": "message", "role": "assistant",
            "content": [], "model": "claude-sonnet-4-5", "stop_reason": null, "stop_sequence": null, "usage": usage}})),
        event(json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
        event(json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": answer}})),
        event(json!({"type": "content_block_stop", "index": 0})),
        event(json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 80}})),
        event(json!({"type": "message_stop"})),
    ];
    Response::builder().header("content-type", "text/event-stream").body(Body::from(frames.concat())).unwrap()
}

/// The figure for CONTRACT.md §21: over 30 turns, the share of input tokens billed at the
/// cache's price, and how often the prefix sent changes (only when the trim point moves).
#[tokio::test]
async fn over_thirty_turns_most_input_is_read_from_the_cache_and_the_prefix_moves_only_with_the_trim() {
    let server = CachingServer::default();
    let router = axum::Router::new().fallback(caching_answer).with_state(server.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    // A window the conversation outgrows after about ten turns.
    let app = app_on("anthropic", &base, "claude-sonnet-4-5", "context_limit = 4000", "").await;
    let mut conversation: Option<String> = None;
    let mut trim_points = Vec::new();
    for turn in 0..30 {
        let question = format!("Question {turn}: {}", "tell me more about the quarterly numbers. ".repeat(6));
        // A page context that changes every turn: it must not break the cached prefix.
        let mut body = json!({"message": question, "context": {"current_page": "reports", "turn": turn}});
        if let Some(id) = &conversation {
            body["conversation_id"] = json!(id);
        }
        let frames = app.chat("ann", body).await;
        let id = frames[0].data["conversation_id"].as_str().unwrap().to_owned();
        let trace_id = complete(&frames)["trace_id"].as_str().unwrap().to_owned();
        let (_, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
        trim_points.push(trace["spans"][0]["attributes"]["chatd.context"]["kept_from"].clone());
        conversation = Some(id);
    }
    let seen = server.seen.lock().unwrap().clone();
    let (input, read): (u64, u64) = seen.iter().fold((0, 0), |(i, r), (input, read, _)| (i + input, r + read));
    let share = read as f64 / input as f64;
    let prefixes = seen.iter().map(|(_, _, p)| p).collect::<HashSet<_>>().len();
    let trims = trim_points.iter().collect::<HashSet<_>>().len();
    println!(
        "30 turns: {:.1}% of {input} input tokens read from the cache; {prefixes} distinct prefixes, {trims} trim points",
        share * 100.0
    );
    assert!(trim_points.iter().any(|t| !t.is_null()), "the conversation was trimmed");
    assert!(share > 0.8, "{share}");
    // The prefix changes only where the trim point moved (the untrimmed turns share one).
    assert!(prefixes <= trims, "{prefixes} prefixes, {trims} trim points");
    assert!(trims < 10, "{trims} trim points in 30 turns");
}

/// A budget of `tokens` a day, with the mock's answers at most 100 tokens long.
fn budget_config(tokens: u64) -> String {
    format!(
        "[limits]\nbudget_tokens_per_day = {tokens}\nmax_concurrent_runs_per_user = 100\nrequests_per_minute = 0\n\
         [limits.budgets.bob]\ntokens_per_day = 1000000\n\
         [profiles.default]\nprovider = \"mock\"\nmodel = \"mock-1\"\nmax_tokens = 100\n"
    )
}

/// POSTs a message as `user`: the response's status and, where the stream opened, its frames.
async fn start(app: &TestApp, user: &str, message: &str) -> (StatusCode, Option<String>, Vec<Frame>) {
    let response = app
        .client
        .post(app.url("/api/chat/stream"))
        .header("x-client-id", user)
        .json(&json!({"message": message}))
        .send()
        .await
        .unwrap();
    let status = response.status();
    let retry_after = response.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
    if status != StatusCode::OK {
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["code"], "QUOTA_EXCEEDED", "{body}");
        return (status, retry_after, Vec::new());
    }
    (status, retry_after, read_frames(response).await)
}

/// What `user` spent today, as `/api/usage` sums it.
async fn spent_today(app: &TestApp, user: &str) -> u64 {
    let (_, usage) = app.get("/api/usage", user).await;
    usage["total"]["input_tokens"].as_u64().unwrap() + usage["total"]["output_tokens"].as_u64().unwrap()
}

both_backends! {
    /// Starts go until the day's budget is spent, then 429 `QUOTA_EXCEEDED` until midnight
    /// (UTC); a user with a budget of their own goes on.
    async fn a_spent_budget_refuses_starts_until_it_resets(backend: Backend) {
        let app = TestApp::spawn(backend, &budget_config(2000)).await;
        let mut started = 0;
        let refused = loop {
            let (status, retry_after, frames) = start(&app, "ann", "hello there").await;
            if status != StatusCode::OK {
                break (status, retry_after);
            }
            assert_eq!(frames.last().unwrap().kind(), "done");
            started += 1;
            assert!(started < 20, "the budget never stopped a start");
        };
        assert_eq!(refused.0, StatusCode::TOO_MANY_REQUESTS);
        let now = chrono::Utc::now();
        let midnight = (now + chrono::Duration::days(1)).date_naive().and_hms_opt(0, 0, 0).unwrap().and_utc();
        let retry_after: i64 = refused.1.expect("Retry-After").parse().unwrap();
        assert!((retry_after - (midnight - now).num_seconds()).abs() <= 5, "{retry_after}");
        assert!(started >= 2, "{started}");
        // Never past the budget: each start held what its answer could spend.
        let spent = spent_today(&app, "ann").await;
        assert!(spent <= 2000, "{spent}");
        // Bob's own budget is larger.
        assert_eq!(start(&app, "bob", "hello").await.0, StatusCode::OK);
    }

    /// 20 starts at once at the edge of the budget: some start, the others are refused, and
    /// together they never spend past it.
    async fn a_burst_of_starts_at_the_edge_never_overspends(backend: Backend) {
        let app = TestApp::spawn(backend, &budget_config(3000)).await;
        start(&app, "ann", "a first answer").await;
        let burst = (0..20).map(|i| start(&app, "ann", if i % 2 == 0 { "hello" } else { "and again" }));
        let outcomes = futures_util::future::join_all(burst).await;
        let ok = outcomes.iter().filter(|(s, ..)| *s == StatusCode::OK).count();
        assert!((1..20).contains(&ok), "{ok} of 20 started");
        let spent = spent_today(&app, "ann").await;
        assert!(spent <= 3000, "{spent}");
    }

    /// A run whose user passes the budget while it runs finishes the model call it is in,
    /// then ends (`finish_reason: "budget"`) instead of calling the model again.
    async fn a_run_that_passes_its_budget_ends_after_its_model_call(backend: Backend) {
        let app = TestApp::spawn(backend, &budget_config(1400)).await;
        let long = "numbers and more numbers ".repeat(80);
        let message = format!("{long} [mock:tool=calculator {{\"expression\": \"1+1\"}}] [mock:loop]");
        let (status, _, frames) = start(&app, "ann", &message).await;
        assert_eq!(status, StatusCode::OK);
        let complete = complete(&frames);
        assert_eq!(complete["finish_reason"], "budget", "{complete}");
        let trace_id = complete["trace_id"].as_str().unwrap();
        let (_, trace) = app.get(&format!("/api/trace/{trace_id}"), "ann").await;
        let calls = trace["spans"].as_array().unwrap().iter().filter(|s| s["kind"] == "llm").count();
        assert!((2..5).contains(&calls), "{calls} model calls");
        // The next start is refused.
        assert_eq!(start(&app, "ann", "more").await.0, StatusCode::TOO_MANY_REQUESTS);
    }
}

/// Two replicas share one budget: a burst split between them never spends past it.
#[tokio::test]
#[cfg_attr(not(chatd_postgres_tests), ignore = "set CHATD_TEST_POSTGRES_URL to run")]
async fn replicas_count_each_others_spend() {
    let db = TestDb::new(Backend::Postgres).await;
    let (a, b) = (TestApp::on(&db.url, &budget_config(3000)).await, TestApp::on(&db.url, &budget_config(3000)).await);
    let burst = (0..20).map(|i| start(if i % 2 == 0 { &a } else { &b }, "ann", "hello"));
    let outcomes = futures_util::future::join_all(burst).await;
    let ok = outcomes.iter().filter(|(s, ..)| *s == StatusCode::OK).count();
    assert!((1..20).contains(&ok), "{ok} of 20 started");
    let spent = spent_today(&a, "ann").await;
    assert!(spent <= 3000, "{spent}");
    assert_eq!(spent, spent_today(&b, "ann").await);
}

/// Each side of a comparison carries what it cost: the priced one its cost, the other none.
#[tokio::test]
async fn a_comparison_shows_each_sides_cost() {
    let app = TestApp::spawn(
        Backend::Sqlite,
        "[pricing.\"mock-1\"]\ninput_per_mtok = 3.0\noutput_per_mtok = 15.0\n\
         [profiles.default]\nprovider = \"mock\"\nmodel = \"mock-1\"\n[profiles.other]\nprovider = \"mock\"\nmodel = \"mock-2\"\n",
    )
    .await;
    let body = json!({"message": "compare", "profile_a": "default", "profile_b": "other"});
    let response =
        app.client.post(app.url("/api/ab/stream")).header("x-client-id", "ann").json(&body).send().await.unwrap();
    let frames = read_frames(response).await;
    let comparison = frames[0].data["comparison_id"].as_str().unwrap().to_owned();
    let (status, view) = app.get(&format!("/api/ab/{comparison}"), "ann").await;
    assert_eq!(status, StatusCode::OK, "{view}");
    let usage = &view["a"]["usage"];
    let expected =
        (usage["input_tokens"].as_f64().unwrap() * 3.0 + usage["output_tokens"].as_f64().unwrap() * 15.0) / 1e6;
    assert!((view["a"]["cost_usd"].as_f64().unwrap() - expected).abs() < 1e-12, "{view}");
    assert!(view["b"].get("cost_usd").is_none(), "mock-2 has no price: {view}");
}

/// Gemini caches by itself: the notes follow the question as a part of their own, and what
/// it read from its cache is reported and priced.
#[tokio::test]
async fn gemini_gets_the_notes_after_the_question_and_its_cache_reads_are_reported() {
    let fixture = Fixture::start(vec![Scripted::sse(&[data(json!({
        "candidates": [{"content": {"role": "model", "parts": [{"text": "Hi."}]}, "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 1200, "candidatesTokenCount": 3, "cachedContentTokenCount": 1024},
    }))])])
    .await;
    let app = app_on("google", &format!("{}/v1beta", fixture.base), "gemini-2.5-flash", "", "").await;
    let frames = app.chat("ann", json!({"message": "hello", "context": {"current_page": "home"}})).await;
    let parts = &fixture.received()[0].body["contents"][0]["parts"];
    assert_eq!(parts[0], json!({"text": "hello"}));
    assert!(parts[1]["text"].as_str().unwrap().starts_with("## Context\n"), "{parts}");
    let payload = complete(&frames);
    assert_eq!(payload["usage"]["cache_read_tokens"], 1024);
    assert!(payload["cost_usd"].as_f64().unwrap() > 0.0, "{payload}");
}

/// `/metrics` counts each profile's tokens by kind and its cost, and its cache hit ratio.
#[tokio::test]
async fn metrics_count_tokens_cost_and_cache_hits_per_profile() {
    let usage = json!({"input_tokens": 100, "cache_read_input_tokens": 900, "output_tokens": 1});
    let fixture = Fixture::start(vec![anthropic_answer("A.", usage)]).await;
    let config = format!(
        "[chat]\ndefault_profile = \"metered\"\n[providers.fx]\nkind = \"anthropic\"\nbase_url = \"{}\"\n\
         [profiles.metered]\nprovider = \"fx\"\nmodel = \"claude-sonnet-4-5\"\n",
        fixture.base
    );
    let app = TestApp::spawn(Backend::Sqlite, &config).await;
    app.chat("ann", json!({"message": "hello"})).await;
    let metrics = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let value = |name: &str| metric(&metrics, name);
    assert_eq!(value("chatd_profile_tokens_total{profile=\"metered\",kind=\"input\"}"), 1000.0);
    assert_eq!(value("chatd_profile_tokens_total{profile=\"metered\",kind=\"cache_read\"}"), 900.0);
    assert_eq!(value("chatd_prompt_cache_hit_ratio{profile=\"metered\"}"), 0.9);
    assert!(value("chatd_cost_usd_total{profile=\"metered\"}") > 0.0);
}
