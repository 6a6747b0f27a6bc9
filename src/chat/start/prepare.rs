//! A chat request (CONTRACT.md §4) and what is checked of it before any stream opens: the
//! message, the conversation, the profile, the parent (branching: continue, regenerate,
//! edit), the user's limit of running runs, and an executed action's result.

use crate::ids::{ConversationId, UserId};

use super::titles::title_from;
use crate::chat::control::cancel::Canceller;
use crate::chat::errors::{ChatError, ControlError, busy, not_found, unknown_profile};
use crate::chat::live::cluster::Cluster;
use crate::chat::live::runs::Reservation;
use crate::chat::live::runs::Runs;
use crate::chat::request::{ChatRequest, InteractionType};
use crate::chat::run::actions::Actions;
use crate::chat::run::attachments::Attachments;
use crate::chat::run::plan::Ask;
use crate::chat::shared::{Drain, Shared};
use crate::config::Multitask;
use crate::config::Settings;
use crate::domain::branch::place;
use crate::domain::{Conversation, Message, Role, Trace, branch};
use crate::store::Store;
use crate::store::StoreError;
use crate::tools::Registry;
use std::sync::Arc;

/// Checks a request before any stream opens (see [`Preparer::prepare`]).
#[derive(Clone)]
pub(in crate::chat) struct Preparer {
    settings: Arc<Settings>,
    store: Arc<dyn Store>,
    tools: Arc<Registry>,
    runs: Runs,
    drain: Drain,
    cluster: Arc<dyn Cluster>,
    conversation_turns: super::turns::Turns<ConversationId>,
    attachments: Attachments,
    actions: Actions,
    canceller: Canceller,
}

impl Preparer {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self {
            settings: shared.settings.clone(),
            store: shared.store.clone(),
            tools: shared.tools.clone(),
            runs: shared.runs.clone(),
            drain: shared.drain.clone(),
            cluster: shared.cluster.clone(),
            conversation_turns: shared.conversation_turns.clone(),
            attachments: Attachments::new(shared),
            actions: Actions::new(shared),
            canceller: Canceller::new(shared),
        }
    }

    /// Everything about a request that does not depend on the profile: the message checked,
    /// the conversation found (or made), the parent, the history, an executed action's result.
    /// `runs`: how many runs the request will start (two for a comparison); `action`: the
    /// executed action's outcome, if an earlier look ran it.
    pub(in crate::chat) async fn prepare(
        &self,
        user: &UserId,
        request: &ChatRequest,
        runs: usize,
        action: &ActionOutcome,
    ) -> Result<Checked, ChatError> {
        if self.drain.is_on() {
            return Err(ChatError::Unavailable("The server is shutting down; try again shortly".into()));
        }
        let text = request.message.trim();
        // A message may be files alone (CONTRACT.md §14), never nothing at all.
        if text.is_empty() && request.attachments.is_empty() {
            return Err(ChatError::Invalid { field: "message", message: "Message cannot be empty".into() });
        }
        // A run sent right after start-up must not go without the MCP servers' tools because
        // they are still starting (bounded by `tools.mcp_start_wait_secs`).
        self.tools.mcp().wait_started().await;
        let limit = self.settings.limits.max_concurrent_runs_per_user;
        let max = self.settings.limits.max_message_chars;
        let chars = text.chars().count();
        if chars > max {
            // Named with its setting: whoever runs the server may raise it.
            return Err(ChatError::TooLarge {
                field: "message",
                message: format!("Message is {chars} characters, longer than limits.max_message_chars ({max})"),
            });
        }
        // One new message of a conversation at a time here: the second sees the first's run
        // (and the conversation as the first left it).
        let conversation_turn = match request.conversation_id {
            Some(id) => Some(self.conversation_turns.take(id).await),
            None => None,
        };
        // The conversation's going runs are read before the conversation itself: a run that
        // ends between the two reads is then seen going, and the message queues behind its
        // answer (written by then), instead of following the leaf read before that answer
        // was written, beside the answer, on a branch that hides it. (A run that starts
        // between them is not seen going; the start's checks refuse the plan if it still
        // goes.)
        let going = match request.conversation_id {
            Some(id) => self.store.running_in_conversation(user, id).await?,
            None => Vec::new(),
        };
        let existing = match request.conversation_id {
            Some(id) => Some(self.store.get_conversation(user, id).await.map_err(|e| match e {
                StoreError::NotFound => not_found("conversation_id", "Conversation not found"),
                e => e.into(),
            })?),
            None => None,
        };
        for profile in request.profile.iter() {
            if !self.settings.profiles.contains_key(profile) {
                return Err(not_found("profile", &unknown_profile(profile)));
            }
        }
        // The runs still going after making room: those a queued message waits behind.
        let (existing, going) = match existing {
            Some(conversation) => match self.make_room(user, conversation, going, request).await? {
                Some((conversation, going)) => (Some(conversation), going),
                None => return Ok(Checked::Repeat),
            },
            None => (None, Vec::new()),
        };
        // After making room: a run that an interrupt cancelled no longer counts. Runs that
        // start queued do not count either (until their turn comes, whatever the limit then).
        let starting = if going.is_empty() { runs } else { 0 };
        let reservation = self.runs.reserve(user, starting, limit).map_err(busy)?;
        let history = match &existing {
            Some(conversation) => self.store.messages(user, conversation.id).await?,
            None => Vec::new(),
        };
        // Branching: a message continues the active branch (queued behind an answer being
        // written, it follows that answer), or the answer it names; naming a user message it
        // regenerates that message's answer (same text) or edits it (CONTRACT.md §4).
        let leaf = existing.as_ref().and_then(|c| c.active_leaf_id);
        let new_files = !request.attachments.is_empty();
        let Some(placement) = place(&history, &going, leaf, request.parent_message_id, text, new_files) else {
            return Err(not_found("parent_message_id", "Parent message not found"));
        };
        let (parent, regenerate) = (placement.parent, placement.regenerates);
        let new_conversation = match &existing {
            Some(_) => None,
            None => Some(Conversation {
                profile: request.profile.clone(),
                external_id: request.client.chat_id.clone(),
                ..Conversation::new(user, title_from(text, self.settings.chat.title_max_chars))
            }),
        };
        let conversation = existing.as_ref().or(new_conversation.as_ref()).expect("one of the two is set");
        // Last of the checks that can fail: the files a request stores are deleted again if
        // it is refused after this (see `ChatService::start`).
        let resolved = self.attachments.resolve(user, &request.attachments).await?;
        // Once per request, however often its start looks again.
        let action_result = action
            .get_or_init(|| async {
                match request.interaction_type {
                    InteractionType::ActionExecuted => {
                        Some(self.actions.run_action(request.action.as_ref(), request.context.as_ref()).await)
                    }
                    _ => None,
                }
            })
            .await
            .clone();
        let asked = crate::chat::run::plan::Asked {
            context: request.context.clone(),
            client_tools: request.client_tools.clone(),
            diagnostics: request.diagnostics,
            action_result: action_result.clone(),
            instructions: request.instructions.clone(),
            max_tokens: request.max_tokens,
            temperature: request.temperature,
        };
        let (seen, max_running) = self.cluster.start_checks(existing.as_ref(), &going, limit);
        Ok(Checked::Ready(Box::new(Prepared {
            queued: !going.is_empty(),
            asked,
            // Where other replicas start runs too, the start makes sure that none began since.
            seen,
            conversation_id: conversation.id,
            system_prompt: conversation.system_prompt.clone(),
            existing_profile: existing.as_ref().and_then(|c| c.profile.clone()),
            user_message_is_new: regenerate.is_none(),
            user_message: regenerate.unwrap_or_else(|| Message {
                client_id: request.client.message_id.clone(),
                attachments: resolved.attachments,
                ..Message::new(conversation.id, parent, Role::User, text.to_owned())
            }),
            stored_files: resolved.stored,
            idempotency_key: request.idempotency_key.clone(),
            conversation_turn,
            earlier: branch(&history, parent),
            new_conversation,
            action_result,
            max_running,
            reservation,
        })))
    }
}

/// What checking a request came to: ready to plan and write, or a repeat of the request
/// whose run is the one going in its conversation (see [`idempotency::once`]).
///
/// [`idempotency::once`]: super::idempotency::once
pub(in crate::chat) enum Checked {
    Ready(Box<Prepared>),
    Repeat,
}

/// An executed action's outcome (CONTRACT.md §4), kept across the looks of one start (it
/// runs once).
pub(in crate::chat) type ActionOutcome = tokio::sync::OnceCell<Option<String>>;

/// The profile-independent part of a request, ready to persist.
pub(in crate::chat) struct Prepared {
    pub(in crate::chat) conversation_id: ConversationId,
    pub(in crate::chat) system_prompt: Option<String>,
    pub(in crate::chat) existing_profile: Option<String>,
    pub(in crate::chat) user_message: Message,
    /// False when regenerating: the user's message is stored already.
    pub(in crate::chat) user_message_is_new: bool,
    /// The active branch up to the new message's parent.
    pub(in crate::chat) earlier: Vec<Message>,
    pub(in crate::chat) new_conversation: Option<Conversation>,
    pub(in crate::chat) action_result: Option<String>,
    /// The user's limit of running runs, checked again in the start's transaction where
    /// other replicas start runs too.
    pub(in crate::chat) max_running: Option<usize>,
    /// Room for the request's runs among its user's, until they are registered.
    pub(in crate::chat) reservation: Reservation,
    /// Files the request stored (its `data:` and remote attachments): deleted again if it
    /// is refused before its run starts.
    pub(in crate::chat) stored_files: Vec<crate::ids::FileId>,
    pub(in crate::chat) idempotency_key: Option<crate::domain::IdempotencyKey>,
    /// This request's turn among the new messages of its conversation, until its run starts.
    pub(in crate::chat) conversation_turn: Option<super::turns::Turn<ConversationId>>,
    /// Whether the request's runs start `queued`, behind the conversation's going runs
    /// (CONTRACT.md §16).
    pub(in crate::chat) queued: bool,
    /// What its runs are planned from again when their turn comes (queued), or when they
    /// are continued before they completed a step (CONTRACT.md §19).
    pub(in crate::chat) asked: crate::chat::run::plan::Asked,
    /// What the request saw of its conversation (see [`RunStart::seen`]).
    ///
    /// [`RunStart::seen`]: crate::store::RunStart::seen
    pub(in crate::chat) seen: Option<crate::store::Seen>,
}

impl Preparer {
    /// What a new message does to the runs of its conversation that are going (`going`, read
    /// before `conversation`; CONTRACT.md §16): refuses itself (`reject`), queues behind them (`enqueue`), or cancels them
    /// first (`interrupt`, keeping their partial answers; `rollback`, deleting them). Returns
    /// the conversation as it is then, and the runs still going; `None` for a repeat of a
    /// request whose run is the one going (its first try's client left before the answer;
    /// another replica): it gets that run, never refuses or stops it.
    async fn make_room(
        &self,
        user: &UserId,
        conversation: Conversation,
        going: Vec<Trace>,
        request: &ChatRequest,
    ) -> Result<Option<(Conversation, Vec<Trace>)>, ChatError> {
        let Some(last) = going.last() else { return Ok(Some((conversation, going))) };
        if super::idempotency::repeat_of_going_run(&*self.store, user, request.idempotency_key.as_ref()).await? {
            return Ok(None);
        }
        let rollback = match request.multitask.unwrap_or(self.settings.chat.multitask) {
            Multitask::Reject => {
                return Err(ChatError::Conflict(format!(
                    "A run of this conversation is still going (trace_id {}): wait for its end, cancel it, \
                     or send with \"multitask\": \"interrupt\"",
                    last.trace_id
                )));
            }
            Multitask::Enqueue => return Ok(Some((conversation, going))),
            Multitask::Interrupt => false,
            Multitask::Rollback => true,
        };
        // Newest first: a queued run must not start while the run ahead of it is stopped.
        for trace in going.iter().rev() {
            match self.canceller.cancel_run(user, trace).await {
                Ok(()) => {}
                // Ended meanwhile (completed, or stopped by another cancel): there is room
                // all the same, and its answer is not this request's to delete.
                Err(ControlError::Ended(_) | ControlError::Missing(_)) => continue,
                Err(ControlError::Store(e)) => return Err(e.into()),
                Err(e) => return Err(ChatError::Unavailable(e.to_string())),
            }
            if rollback {
                match self.store.delete_answer(user, trace.message_id).await {
                    Ok(()) | Err(StoreError::NotFound) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(Some((self.store.get_conversation(user, conversation.id).await?, Vec::new())))
    }
}

impl Prepared {
    /// What `request`, checked as this, asks.
    pub(in crate::chat) fn ask<'a>(&'a self, request: &'a ChatRequest) -> Ask<'a> {
        Ask {
            conversation_id: self.conversation_id,
            new_conversation: self.new_conversation.is_some(),
            system_prompt: self.system_prompt.as_deref(),
            earlier: &self.earlier,
            user_message: &self.user_message,
            action_result: self.action_result.as_deref(),
            context: request.context.as_ref(),
            client_tools: &request.client_tools,
            diagnostics: request.diagnostics,
            instructions: request.instructions.as_deref(),
            max_tokens: request.max_tokens,
            temperature: request.temperature,
            metadata: request.metadata.as_ref(),
        }
    }
}
