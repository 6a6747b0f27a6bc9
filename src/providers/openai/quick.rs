//! A token's `chat.completion.chunk`, read without serde. Every answer's every token comes in
//! one of these, and serde_json took a quarter of a run task's instructions on them (some
//! 4,000 a frame: a string scan set up for each of a dozen keys and values, a visitor per
//! field). This reader walks the frame once, skipping what chatd does not use, and gives
//! the same [`Chunk`] serde would; where it cannot be sure of that (tool calls, usage, an
//! error, an escaped key, a repeated field, anything that is not plain JSON) it declines,
//! and serde reads the frame. A property test holds the two equal on frames of every shape.
//! A stream's next frame that only changes the last one's text is not walked again
//! ([`Frames`]).

use std::borrow::Cow;

use super::{Choice, Chunk, Delta, First, Text};

/// The chunk in `data`, or `None` where serde must read it.
pub(super) fn chunk(data: &str) -> Option<Chunk<'_>> {
    let mut reader = Reader { text: data, bytes: data.as_bytes(), at: 0 };
    let chunk = reader.chunk()?;
    reader.space();
    (reader.at == reader.bytes.len()).then_some(chunk)
}

/// The frame before, where the reader took it whole and its one text was plain: the bytes
/// on either side of that text, and which field it was. A model's tokens come in frames that
/// differ only there (the same id, model, index and nulls around each token), and a frame
/// made of the same bytes around another plain text reads as that one did, with this text
/// in its place: the reader walks the same bytes through the same states to the text, finds
/// its end at the same closing quote (the text holds no quote, backslash or control
/// character), and walks the same bytes after it. So such a frame is two comparisons and one
/// scan of its text. A frame whose last member is a plain string (OpenAI's `obfuscation`,
/// random in every frame, padding its length) has that string as a second place that may
/// differ: the reader skips it whatever it holds, and a plain string ends at its first quote.
#[derive(Default)]
pub(super) struct Frames {
    before: String,
    after: String,
    /// Where the frame's last member is a plain string: its inside, as offsets into `after`.
    last: Option<(usize, usize)>,
    field: Option<Field>,
}

/// A delta's text field.
#[derive(Clone, Copy)]
enum Field {
    Content,
    ReasoningContent,
    Reasoning,
}

impl Frames {
    /// The chunk in `data`, as [`chunk`] reads it, kept for the next frame to be read like it.
    pub(super) fn chunk<'a>(&mut self, data: &'a str) -> Option<Chunk<'a>> {
        let chunk = chunk(data)?;
        self.remember(data, &chunk);
        Some(chunk)
    }

    /// The chunk in `data` (a frame's bytes, not yet known to be UTF-8) where it is the last
    /// frame's bytes around another plain text, or `None`, for [`chunk`](Self::chunk) to read.
    /// Only the bytes that differ from the last frame's are checked for UTF-8 (the rest are
    /// the last frame's, read as text): the text, and the last string where it differs.
    pub(super) fn like_the_last<'a>(&self, data: &'a [u8]) -> Option<Chunk<'a>> {
        let field = self.field?;
        let rest = data.strip_prefix(self.before.as_bytes())?;
        let text = match rest.strip_suffix(self.after.as_bytes()) {
            Some(text) if special(text, 0).is_none() => text,
            _ => self.text_before_another_last_string(rest)?,
        };
        let text = Text(Some(Cow::Borrowed(std::str::from_utf8(text).ok()?)));
        let mut delta = Delta::default();
        match field {
            Field::Content => delta.content = text,
            Field::ReasoningContent => delta.reasoning_content = text,
            Field::Reasoning => delta.reasoning = text,
        }
        Some(Chunk { choices: First(Some(Choice { delta, finish_reason: Text(None) })), usage: None, error: None })
    }

    /// The text of `rest` (a frame after `before`) where the frame's last string differs
    /// from the last frame's: the text ends at its first special byte, which must be the
    /// quote `after` starts with, and the new last string must be plain too. Apart, so that
    /// the frames of servers that do not vary it read as quickly as before.
    #[inline(never)]
    fn text_before_another_last_string<'a>(&self, rest: &'a [u8]) -> Option<&'a [u8]> {
        let (from, to) = self.last?;
        let rest = rest.strip_suffix(&self.after.as_bytes()[to..])?;
        let (text, rest) = rest.split_at(special(rest, 0)?);
        let last = rest.strip_prefix(&self.after.as_bytes()[..from])?;
        (special(last, 0).is_none() && std::str::from_utf8(last).is_ok()).then_some(text)
    }

    /// Keeps `data`'s bytes around its text where `chunk`, read from it whole, is one plain
    /// text and nothing else; forgets the last frame otherwise.
    fn remember(&mut self, data: &str, chunk: &Chunk<'_>) {
        self.field = None;
        let Some(Choice { delta, finish_reason: Text(None) }) = &chunk.choices.0 else { return };
        if !delta.tool_calls.is_empty() {
            return;
        }
        // A borrowed text is a plain string's inside, between its quotes in `data`.
        let (field, text) = match (&delta.content.0, &delta.reasoning_content.0, &delta.reasoning.0) {
            (Some(Cow::Borrowed(text)), None, None) => (Field::Content, *text),
            (None, Some(Cow::Borrowed(text)), None) => (Field::ReasoningContent, *text),
            (None, None, Some(Cow::Borrowed(text))) => (Field::Reasoning, *text),
            _ => return,
        };
        let start = text.as_ptr() as usize - data.as_ptr() as usize;
        self.before.clear();
        self.before.push_str(&data[..start]);
        self.after.clear();
        self.after.push_str(&data[start + text.len()..]);
        self.last = last_string(&self.after);
        self.field = Some(field);
    }
}

/// Where the frame ending with `after` (read whole, so valid JSON) ends with a member whose
/// value is a plain string: that string's inside, as offsets into `after`. The byte before
/// the frame's closing brace is then that string's closing quote, and the quote before it
/// its opening one (a plain string holds none), which follows a colon, as an opening quote
/// does; an escaped quote follows a backslash.
fn last_string(after: &str) -> Option<(usize, usize)> {
    let body = after.trim_end().strip_suffix('}')?.trim_end().strip_suffix('"')?;
    let open = body.rfind('"')?;
    let inside = &body[open + 1..];
    let key = body[..open].trim_end().strip_suffix(':')?.trim_end();
    (key.ends_with('"') && special(inside.as_bytes(), 0).is_none()).then_some((open + 1, body.len()))
}

/// Nesting past this depth is left to serde (whose own limit is 128).
const MAX_DEPTH: usize = 64;

struct Reader<'a> {
    text: &'a str,
    bytes: &'a [u8],
    at: usize,
}

/// The first quote, backslash or control character in `bytes` from `at` on: eight bytes at
/// a time (the bits of a word's bytes that are one of them are set by the borrows of a
/// subtraction; only bits above a true one can be set falsely, so the lowest is right).
fn special(bytes: &[u8], mut at: usize) -> Option<usize> {
    const ONES: u64 = u64::MAX / 255;
    const HIGH: u64 = ONES << 7;
    while let Some(word) = bytes.get(at..at + 8) {
        let word = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        let control = word.wrapping_sub(ONES * 0x20) & !word;
        let quote = word ^ (ONES * u64::from(b'"'));
        let backslash = word ^ (ONES * u64::from(b'\\'));
        let found = (control | quote.wrapping_sub(ONES) & !quote | backslash.wrapping_sub(ONES) & !backslash) & HIGH;
        if found != 0 {
            return Some(at + (found.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    let rest = bytes.get(at..)?;
    rest.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20).map(|i| at + i)
}

/// Marks a field seen; `None` the second time (serde refuses a repeated field).
fn once(seen: &mut bool) -> Option<()> {
    (!std::mem::replace(seen, true)).then_some(())
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// Skips space, then takes `byte`.
    fn take(&mut self, byte: u8) -> Option<()> {
        self.space();
        (self.peek()? == byte).then(|| self.at += 1)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.bytes[self.at..].starts_with(word).then(|| self.at += word.len())
    }

    /// A `null` value (after space).
    fn null(&mut self) -> Option<()> {
        self.space();
        self.literal(b"null")
    }

    /// Whether the next value is `null`, which is then read.
    fn is_null(&mut self) -> bool {
        self.null().is_some()
    }

    /// An object: each member's key handed to `member`, which reads its value.
    fn object(&mut self, mut member: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        self.take(b'{')?;
        self.space();
        if self.peek()? == b'}' {
            self.at += 1;
            return Some(());
        }
        loop {
            self.space();
            let key = self.plain()?;
            self.take(b':')?;
            member(self, key)?;
            self.space();
            match self.peek()? {
                b',' => self.at += 1,
                b'}' => {
                    self.at += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// The rest of an array whose first item has been read: its other items, skipped.
    fn rest_of_array(&mut self, depth: usize) -> Option<()> {
        loop {
            self.space();
            match self.peek()? {
                b',' => {
                    self.at += 1;
                    self.skip(depth)?;
                }
                b']' => {
                    self.at += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// The index of the closing quote of a string without escapes or control characters
    /// that opens here: `None` for any other (serde checks escapes, and refuses control
    /// characters).
    #[inline]
    fn plain_end(&self) -> Option<usize> {
        let end = special(self.bytes, self.at + 1)?;
        (self.bytes[end] == b'"').then_some(end)
    }

    /// A string value: borrowed where it has no escapes, else read by serde_json (which
    /// checks them).
    fn string(&mut self) -> Option<Cow<'a, str>> {
        if let Some(end) = self.plain_end() {
            let text = self.text.get(self.at + 1..end)?;
            self.at = end + 1;
            return Some(Cow::Borrowed(text));
        }
        let mut end = self.at + 1;
        loop {
            end = special(self.bytes, end)?;
            match self.bytes[end] {
                b'"' => break,
                b'\\' => end += 2,
                _ => return None,
            }
        }
        let quoted = self.text.get(self.at..=end)?;
        self.at = end + 1;
        serde_json::from_str::<String>(quoted).ok().map(Cow::Owned)
    }

    /// A key, or a string skipped, without escapes (an escaped key may spell one chatd
    /// reads, and an escape is serde's to check).
    #[inline]
    fn plain(&mut self) -> Option<&'a str> {
        if self.peek()? != b'"' {
            return None;
        }
        let end = self.plain_end()?;
        let text = self.text.get(self.at + 1..end)?;
        self.at = end + 1;
        Some(text)
    }

    /// A string or `null`, as [`Text`] reads it; other values are left to serde.
    fn text(&mut self) -> Option<Text<'a>> {
        self.space();
        match self.peek()? {
            b'"' => Some(Text(Some(self.string()?))),
            _ => self.null().map(|()| Text(None)),
        }
    }

    /// A number, as JSON spells one.
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek()? {
            b'0' => self.at += 1,
            b'1'..=b'9' => self.digits()?,
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            self.digits()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            self.digits()?;
        }
        Some(())
    }

    fn digits(&mut self) -> Option<()> {
        let from = self.at;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.at += 1;
        }
        (self.at > from).then_some(())
    }

    /// Any JSON value, read for its end only.
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.space();
        match self.peek()? {
            b'"' => self.plain().map(drop),
            b'{' => self.object(|reader, _| reader.skip(depth + 1)),
            b'[' => {
                self.at += 1;
                self.space();
                if self.peek()? == b']' {
                    self.at += 1;
                    return Some(());
                }
                self.skip(depth + 1)?;
                self.rest_of_array(depth + 1)
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn chunk(&mut self) -> Option<Chunk<'a>> {
        let mut choices = First::default();
        let (mut seen_choices, mut seen_usage, mut seen_error) = (false, false, false);
        self.object(|reader, key| match key {
            "choices" => {
                once(&mut seen_choices)?;
                choices = reader.choices()?;
                Some(())
            }
            // Usage and errors come once a stream, at most: serde reads those frames.
            "usage" => once(&mut seen_usage).and_then(|()| reader.null()),
            "error" => once(&mut seen_error).and_then(|()| reader.null()),
            _ => reader.skip(1),
        })?;
        Some(Chunk { choices, usage: None, error: None })
    }

    fn choices(&mut self) -> Option<First<Choice<'a>>> {
        if self.is_null() {
            return Some(First(None));
        }
        self.take(b'[')?;
        self.space();
        if self.peek()? == b']' {
            self.at += 1;
            return Some(First(None));
        }
        let choice = self.choice()?;
        self.rest_of_array(2)?;
        Some(First(Some(choice)))
    }

    fn choice(&mut self) -> Option<Choice<'a>> {
        let (mut delta, mut finish_reason) = (Delta::default(), Text(None));
        let (mut seen_delta, mut seen_finish) = (false, false);
        self.object(|reader, key| match key {
            "delta" => {
                once(&mut seen_delta)?;
                if !reader.is_null() {
                    delta = reader.delta()?;
                }
                Some(())
            }
            "finish_reason" => {
                once(&mut seen_finish)?;
                finish_reason = reader.text()?;
                Some(())
            }
            _ => reader.skip(3),
        })?;
        Some(Choice { delta, finish_reason })
    }

    fn delta(&mut self) -> Option<Delta<'a>> {
        let mut delta = Delta::default();
        let mut seen = [false; 4];
        self.object(|reader, key| {
            let (field, slot) = match key {
                "content" => (&mut delta.content, 0),
                "reasoning_content" => (&mut delta.reasoning_content, 1),
                "reasoning" => (&mut delta.reasoning, 2),
                // Tool calls are read by serde.
                "tool_calls" => return once(&mut seen[3]).and_then(|()| reader.null()),
                _ => return reader.skip(4),
            };
            once(&mut seen[slot])?;
            *field = reader.text()?;
            Some(())
        })?;
        Some(delta)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;

    /// What serde makes of `data`.
    fn serde(data: &str) -> Result<Chunk<'_>, String> {
        serde_json::from_str(data).map_err(|e| e.to_string())
    }

    #[test]
    fn tokens_as_servers_send_them_are_read_here() {
        for data in [
            // The bench's mock, OpenAI (with its obfuscation field), a first and a last frame.
            r#"{"id":"chatcmpl-mock","object":"chat.completion.chunk","created":0,"model":"mock-1","choices":[{"index":0,"delta":{"content":" tok5"},"finish_reason":null}]}"#,
            r#"{"id":"chatcmpl-B9MBs8","object":"chat.completion.chunk","created":1741569952,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_06737a9306","choices":[{"index":0,"delta":{"content":" world \"quoted\"\n"},"logprobs":null,"finish_reason":null}],"usage":null,"obfuscation":"xYz12"}"#,
            r#"{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "", "refusal": null}, "logprobs": null, "finish_reason": null}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"created":1.5e9}"#,
            r#" {"choices":[{"delta":{"reasoning_content":"Hm\u00e9"}}]} "#,
        ] {
            let quick = chunk(data).unwrap_or_else(|| panic!("declined {data}"));
            assert_eq!(Ok(&quick), serde(data).as_ref(), "{data}");
        }
    }

    #[test]
    fn what_serde_must_read_is_left_to_it() {
        for data in [
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":3}}"#,
            r#"{"error":{"message":"overloaded"}}"#,
            r#"{"choices":[{"delta":{"content":"a","content":"b"}}]}"#,
            r#"{"choi\u0063es":[]}"#,
            r#"{"choices":[{"delta":{"content":["part"]}}]}"#,
            r#"{"choices":[{"delta":{"content":"a"}}]} x"#,
            r#"{"id": 01, "choices": []}"#,
            "{\"choices\":[{\"delta\":{\"content\":\"raw \u{1} control\"}}]}",
            r#"[[], null, null]"#,
        ] {
            assert_eq!(chunk(data), None, "{data}");
        }
    }

    /// JSON values of every kind, as servers put in fields chatd skips.
    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
            "[a-z \"\\\\é😀\u{1}/]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 12, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
                prop::collection::vec(("[a-z_]{1,8}", inner), 0..3)
                    .prop_map(|members| Value::Object(members.into_iter().collect())),
            ]
        })
    }

    /// What a text field may hold.
    fn text() -> impl Strategy<Value = Value> {
        prop_oneof![
            4 => "[a-z \"\\\\\n\té→😀\u{7f}]{0,10}".prop_map(Value::String),
            1 => Just(Value::Null),
            1 => value(),
        ]
    }

    /// An object of the given members in a shuffled order, some left out.
    fn members(fields: Vec<(&'static str, BoxedStrategy<Value>)>) -> impl Strategy<Value = String> {
        let fields: Vec<_> = fields
            .into_iter()
            .map(|(name, value)| prop::option::weighted(0.7, value).prop_map(move |v| v.map(|v| (name, v))))
            .collect();
        (fields, prop::collection::vec(("[a-z_]{1,8}", value()), 0..3), any::<prop::sample::Index>()).prop_map(
            |(known, extra, turn)| {
                let mut members: Vec<String> = known
                    .into_iter()
                    .flatten()
                    .map(|(name, value)| format!("{}:{value}", json!(name)))
                    .chain(extra.into_iter().map(|(name, value)| format!("{}:{value}", json!(name))))
                    .collect();
                if !members.is_empty() {
                    let turn = turn.index(members.len());
                    members.rotate_left(turn);
                }
                format!("{{{}}}", members.join(" , "))
            },
        )
    }

    /// Frames of the shapes chunks take, and of shapes they should not.
    fn frame() -> impl Strategy<Value = String> {
        let delta = members(vec![
            ("content", text().boxed()),
            ("reasoning_content", text().boxed()),
            ("reasoning", text().boxed()),
            ("role", Just(json!("assistant")).boxed()),
            ("tool_calls", prop_oneof![Just(Value::Null), value()].boxed()),
        ]);
        let delta = prop_oneof![4 => delta, 1 => Just("null".to_owned())];
        let choice = (delta, text())
            .prop_map(|(delta, finish)| format!("{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish}}}"));
        let choices = prop_oneof![
            4 => (choice, prop::collection::vec(value(), 0..2)).prop_map(|(first, rest)| {
                let rest: String = rest.iter().map(|v| format!(",{v}")).collect();
                format!("[{first}{rest}]")
            }),
            1 => Just("[]".to_owned()),
            1 => Just("null".to_owned()),
            1 => value().prop_map(|v| v.to_string()),
        ];
        let frame = (
            choices,
            members(vec![
                ("id", Just(json!("chatcmpl-1")).boxed()),
                ("usage", prop_oneof![Just(Value::Null), value()].boxed()),
                ("error", prop_oneof![4 => Just(Value::Null), 1 => value()].boxed()),
            ]),
        )
            .prop_map(|(choices, rest)| match rest.as_str() {
                "{}" => format!("{{\"choices\":{choices}}}"),
                _ => format!("{{\"choices\":{choices},{}", &rest[1..]),
            });
        // Some frames cut short or with a byte changed: malformed JSON.
        (frame, any::<prop::sample::Index>(), 0u8..8).prop_map(|(frame, at, how)| {
            let at = at.index(frame.len() + 1);
            let at = (0..=at).rev().find(|&i| frame.is_char_boundary(i)).unwrap_or(0);
            match how {
                0 => frame[..at].to_owned(),
                1 => format!("{}{}", &frame[..at], &frame[at..].replacen(['"', ':', ',', '}'], "", 1)),
                _ => frame,
            }
        })
    }

    /// `frame`'s bytes with each `#` made 0xff, which is never UTF-8.
    fn not_utf8(frame: &str) -> Vec<u8> {
        frame.bytes().map(|b| if b == b'#' { 0xff } else { b }).collect()
    }

    #[test]
    fn a_frame_that_changes_only_the_last_ones_text_is_read_without_a_walk() {
        let token = |text: &str| {
            format!(
                r#"{{"id":"chatcmpl-mock","object":"chat.completion.chunk","created":0,"model":"mock-1","choices":[{{"index":0,"delta":{{"reasoning":{}}},"finish_reason":null}}]}}"#,
                json!(text)
            )
        };
        let mut frames = Frames::default();
        let first = token(" tok1");
        assert_eq!(Ok(frames.chunk(&first).expect("read")), serde(&first));
        for text in [" tok2", "", "é😀 and more"] {
            let next = token(text);
            let quick = frames.like_the_last(next.as_bytes()).unwrap_or_else(|| panic!("walked {next}"));
            assert_eq!(Ok(quick), serde(&next), "{next}");
        }
        assert!(frames.like_the_last(&not_utf8(&token("a#b"))).is_none(), "a byte not UTF-8: read whole");
        // A text with an escape is read whole (and its frame then not kept: its text is owned).
        let escaped = token("say \"hi\"");
        assert!(frames.like_the_last(escaped.as_bytes()).is_none());
        assert_eq!(Ok(frames.chunk(&escaped).expect("read")), serde(&escaped));
        assert!(frames.field.is_none());
        // The last frame, with its finish reason, is not kept either; the one before it is forgotten.
        frames.chunk(&first);
        let last = r#"{"id":"chatcmpl-mock","object":"chat.completion.chunk","created":0,"model":"mock-1","choices":[{"index":0,"delta":{"reasoning":" tok3"},"finish_reason":"stop"}]}"#;
        assert!(frames.like_the_last(last.as_bytes()).is_none());
        assert_eq!(Ok(frames.chunk(last).expect("read")), serde(last));
        assert!(frames.like_the_last(token(" tok4").as_bytes()).is_none());
    }

    #[test]
    fn openais_frames_whose_text_and_obfuscation_differ_are_read_without_a_walk() {
        let token = |text: &str, obfuscation: &str| {
            format!(
                r#"{{"id":"chatcmpl-B9MBs8","object":"chat.completion.chunk","created":1741569952,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_06737a9306","choices":[{{"index":0,"delta":{{"content":{}}},"logprobs":null,"finish_reason":null}}],"obfuscation":{}}}"#,
                json!(text),
                json!(obfuscation)
            )
        };
        let mut frames = Frames::default();
        let first = token(" Hello", "Qx3");
        assert_eq!(Ok(frames.chunk(&first).expect("read")), serde(&first));
        assert_eq!(frames.last.map(|(from, to)| &frames.after[from..to]), Some("Qx3"));
        for (text, obfuscation) in [(" world", "a"), ("", "Zk93mPq0"), ("é😀", "")] {
            let next = token(text, obfuscation);
            let quick = frames.like_the_last(next.as_bytes()).unwrap_or_else(|| panic!("walked {next}"));
            assert_eq!(Ok(quick), serde(&next), "{next}");
        }
        // An escape in either place: read whole.
        for (text, obfuscation) in [("say \"hi\"", "x"), (" ok", "a\"b"), (" ok", "a\nb")] {
            let next = token(text, obfuscation);
            assert!(frames.like_the_last(next.as_bytes()).is_none(), "{next}");
        }
        // A byte that is not UTF-8 in either place (`#` made 0xff): left to the whole frame's check.
        for (text, obfuscation) in [("#", "x"), (" ok", "#"), (" é#", "a#")] {
            let next = not_utf8(&token(text, obfuscation));
            assert!(frames.like_the_last(&next).is_none(), "{}", String::from_utf8_lossy(&next));
        }
        // A frame whose last member is not a string keeps no last string.
        let usage_last =
            r#"{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}],"x":"y","usage":null}"#;
        assert_eq!(Ok(frames.chunk(usage_last).expect("read")), serde(usage_last));
        assert!(frames.last.is_none());
    }

    /// A token's frame: one text field in the delta, among others chatd skips.
    fn token() -> impl Strategy<Value = String> {
        let field = prop::sample::select(vec!["content", "reasoning_content", "reasoning"]);
        // The last member: any value, half the time a string as OpenAI's `obfuscation` is.
        let extra = prop_oneof![value(), "[a-zA-Z0-9\"\\\\]{0,12}".prop_map(Value::String)];
        (field, "[a-z é😀]{0,6}", members(vec![("role", Just(json!("assistant")).boxed())]), extra).prop_map(
            |(field, text, others, extra)| {
                let delta = match others.as_str() {
                    "{}" => format!("{{{}:{}}}", json!(field), json!(text)),
                    _ => format!("{{{}:{},{}", json!(field), json!(text), &others[1..]),
                };
                format!(
                    r#"{{"id":"c1","choices":[{{"index":0,"delta":{delta},"finish_reason":null}}],"x" : {extra} }}"#
                )
            },
        )
    }

    /// What goes between a text's quotes: JSON-escaped or raw (a quote or backslash of its own
    /// makes another frame, often malformed).
    fn inside() -> impl Strategy<Value = String> {
        let text = "[a-z \"\\\\\n\té→😀\u{7f}\u{1}]{0,10}";
        prop_oneof![text.prop_map(|t| json!(t).to_string().trim_matches('"').to_owned()), text.prop_map(String::from),]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn what_is_read_here_is_what_serde_reads(data in frame()) {
            if let Some(quick) = chunk(&data) {
                prop_assert_eq!(Ok(quick), serde(&data), "{}", data);
            }
        }

        #[test]
        fn a_frame_read_after_another_is_what_serde_reads(
            first in prop_oneof![token(), frame()],
            other in frame(),
            text in inside(),
            last in inside(),
            like in any::<bool>(),
        ) {
            let mut frames = Frames::default();
            frames.chunk(&first);
            // Half the time, where the first was kept: its bytes around another text (and
            // another last string, where it ends with one).
            let next = match (frames.field, frames.last, like) {
                (Some(_), None, true) => format!("{}{text}{}", frames.before, frames.after),
                (Some(_), Some((from, to)), true) => {
                    format!("{}{text}{}{last}{}", frames.before, &frames.after[..from], &frames.after[to..])
                }
                _ => other,
            };
            if let Some(quick) = frames.like_the_last(next.as_bytes()).or_else(|| frames.chunk(&next)) {
                prop_assert_eq!(Ok(quick), serde(&next), "{} after {}", next, first);
            }
        }
    }
}
