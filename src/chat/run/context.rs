//! Context management: before each model call, estimate the tokens of the system prompt,
//! the history and the tools; once they would pass 70% of the profile's `context_limit`, keep
//! the system prompt and the newest messages that fit, and store what was kept as the
//! conversation's context state. Whole messages are dropped, so a tool call never loses its
//! result (both live in the same assistant message), and the history still starts with the
//! user. The state is recomputed for every call, so it never outlives the messages it
//! describes; it is cleared when nothing needs trimming and deleted with the conversation.

use crate::ids::{ConversationId, UserId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;

use crate::domain::{ContextState, ContextStrategy};
use crate::providers::{InputMessage, ModelRequest};
use crate::store::Store;

/// The share of the context window the request may fill before history is trimmed.
pub const THRESHOLD: f64 = 0.7;
/// The share a trim brings the request down to: trimmed, the history has room to grow for
/// several turns before the next trim, and its first kept message (where the prefix the
/// provider caches begins) holds meanwhile (CONTRACT.md §21).
pub const TRIM_TO: f64 = 0.5;

/// A rough token count: four characters a token, as the providers' own rules of thumb.
pub fn estimate(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4)
}

/// Counts text's tokens with `model`'s own tokenizer where it is one of OpenAI's (the
/// tiktoken encodings), else as [`estimate`]: for usage a provider did not report
/// (CONTRACT.md §18). Context trimming, which counts every request, keeps to the estimate.
pub fn tokenizer(model: &str) -> impl Fn(&str) -> u64 + use<> {
    use tiktoken_rs::tokenizer::{Tokenizer, get_tokenizer};
    let bpe = match get_tokenizer(model) {
        Some(Tokenizer::O200kBase) => Some(tiktoken_rs::o200k_base_singleton()),
        Some(Tokenizer::O200kHarmony) => Some(tiktoken_rs::o200k_harmony_singleton()),
        Some(Tokenizer::Cl100kBase) => Some(tiktoken_rs::cl100k_base_singleton()),
        _ => None,
    };
    move |text: &str| match bpe {
        Some(bpe) => bpe.encode_ordinary(text).len() as u64,
        None => estimate(text),
    }
}

fn message_tokens(message: &InputMessage, count: &dyn Fn(&str) -> u64) -> u64 {
    let turns: u64 = match message {
        InputMessage::Assistant { turns, .. } => turns
            .iter()
            .map(|t| {
                count(&t.text)
                    + t.tool_calls.iter().map(|c| count(&c.input.to_string()) + count(&c.name)).sum::<u64>()
                    + t.tool_results.iter().map(|r| count(&r.content)).sum::<u64>()
            })
            .sum(),
        InputMessage::User { text, files, .. } => {
            count(text) + files.iter().map(crate::providers::InputFile::estimated_tokens).sum::<u64>()
        }
        InputMessage::System { text, .. } => count(text),
    };
    // Role markers and framing cost a few tokens a message.
    turns + 4
}

/// The request's size in estimated tokens.
pub fn request_tokens(request: &ModelRequest) -> u64 {
    request_tokens_by(request, &estimate)
}

/// The request's size in tokens as `count` counts them.
pub fn request_tokens_by(request: &ModelRequest, count: &dyn Fn(&str) -> u64) -> u64 {
    let system = request.system_prompt.as_deref().map_or(0, count) + request.notes.as_deref().map_or(0, count);
    let tools: u64 =
        request.tools.iter().map(|t| count(&t.name) + count(&t.description) + count(&t.input_schema.to_string())).sum();
    system + tools + request.messages.iter().map(|m| message_tokens(m, count)).sum::<u64>()
}

/// The estimated tokens of what a request marks for the provider's prompt cache: all of it
/// but its notes, which come last and change every turn (CONTRACT.md §21).
pub fn prefix_tokens(request: &ModelRequest) -> u64 {
    request_tokens(request) - request.notes.as_deref().map_or(0, estimate)
}

/// What trimming did to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Trimmed {
    pub request: ModelRequest,
    /// The state to store: `None` when nothing was dropped.
    pub state: Option<ContextState>,
}

/// Fits `request` under `THRESHOLD` of `limit`. `protected` is how many messages at the end
/// must stay whatever they cost (the new user message and this run's exchanges). Trimming
/// drops in steps: where the `previous` trim's first kept message still fits, it stays the
/// first; else the history is trimmed down to `TRIM_TO` of the limit, so that the next trim
/// is several turns away.
pub fn fit(request: &ModelRequest, limit: Option<u32>, protected: usize, previous: Option<&ContextState>) -> Trimmed {
    let Some(limit) = limit.filter(|l| *l > 0) else {
        return Trimmed { request: request.clone(), state: None };
    };
    let budget = (f64::from(limit) * THRESHOLD) as u64;
    let before = request_tokens(request);
    if before <= budget {
        return Trimmed { request: request.clone(), state: None };
    }
    let fixed = request_tokens(&ModelRequest { messages: Arc::default(), ..request.clone() });
    let messages = &request.messages;
    let protected = protected.min(messages.len());
    let movable = messages.len() - protected;
    // What the request costs from each message on: `from[i]` keeps `messages[i..]`.
    let mut from = vec![fixed; messages.len() + 1];
    for i in (0..messages.len()).rev() {
        from[i] = from[i + 1] + message_tokens(&messages[i], &estimate);
    }
    let starts_well = |i: usize| i == movable || messages[i].is_user();
    let held = previous
        .and_then(|p| p.kept_from)
        .and_then(|id| messages[..movable].iter().position(|m| m.id() == id))
        .filter(|&i| from[i] <= budget && starts_well(i));
    let first_kept = held.unwrap_or_else(|| {
        let target = (f64::from(limit) * TRIM_TO) as u64;
        // The fewest dropped that bring it under the target, and a user's turn first.
        let mut i = (0..movable).find(|&i| from[i] <= target).unwrap_or(movable);
        while !starts_well(i) {
            i += 1;
        }
        i
    });
    let used = from[first_kept];
    let kept = messages[first_kept..].to_vec();
    let state = ContextState {
        strategy: ContextStrategy::TrimOldest,
        limit,
        threshold: THRESHOLD,
        estimate_before: before,
        estimate: used,
        dropped: first_kept,
        kept: kept.len(),
        kept_from: kept.first().map(InputMessage::id),
        dropped_through: first_kept.checked_sub(1).map(|i| messages[i].id()),
        summary: None,
    };
    Trimmed { request: ModelRequest { messages: Arc::new(kept), ..request.clone() }, state: Some(state) }
}

/// Stores a conversation's context state as requests are trimmed (or not).
#[derive(Clone)]
pub struct ContextKeeper {
    store: Arc<dyn Store>,
    user: UserId,
    conversation_id: ConversationId,
    /// Whether a state may be stored: not for a conversation this run created, until it
    /// stores one (clearing what cannot exist would be one more write per new chat).
    may_be_stored: Arc<AtomicBool>,
    /// A clear still being written, aside from the run (see [`record`](Self::record)).
    clearing: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl ContextKeeper {
    pub fn new(store: Arc<dyn Store>, user: &UserId, conversation_id: ConversationId, new_conversation: bool) -> Self {
        let may_be_stored = Arc::new(AtomicBool::new(!new_conversation));
        Self { store, user: user.to_owned(), conversation_id, may_be_stored, clearing: Arc::default() }
    }

    /// The stored state, if any.
    pub async fn stored(&self) -> Option<ContextState> {
        self.cleared().await;
        self.store.context_state(&self.user, self.conversation_id).await.ok().flatten()
    }

    /// Stores the state of the latest trim, or clears a stored one that no longer applies.
    /// A clear (the first call of most turns of an existing conversation) is written aside,
    /// while the model is called: it is not in the way of the first token. What comes after
    /// it here (a read, a new state, the run's end) waits for it.
    pub async fn record(&self, state: Option<&ContextState>) {
        let Some(state) = state else {
            if self.may_be_stored.swap(false, Ordering::Relaxed) {
                let (store, user, conversation_id) = (self.store.clone(), self.user.clone(), self.conversation_id);
                let clear = tokio::spawn(async move {
                    if let Err(e) = store.set_context_state(&user, conversation_id, None).await {
                        tracing::warn!(error = %e, %conversation_id, "could not clear the context state");
                    }
                });
                *self.clearing.lock().expect("never poisoned") = Some(clear);
            }
            return;
        };
        self.cleared().await;
        self.may_be_stored.store(true, Ordering::Relaxed);
        if let Err(e) = self.store.set_context_state(&self.user, self.conversation_id, Some(state)).await {
            tracing::warn!(error = %e, conversation_id = %self.conversation_id, "could not store the context state");
        }
    }

    /// Waits for a clear written aside, if one is.
    pub async fn cleared(&self) {
        let clearing = self.clearing.lock().expect("never poisoned").take();
        if let Some(clearing) = clearing {
            let _ = clearing.await;
        }
    }
}

/// The request that asks the model to summarise what trimming dropped.
pub fn summary_request(request: &ModelRequest, dropped: &[InputMessage]) -> ModelRequest {
    let mut messages = dropped.to_vec();
    messages.push(InputMessage::user(SUMMARY_ASK));
    ModelRequest {
        system_prompt: Some(SUMMARY_PROMPT.into()),
        messages: Arc::new(messages),
        tools: Arc::default(),
        enable_thinking: false,
        thinking_budget: None,
        max_tokens: Some(400),
        ..request.clone()
    }
}

pub const SUMMARY_PROMPT: &str = "You summarise conversations for an assistant that can no longer see \
     their beginning. Keep names, numbers, decisions and open questions; at most a short paragraph.";
pub const SUMMARY_ASK: &str = "Summarise the conversation so far.";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{AssistantTurn, ToolCall, ToolResult};
    use crate::ids::MessageId;

    #[derive(Clone, Copy)]
    enum Role {
        User,
        Assistant,
    }

    fn message(role: Role, text: &str) -> InputMessage {
        match role {
            Role::User => InputMessage::user(text),
            Role::Assistant => InputMessage::Assistant {
                id: MessageId::new(),
                turns: vec![AssistantTurn { text: text.to_owned(), ..AssistantTurn::default() }],
            },
        }
    }

    fn request(messages: Vec<InputMessage>) -> ModelRequest {
        ModelRequest {
            model: "m".into(),
            system_prompt: Some("s".repeat(40).into()),
            messages: Arc::new(messages),
            temperature: None,
            max_tokens: None,
            enable_thinking: false,
            thinking_budget: None,
            reasoning_effort: None,
            tools: Arc::default(),
            ..ModelRequest::default()
        }
    }

    #[test]
    fn a_request_under_the_threshold_is_left_alone() {
        let r = request(vec![message(Role::User, "hi")]);
        assert_eq!(fit(&r, Some(1000), 1, None), Trimmed { request: r.clone(), state: None });
        assert_eq!(fit(&r, None, 1, None).state, None);
        // Left alone, it is shared with the run's own request for as long as the answer
        // streams, not copied: the conversation, the system prompt and the tools.
        for fitted in [fit(&r, Some(1000), 1, None), fit(&r, None, 1, None)] {
            assert!(Arc::ptr_eq(&fitted.request.messages, &r.messages));
            assert!(Arc::ptr_eq(fitted.request.system_prompt.as_ref().unwrap(), r.system_prompt.as_ref().unwrap()));
            assert!(Arc::ptr_eq(&fitted.request.tools, &r.tools));
        }
    }

    #[test]
    fn the_oldest_turns_go_first_and_the_history_starts_with_the_user() {
        let long = "x".repeat(400); // 100 tokens
        let tool_turn = InputMessage::Assistant {
            id: MessageId::new(),
            turns: vec![AssistantTurn {
                text: "calling".into(),
                tool_calls: vec![ToolCall {
                    id: "c1".into(),
                    name: "t".into(),
                    input: serde_json::json!({}),
                    invalid_arguments: None,
                }],
                tool_results: vec![ToolResult {
                    tool_call_id: "c1".into(),
                    tool_name: "t".into(),
                    content: long.clone(),
                    is_error: false,
                }],
                ..AssistantTurn::default()
            }],
        };
        let messages = vec![
            message(Role::User, &long),
            message(Role::Assistant, &long),
            message(Role::User, &long),
            tool_turn.clone(),
            message(Role::User, "newest"),
        ];
        let trimmed = fit(&request(messages.clone()), Some(560), 1, None);
        let state = trimmed.state.expect("trimmed");
        // Past 70% of 560, trimmed to 50% = 280 tokens: the newest user turn, the tool
        // exchange and the user message before it fit; the first exchange does not.
        assert_eq!(trimmed.request.messages.len(), 3);
        assert_eq!(trimmed.request.messages[0].id(), messages[2].id());
        assert_eq!(trimmed.request.messages[1], tool_turn, "a call stays with its result");
        assert_eq!(state.dropped, 2);
        assert_eq!(state.kept_from, Some(messages[2].id()));
        assert!(state.estimate <= 280);

        // With room only for the tool exchange, it would lead: it is dropped too, so the
        // history starts with the user.
        let trimmed = fit(&request(messages.clone()), Some(250), 1, None);
        assert!(trimmed.request.messages.first().unwrap().is_user());
    }

    #[test]
    fn protected_messages_stay_even_over_budget() {
        let huge = "y".repeat(4000);
        let messages = vec![message(Role::User, "old"), message(Role::User, &huge)];
        let trimmed = fit(&request(messages.clone()), Some(100), 1, None);
        assert_eq!(*trimmed.request.messages, vec![messages[1].clone()]);
    }

    #[test]
    fn the_first_kept_message_holds_for_several_turns() {
        // Thirty turns of about 30 tokens a message against a limit of 1,000 tokens.
        let (mut messages, mut previous): (Vec<InputMessage>, Option<ContextState>) = (Vec::new(), None);
        let (mut moves, mut moves_without_steps, mut trimmed_turns) = (0, 0, 0);
        let (mut last, mut last_without) = (None, None);
        for turn in 0..30 {
            messages.push(message(Role::User, &format!("question {turn} {}", "q".repeat(90))));
            let r = request(messages.clone());
            let fitted = fit(&r, Some(1_000), 1, previous.as_ref());
            let fresh = fit(&r, Some(1_000), 1, None);
            if let Some(state) = &fitted.state {
                trimmed_turns += 1;
                assert!(state.estimate <= 700, "turn {turn}: {}", state.estimate);
                assert!(fitted.request.messages[0].is_user());
                moves += usize::from(last.is_some_and(|l| Some(l) != state.kept_from));
                last = state.kept_from;
            }
            if let Some(state) = &fresh.state {
                moves_without_steps += usize::from(last_without.is_some_and(|l| Some(l) != state.kept_from));
                last_without = state.kept_from;
            }
            previous = fitted.state.clone().or(previous);
            messages.push(message(Role::Assistant, &format!("answer {turn} {}", "a".repeat(90))));
        }
        assert!(trimmed_turns >= 15, "{trimmed_turns}");
        // Trimmed to 50%, the history grows for about three turns before it passes 70%.
        assert!(moves * 3 <= trimmed_turns, "{moves} moves in {trimmed_turns} trimmed turns");
        assert!(moves < moves_without_steps / 2, "{moves} against {moves_without_steps}");
    }

    #[test]
    fn openai_models_are_counted_with_their_own_tokenizer_and_others_by_the_rule() {
        let text = "Tokenizers split words like unbelievably into pieces; 12345 and emoji 🎉 too.";
        let gpt = tokenizer("gpt-4o")(text);
        // What tiktoken's o200k_base says, and not the four-characters rule.
        assert_eq!(gpt, tiktoken_rs::o200k_base_singleton().encode_ordinary(text).len() as u64);
        assert_ne!(gpt, estimate(text));
        assert_eq!(tokenizer("gpt-4")(text), tiktoken_rs::cl100k_base_singleton().encode_ordinary(text).len() as u64);
        assert_eq!(tokenizer("llama3.2:3b")(text), estimate(text));
    }
}
