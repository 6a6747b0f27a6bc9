//! Scans for tags and markers in streamed text, shared by the cleaner (`clean`) and the
//! marker filter (`markers`).

/// Where `pattern` first occurs in `text`. Runs once per token for every tag and marker,
/// and nearly always finds nothing: a scan for the first byte answers that before a
/// substring search is set up.
pub fn find(text: &str, pattern: &str) -> Option<usize> {
    let first = *pattern.as_bytes().first()?;
    if !text.as_bytes().contains(&first) {
        return None;
    }
    text.find(pattern)
}

/// The length of the longest end of `text` that `pattern` begins with, short of the whole
/// pattern: a tag or marker cut by a chunk boundary. Only ends that start with the
/// pattern's first byte are compared.
pub fn partial_len(text: &str, pattern: &str) -> usize {
    let (text, pattern) = (text.as_bytes(), pattern.as_bytes());
    let Some(&first) = pattern.first() else { return 0 };
    let from = text.len().saturating_sub(pattern.len() - 1);
    (from..text.len()).find(|&i| text[i] == first && pattern.starts_with(&text[i..])).map_or(0, |i| text.len() - i)
}
