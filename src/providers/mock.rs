//! The built-in mock model: deterministic and scriptable, so `cargo run` answers with no API
//! key and tests know exactly what it will say.
//!
//! What it answers, for the newest user message:
//! - the first configured rule whose `when` the message contains (its `text` and `thinking`);
//! - else a short thinking line and `Mock reply: <message>`.
//!
//! Directives in the message script a run (they are not echoed):
//! `[mock:words=N]` answer with N words; `[mock:delay=MS]` pause between chunks;
//! `[mock:think=off]` no thinking; `[mock:error=KIND]` fail before any output, KIND one of
//! `unauthorized`, `rate_limited`, `unavailable`, `network`, `parse`; `[mock:fail_after=N]`
//! fail after N text chunks; `[mock:fail_once_after=N]` the same, on the first try of each
//! model call of a run only (a retry answers); `[mock:tool=NAME {"arg": …}]` call a tool (several of them: a
//! parallel turn), then, once the results are back, answer with what the tools said;
//! `[mock:loop]` call the tools again on every turn (to reach `max_iterations`);
//! `[mock:instructions]` answer with what the system prompt's instructions say.

use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;

use super::{
    FileContent, InputFile, InputMessage, LlmProvider, ModelRequest, ProviderError, ProviderErrorKind, ProviderEvent,
    ProviderStream,
};
use crate::config::MockSettings;
use crate::domain::Usage;

pub struct MockProvider {
    settings: MockSettings,
    /// The model calls (a user message, and how far its run got) that failed once already
    /// (`fail_once_after`).
    failed_once: std::sync::Mutex<std::collections::HashSet<(crate::ids::MessageId, usize)>>,
}

/// What one call will do, decided before it streams.
#[derive(Debug, Default, PartialEq)]
struct Script {
    thinking: Option<String>,
    text: String,
    delay: Duration,
    error: Option<ProviderErrorKind>,
    fail_after: Option<usize>,
    fail_once_after: Option<usize>,
    tools: Vec<(String, String)>,
    repeat_tools: bool,
    /// Answer with the system prompt's instructions (`[mock:instructions]`).
    echo_instructions: bool,
}

const WORDS: [&str; 12] =
    ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"];

impl MockProvider {
    pub fn new(settings: MockSettings) -> Self {
        Self { settings, failed_once: Default::default() }
    }

    fn script(&self, message: &str) -> Script {
        let (said, directives) = split_directives(message);
        let mut script = Script {
            thinking: self
                .settings
                .thinking
                .then(|| format!("The user wrote {} characters; a short, direct answer fits.", said.chars().count())),
            text: format!("Mock reply: {said}"),
            delay: Duration::from_millis(self.settings.delay_ms),
            ..Script::default()
        };
        if let Some(rule) = self.settings.rules.iter().find(|r| said.contains(&r.when)) {
            script.text = rule.text.clone();
            script.thinking = rule.thinking.clone();
        }
        for (key, value) in directives {
            match (key.as_str(), value.as_str()) {
                ("words", n) => {
                    let n: usize = n.parse().unwrap_or(0);
                    script.text = (0..n).map(|i| WORDS[i % WORDS.len()]).collect::<Vec<_>>().join(" ");
                }
                ("delay", ms) => script.delay = Duration::from_millis(ms.parse().unwrap_or(0)),
                ("think", "off") => script.thinking = None,
                ("fail_after", n) => script.fail_after = n.parse().ok(),
                ("fail_once_after", n) => script.fail_once_after = n.parse().ok(),
                ("tool", call) => {
                    let (name, args) = call.split_once(char::is_whitespace).unwrap_or((call, "{}"));
                    script.tools.push((name.to_owned(), args.trim().to_owned()));
                }
                ("loop", _) => script.repeat_tools = true,
                ("instructions", _) => script.echo_instructions = true,
                ("error", kind) => {
                    script.error = Some(match kind {
                        "unauthorized" => ProviderErrorKind::Unauthorized,
                        "rate_limited" => ProviderErrorKind::RateLimited,
                        "network" => ProviderErrorKind::Network,
                        "parse" => ProviderErrorKind::Parse,
                        _ => ProviderErrorKind::Unavailable,
                    })
                }
                _ => {}
            }
        }
        script
    }
}

/// A message without its `[mock:…]` directives (as a title shows it).
pub fn without_directives(message: &str) -> String {
    split_directives(message).0
}

/// Splits `[mock:key=value]` directives out of a message; returns the rest, trimmed, its
/// lines as they were (Markdown can be tried on the echo): a directive takes one space
/// beside it along.
fn split_directives(message: &str) -> (String, Vec<(String, String)>) {
    let mut rest = String::with_capacity(message.len());
    let mut directives = Vec::new();
    let mut text = message;
    while let Some(start) = text.find("[mock:") {
        let Some(len) = text[start..].find(']') else {
            break;
        };
        rest.push_str(&text[..start]);
        let body = &text[start + "[mock:".len()..start + len];
        let (key, value) = body.split_once('=').unwrap_or((body, ""));
        directives.push((key.trim().to_owned(), value.trim().to_owned()));
        text = &text[start + len + 1..];
        let line_start = rest.is_empty() || rest.ends_with(' ') || rest.ends_with('\n');
        if line_start && text.starts_with(' ') {
            text = &text[1..];
        } else if rest.ends_with(' ') && (text.is_empty() || text.starts_with('\n')) {
            rest.pop();
        }
    }
    rest.push_str(text);
    (rest.trim().to_owned(), directives)
}

/// Cuts text into pieces of `size` characters (never inside a character).
fn chunks(text: &str, size: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(size.max(1)).map(|c| c.iter().collect()).collect()
}

/// A rough token count: four characters a token.
fn estimate_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4)
}

fn error_message(kind: ProviderErrorKind) -> &'static str {
    match kind {
        ProviderErrorKind::Unauthorized => "Invalid API key",
        ProviderErrorKind::RateLimited => "Rate limited, try again",
        ProviderErrorKind::Network => "Connection failed",
        ProviderErrorKind::Parse => "Failed to parse response",
        ProviderErrorKind::Unavailable => "The mock model is unavailable",
    }
}

#[async_trait]
impl LlmProvider for MockProvider {
    async fn stream(&self, request: &ModelRequest) -> Result<ProviderStream, ProviderError> {
        let (asked, last_user, files) = request
            .messages
            .iter()
            .rev()
            .find_map(|m| match m {
                InputMessage::User { id, text, files } => Some((Some(*id), text.as_str(), files.as_slice())),
                _ => None,
            })
            .unwrap_or_default();
        let mut script = self.script(last_user);
        if let (Some(n), Some(asked)) = (script.fail_once_after, asked) {
            let call = (asked, request.messages.len());
            if self.failed_once.lock().expect("mock lock").insert(call) {
                script.fail_after = Some(n);
            }
        }
        if script.echo_instructions {
            // What the prompt's "## Instructions" section says, up to the next section.
            let prompt = request.system_prompt.as_deref().unwrap_or_default();
            let said = prompt.split("## Instructions\n").nth(1).and_then(|s| s.split("\n\n## ").next());
            script.text = format!("Instructions: {}", said.unwrap_or("none"));
        }
        for file in files {
            script.text.push_str(&format!(" [{}]", acknowledge(file)));
        }
        if let Some(kind) = script.error {
            return Err(ProviderError::new(kind, error_message(kind)));
        }
        // After the user's message, the exchanges of this run: the tools were called already.
        let results: Vec<String> = request
            .messages
            .iter()
            .rev()
            .take_while(|m| !m.is_user())
            .flat_map(|m| match m {
                InputMessage::Assistant { turns, .. } => turns.as_slice(),
                _ => &[],
            })
            .flat_map(|t| &t.tool_results)
            .map(|r| format!("{} said {}", r.tool_name, r.content))
            .collect();
        let round = request.messages.iter().rev().take_while(|m| !m.is_user()).count();
        if !results.is_empty() {
            script.text = format!("The tools answered: {}.", results.join("; "));
            if !script.repeat_tools {
                script.tools.clear();
            }
        }
        let input_tokens = request
            .messages
            .iter()
            .map(|m| match m {
                InputMessage::User { text, files, .. } => {
                    estimate_tokens(text) + files.iter().map(InputFile::estimated_tokens).sum::<u64>()
                }
                InputMessage::System { text, .. } => estimate_tokens(text),
                InputMessage::Assistant { turns, .. } => turns.iter().map(|t| estimate_tokens(&t.text)).sum(),
            })
            .sum::<u64>()
            + request.system_prompt.as_deref().map_or(0, estimate_tokens)
            + request.notes.as_deref().map_or(0, estimate_tokens);
        let size = self.settings.chunk_chars;
        let stream = async_stream::stream! {
            let mut output_tokens = 0;
            if let Some(thinking) = &script.thinking {
                output_tokens += estimate_tokens(thinking);
                for piece in chunks(thinking, size) {
                    pause(script.delay).await;
                    yield Ok(ProviderEvent::Thinking(piece.into()));
                }
            }
            for (sent, piece) in chunks(&script.text, size).into_iter().enumerate() {
                if script.fail_after == Some(sent) {
                    yield Err(ProviderError::new(ProviderErrorKind::Unavailable, "The mock model failed mid-stream"));
                    return;
                }
                pause(script.delay).await;
                yield Ok(ProviderEvent::Text(piece.into()));
            }
            output_tokens += estimate_tokens(&script.text);
            for (index, (name, args)) in script.tools.iter().enumerate() {
                let index = index as u32;
                yield Ok(ProviderEvent::ToolCallStart { index, id: format!("mock_call_{round}_{index}"), name: name.clone() });
                for piece in chunks(args, size) {
                    yield Ok(ProviderEvent::ToolCallDelta { index, arguments: piece });
                }
                yield Ok(ProviderEvent::ToolCallEnd { index });
            }
            yield Ok(ProviderEvent::Usage(Usage { input_tokens, output_tokens, ..Usage::default() }));
            let reason = if script.tools.is_empty() { "stop" } else { "tool_calls" };
            yield Ok(ProviderEvent::Finish(reason.to_owned()));
        };
        Ok(stream.boxed())
    }
}

/// What the mock says it was sent of a file, read from what it got (an image's size from
/// its bytes, a text's lines), so tests and the page see the file arrive.
fn acknowledge(file: &InputFile) -> String {
    let kind = file.file.media_type.rsplit('/').next().unwrap_or_default();
    match &file.content {
        FileContent::Bytes(bytes) if file.file.is_image() => match imagesize::blob_size(bytes) {
            Ok(size) => format!("1 image {}×{} {kind}", size.width, size.height),
            Err(_) => format!("1 unreadable image {}", file.file.name),
        },
        FileContent::Bytes(bytes) => format!("1 {kind} {} of {} bytes", file.file.name, bytes.len()),
        FileContent::Text(text) => format!("1 text file {} of {} lines", file.file.name, text.lines().count()),
        FileContent::Unread | FileContent::Left(_) => format!("1 file left out: {}", file.file.name),
    }
}

async fn pause(delay: Duration) {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_are_split_out() {
        let (rest, directives) = split_directives("hello [mock:words=3] there [mock:think=off]");
        assert_eq!(rest, "hello there");
        assert_eq!(directives, vec![("words".into(), "3".into()), ("think".into(), "off".into())]);
        let markdown = "# Plan\n\n- one\n- two [mock:think=off]\n\n    code";
        assert_eq!(split_directives(markdown).0, "# Plan\n\n- one\n- two\n\n    code", "lines kept");
    }

    #[test]
    fn scripts_follow_rules_then_directives() {
        let provider = MockProvider::new(MockSettings {
            rules: vec![crate::config::MockRule { when: "weather".into(), text: "Sunny.".into(), thinking: None }],
            ..MockSettings::default()
        });
        assert_eq!(provider.script("the weather?").text, "Sunny.");
        assert_eq!(provider.script("hi [mock:words=4]").text, "alpha bravo charlie delta");
        assert_eq!(provider.script("hi").text, "Mock reply: hi");
        assert_eq!(provider.script("[mock:error=network] x").error, Some(ProviderErrorKind::Network));
    }

    #[test]
    fn chunks_keep_characters_whole() {
        assert_eq!(chunks("héllo→wörld", 4).concat(), "héllo→wörld");
        assert_eq!(chunks("ab", 0), vec!["a", "b"]);
    }
}
