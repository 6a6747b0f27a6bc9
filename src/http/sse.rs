//! Streams as Server-Sent Events. A run's frames, live or replayed from its log, reach the
//! wire through an [`Encoder`]: one small type per vocabulary a client may speak (`Native`,
//! `Conversational`, `Legacy`, `Comparisons` here; the client libraries' in their folders),
//! each a function of the typed events.

use crate::ids::MessageId;
use std::convert::Infallible;

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde::Serialize;

use super::AppState;
use crate::chat::Frame;
use crate::domain::Comparison;
use crate::events::comparison::{ComparisonEvent, Tagged, Variant};
use crate::events::legacy::ToLegacy;
use crate::wake::when_woken;

/// Turns the items of a stream into SSE text.
pub trait Encoder: Send + 'static {
    type Item: Send + 'static;

    /// Appends the SSE frames of `item` to `out`: none where the vocabulary has no word for it.
    fn encode(&mut self, item: &Self::Item, out: &mut String);

    /// Appends what the vocabulary says when the items end without their own ending (a
    /// run that waits, CONTRACT.md §15).
    fn end(&mut self, _out: &mut String) {}

    /// About how many bytes `item` takes (to size a write once).
    fn size(&self, _item: &Self::Item) -> usize {
        256
    }
}

/// Appends one SSE frame: `id: <seq>`, `data: <json>` (compact JSON never holds a newline).
fn push_frame(out: &mut String, seq: u64, data: &str) {
    // Pieces pushed one by one: `write!` through `fmt` cost four times as much.
    out.push_str("id: ");
    out.push_str(itoa::Buffer::new().format(seq));
    out.push_str("\ndata: ");
    out.push_str(data);
    out.push_str("\n\n");
}

/// Appends `event` serialized as one SSE frame.
fn push_event(out: &mut String, seq: u64, event: &impl Serialize) {
    push_frame(out, seq, &serde_json::to_string(event).expect("events always serialize"));
}

/// The contract's own events (CONTRACT.md §5), as they were serialized once for every
/// listener and the log.
pub struct Native;

impl Encoder for Native {
    type Item = Frame;

    fn encode(&mut self, frame: &Frame, out: &mut String) {
        push_frame(out, frame.seq, frame.data());
    }

    fn size(&self, frame: &Frame) -> usize {
        frame.data().len() + 32
    }
}

/// Every run of a conversation (CONTRACT.md §16): each event as the native stream has it,
/// with its run's `trace_id` and `seq` added, and `id: <trace_id>:<seq>`.
pub struct Conversational;

impl Encoder for Conversational {
    type Item = (crate::ids::TraceId, Frame);

    fn encode(&mut self, (trace_id, frame): &Self::Item, out: &mut String) {
        let Ok(serde_json::Value::Object(mut event)) = serde_json::from_str::<serde_json::Value>(frame.data()) else {
            return;
        };
        event.insert("trace_id".into(), serde_json::Value::String(trace_id.to_string()));
        event.insert("seq".into(), frame.seq.into());
        out.push_str("id: ");
        out.push_str(&trace_id.to_string());
        out.push(':');
        out.push_str(itoa::Buffer::new().format(frame.seq));
        out.push_str("\ndata: ");
        out.push_str(&serde_json::to_string(&event).expect("events always serialize"));
        out.push_str("\n\n");
    }
}

/// The legacy vocabulary (CONTRACT.md §11), numbered as the run's events are.
#[derive(Default)]
pub struct Legacy(ToLegacy);

impl Encoder for Legacy {
    type Item = Frame;

    fn encode(&mut self, frame: &Frame, out: &mut String) {
        if let Some(event) = frame.event().and_then(|event| self.0.translate(event)) {
            push_event(out, frame.seq, &event);
        }
    }
}

/// Appends one SSE frame with no `id:` line.
pub(super) fn push_data(out: &mut String, data: &str) {
    out.push_str("data: ");
    out.push_str(data);
    out.push_str("\n\n");
}

/// What an A/B stream is made of: its opening, both runs' events, its closing.
pub enum Paired {
    Opening,
    Side(Variant, Frame),
    Closing,
}

/// The A/B stream (CONTRACT.md §10), its frames numbered afresh: to resume one side, follow
/// its trace id.
pub struct Comparisons {
    comparison: Comparison,
    message_a: MessageId,
    message_b: MessageId,
    seq: u64,
}

impl Comparisons {
    pub fn new(comparison: Comparison, message_a: MessageId, message_b: MessageId) -> Self {
        Self { comparison, message_a, message_b, seq: 0 }
    }
}

impl Encoder for Comparisons {
    type Item = Paired;

    fn encode(&mut self, item: &Paired, out: &mut String) {
        let (comparison, a, b) = (&self.comparison, self.message_a, self.message_b);
        let data = match item {
            Paired::Opening => serde_json::to_string(&ComparisonEvent::opening(comparison, a, b)),
            Paired::Side(variant, frame) => match frame.event() {
                Some(event) => serde_json::to_string(&Tagged { event, variant: *variant }),
                // (A live run's frames always have their event.)
                None => return,
            },
            Paired::Closing => serde_json::to_string(&ComparisonEvent::closing(comparison, a, b)),
        };
        self.seq += 1;
        push_frame(out, self.seq, &data.expect("events always serialize"));
    }
}

/// Items sent in one write, at most (a listener that fell behind catches up in a few).
const ITEMS_PER_WRITE: usize = 512;

/// The SSE response for a stream of items; ends with the stream or when the server stops.
/// Items that are ready together go out as one write, and `: ping` goes out when idle.
pub fn sse<E: Encoder>(
    state: &AppState,
    items: impl Stream<Item = E::Item> + Send + 'static,
    mut encoder: E,
) -> Response {
    let items = items.take_until(when_woken(state.shutdown.clone().cancelled_owned())).ready_chunks(ITEMS_PER_WRITE);
    let keepalive = state.keepalive();
    let body = async_stream::stream! {
        let mut items = std::pin::pin!(items);
        let mut idle = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A ping only after a whole interval without frames: re-arming the timer on every
        // write would cost more than the frames themselves.
        let mut sent = false;
        loop {
            tokio::select! {
                biased;
                batch = items.next() => match batch {
                    Some(batch) => {
                        let mut out = String::with_capacity(batch.iter().map(|item| encoder.size(item)).sum());
                        for item in &batch {
                            encoder.encode(item, &mut out);
                        }
                        if !out.is_empty() {
                            sent = true;
                            yield Ok::<_, Infallible>(Bytes::from(out));
                        }
                    }
                    None => {
                        let mut out = String::new();
                        encoder.end(&mut out);
                        if !out.is_empty() {
                            yield Ok(Bytes::from(out));
                        }
                        break;
                    }
                },
                _ = idle.tick() => {
                    if !std::mem::take(&mut sent) {
                        yield Ok(Bytes::from_static(b": ping\n\n"));
                    }
                }
            }
        }
    };
    let mut response = Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Proxies such as nginx must pass each frame on at once.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}
