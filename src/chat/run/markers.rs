//! Marker blocks in the answer: `SUGGESTED_VALUES: [...]`, `SUGGESTED_ACTIONS: [...]` and
//! configured payload markers (`SCHEMA_PROPOSAL: {...}`) are cut out of the text as it
//! streams, whatever the chunking: text that may be the start of a marker is held back until
//! it is known not to be one, and a marker's JSON is captured up to its balanced end. A
//! block whose JSON turns out not to parse stays in the text.

use super::scan::{find, partial_len};

/// A captured block: its marker and the JSON text after it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Captured {
    pub marker: String,
    pub json: String,
}

#[derive(Debug, Default)]
pub struct MarkerFilter {
    markers: Vec<String>,
    /// Text that may be the start of a marker.
    held: String,
    capture: Option<Capture>,
    pub captured: Vec<Captured>,
    /// Blocks left in the text because their JSON did not parse.
    pub invalid: Vec<String>,
}

#[derive(Debug)]
struct Capture {
    marker: String,
    /// Everything after the marker so far (leading whitespace included).
    raw: String,
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl MarkerFilter {
    pub fn new(markers: Vec<String>) -> Self {
        Self { markers: markers.into_iter().filter(|m| !m.is_empty()).collect(), ..Self::default() }
    }

    /// What of a chunk of answer text may be shown: the chunk itself in the usual case,
    /// where nothing is held back or captured and no marker begins in it.
    pub fn filter<'a>(&mut self, chunk: &'a str) -> std::borrow::Cow<'a, str> {
        if self.passes(chunk) {
            return chunk.into();
        }
        let mut shown = String::with_capacity(chunk.len());
        self.push(chunk, &mut shown);
        shown.into()
    }

    /// Whether all of `chunk` may be shown as it is, and filtering it would change nothing
    /// here.
    pub fn passes(&self, chunk: &str) -> bool {
        let plain = || self.markers.iter().all(|m| find(chunk, m).is_none() && partial_len(chunk, m) == 0);
        self.markers.is_empty() || self.idle() && plain()
    }

    /// Nothing is held back or being captured.
    pub fn idle(&self) -> bool {
        self.held.is_empty() && self.capture.is_none()
    }

    /// The first bytes of the markers: a chunk with none of them cannot hold one, nor begin
    /// one.
    pub fn first_bytes(&self) -> impl Iterator<Item = u8> + '_ {
        self.markers.iter().filter_map(|m| m.as_bytes().first().copied())
    }

    /// Filters a chunk of answer text, appending what may be shown to `out`.
    pub fn push(&mut self, chunk: &str, out: &mut String) {
        if self.markers.is_empty() {
            out.push_str(chunk);
            return;
        }
        if self.held.is_empty() {
            // The usual case: nothing held back, so the chunk is scanned where it lies.
            self.scan(chunk, out);
        } else {
            let mut buffer = std::mem::take(&mut self.held);
            buffer.push_str(chunk);
            self.scan(&buffer, out);
        }
    }

    /// Filters `rest` (held text and the new chunk), holding back a possible marker start.
    fn scan(&mut self, mut rest: &str, out: &mut String) {
        loop {
            if let Some(capture) = &mut self.capture {
                match capture.feed(rest) {
                    Feed::More => return,
                    Feed::Done(used) => {
                        self.end_capture(out);
                        rest = &rest[used..];
                    }
                    Feed::NotJson(used) => {
                        // Not a marker block after all: marker and text stay.
                        let capture = self.capture.take().expect("capturing");
                        out.push_str(&capture.marker);
                        out.push_str(&capture.raw);
                        rest = &rest[used..];
                    }
                }
                continue;
            }
            match self.first_marker(rest) {
                Some((at, marker)) => {
                    out.push_str(&rest[..at]);
                    rest = &rest[at + marker.len()..];
                    self.capture = Some(Capture::new(marker));
                }
                None => {
                    let keep = self.markers.iter().map(|m| partial_len(rest, m)).max().unwrap_or(0);
                    let (now, later) = rest.split_at(rest.len() - keep);
                    out.push_str(now);
                    self.held.push_str(later);
                    return;
                }
            }
        }
    }

    /// Ends the stream: held text and an unfinished block are text after all.
    pub fn finish(&mut self, out: &mut String) {
        if let Some(capture) = self.capture.take() {
            self.invalid.push(format!("{}{}", capture.marker, capture.raw));
            out.push_str(&capture.marker);
            out.push_str(&capture.raw);
        }
        out.push_str(&std::mem::take(&mut self.held));
    }

    fn end_capture(&mut self, out: &mut String) {
        let capture = self.capture.take().expect("capturing");
        let json = capture.raw.trim().to_owned();
        if serde_json::from_str::<serde_json::Value>(&json).is_ok() {
            self.captured.push(Captured { marker: capture.marker, json });
        } else {
            self.invalid.push(format!("{}{}", capture.marker, capture.raw));
            out.push_str(&capture.marker);
            out.push_str(&capture.raw);
        }
    }

    fn first_marker(&self, text: &str) -> Option<(usize, String)> {
        self.markers
            .iter()
            .filter_map(|m| find(text, m).map(|at| (at, m.clone())))
            .min_by_key(|(at, m)| (*at, std::cmp::Reverse(m.len())))
    }
}

enum Feed {
    /// The block goes on past this chunk.
    More,
    /// The block ended after this many bytes of the chunk.
    Done(usize),
    /// What follows the marker is not JSON; this many bytes were looked at.
    NotJson(usize),
}

impl Capture {
    fn new(marker: String) -> Self {
        Self { marker, raw: String::new(), depth: 0, in_string: false, escaped: false }
    }

    /// Feeds text after the marker, tracking brackets and strings to find the JSON's end.
    fn feed(&mut self, text: &str) -> Feed {
        for (at, c) in text.char_indices() {
            let end = at + c.len_utf8();
            if self.depth == 0 {
                if c.is_whitespace() {
                    self.raw.push(c);
                    continue;
                }
                if c != '[' && c != '{' {
                    // This character is ordinary text again.
                    return Feed::NotJson(at);
                }
            }
            self.raw.push(c);
            if self.in_string {
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, '\\') => self.escaped = true,
                    (false, '"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => self.in_string = true,
                '[' | '{' => self.depth += 1,
                ']' | '}' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return Feed::Done(end);
                    }
                }
                _ => {}
            }
        }
        Feed::More
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(markers: &[&str], chunks: &[&str]) -> (String, Vec<Captured>, Vec<String>) {
        let mut filter = MarkerFilter::new(markers.iter().map(|m| m.to_string()).collect());
        let mut out = String::new();
        for chunk in chunks {
            out.push_str(&filter.filter(chunk));
        }
        filter.finish(&mut out);
        (out, filter.captured, filter.invalid)
    }

    const MARKERS: [&str; 3] = ["SUGGESTED_VALUES:", "SUGGESTED_ACTIONS:", "SCHEMA_PROPOSAL:"];

    #[test]
    fn blocks_are_cut_out_and_captured() {
        let text = "Pick one.\n\nSUGGESTED_VALUES: [{\"label\": \"Yes ]\", \"value\": \"y\"}]\nSCHEMA_PROPOSAL: {\"a\": {\"b\": [1]}} done";
        let (out, captured, invalid) = run(&MARKERS, &[text]);
        assert_eq!(out, "Pick one.\n\n\n done");
        assert_eq!(
            captured[0],
            Captured { marker: "SUGGESTED_VALUES:".into(), json: "[{\"label\": \"Yes ]\", \"value\": \"y\"}]".into() }
        );
        assert_eq!(captured[1].json, "{\"a\": {\"b\": [1]}}");
        assert!(invalid.is_empty());
    }

    #[test]
    fn a_marker_without_json_stays_text() {
        let (out, captured, _) = run(&MARKERS, &["See SUGGESTED_VALUES: below"]);
        assert_eq!(out, "See SUGGESTED_VALUES: below");
        assert!(captured.is_empty());
    }

    #[test]
    fn invalid_json_stays_text_with_a_warning() {
        let (out, captured, invalid) = run(&MARKERS, &["x SUGGESTED_VALUES: {oops} y"]);
        assert_eq!(out, "x SUGGESTED_VALUES: {oops} y");
        assert!(captured.is_empty());
        assert_eq!(invalid, vec!["SUGGESTED_VALUES: {oops}".to_owned()]);
        let (out, _, invalid) = run(&MARKERS, &["x SUGGESTED_VALUES: [1, 2"]);
        assert_eq!(out, "x SUGGESTED_VALUES: [1, 2");
        assert_eq!(invalid.len(), 1);
    }

    proptest! {
        #[test]
        fn the_result_does_not_depend_on_the_chunking(
            atoms in prop::collection::vec(prop::sample::select(vec![
                "SUGGESTED_VALUES:", "SUGGESTED_", "SUGG", "SCHEMA_PROPOSAL:", " ", "\n", "[", "]", "{", "}",
                "\"", "\\", "\"label\"", ":", ",", "1", "text", "é", "S",
            ]), 0..40),
            cuts in prop::collection::vec(0usize..300, 0..10),
        ) {
            let text: String = atoms.concat();
            let whole = run(&MARKERS, &[&text]);
            let chars: Vec<char> = text.chars().collect();
            let mut points: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
            points.sort_unstable();
            points.dedup();
            let mut chunks = Vec::new();
            let mut from = 0;
            for to in points.into_iter().chain([chars.len()]) {
                chunks.push(chars[from..to].iter().collect::<String>());
                from = to;
            }
            let borrowed: Vec<&str> = chunks.iter().map(String::as_str).collect();
            prop_assert_eq!(run(&MARKERS, &borrowed), whole);
        }
    }
}
