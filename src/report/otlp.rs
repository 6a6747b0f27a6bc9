//! Runs exported as OpenTelemetry traces over OTLP/HTTP protobuf (CONTRACT.md §18), with
//! the `opentelemetry` SDK's batch processor and `opentelemetry-otlp`'s exporter.
//!
//! A run is exported once it has ended, from its stored trace, by whichever process ended
//! it: a span per run (`invoke_agent <profile>`), a child per model call (`chat <model>`)
//! and per tool call (`execute_tool <tool>`), with the GenAI attribute names. The trace id
//! is the request's `traceparent`'s, with its span as the run's parent; without one, the
//! trace id is the run's own trace id (a UUID is 16 bytes, as a trace id is), so a trace in
//! the tracing backend and `GET /api/trace/{id}` name the same run.
//!
//! The export never runs on a stream's path: the run's end hands the trace to a task, which
//! reads it and queues its spans; the SDK's batch processor sends them from a thread of its
//! own, dropping spans when its bounded queue is full (a collector that is down costs
//! neither streams nor unbounded memory). With no endpoint configured nothing is built:
//! a run's end checks one `OnceLock`.
//!
//! One exporter per process (like the metrics recorder): the first app built in a process
//! sets it.

use std::borrow::Cow;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue, Value};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{BatchSpanProcessor, SpanData, SpanEvents, SpanLinks, SpanProcessor};

use crate::config::{ProviderKind, Settings};
use crate::domain::{CallStatus, Span, ToolStatus, Trace, TraceStatus};

/// The OTLP path traces are posted to, under a base URL.
const TRACES_PATH: &str = "/v1/traces";
/// How long one export request may take (OTLP's default).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

static EXPORTER: OnceLock<Exporter> = OnceLock::new();

tokio::task_local! {
    /// The `traceparent` of the request being handled (see [`remember_traceparent`]).
    static TRACEPARENT: Option<String>;
}

struct Exporter {
    processor: BatchSpanProcessor,
    scope: InstrumentationScope,
    settings: std::sync::Arc<Settings>,
    /// The ended runs whose traces are being read back to be queued ([`flush`] waits for them).
    reading: tokio_util::task::TaskTracker,
}

/// Where traces go: `telemetry.otlp_endpoint` + `/v1/traces`, else what
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` say (read by the
/// exporter, as the specification says); `None` when none is set, or the SDK is disabled
/// (`OTEL_SDK_DISABLED=true`, `OTEL_TRACES_EXPORTER=none`).
fn endpoint(settings: &Settings) -> Option<Option<String>> {
    let set = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if set("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || set("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
    {
        return None;
    }
    match settings.telemetry.otlp_endpoint.as_deref().filter(|e| !e.trim().is_empty()) {
        Some(base) => Some(Some(format!("{}{TRACES_PATH}", base.trim_end_matches('/')))),
        None if set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some() || set("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() => {
            Some(None)
        }
        None => None,
    }
}

/// Starts the exporter where an endpoint is configured; true when it runs (now or from an
/// earlier app of this process).
pub fn start(settings: &std::sync::Arc<Settings>) -> bool {
    if EXPORTER.get().is_some() {
        return true;
    }
    let Some(endpoint) = endpoint(settings) else { return false };
    let client = Client { http: reqwest_client(), runtime: tokio::runtime::Handle::current() };
    let mut builder = opentelemetry_otlp::SpanExporter::builder().with_http().with_http_client(client);
    if let Some(endpoint) = &endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    let exporter = match builder.build() {
        Ok(exporter) => exporter,
        Err(e) => {
            tracing::error!(error = %e, "traces cannot be exported: the OTLP exporter could not be built");
            return false;
        }
    };
    let mut processor = BatchSpanProcessor::builder(exporter).build();
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none()
        && !std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| a.contains("service.name"))
    {
        resource = resource.with_service_name("chatd");
    }
    processor.set_resource(&resource.build());
    let scope = InstrumentationScope::builder("chatd").with_version(env!("CARGO_PKG_VERSION")).build();
    let reading = tokio_util::task::TaskTracker::new();
    let started = EXPORTER.set(Exporter { processor, scope, settings: settings.clone(), reading }).is_ok();
    if started {
        tracing::info!(
            endpoint = endpoint.as_deref().unwrap_or("from OTEL_EXPORTER_OTLP_*"),
            "exporting runs as OTLP traces"
        );
    }
    true
}

/// Whether runs are exported.
pub fn enabled() -> bool {
    EXPORTER.get().is_some()
}

/// Middleware: the request's `traceparent` header, for the runs it starts (installed only
/// where traces are exported).
pub async fn remember_traceparent(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let traceparent = request.headers().get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_owned);
    TRACEPARENT.scope(traceparent, next.run(request)).await
}

/// `future` with the `traceparent` of the request being handled, for a task of its own
/// (a task does not inherit it).
pub fn carrying_traceparent<F: Future>(future: F) -> impl Future<Output = F::Output> {
    let traceparent = TRACEPARENT.try_with(Clone::clone).ok().flatten();
    TRACEPARENT.scope(traceparent, future)
}

/// The `traceparent` of the request being handled, where it is a valid one.
pub fn incoming_traceparent() -> Option<String> {
    TRACEPARENT.try_with(|t| t.clone()).ok().flatten().filter(|t| parse_traceparent(t).is_some())
}

/// A `traceparent`'s trace id and parent span id (W3C Trace Context, version 00).
fn parse_traceparent(text: &str) -> Option<(TraceId, SpanId)> {
    let mut parts = text.trim().split('-');
    let (version, trace, span, _flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || version == "ff" || trace.len() != 32 || span.len() != 16 {
        return None;
    }
    let trace = TraceId::from_hex(trace).ok().filter(|t| *t != TraceId::INVALID)?;
    let span = SpanId::from_hex(span).ok().filter(|s| *s != SpanId::INVALID)?;
    Some((trace, span))
}

/// Exports a run that ended, from its stored trace, in a task of its own (nothing when no
/// endpoint is configured).
pub fn export_run(
    store: std::sync::Arc<dyn crate::store::Store>,
    user: crate::ids::UserId,
    trace_id: crate::ids::TraceId,
) {
    let Some(exporter) = EXPORTER.get() else { return };
    exporter.reading.spawn(async move {
        match store.get_trace(&user, trace_id).await {
            Ok(trace) => {
                for span in exporter.spans(&trace) {
                    exporter.processor.on_end(span);
                }
            }
            Err(e) => tracing::warn!(error = %e, %trace_id, "could not read a run's trace to export it"),
        }
    });
}

/// Sends what is queued (at shutdown), the runs that ended last included (those the drain
/// cancelled: their traces are still being read back), waiting at most the export's timeout
/// for each.
pub async fn flush() {
    let Some(exporter) = EXPORTER.get() else { return };
    exporter.reading.close();
    let _ = tokio::time::timeout(EXPORT_TIMEOUT, exporter.reading.wait()).await;
    exporter.reading.reopen();
    let flushed = tokio::task::spawn_blocking(|| EXPORTER.get().map(|e| e.processor.force_flush()));
    if let Ok(Ok(Some(Err(e)))) = tokio::time::timeout(EXPORT_TIMEOUT, flushed).await {
        tracing::warn!(error = %e, "could not send the last traces");
    }
}

impl Exporter {
    /// The run's spans: the run's own first, then its model and tool calls.
    fn spans(&self, trace: &Trace) -> Vec<SpanData> {
        let own = uuid_trace_id(trace.trace_id);
        let (trace_id, parent, remote) = match trace.traceparent.as_deref().and_then(parse_traceparent) {
            Some((trace_id, parent)) => (trace_id, parent, true),
            None => (own, SpanId::INVALID, false),
        };
        let run_span = SpanId::from_bytes(trace.trace_id.0.as_bytes()[8..].try_into().expect("8 bytes"));
        let run_span = if run_span == SpanId::INVALID { SpanId::from(1u64) } else { run_span };
        let conversation = trace.conversation_id.to_string();
        let provider = |model: &str| self.provider_name(&trace.profile, model);
        let mut usage = Vec::new();
        if let Some(u) = &trace.usage {
            usage.push(KeyValue::new("gen_ai.usage.input_tokens", u.input_tokens as i64));
            usage.push(KeyValue::new("gen_ai.usage.output_tokens", u.output_tokens as i64));
            if let Some(read) = u.cache_read_tokens {
                usage.push(KeyValue::new("gen_ai.usage.cache_read.input_tokens", read as i64));
            }
        }
        let answered_by = trace
            .spans
            .iter()
            .rev()
            .find_map(|s| match s {
                Span::Llm { attributes, .. } => Some(attributes.request_model.clone()),
                Span::Tool { .. } => None,
            })
            .unwrap_or_else(|| trace.model.clone());
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", "invoke_agent"),
            KeyValue::new("gen_ai.agent.name", trace.profile.clone()),
            KeyValue::new("gen_ai.provider.name", provider(&trace.model)),
            KeyValue::new("gen_ai.request.model", trace.model.clone()),
            KeyValue::new("gen_ai.response.model", answered_by),
            KeyValue::new("gen_ai.conversation.id", conversation.clone()),
            KeyValue::new("chatd.trace_id", trace.trace_id.to_string()),
            KeyValue::new("chatd.status", trace.status.as_str()),
        ];
        attributes.extend(usage);
        if let Some(cost) = trace.cost.cost_usd {
            attributes.push(KeyValue::new("chatd.cost_usd", cost));
        }
        let status = match (&trace.error, trace.status) {
            (Some(error), _) => {
                attributes.push(KeyValue::new("error.type", error.code.clone()));
                Status::error(error.message.clone())
            }
            (None, TraceStatus::Completed) => Status::Ok,
            _ => Status::Unset,
        };
        let ended = trace.ended_at.unwrap_or_else(crate::domain::now);
        let mut spans = vec![self.span(SpanSpec {
            trace_id,
            span_id: run_span,
            parent,
            remote,
            kind: SpanKind::Internal,
            name: format!("invoke_agent {}", trace.profile),
            start: trace.started_at.into(),
            end: ended.into(),
            attributes,
            status,
        })];
        for span in &trace.spans {
            let (timing, kind, attributes, status) = match span {
                Span::Llm { timing, status, attributes: a } => {
                    let mut kv = vec![
                        KeyValue::new("gen_ai.operation.name", "chat"),
                        KeyValue::new("gen_ai.provider.name", provider(&a.request_model)),
                        KeyValue::new("gen_ai.request.model", a.request_model.clone()),
                        KeyValue::new("gen_ai.response.model", a.request_model.clone()),
                        KeyValue::new("gen_ai.conversation.id", conversation.clone()),
                        KeyValue::new("gen_ai.usage.input_tokens", a.input_tokens as i64),
                        KeyValue::new("gen_ai.usage.output_tokens", a.output_tokens as i64),
                    ];
                    if let Some(read) = a.cache_read_tokens {
                        kv.push(KeyValue::new("gen_ai.usage.cache_read.input_tokens", read as i64));
                    }
                    if let Some(written) = a.cache_write_tokens {
                        kv.push(KeyValue::new("gen_ai.usage.cache_creation.input_tokens", written as i64));
                    }
                    if let Some(cost) = a.cost_usd {
                        kv.push(KeyValue::new("chatd.cost_usd", cost));
                    }
                    if !a.finish_reasons.is_empty() {
                        let reasons: Vec<opentelemetry::StringValue> =
                            a.finish_reasons.iter().map(|r| r.clone().into()).collect();
                        kv.push(KeyValue::new("gen_ai.response.finish_reasons", Value::Array(reasons.into())));
                    }
                    let status = match status {
                        CallStatus::Ok => Status::Ok,
                        CallStatus::Cancelled => Status::Unset,
                        CallStatus::Error => Status::error("the model call failed"),
                    };
                    (timing, SpanKind::Client, kv, status)
                }
                Span::Tool { timing, status, attributes: a } => {
                    let kv = vec![
                        KeyValue::new("gen_ai.operation.name", "execute_tool"),
                        KeyValue::new("gen_ai.tool.name", a.tool_name.clone()),
                        KeyValue::new("gen_ai.tool.call.id", a.tool_call_id.clone()),
                        KeyValue::new("gen_ai.conversation.id", conversation.clone()),
                        KeyValue::new("chatd.tool.status", tool_status(*status)),
                    ];
                    let status = match status {
                        ToolStatus::Success => Status::Ok,
                        ToolStatus::Error | ToolStatus::Timeout => {
                            Status::error(format!("the tool call ended: {}", tool_status(*status)))
                        }
                        ToolStatus::Cancelled | ToolStatus::Denied => Status::Unset,
                    };
                    (timing, SpanKind::Internal, kv, status)
                }
            };
            spans.push(self.span(SpanSpec {
                trace_id,
                span_id: SpanId::from(fastrand::u64(1..)),
                parent: run_span,
                remote: false,
                kind,
                name: timing.name.clone(),
                start: timing.started_at.into(),
                end: timing.ended_at.into(),
                attributes,
                status,
            }));
        }
        spans
    }

    fn span(&self, spec: SpanSpec) -> SpanData {
        let context = SpanContext::new(spec.trace_id, spec.span_id, TraceFlags::SAMPLED, false, TraceState::NONE);
        SpanData {
            span_context: context,
            parent_span_id: spec.parent,
            parent_span_is_remote: spec.remote,
            span_kind: spec.kind,
            name: Cow::Owned(spec.name),
            start_time: spec.start,
            end_time: spec.end,
            attributes: spec.attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: spec.status,
            instrumentation_scope: self.scope.clone(),
        }
    }

    /// The GenAI name of the provider that serves `model` for `profile` (its own model, or
    /// one of its fallbacks'); an OpenAI-compatible server is named by its provider id.
    fn provider_name(&self, profile: &str, model: &str) -> String {
        let settings = &self.settings;
        let own = settings.profiles.get(profile);
        let candidates = own.into_iter().chain(
            own.map(|p| p.fallbacks.as_slice()).unwrap_or_default().iter().filter_map(|f| settings.profiles.get(f)),
        );
        let chosen = candidates.clone().find(|p| p.model == model).or(own);
        let Some(provider_id) = chosen.map(|p| p.provider.as_str()) else { return "unknown".into() };
        match settings.providers.get(provider_id).map(|p| p.kind) {
            Some(ProviderKind::Anthropic) => "anthropic".into(),
            Some(ProviderKind::Openai) => "openai".into(),
            Some(ProviderKind::Google) => "gcp.gemini".into(),
            Some(ProviderKind::Mock) => "chatd.mock".into(),
            Some(ProviderKind::OpenaiCompatible) | None => provider_id.to_owned(),
        }
    }
}

struct SpanSpec {
    trace_id: TraceId,
    span_id: SpanId,
    parent: SpanId,
    remote: bool,
    kind: SpanKind,
    name: String,
    start: SystemTime,
    end: SystemTime,
    attributes: Vec<KeyValue>,
    status: Status,
}

fn tool_status(status: ToolStatus) -> &'static str {
    match status {
        ToolStatus::Success => "success",
        ToolStatus::Error => "error",
        ToolStatus::Cancelled => "cancelled",
        ToolStatus::Timeout => "timeout",
        ToolStatus::Denied => "denied",
    }
}

/// A run's trace id as an OpenTelemetry trace id: its 16 bytes.
fn uuid_trace_id(id: crate::ids::TraceId) -> TraceId {
    TraceId::from_bytes(*id.0.as_bytes())
}

fn reqwest_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(EXPORT_TIMEOUT)
        .connect_timeout(Duration::from_secs(5))
        .build()
        .unwrap_or_default()
}

/// The exporter's HTTP client: our reqwest (one TLS stack). The batch processor exports
/// from a thread of its own, outside tokio, so each request runs on the server's runtime.
#[derive(Debug)]
struct Client {
    http: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Client {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let http = self.http.clone();
        let request = reqwest::Request::try_from(request)?;
        let sent = self.runtime.spawn(async move {
            let response = http.execute(request).await?;
            let mut answer = http::Response::builder().status(response.status().as_u16());
            for (name, value) in response.headers() {
                answer = answer.header(name.as_str(), value.as_bytes());
            }
            let body = response.bytes().await?;
            Ok::<_, opentelemetry_http::HttpError>(answer.body(body)?)
        });
        sent.await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_read_as_w3c_trace_context_says() {
        let (trace, span) = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(trace.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(span.to_string(), "00f067aa0ba902b7");
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-xyz92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_run_without_a_traceparent_keeps_its_own_trace_id() {
        let id = crate::ids::TraceId::new();
        assert_eq!(uuid_trace_id(id).to_string(), id.0.simple().to_string());
    }
}
