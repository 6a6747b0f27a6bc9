//! Conversation titles: the first message's first line at once, then (with
//! `chat.refine_titles`) a short title the default profile's model writes after the first
//! answer.

use crate::ids::{ConversationId, UserId};
use std::sync::Arc;

use crate::chat::live::runs::LiveRun;
use crate::chat::shared::Shared;
use crate::providers::InputMessage;
use crate::providers::ModelRequest;
use crate::store::ConversationPatch;

const TITLE_PROMPT: &str = "Write a title of at most six words for a conversation that starts with the \
     user's message below. Answer with the title only, without quotes or a final period.";

/// Writes conversation titles.
#[derive(Clone)]
pub(in crate::chat) struct Titles {
    store: std::sync::Arc<dyn crate::store::Store>,
    settings: std::sync::Arc<crate::config::Settings>,
    providers: crate::providers::Providers,
}

impl Titles {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self { store: shared.store.clone(), settings: shared.settings.clone(), providers: shared.providers.clone() }
    }

    /// Replaces the first-message title by a short one the default profile's model writes,
    /// after the first answer, unless the user renamed the conversation meanwhile. Never
    /// blocks or fails a stream.
    pub(in crate::chat) fn refine_title(
        &self,
        user: &UserId,
        conversation_id: ConversationId,
        first_message: &str,
        run: Arc<LiveRun>,
    ) {
        let (store, settings, providers) = (self.store.clone(), self.settings.clone(), self.providers.clone());
        let (user, first_message) = (user.to_owned(), first_message.to_owned());
        tokio::spawn(async move {
            run.finished().await;
            let profile = &settings.profiles[&settings.chat.default_profile];
            let Some(provider) = providers.get(&profile.provider) else {
                return;
            };
            let request = ModelRequest {
                model: profile.model.clone(),
                system_prompt: Some(TITLE_PROMPT.into()),
                messages: Arc::new(vec![InputMessage::user(first_message.clone())]),
                temperature: Some(0.2),
                max_tokens: Some(30),
                enable_thinking: false,
                thinking_budget: None,
                reasoning_effort: None,
                tools: Arc::default(),
                ..ModelRequest::default()
            };
            let Some(text) = crate::chat::run::turn::complete_text(&*provider, &request).await else { return };
            let Some(title) = model_title(&text, settings.chat.title_max_chars) else { return };
            let unchanged = store
                .get_conversation(&user, conversation_id)
                .await
                .is_ok_and(|c| c.title == title_from(&first_message, settings.chat.title_max_chars));
            if unchanged {
                let patch = ConversationPatch { title: Some(title), ..ConversationPatch::default() };
                if let Err(e) = store.update_conversation(&user, conversation_id, &patch).await {
                    tracing::warn!(error = %e, "could not store the refined title");
                }
            }
        });
    }
}

/// A conversation's first title: the message's first line, cut to `max` characters.
pub fn title_from(message: &str, max: usize) -> String {
    // The mock's `[mock:…]` directives script an answer; they are not what it is about.
    let message = crate::providers::without_directives(message);
    let line = message.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("New conversation");
    let collapsed = line.split_whitespace().collect::<Vec<_>>().join(" ");
    if collapsed.chars().count() <= max {
        return collapsed;
    }
    let cut: String = collapsed.chars().take(max.saturating_sub(1)).collect();
    format!("{}…", cut.trim_end())
}

/// A title as a model wrote it, made one line: every run of whitespace (a newline too) is one
/// space, the quotes it was asked to leave out are dropped, and it is cut to `max` characters.
/// `None` when nothing is left.
fn model_title(text: &str, max: usize) -> Option<String> {
    let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let title: String = collapsed.trim_matches('"').trim().chars().take(max).collect();
    let title = title.trim_end().to_owned();
    (!title.is_empty()).then_some(title)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_written_title_is_one_line() {
        assert_eq!(model_title("Planning a\n  Trip\tto\r\nOslo\n", 60).as_deref(), Some("Planning a Trip to Oslo"));
        assert_eq!(model_title("  \"Oslo in spring\"\n\n", 60).as_deref(), Some("Oslo in spring"));
        assert_eq!(model_title("\" Two words \"", 60).as_deref(), Some("Two words"));
        assert_eq!(model_title("abc def", 4).as_deref(), Some("abc"), "no space left at the cut");
        assert_eq!(model_title(" \n\"\" \n", 60), None);
    }

    #[test]
    fn titles_come_from_the_first_line() {
        assert_eq!(title_from("  Hello   world \nsecond", 60), "Hello world");
        assert_eq!(title_from("abcdefghij", 5), "abcd…");
        assert_eq!(title_from("\n\n", 7), "New co…");
        assert_eq!(title_from("[mock:words=300] A long story [mock:delay=50]", 60), "A long story");
    }
}
