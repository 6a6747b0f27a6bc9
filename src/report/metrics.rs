//! Prometheus metrics: one process-wide recorder, rendered at `GET /metrics`. The names:
//! `chatd_http_requests_total{method,route,status}`, `chatd_active_runs`,
//! `chatd_runs_total{status}`, `chatd_time_to_first_event_seconds{model}`,
//! `chatd_tokens_total{model,direction}`, `chatd_tool_calls_total{tool,status}`,
//! `chatd_provider_errors_total{code}`, `chatd_event_log_flush_seconds`; per profile
//! (CONTRACT.md §18, §21): `chatd_profile_tokens_total{profile,kind}` (kind `input`,
//! `output`, `cache_read`, `cache_write`), `chatd_cost_usd_total{profile}` (a gauge that only
//! grows: Prometheus counters here are whole numbers) and
//! `chatd_prompt_cache_hit_ratio{profile}` (the share of input tokens read from the
//! provider's cache since start).

use std::sync::OnceLock;
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The recorder, installed on first use (several apps in one test process share it).
pub fn handle() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be set (an embedding program's); then ours only renders.
        let _ = metrics::set_global_recorder(recorder);
        handle
    })
}

/// How often histogram samples are folded into their summaries.
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Folds the histograms' raw samples into their summaries every few seconds, until
/// `shutdown`. The recorder keeps every sample until then: without it, a server nobody
/// scrapes grew by every request's and every flush's timing (about 250 KB a minute under the
/// soak).
pub fn spawn_upkeep(shutdown: tokio_util::sync::CancellationToken) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP_EVERY);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => handle().run_upkeep(),
            }
        }
    });
}

/// Counts every request by method, route template and status.
pub async fn track(request: Request, next: Next) -> Response {
    let method = request.method().to_string();
    let route =
        request.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let started = Instant::now();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("chatd_http_requests_total", "method" => method, "route" => route.clone(), "status" => status)
        .increment(1);
    metrics::histogram!("chatd_http_request_seconds", "route" => route).record(started.elapsed().as_secs_f64());
    response
}

/// Counts one model call's tokens and cost for its profile, and updates the profile's cache
/// hit ratio.
pub fn record_call(profile: &str, usage: &crate::domain::Usage, cost_usd: Option<f64>) {
    use std::collections::HashMap;
    use std::sync::Mutex;
    /// Per profile: input tokens, and those read from the cache, since start.
    static INPUT: Mutex<Option<HashMap<String, (u64, u64)>>> = Mutex::new(None);
    let read = usage.cache_read_tokens.unwrap_or(0);
    for (kind, n) in [
        ("input", usage.input_tokens),
        ("output", usage.output_tokens),
        ("cache_read", read),
        ("cache_write", usage.cache_write_tokens.unwrap_or(0)),
    ] {
        if n > 0 {
            metrics::counter!("chatd_profile_tokens_total", "profile" => profile.to_owned(), "kind" => kind)
                .increment(n);
        }
    }
    if let Some(usd) = cost_usd {
        metrics::gauge!("chatd_cost_usd_total", "profile" => profile.to_owned()).increment(usd);
    }
    if usage.input_tokens == 0 {
        return;
    }
    let mut sums = INPUT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (input, cached) = sums.get_or_insert_with(HashMap::new).entry(profile.to_owned()).or_default();
    (*input, *cached) = (*input + usage.input_tokens, *cached + read);
    metrics::gauge!("chatd_prompt_cache_hit_ratio", "profile" => profile.to_owned())
        .set(*cached as f64 / *input as f64);
}
