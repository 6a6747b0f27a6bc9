//! Streams as Server-Sent Events. A run's frames, live or replayed from its log, reach the
//! wire through an [`Encoder`]: one small type per vocabulary a client may speak (`Native`,
//! `Conversational`, `Legacy`, `Comparisons` here; the client libraries' in their folders),
//! each a function of the typed events.

use crate::ids::MessageId;
use std::convert::Infallible;

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{FutureExt, Stream};
use serde::Serialize;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::AppState;
use crate::chat::Frame;
use crate::domain::Comparison;
use crate::events::comparison::{ComparisonEvent, Tagged, Variant};
use crate::events::legacy::ToLegacy;
use crate::wake::{WhenWoken, when_woken};

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
pub fn sse<E: Encoder + Unpin>(
    state: &AppState,
    items: impl Stream<Item = E::Item> + Send + 'static,
    encoder: E,
) -> Response {
    let body = Writes::new(items, encoder, &state.shutdown, state.keepalive());
    let mut response = Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Proxies such as nginx must pass each frame on at once.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// An SSE response's writes (see [`sse`]): each takes the items ready when it is asked for,
/// at most [`ITEMS_PER_WRITE`], and encodes them as they are taken, straight into its text.
struct Writes<S, E> {
    items: Pin<Box<S>>,
    encoder: E,
    /// The server's stop: then the items end.
    shutdown: WhenWoken<WaitForCancellationFutureOwned>,
    idle: tokio::time::Interval,
    /// Whether a write went out since the idle timer last fired.
    sent: bool,
    /// The items ended, and the encoder's ending is written.
    ended: bool,
}

impl<S, E> Writes<S, E> {
    fn new(items: S, encoder: E, shutdown: &CancellationToken, keepalive: Duration) -> Self {
        let mut idle = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let shutdown = when_woken(shutdown.clone().cancelled_owned());
        Self { items: Box::pin(items), encoder, shutdown, idle, sent: false, ended: false }
    }
}

impl<S, E> Stream for Writes<S, E>
where
    S: Stream<Item = E::Item>,
    E: Encoder + Unpin,
{
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        let mut out = String::new();
        let mut taken = 0;
        // A write ends after a write's worth of items once it has something to say: items
        // this vocabulary has no word for do not end it empty.
        let ended = this.shutdown.poll_unpin(cx).is_ready()
            || loop {
                match this.items.as_mut().poll_next(cx) {
                    Poll::Ready(Some(item)) => {
                        out.reserve(this.encoder.size(&item));
                        this.encoder.encode(&item, &mut out);
                        taken += 1;
                        if taken >= ITEMS_PER_WRITE && !out.is_empty() {
                            break false;
                        }
                    }
                    Poll::Ready(None) => break true,
                    Poll::Pending => break false,
                }
            };
        if ended {
            this.encoder.end(&mut out);
            this.ended = true;
            return Poll::Ready((!out.is_empty()).then(|| Ok(Bytes::from(out))));
        }
        if !out.is_empty() {
            this.sent = true;
            return Poll::Ready(Some(Ok(Bytes::from(out))));
        }
        // A ping only after a whole interval without a write: re-arming the timer on every
        // write would cost more than the frames themselves. (Polled until pending, so that
        // the timer wakes this stream for its next tick.)
        while this.idle.poll_tick(cx).is_ready() {
            if !std::mem::take(&mut this.sent) {
                return Poll::Ready(Some(Ok(Bytes::from_static(b": ping\n\n"))));
            }
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::*;

    /// Writes the items it is asked to (and the rest as nothing), then `end`.
    struct Only(fn(u32) -> bool);

    impl Encoder for Only {
        type Item = u32;

        fn encode(&mut self, item: &u32, out: &mut String) {
            if (self.0)(*item) {
                out.push_str(&format!("{item}\n"));
            }
        }

        fn end(&mut self, out: &mut String) {
            out.push_str("end\n");
        }
    }

    fn writes<S: Stream<Item = u32>>(items: S, encoder: Only, stop: &CancellationToken) -> Writes<S, Only> {
        Writes::new(items, encoder, stop, Duration::from_secs(3600))
    }

    fn text(write: Result<Bytes, Infallible>) -> String {
        String::from_utf8(write.unwrap().to_vec()).unwrap()
    }

    #[tokio::test]
    async fn items_ready_together_are_one_write_and_the_servers_stop_ends_them_with_the_encoders_end() {
        let stop = CancellationToken::new();
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        let items = futures_util::stream::unfold(receiver, |mut r| async { r.recv().await.map(|item| (item, r)) });
        let mut body = writes(items, Only(|_| true), &stop);
        sender.send(1).unwrap();
        sender.send(2).unwrap();
        assert_eq!(text(body.next().await.unwrap()), "1\n2\n");
        sender.send(3).unwrap();
        assert_eq!(text(body.next().await.unwrap()), "3\n");
        let waiting = tokio::spawn(async move { body.next().await.map(text) });
        tokio::task::yield_now().await;
        stop.cancel();
        assert_eq!(waiting.await.unwrap().as_deref(), Some("end\n"), "woken by the stop");
    }

    #[tokio::test]
    async fn items_without_a_word_in_the_vocabulary_are_taken_past_a_writes_worth() {
        let stop = CancellationToken::new();
        // 1000 is in the second write's worth of items, 2000 in the fourth.
        assert_eq!(ITEMS_PER_WRITE, 512);
        let body = writes(futures_util::stream::iter(1..=2600), Only(|n| n % 1000 == 0), &stop);
        let written = tokio::time::timeout(std::time::Duration::from_secs(5), body.map(text).collect::<Vec<_>>());
        assert_eq!(written.await.expect("not left waiting"), ["1000\n", "2000\n", "end\n"]);
    }
}
