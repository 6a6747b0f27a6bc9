//! Cleaning what a model streams into what a client may see, whatever the chunking:
//! control characters and `␄` are dropped (`\n` and `\t` stay), inline `<think>…</think>`
//! (models served by Ollama, vLLM, llama.cpp) goes to the thinking channel, a tag split
//! across chunks is held back until it is whole, and whitespace at the edges of the answer
//! and of the thinking is trimmed, and marker blocks (`SUGGESTED_VALUES: […]`, …) are cut
//! out of the answer ([`MarkerFilter`]). The output depends only on the concatenated input,
//! never on where it was cut; the property tests below prove it.

use super::markers::{Captured, MarkerFilter};
use super::scan::{find, partial_len};
use crate::events::Text;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// A cleaned piece, ready to append on the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(Text),
    Thinking(Text),
}

#[derive(Debug)]
pub struct Cleaner {
    markers: MarkerFilter,
    in_think: bool,
    /// The end of the answer channel so far that may be the start of a tag.
    held: String,
    /// The same for the reasoning channel, where tags are dropped.
    held_thinking: String,
    text: Edge,
    thinking: Edge,
    /// The first bytes of the tags and markers.
    first_bytes: Vec<u8>,
    /// The bytes a usual token is made of, as bits (bit `b` for byte `b`): ASCII that is
    /// visible (or `\n`, `\t`) and begins no tag or marker.
    plain_bytes: u128,
}

/// Trims one channel's edges: nothing before its first visible character, and whitespace
/// waits until a visible character follows it (so trailing whitespace is never sent).
#[derive(Debug, Default)]
struct Edge {
    started: bool,
    pending: String,
}

impl Edge {
    fn push(&mut self, text: &str, out: &mut Text) {
        let text = if self.started { text } else { text.trim_start() };
        let body = text.trim_end();
        if body.is_empty() {
            // Whitespace alone waits for what follows it (nothing before the first visible
            // character: `text` is empty then).
            self.pending.push_str(text);
            return;
        }
        out.push_str(&self.pending);
        self.pending.clear();
        out.push_str(body);
        self.pending.push_str(&text[body.len()..]);
        self.started = true;
    }

    /// Whether `text` comes out of [`push`](Self::push) as it is, changing nothing here.
    fn passes(&self, text: &str) -> bool {
        self.started && self.pending.is_empty() && text.ends_with(|c: char| !c.is_whitespace())
    }

    /// Ends a block: whitespace waiting at its end is dropped.
    fn close(&mut self) {
        self.pending.clear();
    }
}

impl Default for Cleaner {
    /// A cleaner of tags alone.
    fn default() -> Self {
        Self::with_markers(Vec::new())
    }
}

impl Cleaner {
    /// A cleaner that also cuts out blocks that start with one of `markers`.
    pub fn with_markers(markers: Vec<String>) -> Self {
        let markers = MarkerFilter::new(markers);
        let mut first_bytes: Vec<u8> = markers.first_bytes().chain([b'<']).collect();
        first_bytes.sort_unstable();
        first_bytes.dedup();
        let visible = (0x20..0x7f).chain([b'\n', b'\t']).fold(0u128, |bits, b: u8| bits | 1 << b);
        let plain_bytes = first_bytes.iter().filter(|b| b.is_ascii()).fold(visible, |bits, b| bits & !(1 << b));
        Self {
            markers,
            in_think: false,
            held: String::new(),
            held_thinking: String::new(),
            text: Edge::default(),
            thinking: Edge::default(),
            first_bytes,
            plain_bytes,
        }
    }

    /// The marker blocks cut out so far, and those left in the text as invalid.
    pub fn markers(&self) -> (&[Captured], &[String]) {
        (&self.markers.captured, &self.markers.invalid)
    }

    /// Cleans a chunk of the answer channel, which may carry `<think>` tags. The usual
    /// chunk (a token of the answer: every character visible, nothing held back, no tag or
    /// marker begun, nothing at its edges to trim) becomes its piece as it is.
    pub fn text(&mut self, chunk: Text, out: &mut Vec<Piece>) {
        // A chunk of plain bytes alone is visible, and holds and begins no tag or marker:
        // one look at each byte tells it.
        let plain = || chunk.bytes().all(|b| b.is_ascii() && (self.plain_bytes >> b) & 1 == 1);
        // A chunk without a tag's or a marker's first byte holds none and begins none.
        let quiet = || !chunk.bytes().any(|b| self.first_bytes.contains(&b));
        let holds_nothing = || {
            first_tag(&chunk).is_none()
                && partial_len(&chunk, OPEN) == 0
                && partial_len(&chunk, CLOSE) == 0
                && self.markers.passes(&chunk)
        };
        let whole = !self.in_think
            && self.held.is_empty()
            && self.text.passes(&chunk)
            && self.markers.idle()
            && (plain() || all_visible(&chunk) && (quiet() || holds_nothing()));
        if whole {
            out.push(Piece::Text(chunk));
        } else {
            self.text_in(&chunk, out);
        }
    }

    fn text_in(&mut self, chunk: &str, out: &mut Vec<Piece>) {
        // The usual chunk (nothing held back, every character visible) is read where it lies.
        let buffer = held_and(&mut self.held, chunk);
        let mut rest = &*buffer;
        // Either tag switches the channel; a stray one (a `</think>` with no opening, as
        // some chat templates produce) is dropped, so no tag ever reaches a client.
        while let Some((at, tag)) = first_tag(rest) {
            self.emit(&rest[..at], out);
            rest = &rest[at + tag.len()..];
            if self.in_think {
                self.thinking.close();
            }
            self.in_think = tag == OPEN;
        }
        let keep = partial_len(rest, OPEN).max(partial_len(rest, CLOSE));
        let (now, later) = rest.split_at(rest.len() - keep);
        self.emit(now, out);
        self.held.push_str(later);
    }

    /// Cleans a chunk of the provider's own reasoning channel; tags in it are dropped.
    pub fn thinking(&mut self, chunk: &str, out: &mut Vec<Piece>) {
        let buffer = held_and(&mut self.held_thinking, chunk);
        let mut rest = &*buffer;
        while let Some((at, tag)) = first_tag(rest) {
            self.push_thinking(&rest[..at], out);
            rest = &rest[at + tag.len()..];
        }
        let keep = partial_len(rest, OPEN).max(partial_len(rest, CLOSE));
        let (now, later) = rest.split_at(rest.len() - keep);
        self.push_thinking(now, out);
        self.held_thinking.push_str(later);
    }

    /// Ends the stream: a held-back fragment that never became a tag is text after all.
    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        let held = std::mem::take(&mut self.held);
        self.emit(&held, out);
        let mut rest = String::new();
        self.markers.finish(&mut rest);
        self.push_text(&rest, out);
        let held = std::mem::take(&mut self.held_thinking);
        self.push_thinking(&held, out);
    }

    /// Emits answer-channel text to whichever channel the tags have selected.
    fn emit(&mut self, text: &str, out: &mut Vec<Piece>) {
        if self.in_think {
            self.push_thinking(text, out);
        } else {
            let shown = self.markers.filter(text);
            self.push_text(&shown, out);
        }
    }

    fn push_text(&mut self, text: &str, out: &mut Vec<Piece>) {
        let mut cleaned = Text::with_capacity(self.text.pending.len() + text.len());
        self.text.push(text, &mut cleaned);
        append(out, Piece::Text(cleaned));
    }

    fn push_thinking(&mut self, text: &str, out: &mut Vec<Piece>) {
        let mut cleaned = Text::with_capacity(self.thinking.pending.len() + text.len());
        self.thinking.push(text, &mut cleaned);
        append(out, Piece::Thinking(cleaned));
    }
}

/// Appends a non-empty piece. Pieces are never merged across a removed tag, so no piece can
/// hold a tag that the removal of another one put together (`<</think>think>`).
fn append(out: &mut Vec<Piece>, piece: Piece) {
    let (Piece::Text(t) | Piece::Thinking(t)) = &piece;
    if !t.is_empty() {
        out.push(piece);
    }
}

/// Whether a character may reach a client: no control characters but `\n` and `\t`, no `␄`.
pub fn visible(c: char) -> bool {
    (!c.is_control() || c == '\n' || c == '\t') && c != '\u{2404}'
}

/// Whether every character of `text` is [`visible`]: ASCII is told by its bytes.
fn all_visible(text: &str) -> bool {
    let ascii_visible = |b: u8| (0x20..0x7f).contains(&b) || b == b'\n' || b == b'\t';
    text.bytes().all(ascii_visible) || text.chars().all(visible)
}

/// The text `held` back before and the visible characters of `chunk`: `chunk` itself where
/// nothing was held and every character is visible. `held` is left empty.
fn held_and<'a>(held: &mut String, chunk: &'a str) -> std::borrow::Cow<'a, str> {
    if held.is_empty() && all_visible(chunk) {
        return chunk.into();
    }
    let mut buffer = std::mem::take(held);
    if all_visible(chunk) {
        buffer.push_str(chunk);
    } else {
        buffer.extend(chunk.chars().filter(|c| visible(*c)));
    }
    buffer.into()
}

/// The first `<think>` or `</think>` in `text`, with its position.
fn first_tag(text: &str) -> Option<(usize, &'static str)> {
    let open = find(text, OPEN).map(|at| (at, OPEN));
    let close = find(text, CLOSE).map(|at| (at, CLOSE));
    match (open, close) {
        (Some(o), Some(c)) => Some(if o.0 < c.0 { o } else { c }),
        (o, c) => o.or(c),
    }
}

/// Runs chunks (`true` for the reasoning channel) through one cleaner; returns its pieces.
pub fn clean_chunks(chunks: &[(bool, &str)]) -> Vec<Piece> {
    let mut cleaner = Cleaner::default();
    let mut out = Vec::new();
    for (thinking, chunk) in chunks {
        if *thinking {
            cleaner.thinking(chunk, &mut out);
        } else {
            cleaner.text((*chunk).into(), &mut out);
        }
    }
    cleaner.finish(&mut out);
    out
}

/// The concatenated (text, thinking) of chunks run through one cleaner.
pub fn clean_all(chunks: &[(bool, &str)]) -> (String, String) {
    join(&clean_chunks(chunks))
}

/// The concatenated (text, thinking) of some pieces.
pub fn join(pieces: &[Piece]) -> (String, String) {
    let (mut text, mut thinking) = (String::new(), String::new());
    for piece in pieces {
        match piece {
            Piece::Text(t) => text.push_str(t),
            Piece::Thinking(t) => thinking.push_str(t),
        }
    }
    (text, thinking)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn think_tags_split_into_thinking() {
        let (text, thinking) = clean_all(&[(false, "<think>\nWeigh it.\n</think>\n\nThe answer␄\u{4}.")]);
        assert_eq!(thinking, "Weigh it.");
        assert_eq!(text, "The answer.");
    }

    #[test]
    fn a_stray_closing_tag_is_dropped() {
        assert_eq!(
            clean_all(&[(false, "reasoned</think>\n\nAnswer")]),
            ("reasoned\n\nAnswer".to_owned(), String::new())
        );
    }

    #[test]
    fn a_lone_angle_bracket_is_text() {
        assert_eq!(clean_all(&[(false, "a <b> c <thi")]).0, "a <b> c <thi");
        assert_eq!(clean_all(&[(false, "x < y"), (false, "<")]).0, "x < y<");
    }

    #[test]
    fn tabs_and_newlines_stay_other_controls_go() {
        assert_eq!(clean_all(&[(false, "a\tb\r\nc\u{1b}[0m\u{0}")]).0, "a\tb\nc[0m");
    }

    #[test]
    fn no_piece_holds_half_a_tag() {
        let mut cleaner = Cleaner::default();
        let mut out = Vec::new();
        for c in "ok <think>hm</think> done".chars() {
            cleaner.text(c.to_string().into(), &mut out);
        }
        cleaner.finish(&mut out);
        for piece in &out {
            let (Piece::Text(t) | Piece::Thinking(t)) = piece;
            assert!(!t.contains('<') && !t.contains('>'), "{out:?}");
        }
        assert_eq!(join(&out), ("ok  done".to_owned(), "hm".to_owned()));
    }

    /// Text made of the pieces that make cleaning hard.
    fn tricky() -> impl Strategy<Value = String> {
        let atoms = prop::sample::select(vec![
            "<think>", "</think>", "<", "</", "<th", "think>", ">", " ", "\n", "\t", "\r", "␄", "\u{4}", "a", "é", "→",
            "word", "😀",
        ]);
        prop::collection::vec(atoms, 0..40).prop_map(|v| v.concat())
    }

    /// Splits `text` at the given character positions.
    fn split(text: &str, cuts: &[usize]) -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
        points.sort_unstable();
        points.dedup();
        let mut pieces = Vec::new();
        let mut from = 0;
        for to in points.into_iter().chain([chars.len()]) {
            pieces.push(chars[from..to].iter().collect());
            from = to;
        }
        pieces
    }

    proptest! {
        #[test]
        fn the_fast_searches_agree_with_the_plain_ones(text in "[ab<é/]{0,12}", pattern in "[ab<é/]{1,5}") {
            let plain_partial = (1..pattern.len())
                .rev()
                .filter(|&n| pattern.is_char_boundary(n))
                .find(|&n| text.ends_with(&pattern[..n]))
                .unwrap_or(0);
            prop_assert_eq!(partial_len(&text, &pattern), plain_partial);
            prop_assert_eq!(find(&text, &pattern), text.find(pattern.as_str()));
        }

        #[test]
        fn plain_text_comes_out_trimmed_and_whole(
            text in "[ a\n\té→😀b]{0,30}",
            cuts in prop::collection::vec(0usize..40, 0..8),
        ) {
            let chunks: Vec<(bool, String)> = split(&text, &cuts).into_iter().map(|c| (false, c)).collect();
            let borrowed: Vec<(bool, &str)> = chunks.iter().map(|(t, c)| (*t, c.as_str())).collect();
            prop_assert_eq!(clean_all(&borrowed), (text.trim().to_owned(), String::new()));
        }

        #[test]
        fn the_output_does_not_depend_on_the_chunking(
            text in tricky(),
            reasoning in tricky(),
            cuts in prop::collection::vec(0usize..200, 0..12),
        ) {
            let whole = clean_all(&[(true, &reasoning), (false, &text)]);
            let mut chunks: Vec<(bool, String)> = split(&reasoning, &cuts).into_iter().map(|c| (true, c)).collect();
            chunks.extend(split(&text, &cuts).into_iter().map(|c| (false, c)));
            let borrowed: Vec<(bool, &str)> = chunks.iter().map(|(t, c)| (*t, c.as_str())).collect();
            let pieces = clean_chunks(&borrowed);
            let chunked = join(&pieces);
            prop_assert_eq!(&chunked, &whole);
            for piece in &pieces {
                let (Piece::Text(t) | Piece::Thinking(t)) = piece;
                prop_assert!(!t.contains("<think>") && !t.contains("</think>"), "{:?}", piece);
            }
            for out in [&chunked.0, &chunked.1] {
                prop_assert!(out.chars().all(visible));
                prop_assert_eq!(out.trim(), out.as_str());
            }
        }

        #[test]
        fn with_markers_the_output_does_not_depend_on_the_chunking(
            atoms in prop::collection::vec(prop::sample::select(vec![
                "SUGGESTED_VALUES:", "SUGG", "S", "$$", "$", "<think>", "</think>", "<", "[", "]", "\"a\"", ",",
                " ", "\n", "\u{4}", "word", "é",
            ]), 0..40),
            cuts in prop::collection::vec(0usize..300, 0..12),
        ) {
            // A marker that begins with a letter and one that begins with a symbol: each
            // first byte is one a plain token must not hold.
            let clean = |chunks: &[String]| {
                let mut cleaner = Cleaner::with_markers(vec!["SUGGESTED_VALUES:".to_owned(), "$$".to_owned()]);
                let mut out = Vec::new();
                for chunk in chunks {
                    cleaner.text(chunk.as_str().into(), &mut out);
                }
                cleaner.finish(&mut out);
                let (captured, invalid) = cleaner.markers();
                (join(&out), captured.to_vec(), invalid.to_vec())
            };
            let text = atoms.concat();
            prop_assert_eq!(clean(&split(&text, &cuts)), clean(&[text]));
        }
    }
}
