//! What a file is, read from its bytes as they stream past (CONTRACT.md §14): the magic
//! numbers say which image or PDF it is (`infer`), an image's header its size (`imagesize`),
//! its last bytes whether it is whole; a file that is UTF-8 from end to end is text. The
//! client's word is never taken for the type; the name's extension only tells one kind of
//! text from another, and a name that claims another kind than the bytes is refused.

/// Bytes kept from the start of a file: enough for every header read here.
const HEAD: usize = 64 * 1024;
/// Bytes kept from the end: enough for every trailer read here.
const TAIL: usize = 1024;

/// The kinds chatd takes, and their media types.
pub const ACCEPTED: &str = "PNG, JPEG, GIF, WebP, PDF, or UTF-8 text (plain, Markdown, CSV, JSON)";

/// A file's kind, once all of it was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kind {
    pub media_type: &'static str,
    pub width: Option<u32>,
    pub height: Option<u32>,
}

/// Reads a file's kind from its bytes, fed in order in pieces of any size.
#[derive(Debug, Default)]
pub struct Sniffer {
    head: Vec<u8>,
    tail: Vec<u8>,
    size: u64,
    /// Whether every byte so far is UTF-8 text without NULs.
    text: bool,
    /// The start of a UTF-8 character cut by the end of the last piece.
    carry: Vec<u8>,
    /// Whether a JPEG's end marker (`FF D9`) was seen after its start: phones append data
    /// after it (Samsung's trailer, a motion photo's video), so it need not be last.
    jpeg_end: bool,
    /// The last byte of the previous piece (a marker may span two pieces).
    last: Option<u8>,
}

impl Sniffer {
    pub fn new() -> Self {
        Self { text: true, ..Self::default() }
    }

    pub fn feed(&mut self, piece: &[u8]) {
        self.size += piece.len() as u64;
        if self.head.len() < HEAD {
            let room = HEAD - self.head.len();
            self.head.extend_from_slice(&piece[..piece.len().min(room)]);
        }
        if piece.len() >= TAIL {
            self.tail.clear();
            self.tail.extend_from_slice(&piece[piece.len() - TAIL..]);
        } else {
            self.tail.extend_from_slice(piece);
            let excess = self.tail.len().saturating_sub(TAIL);
            self.tail.drain(..excess);
        }
        if self.text {
            self.check_text(piece);
        }
        if !self.jpeg_end && self.head.starts_with(&[0xFF, 0xD8]) {
            let skip = if self.size == piece.len() as u64 { 2 } else { 0 };
            let spans = self.last == Some(0xFF) && piece.first() == Some(&0xD9);
            self.jpeg_end = spans || piece.get(skip..).is_some_and(|rest| rest.windows(2).any(|w| w == [0xFF, 0xD9]));
        }
        self.last = piece.last().copied().or(self.last);
    }

    fn check_text(&mut self, piece: &[u8]) {
        if piece.contains(&0) {
            self.text = false;
            return;
        }
        let joined;
        let bytes = if self.carry.is_empty() {
            piece
        } else {
            joined = [std::mem::take(&mut self.carry).as_slice(), piece].concat();
            &joined[..]
        };
        match std::str::from_utf8(bytes) {
            Ok(_) => {}
            // A character cut by the piece's end: its start waits for the next piece.
            Err(e) if e.error_len().is_none() => self.carry = bytes[e.valid_up_to()..].to_vec(),
            Err(_) => self.text = false,
        }
    }

    /// Bytes seen so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The file's kind, or why it is refused. `name` is the file's name as given.
    pub fn finish(self, name: &str) -> Result<Kind, String> {
        if self.size == 0 {
            return Err(format!("{name} is empty"));
        }
        let claimed = claimed_kind(name);
        // The kinds chatd takes first: `infer` also names kinds by loose matches (`BM` is a
        // bitmap, `<p ` HTML), which text may start with.
        let found = infer::get(&self.head).map(|t| t.mime_type());
        let media_type = match found {
            Some(t @ ("image/png" | "image/jpeg" | "image/gif" | "image/webp" | "application/pdf")) => t,
            _ if self.text && self.carry.is_empty() => {
                if let Some(claimed) = claimed.filter(|c| !c.starts_with("text/") && *c != "application/json") {
                    return Err(format!("{name} is not {} but text", article(claimed)));
                }
                return Ok(Kind { media_type: text_type(name), width: None, height: None });
            }
            Some(other) => return Err(format!("{name} is {other}, which chatd does not take: send {ACCEPTED}")),
            None => return Err(format!("{name} is not a kind of file chatd takes: send {ACCEPTED}")),
        };
        if let Some(claimed) = claimed.filter(|c| *c != media_type && !c.starts_with("text/")) {
            return Err(format!("{name} is not {} but {}", article(claimed), article(media_type)));
        }
        if media_type == "application/pdf" {
            if !contains(&self.tail, b"%%EOF") {
                return Err(format!("{name} is not a whole PDF: its end is missing"));
            }
            return Ok(Kind { media_type, width: None, height: None });
        }
        let size = imagesize::blob_size(&self.head)
            .map_err(|_| format!("{name} is not a readable {media_type} image: its header is damaged"))?;
        if !self.image_is_whole(media_type) {
            return Err(format!(
                "{name} is not a whole {media_type} image: it is cut short or is another kind of file"
            ));
        }
        let dimension = |d: usize| u32::try_from(d).ok().filter(|d| *d > 0);
        match (dimension(size.width), dimension(size.height)) {
            (Some(width), Some(height)) => Ok(Kind { media_type, width: Some(width), height: Some(height) }),
            _ => Err(format!("{name} is not a readable {media_type} image: it has no size")),
        }
    }

    /// Whether an image's last bytes are the ones its format ends with.
    fn image_is_whole(&self, media_type: &str) -> bool {
        let end = trim_padding(&self.tail);
        match media_type {
            // The IEND chunk: length 0, type, CRC.
            "image/png" => end.ends_with(&[0, 0, 0, 0, b'I', b'E', b'N', b'D', 0xAE, 0x42, 0x60, 0x82]),
            "image/jpeg" => self.jpeg_end || end.ends_with(&[0xFF, 0xD9]),
            "image/gif" => end.ends_with(&[0x3B]),
            // A RIFF file says its own length (after the first 8 bytes), padded to even.
            "image/webp" => self.head.get(4..8).is_some_and(|riff| {
                let said = u64::from(u32::from_le_bytes([riff[0], riff[1], riff[2], riff[3]])) + 8;
                said == self.size || said + 1 == self.size
            }),
            _ => false,
        }
    }
}

/// Some writers pad a file's end with zeros or line ends.
fn trim_padding(bytes: &[u8]) -> &[u8] {
    let end = bytes.iter().rposition(|b| !matches!(b, 0 | b'\n' | b'\r' | b' ')).map_or(0, |i| i + 1);
    &bytes[..end]
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn extension(name: &str) -> String {
    name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase()).unwrap_or_default()
}

/// The kind a name's extension claims, where it names one chatd knows.
fn claimed_kind(name: &str) -> Option<&'static str> {
    Some(match extension(name).as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "pdf" => "application/pdf",
        "txt" | "text" => "text/plain",
        "md" | "markdown" => "text/markdown",
        "csv" => "text/csv",
        "json" => "application/json",
        _ => return None,
    })
}

/// Which text: the extension tells (the bytes cannot); plain text otherwise.
fn text_type(name: &str) -> &'static str {
    match claimed_kind(name) {
        Some(t @ ("text/markdown" | "text/csv" | "application/json")) => t,
        _ => "text/plain",
    }
}

fn article(media_type: &str) -> &'static str {
    match media_type {
        "image/png" => "a PNG image",
        "image/jpeg" => "a JPEG image",
        "image/gif" => "a GIF image",
        "image/webp" => "a WebP image",
        "application/pdf" => "a PDF",
        _ => "text",
    }
}

/// Checks a file's name as a client gave it: a name, not a path, printable, at most 255 bytes.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.trim().is_empty() {
        return Err("A file name cannot be empty".into());
    }
    if name.len() > 255 {
        return Err("A file name is at most 255 bytes".into());
    }
    if name.chars().any(char::is_control) {
        return Err(format!("The file name {name:?} holds control characters"));
    }
    if name.contains('/') || name.contains('\\') || name == "." || name == ".." {
        return Err(format!("The file name {name:?} is a path: give the file's name alone"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A 2×1 PNG, whole.
    pub const PNG: &[u8] = &[
        0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A, 0, 0, 0, 0x0D, 0x49, 0x48, 0x44, 0x52, 0, 0, 0, 2, 0, 0, 0, 1,
        8, 2, 0, 0, 0, 0x7B, 0x40, 0xE8, 0xDD, 0, 0, 0, 0x0F, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9C, 0x63, 0xF8, 0xCF,
        0xC0, 0xF0, 0x1F, 0, 0x05, 0x00, 0x01, 0xFF, 0x56, 0x2C, 0x4F, 0x5F, 0, 0, 0, 0, 0x49, 0x45, 0x4E, 0x44, 0xAE,
        0x42, 0x60, 0x82,
    ];

    fn sniff(bytes: &[u8], name: &str) -> Result<Kind, String> {
        let mut s = Sniffer::new();
        s.feed(bytes);
        s.finish(name)
    }

    #[test]
    fn images_pdfs_and_text_are_told_by_their_bytes() {
        assert_eq!(sniff(PNG, "a.png"), Ok(Kind { media_type: "image/png", width: Some(2), height: Some(1) }));
        // The extension does not matter to a picture's kind when it names text.
        assert_eq!(sniff(PNG, "notes.txt").unwrap().media_type, "image/png");
        assert_eq!(sniff(b"%PDF-1.4\n1 0 obj\n%%EOF\n", "r.pdf").unwrap().media_type, "application/pdf");
        assert_eq!(sniff("a,b\n1,2\n".as_bytes(), "t.csv").unwrap().media_type, "text/csv");
        assert_eq!(sniff("# Title ✓".as_bytes(), "README.md").unwrap().media_type, "text/markdown");
        assert_eq!(sniff(b"{\"a\": 1}", "x.json").unwrap().media_type, "application/json");
        assert_eq!(sniff(b"hello", "hello").unwrap().media_type, "text/plain");
    }

    #[test]
    fn bad_files_are_refused_with_a_reason() {
        let mut zip_as_png = PNG[..33].to_vec();
        zip_as_png.extend_from_slice(b"PK\x03\x04 and then a zip archive's bytes");
        for (bytes, name, why) in [
            (&b""[..], "empty.txt", "is empty"),
            (&zip_as_png[..], "z.png", "not a whole image/png"),
            (&PNG[..40], "cut.png", "not a whole image/png"),
            (&b"%PDF-1.4\n1 0 obj"[..], "cut.pdf", "not a whole PDF"),
            (&b"just words"[..], "fake.pdf", "is not a PDF but text"),
            (&b"PK\x03\x04\x14\x00\x00\x00\x08\x00"[..], "a.zip", "application/zip"),
            (&[0xFF, 0xFE, 0x00, 0x41][..], "bin.txt", "not a kind of file"),
        ] {
            let error = sniff(bytes, name).unwrap_err();
            assert!(error.contains(why), "{name}: {error}");
        }
        assert!(sniff(PNG, "photo.jpg").unwrap_err().contains("is not a JPEG image but a PNG image"));
    }

    #[test]
    fn text_that_starts_like_another_kind_is_text_and_a_jpeg_may_have_a_trailer() {
        assert_eq!(sniff(b"BMI,weight\n22,70\n", "health.csv").unwrap().media_type, "text/csv");
        assert_eq!(sniff(b"<p align=\"center\">Logo</p>\n", "README.md").unwrap().media_type, "text/markdown");
        let mut jpeg = vec![0xFF, 0xD8, 0xFF, 0xE0, 0, 16, b'J', b'F', b'I', b'F', 0, 1, 1, 0, 0, 1, 0, 1, 0, 0];
        jpeg.extend_from_slice(&[0xFF, 0xC0, 0, 11, 8, 0, 2, 0, 3, 1, 1, 0x11, 0, 0xFF, 0xD9]);
        let mut with_trailer = jpeg.clone();
        with_trailer.extend_from_slice(b"SEFT samsung trailer data that follows the image");
        assert_eq!(sniff(&with_trailer, "phone.jpg").unwrap().media_type, "image/jpeg");
        assert!(sniff(&jpeg[..jpeg.len() - 2], "cut.jpg").is_err(), "no end marker: cut short");
    }

    #[test]
    fn names_must_be_names() {
        assert!(check_name("report (final).pdf").is_ok());
        for bad in ["../../x", "a/b.png", "c:\\x.png", "..", "", "tab\there", "bell\u{7}"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        /// Any way of cutting the bytes into pieces gives the same verdict as one piece.
        #[test]
        fn the_verdict_does_not_depend_on_the_pieces(
            text in "\\PC{0,300}",
            image in any::<bool>(),
            cuts in proptest::collection::vec(0usize..400, 0..8),
        ) {
            let bytes: Vec<u8> = if image { PNG.to_vec() } else { text.into_bytes() };
            let whole = sniff(&bytes, "f");
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.sort_unstable();
            let mut s = Sniffer::new();
            let mut at = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                s.feed(&bytes[at..cut]);
                at = cut;
            }
            prop_assert_eq!(s.finish("f"), whole);
        }
    }
}
