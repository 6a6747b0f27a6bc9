//! The event log's storage format: a run's events are kept in chunks, one row per run per
//! flush, instead of one row per event (a row per streamed token cost SQLite more than
//! everything else chatd does for that token). A chunk's text is a JSON array of
//! `[seq, at, event]`, `at` in microseconds since the epoch and `event` the JSON exactly as
//! it was sent, so writing a chunk never parses an event.

use std::collections::HashMap;

use crate::ids::TraceId;
use chrono::DateTime;
use serde_json::value::RawValue;

use super::{NewEvent, Progress, StoreError};
use crate::events::LoggedEvent;

/// One row of the log: the events of one run, `first_seq..=last_seq`.
#[derive(Debug, PartialEq)]
pub struct Chunk {
    pub trace_id: TraceId,
    pub first_seq: i64,
    pub last_seq: i64,
    pub events: String,
}

/// A batch's chunks in transactions of `per`, each with the checkpoints it writes: a run's
/// checkpoint goes with the run's chunk, or with the last transaction where the run has
/// none in the batch. A batch of checkpoints alone is one transaction without chunks.
pub fn transactions(chunks: Vec<Chunk>, per: usize, progress: &[Progress]) -> Vec<(Vec<Chunk>, Vec<&Progress>)> {
    let per = per.max(1);
    let group_of: Vec<Option<usize>> =
        progress.iter().map(|p| chunks.iter().position(|c| c.trace_id == p.trace_id).map(|i| i / per)).collect();
    let mut groups: Vec<(Vec<Chunk>, Vec<&Progress>)> = Vec::new();
    let mut chunks = chunks.into_iter().peekable();
    while chunks.peek().is_some() {
        groups.push((chunks.by_ref().take(per).collect(), Vec::new()));
    }
    if groups.is_empty() && !progress.is_empty() {
        groups.push((Vec::new(), Vec::new()));
    }
    let last = groups.len().saturating_sub(1);
    for (p, group) in progress.iter().zip(group_of) {
        groups[group.unwrap_or(last)].1.push(p);
    }
    groups
}

/// An entry's bytes besides its event: brackets, commas, a seq and a time in microseconds.
const ENTRY_ROOM: usize = 4 + 20 + 20;

/// Groups a batch into one chunk per run, each run's events in the order given.
///
/// Two passes: the first finds each event's chunk and adds up each chunk's room, the second
/// writes each text into a string of its full size. (Sized by the first stretch of a run's
/// events, a chunk grew by doubling wherever runs' events came interleaved, as they do when
/// each run sends a token a read.)
pub fn encode(events: &[NewEvent]) -> Vec<Chunk> {
    let mut chunks: Vec<Chunk> = Vec::new();
    let mut rooms: Vec<usize> = Vec::new();
    let mut places: Vec<usize> = Vec::with_capacity(events.len());
    let mut index: HashMap<TraceId, usize> = HashMap::new();
    let mut last: Option<usize> = None;
    for event in events {
        // A run's emitter hands its events over together: the map is asked only where the
        // run changes.
        let i = match last.filter(|&i| chunks[i].trace_id == event.trace_id) {
            Some(i) => i,
            None => *index.entry(event.trace_id).or_insert_with(|| {
                chunks.push(Chunk {
                    trace_id: event.trace_id,
                    first_seq: event.seq,
                    last_seq: event.seq,
                    events: String::new(),
                });
                rooms.push(2);
                chunks.len() - 1
            }),
        };
        last = Some(i);
        places.push(i);
        rooms[i] += event.data.json().len() + ENTRY_ROOM;
        let chunk = &mut chunks[i];
        chunk.first_seq = chunk.first_seq.min(event.seq);
        chunk.last_seq = chunk.last_seq.max(event.seq);
    }
    for (chunk, room) in chunks.iter_mut().zip(rooms) {
        chunk.events.reserve_exact(room);
        chunk.events.push('[');
    }
    let mut number = itoa::Buffer::new();
    // The events of a burst carry one time (the emitter's): it is written out once for them.
    let (mut times, mut last_at, mut at_text) = (itoa::Buffer::new(), None, "");
    for (event, i) in events.iter().zip(places) {
        if last_at != Some(event.at) {
            last_at = Some(event.at);
            at_text = times.format(event.at.timestamp_micros());
        }
        let text = &mut chunks[i].events;
        if text.len() > 1 {
            text.push(',');
        }
        text.push('[');
        text.push_str(number.format(event.seq));
        text.push(',');
        text.push_str(at_text);
        text.push(',');
        text.push_str(event.data.json());
        text.push(']');
    }
    for chunk in &mut chunks {
        chunk.events.push(']');
    }
    chunks
}

/// The events of a stored chunk with `seq > after`.
pub fn decode(text: &str, after: i64, into: &mut Vec<LoggedEvent>) -> Result<(), StoreError> {
    let corrupt = |e: serde_json::Error| StoreError::Corrupt(format!("event log chunk: {e}"));
    let entries: Vec<(i64, i64, &RawValue)> = serde_json::from_str(text).map_err(corrupt)?;
    for (seq, at, event) in entries.into_iter().filter(|(seq, ..)| *seq > after) {
        let at = DateTime::from_timestamp_micros(at)
            .ok_or_else(|| StoreError::Corrupt(format!("event log chunk: time {at} out of range")))?;
        into.push(LoggedEvent::decode(seq, at, event.to_owned()).map_err(corrupt)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::now;

    fn event(trace_id: TraceId, seq: i64, text: &str) -> NewEvent {
        let data = serde_json::json!({"type": "text_delta", "text": text}).to_string();
        NewEvent { trace_id, seq, at: now(), kind: "text_delta", data: crate::events::Sent::text(&data) }
    }

    #[test]
    fn interleaved_runs_get_one_chunk_each_and_read_back_exactly() {
        let (a, b) = (TraceId::new(), TraceId::new());
        let events =
            vec![event(a, 1, "a1"), event(b, 7, "b7"), event(a, 2, "a\"2\n"), event(b, 8, "b8"), event(a, 3, "a3")];
        let chunks = encode(&events);
        assert_eq!(chunks.len(), 2);
        assert_eq!((chunks[0].trace_id, chunks[0].first_seq, chunks[0].last_seq), (a, 1, 3));
        assert_eq!((chunks[1].trace_id, chunks[1].first_seq, chunks[1].last_seq), (b, 7, 8));
        let mut read = Vec::new();
        decode(&chunks[0].events, 0, &mut read).unwrap();
        let texts: Vec<&str> = read
            .iter()
            .map(|e| match &e.event {
                Some(crate::events::Event::TextDelta { text }) => text.as_str(),
                other => panic!("read back {other:?}"),
            })
            .collect();
        assert_eq!(texts, ["a1", "a\"2\n", "a3"]);
        assert_eq!(read[1].data.get(), r#"{"type":"text_delta","text":"a\"2\n"}"#, "the stored text, unchanged");
        assert_eq!(read[1].at, events[2].at);
        assert_eq!(read[1].kind, "text_delta");
    }

    #[test]
    fn each_event_reads_back_its_own_time_where_a_burst_shares_one() {
        let (a, b) = (TraceId::new(), TraceId::new());
        let t = now();
        let later = t + chrono::Duration::microseconds(1);
        let times = [t, t, later, later, t, later];
        let events: Vec<NewEvent> = times
            .iter()
            .enumerate()
            .map(|(i, &at)| NewEvent { at, ..event(if i % 3 == 0 { b } else { a }, i as i64 + 1, "x") })
            .collect();
        let mut read = Vec::new();
        for chunk in encode(&events) {
            decode(&chunk.events, 0, &mut read).unwrap();
        }
        read.sort_by_key(|e| e.seq);
        assert_eq!(read.iter().map(|e| e.at).collect::<Vec<_>>(), times);
    }

    #[test]
    fn reading_after_a_seq_skips_what_the_client_has() {
        let a = TraceId::new();
        let chunks = encode(&[event(a, 4, "x"), event(a, 5, "y"), event(a, 6, "z")]);
        let mut read = Vec::new();
        decode(&chunks[0].events, 5, &mut read).unwrap();
        assert_eq!(read.iter().map(|e| e.seq).collect::<Vec<_>>(), [6]);
    }

    #[test]
    fn a_damaged_chunk_is_an_error_not_a_panic() {
        let mut read = Vec::new();
        assert!(matches!(decode("[[1,2,{\"type\":", 0, &mut read), Err(StoreError::Corrupt(_))));
    }
}
