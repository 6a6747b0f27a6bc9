//! A provider's Server-Sent Events, parsed from its bytes line by line: the frames
//! eventsource-stream makes of the same bytes, in any chunking (a property test below holds
//! the two equal), at a fraction of its cost. eventsource-stream parses a character at a time,
//! copies its buffer after each line, and allocates about seven times per frame; on a run's
//! hot path (every token of every answer passes here) that was some 30 % of a run task's
//! instructions. Here a line is found with `memchr` and read in place where a chunk holds it
//! whole, and a frame is lent to its reader from buffers the parser keeps: a stream's frames
//! allocate nothing once its first few have sized them. (A stream that begins with a byte
//! order mark made eventsource-stream 0.2.3 panic; here the mark is left out, as the spec
//! says.)
//!
//! A frame's data is lent as the bytes came, and its reader checks that they are UTF-8
//! ([`Frame::text`]) where it reads them: OpenAI's reader checks only the bytes of a token's
//! frame that differ from the frame before (already checked), which is its text, where
//! checking every data line here was the parser's largest cost. Every other line is checked
//! here, whole. Bytes that are not UTF-8 fail the stream either way, once the frame that
//! holds them ends (a frame never ended is never read, whatever its bytes).

use std::time::Duration;

/// The most bytes one SSE frame (its lines up to the blank line that ends it) may have: a
/// larger one fails the run as unparsable instead of growing without bound.
pub const MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;

/// What is wrong with bytes that are no SSE stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A line, or a frame's data, is not UTF-8.
    Utf8,
    /// A frame is longer than [`MAX_FRAME_BYTES`].
    TooLarge,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Utf8 => write!(f, "SSE bytes that are not UTF-8"),
            Fault::TooLarge => write!(f, "an SSE frame longer than {MAX_FRAME_BYTES} bytes"),
        }
    }
}

/// One frame, lent by the parser to its reader until the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    /// `message` where the frame names no event.
    pub event: &'a str,
    /// Its data lines, joined by LF, as the bytes came: not checked for UTF-8 here
    /// ([`text`](Self::text) does).
    pub data: &'a [u8],
    /// The last `id:` seen in the stream so far.
    pub id: &'a str,
    pub retry: Option<Duration>,
}

impl<'a> Frame<'a> {
    /// Its data as text, or [`Fault::Utf8`] where it is not UTF-8.
    pub fn text(&self) -> Result<&'a str, Fault> {
        std::str::from_utf8(self.data).map_err(|_| Fault::Utf8)
    }
}

/// Why [`Parser::feed`] stopped before the end of a chunk.
#[derive(Debug, PartialEq, Eq)]
pub enum Stop<E> {
    /// The bytes are no SSE.
    Fault(Fault),
    /// The reader of a frame said so.
    Reader(E),
}

/// The SSE parser: bytes in, in any pieces; each frame handed to a reader as it ends
/// (HTML's "event stream interpretation", as eventsource-stream implements it).
#[derive(Default)]
pub struct Parser {
    /// The bytes of a line not ended yet.
    partial: Vec<u8>,
    /// The line in `partial` ended with a CR at the end of a chunk: whether a LF follows (one
    /// line end, CRLF) is told by the next byte. (eventsource-stream reads the line only then.)
    after_cr: bool,
    /// The stream's first bytes were looked at for a byte order mark.
    started: bool,
    /// Bytes of the frame so far.
    frame_bytes: usize,
    frame: Building,
    /// The last `id:` seen; each frame carries it.
    last_id: String,
}

/// The frame being read, in buffers kept from one frame to the next.
#[derive(Default)]
struct Building {
    /// Its `event:` (the last one), empty for none.
    event: String,
    /// Its data lines, each followed by a LF.
    data: Vec<u8>,
    retry: Option<Duration>,
}

const BOM: &[u8] = "\u{feff}".as_bytes();

impl Parser {
    /// Reads `chunk`, handing each frame it ends to `read`; stops at bytes that are no SSE,
    /// or where `read` fails (the rest of the chunk is then left unread).
    pub fn feed<E>(
        &mut self,
        mut chunk: &[u8],
        read: &mut impl FnMut(Frame<'_>) -> Result<(), E>,
    ) -> Result<(), Stop<E>> {
        if !self.started {
            // The first bytes tell whether the stream begins with a byte order mark, which
            // is not part of it (they may come in pieces).
            let take = (BOM.len() - self.partial.len()).min(chunk.len());
            self.partial.extend_from_slice(&chunk[..take]);
            chunk = &chunk[take..];
            if self.partial.len() < BOM.len() && BOM.starts_with(&self.partial) {
                return Ok(());
            }
            self.started = true;
            let head = std::mem::take(&mut self.partial);
            self.lines(head.strip_prefix(BOM).unwrap_or(&head), read)?;
        }
        self.lines(chunk, read)
    }

    /// Reads bytes of the stream after its start.
    fn lines<E>(&mut self, mut chunk: &[u8], read: &mut impl FnMut(Frame<'_>) -> Result<(), E>) -> Result<(), Stop<E>> {
        if std::mem::take(&mut self.after_cr) {
            if chunk.is_empty() {
                self.after_cr = true;
                return Ok(());
            }
            if chunk[0] == b'\n' {
                chunk = &chunk[1..];
            }
            let line = std::mem::take(&mut self.partial);
            let read_line = self.line(&line, read);
            self.partial = line;
            self.partial.clear();
            read_line?;
        }
        while let Some(at) = memchr::memchr2(b'\n', b'\r', chunk) {
            let (end, rest) = (chunk[at], &chunk[at + 1..]);
            if end == b'\r' && rest.is_empty() {
                // Read once the next byte tells whether a LF follows.
                self.partial.extend_from_slice(&chunk[..at]);
                self.count(self.partial.len())?;
                self.after_cr = true;
                return Ok(());
            }
            if self.partial.is_empty() {
                self.count(at)?;
                self.line(&chunk[..at], read)?;
            } else {
                self.partial.extend_from_slice(&chunk[..at]);
                let line = std::mem::take(&mut self.partial);
                let counted = self.count(line.len());
                let read_line = counted.and_then(|()| self.line(&line, read));
                self.partial = line;
                self.partial.clear();
                read_line?;
            }
            chunk = if end == b'\r' && rest[0] == b'\n' { &rest[1..] } else { rest };
        }
        self.partial.extend_from_slice(chunk);
        self.count(self.partial.len())
    }

    /// Counts a line's bytes in its frame, refusing a frame past the bound.
    fn count<E>(&self, line: usize) -> Result<(), Stop<E>> {
        if self.frame_bytes + line > MAX_FRAME_BYTES {
            return Err(Stop::Fault(Fault::TooLarge));
        }
        Ok(())
    }

    /// Reads one line, without its end: a data line's value as it came, any other line
    /// checked for UTF-8 whole.
    fn line<E>(&mut self, line: &[u8], read: &mut impl FnMut(Frame<'_>) -> Result<(), E>) -> Result<(), Stop<E>> {
        if line.is_empty() {
            self.frame_bytes = 0;
            return self.dispatch(read).map_err(Stop::Reader);
        }
        self.frame_bytes += line.len();
        if let Some(value) = data_value(line) {
            let data = &mut self.frame.data;
            data.reserve(value.len() + 1);
            data.extend_from_slice(value);
            data.push(b'\n');
            return Ok(());
        }
        let line = std::str::from_utf8(line).map_err(|_| Stop::Fault(Fault::Utf8))?;
        if line.starts_with(':') {
            return Ok(());
        }
        let (name, value) = match line.split_once(':') {
            Some((name, value)) => (name, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match name {
            "event" => value.clone_into(&mut self.frame.event),
            "id" if !value.contains('\0') => value.clone_into(&mut self.last_id),
            "retry" => {
                if let Ok(ms) = value.parse::<u64>() {
                    self.frame.retry = Some(Duration::from_millis(ms));
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Hands the frame a blank line ends, if it has data, to `read`; the next frame starts
    /// empty in the same buffers.
    fn dispatch<E>(&mut self, read: &mut impl FnMut(Frame<'_>) -> Result<(), E>) -> Result<(), E> {
        let frame = &mut self.frame;
        let read_frame = match frame.data.len() {
            0 => Ok(()),
            len => read(Frame {
                event: if frame.event.is_empty() { "message" } else { &frame.event },
                data: &frame.data[..len - 1],
                id: &self.last_id,
                retry: frame.retry,
            }),
        };
        frame.event.clear();
        frame.data.clear();
        if frame.data.capacity() > KEPT_CAPACITY {
            frame.data = Vec::new();
        }
        frame.retry = None;
        read_frame
    }
}

/// The value of a `data` line (`data`, `data:` and `data: ` before it), unchecked.
fn data_value(line: &[u8]) -> Option<&[u8]> {
    match line.strip_prefix(b"data")? {
        [] => Some(&[]),
        [b':', b' ', value @ ..] | [b':', value @ ..] => Some(value),
        _ => None,
    }
}

/// The most a frame's data buffer keeps between frames: one large frame does not hold its
/// size for the rest of the stream.
const KEPT_CAPACITY: usize = 64 * 1024;

/// A frame of its own, for whoever keeps frames past the next (tests and benchmarks).
#[cfg(test)]
impl Frame<'_> {
    fn owned(&self) -> eventsource_stream::Event {
        eventsource_stream::Event {
            event: self.event.to_owned(),
            data: self.text().expect("UTF-8 data").to_owned(),
            id: self.id.to_owned(),
            retry: self.retry,
        }
    }
}

#[cfg(test)]
mod tests {
    use eventsource_stream::{Event as SseFrame, Eventsource};
    use futures_util::StreamExt;
    use proptest::prelude::*;

    use super::*;

    /// What eventsource-stream makes of `chunks`.
    fn theirs(chunks: &[Vec<u8>]) -> Vec<SseFrame> {
        let stream = futures_util::stream::iter(chunks.iter().cloned().map(Ok::<_, std::io::Error>)).eventsource();
        let frames = stream.map(|frame| frame.expect("valid SSE")).collect::<Vec<_>>();
        futures_util::FutureExt::now_or_never(frames).expect("chunks in memory are read at once")
    }

    /// What the parser makes of `chunks`.
    fn ours(chunks: &[Vec<u8>]) -> Vec<SseFrame> {
        let (mut parser, mut out) = (Parser::default(), Vec::new());
        for chunk in chunks {
            parser.feed(chunk, &mut keep(&mut out)).expect("valid SSE");
        }
        out
    }

    /// A reader that keeps each frame in `out`.
    fn keep(out: &mut Vec<SseFrame>) -> impl FnMut(Frame<'_>) -> Result<(), ()> + '_ {
        |frame| {
            out.push(frame.owned());
            Ok(())
        }
    }

    /// `text` cut at `cuts` (byte offsets, any order, out of range ignored).
    fn cut(text: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).collect();
        at.sort_unstable();
        let mut pieces = Vec::new();
        let mut from = 0;
        for to in at.into_iter().chain([text.len()]) {
            pieces.push(text[from..to].to_vec());
            from = to;
        }
        pieces
    }

    /// Lines as providers and odd servers send them: fields with and without a space, empty
    /// values, comments, unknown fields, every line end, blank lines, non-ASCII text.
    fn line() -> impl Strategy<Value = String> {
        let value = "[a-zA-Z0-9 :{}\",é€😀]{0,12}";
        let end = prop_oneof![Just("\n"), Just("\r\n"), Just("\r")];
        let body = prop_oneof![
            (Just("data"), value).prop_map(|(f, v)| format!("{f}: {v}")),
            value.prop_map(|v| format!("data:{v}")),
            Just("data".to_owned()),
            value.prop_map(|v| format!("event: {v}")),
            value.prop_map(|v| format!("id: {v}")),
            "[0-9]{1,4}".prop_map(|v| format!("retry: {v}")),
            value.prop_map(|v| format!("retry: {v}")),
            value.prop_map(|v| format!(": {v}")),
            value.prop_map(|v| format!("x-other: {v}")),
            Just(String::new()),
        ];
        (body, end).prop_map(|(body, end)| body + end)
    }

    proptest! {
        #[test]
        fn frames_are_eventsource_streams_for_any_bytes_in_any_pieces(
            bom in any::<bool>(),
            lines in prop::collection::vec(line(), 0..40),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
        ) {
            let text = lines.concat();
            // A byte order mark first is left out, as the spec says; eventsource-stream
            // 0.2.3 means to, but slices one byte of its three and panics: it is given the
            // text without it.
            let sent = format!("{}{text}", if bom { "\u{feff}" } else { "" });
            prop_assert_eq!(ours(&cut(sent.as_bytes(), &cuts)), theirs(&cut(text.as_bytes(), &cuts)));
        }
    }

    #[test]
    fn a_reader_that_fails_stops_the_chunk_where_it_failed() {
        let mut parser = Parser::default();
        let mut read = Vec::new();
        let mut reader = |frame: Frame<'_>| {
            read.push(frame.data.to_owned());
            if frame.data == b"stop" { Err("stopped") } else { Ok(()) }
        };
        let fed = parser.feed(b"data: a\n\ndata: stop\n\ndata: c\n\n", &mut reader);
        assert_eq!(fed, Err(Stop::Reader("stopped")));
        assert_eq!(read, [b"a".to_vec(), b"stop".to_vec()], "nothing after the frame that failed");
    }

    #[test]
    fn a_frame_past_the_bound_is_a_fault() {
        let (mut parser, mut out) = (Parser::default(), Vec::new());
        let line = format!("data: {}\n", "x".repeat(1024 * 1024));
        let fed = (0..9).map(|_| parser.feed(line.as_bytes(), &mut keep(&mut out))).find(Result::is_err);
        assert_eq!(fed, Some(Err(Stop::Fault(Fault::TooLarge))));
        // One line without its end, in pieces.
        let mut parser = Parser::default();
        let piece = vec![b'x'; 1024 * 1024];
        let fed = (0..9).map(|_| parser.feed(&piece, &mut keep(&mut out))).find(Result::is_err);
        assert_eq!(fed, Some(Err(Stop::Fault(Fault::TooLarge))));
    }

    #[test]
    fn data_not_utf8_is_lent_as_it_came_and_any_other_line_not_utf8_is_a_fault() {
        let mut parser = Parser::default();
        let mut read: Vec<(Vec<u8>, Result<String, Fault>)> = Vec::new();
        let mut reader = |frame: Frame<'_>| {
            read.push((frame.data.to_vec(), frame.text().map(str::to_owned)));
            Ok::<_, ()>(())
        };
        let fed = parser.feed(b"data: ok\n\ndata: \xff\xfe\ndata:\xc3\xa9\n\n", &mut reader);
        assert_eq!(fed, Ok(()));
        assert_eq!(read[0], (b"ok".to_vec(), Ok("ok".to_owned())));
        assert_eq!(read[1], (b"\xff\xfe\n\xc3\xa9".to_vec(), Err(Fault::Utf8)), "the reader is told");
        for line in [&b"event: \xff\n"[..], b": \xff\n", b"id: \xff\n", b"dat\xff: x\n", b"\xff\n"] {
            let mut parser = Parser::default();
            let fed = parser.feed(&[b"data: before\n\n", line].concat(), &mut |_| Ok::<_, ()>(()));
            assert_eq!(fed, Err(Stop::Fault(Fault::Utf8)), "{line:?}");
        }
    }
}
