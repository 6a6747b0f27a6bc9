//! Starting a run: validate the request (everything that can fail with a status code fails
//! here, before any stream opens), persist the user's message, then hand the run to a task
//! of its own so it outlives the request that started it.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::json;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::agent::{self, RunPlan, ToolLimits};
use super::context::ContextKeeper;
use super::log::EventLog;
use super::news::RunNews;
use super::payloads::LlmPayloadType;
use super::prompt::{self, PromptParts};
use super::runs::{LiveRun, Reservation, Runs};
use super::starts::StartWriter;
use crate::config::{PayloadSource, Settings};
use crate::domain::{Comparison, Conversation, Message, Role, Trace, branch, new_id, now};
use crate::providers::{ModelRequest, Providers, ToolSpec};
use crate::store::{ConversationPatch, RunStart, Store, StoreError};
use crate::tools::{PageScope, Registry, ToolCallContext};

/// The body of `POST /api/chat/stream` (CONTRACT.md §4).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    pub message: String,
    #[serde(default)]
    pub conversation_id: Option<Uuid>,
    #[serde(default)]
    pub profile: Option<String>,
    #[serde(default)]
    pub parent_message_id: Option<Uuid>,
    #[serde(default)]
    pub context: Option<Value>,
    #[serde(default)]
    pub interaction_type: InteractionType,
    #[serde(default)]
    pub action: Option<Value>,
    #[serde(default)]
    pub diagnostics: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum InteractionType {
    #[default]
    TextInput,
    ValueSelected,
    ActionExecuted,
}

/// Why a chat request was refused before its stream opened.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{message}")]
    Invalid { field: &'static str, message: String },
    #[error("{message}")]
    TooLarge { field: &'static str, message: String },
    #[error("{message}")]
    NotFound { field: &'static str, message: String },
    #[error("{0}")]
    Unavailable(String),
    /// Too many runs at once for this user.
    #[error("{message}")]
    Busy { message: String, retry_after: Duration },
    #[error(transparent)]
    Store(#[from] StoreError),
}

const TITLE_PROMPT: &str = "Write a title of at most six words for a conversation that starts with the \
     user's message below. Answer with the title only, without quotes or a final period.";

#[derive(Clone)]
pub struct ChatService {
    pub(super) settings: Arc<Settings>,
    pub(super) store: Arc<dyn Store>,
    pub(super) providers: Providers,
    pub(super) tools: Arc<Registry>,
    pub(super) runs: Runs,
    pub(super) log: EventLog,
    pub(super) starts: StartWriter,
    /// For server-side action handlers given as URLs.
    pub(super) http: reqwest::Client,
    /// This process, as the owner of the runs it starts.
    pub(super) replica_id: String,
    /// Set when the server drains for shutdown: no new runs.
    pub(super) draining: Arc<AtomicBool>,
    /// What other processes tell of their runs.
    pub(super) news: RunNews,
}

impl ChatService {
    pub fn new(
        settings: Arc<Settings>,
        store: Arc<dyn Store>,
        providers: Providers,
        tools: Arc<Registry>,
        runs: Runs,
        log: EventLog,
    ) -> Self {
        let http = reqwest::Client::builder()
            .http1_only()
            .timeout(Duration::from_secs_f64(settings.tools.timeout_secs.max(0.001)))
            .build()
            .expect("the TLS backend initialises");
        Self {
            starts: StartWriter::start(store.clone()),
            settings,
            store,
            providers,
            tools,
            runs,
            log,
            http,
            replica_id: new_id().to_string(),
            draining: Arc::new(AtomicBool::new(false)),
            news: RunNews::default(),
        }
    }

    pub fn runs(&self) -> &Runs {
        &self.runs
    }

    /// The event log writer (its batch count shows how often runs write).
    pub fn event_log(&self) -> &EventLog {
        &self.log
    }

    /// Where this process hears what the others tell of their runs.
    pub fn news(&self) -> &RunNews {
        &self.news
    }

    pub fn replica_id(&self) -> &str {
        &self.replica_id
    }

    /// Refuses new runs from now on (shutdown).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether the server is shutting down (readiness says no meanwhile).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Validates and persists the request, then starts its run; returns the live run to follow.
    pub async fn start(&self, user: &str, request: ChatRequest) -> Result<Arc<LiveRun>, ChatError> {
        let turn = self.prepare(user, &request, 1).await?;
        let profile = request
            .profile
            .clone()
            .or_else(|| turn.existing_profile.clone())
            .unwrap_or_else(|| self.settings.chat.default_profile.clone());
        let side = self.plan(user, &request, &turn, &profile, None)?;
        let mut runs = self.launch(user, turn, vec![side], None).await?;
        Ok(runs.remove(0))
    }

    /// Starts one message answered by two profiles side by side (CONTRACT.md §10): two full
    /// runs, two traces, one comparison; both answers become siblings under the message.
    pub async fn start_comparison(
        &self,
        user: &str,
        request: &ChatRequest,
        profile_a: &str,
        profile_b: &str,
    ) -> Result<(Comparison, Arc<LiveRun>, Arc<LiveRun>), ChatError> {
        let turn = self.prepare(user, request, 2).await?;
        let comparison_id = new_id();
        let a = self.plan(user, request, &turn, profile_a, Some((comparison_id, "a")))?;
        let b = self.plan(user, request, &turn, profile_b, Some((comparison_id, "b")))?;
        let comparison = Comparison {
            comparison_id,
            conversation_id: turn.conversation_id,
            user_id: user.to_owned(),
            user_message_id: turn.user_message.id,
            trace_a: a.trace.trace_id,
            trace_b: b.trace.trace_id,
            profile_a: profile_a.to_owned(),
            profile_b: profile_b.to_owned(),
            model_a: a.trace.model.clone(),
            model_b: b.trace.model.clone(),
            preference: None,
            voted_at: None,
            vote_history: Vec::new(),
            created_at: now(),
        };
        let mut runs = self.launch(user, turn, vec![a, b], Some(comparison.clone())).await?;
        let run_b = runs.pop().expect("two runs");
        let run_a = runs.pop().expect("two runs");
        Ok((comparison, run_a, run_b))
    }

    /// Everything about a request that does not depend on the profile: the message checked,
    /// the conversation found (or made), the parent, the history, an executed action's result.
    /// `runs`: how many runs the request will start (two for a comparison).
    async fn prepare(&self, user: &str, request: &ChatRequest, runs: usize) -> Result<Prepared, ChatError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ChatError::Unavailable("The server is shutting down; try again shortly".into()));
        }
        let text = request.message.trim();
        if text.is_empty() {
            return Err(ChatError::Invalid { field: "message", message: "Message cannot be empty".into() });
        }
        // A run sent right after start-up must not go without the MCP servers' tools because
        // they are still starting (bounded by `tools.mcp_start_wait_secs`).
        self.tools.mcp().wait_started().await;
        let limit = self.settings.limits.max_concurrent_runs_per_user;
        let reservation = self.runs.reserve(user, runs, limit).map_err(busy)?;
        let max = self.settings.limits.max_message_chars;
        if text.chars().count() > max {
            return Err(ChatError::TooLarge {
                field: "message",
                message: format!("Message is longer than {max} characters"),
            });
        }
        let existing = match request.conversation_id {
            Some(id) => Some(self.store.get_conversation(user, id).await.map_err(|e| match e {
                StoreError::NotFound => not_found("conversation_id", "Conversation not found"),
                e => e.into(),
            })?),
            None => None,
        };
        for profile in request.profile.iter() {
            if !self.settings.profiles.contains_key(profile) {
                return Err(not_found("profile", "Profile not found"));
            }
        }
        let history = match &existing {
            Some(conversation) => self.store.messages(user, conversation.id).await?,
            None => Vec::new(),
        };
        // Branching: after an answer, the new message continues from it; naming a user
        // message with its own text regenerates its answer (a sibling of the earlier ones),
        // with other text it is an edit (a sibling of that message).
        let mut regenerate: Option<Message> = None;
        let parent = match request.parent_message_id {
            Some(id) => match history.iter().find(|m| m.id == id) {
                Some(m) if m.role == Role::User && m.content == text => {
                    regenerate = Some(m.clone());
                    m.parent_id
                }
                Some(m) if m.role == Role::User => m.parent_id,
                Some(m) => Some(m.id),
                None => return Err(not_found("parent_message_id", "Parent message not found")),
            },
            None => existing.as_ref().and_then(|c| c.active_leaf_id),
        };
        let new_conversation = match &existing {
            Some(_) => None,
            None => Some(Conversation {
                profile: request.profile.clone(),
                ..Conversation::new(user, title_from(text, self.settings.chat.title_max_chars))
            }),
        };
        let conversation = existing.as_ref().or(new_conversation.as_ref()).expect("one of the two is set");
        let action_result = match request.interaction_type {
            InteractionType::ActionExecuted => {
                Some(self.run_action(request.action.as_ref(), request.context.as_ref()).await)
            }
            _ => None,
        };
        Ok(Prepared {
            conversation_id: conversation.id,
            system_prompt: conversation.system_prompt.clone(),
            existing_profile: existing.as_ref().and_then(|c| c.profile.clone()),
            user_message_is_new: regenerate.is_none(),
            user_message: regenerate
                .unwrap_or_else(|| Message::new(conversation.id, parent, Role::User, text.to_owned())),
            earlier: branch(&history, parent),
            new_conversation,
            action_result,
            max_running: self.store.is_shared().then_some(limit),
            reservation,
        })
    }

    /// One side of a request: the trace and the run plan for `profile_name`.
    fn plan(
        &self,
        user: &str,
        request: &ChatRequest,
        turn: &Prepared,
        profile_name: &str,
        comparison: Option<(Uuid, &str)>,
    ) -> Result<Side, ChatError> {
        let field = match comparison {
            Some((_, "a")) => "profile_a",
            Some(_) => "profile_b",
            None => "profile",
        };
        let profile = self.settings.profiles.get(profile_name).ok_or_else(|| not_found(field, "Profile not found"))?;
        let provider = self.providers.get(&profile.provider).ok_or_else(|| not_found(field, "Profile not found"))?;
        let trace = Trace {
            comparison_id: comparison.map(|(id, _)| id),
            variant: comparison.map(|(_, v)| v.to_owned()),
            ..Trace::start(user, &turn.user_message, &profile.model, profile_name)
        };
        let scope = PageScope::resolve(&self.settings, request.context.as_ref());
        let tools = self.tools.for_request(&scope, &profile.tools);
        let specs: Vec<ToolSpec> = tools.iter().map(|t| t.spec()).collect();
        let payload_types = self.payload_types(&scope);
        let mut system_prompt = prompt::system_prompt(&PromptParts {
            base: turn.system_prompt.as_deref().or(profile.system_prompt.as_deref()),
            scope: &scope,
            context: request.context.as_ref(),
            history: &turn.earlier,
            tools: &specs,
            payload_types: &payload_types,
            actions: &self.settings.actions,
        });
        if let Some(outcome) = &turn.action_result {
            system_prompt.push_str(&format!("\n\n## Action result\n{outcome}"));
        }
        let mut messages = turn.earlier.clone();
        messages.push(turn.user_message.clone());
        let diagnostics = (request.diagnostics && self.settings.chat.allow_diagnostics).then(|| {
            json!({
                "model": profile.model,
                "max_tokens": profile.max_tokens,
                "max_iterations": profile.max_iterations,
                "temperature": profile.temperature,
                "tools": specs.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
                "system_prompt": system_prompt,
                "messages": messages.iter().map(|m| json!({"role": m.role, "content": m.content})).collect::<Vec<_>>(),
                "context": request.context,
            })
        });
        let limits = &self.settings.tools;
        let plan = RunPlan {
            conversation_id: turn.conversation_id,
            user_message_id: turn.user_message.id,
            message_id: trace.message_id,
            trace_id: trace.trace_id,
            profile: profile_name.to_owned(),
            provider,
            request: ModelRequest {
                model: profile.model.clone(),
                system_prompt: Some(system_prompt),
                messages,
                temperature: profile.temperature,
                max_tokens: profile.max_tokens,
                enable_thinking: profile.enable_thinking,
                thinking_budget: profile.thinking_budget,
                reasoning_effort: profile.reasoning_effort.clone(),
                tools: specs,
            },
            tools,
            max_iterations: profile.max_iterations,
            payload_types,
            limits: ToolLimits {
                timeout: Duration::from_secs_f64(limits.timeout_secs.max(0.001)),
                max_output_chars: limits.max_output_chars,
                max_retries: limits.max_retries,
            },
            diagnostics,
            comparison: comparison.map(|(id, variant)| (id, variant.to_owned())),
            context_limit: profile.context_limit,
            context: ContextKeeper::new(
                self.store.clone(),
                user,
                turn.conversation_id,
                turn.new_conversation.is_some(),
            ),
            summarize_dropped: self.settings.chat.summarize_dropped,
        };
        Ok(Side { trace, plan })
    }

    /// Persists the message and the traces in one transaction, then starts each run in a
    /// task of its own.
    async fn launch(
        &self,
        user: &str,
        turn: Prepared,
        sides: Vec<Side>,
        comparison: Option<Comparison>,
    ) -> Result<Vec<Arc<LiveRun>>, ChatError> {
        let (traces, plans): (Vec<Trace>, Vec<RunPlan>) = sides.into_iter().map(|s| (s.trace, s.plan)).unzip();
        let start = RunStart {
            new_conversation: turn.new_conversation,
            user_message: turn.user_message,
            user_message_is_new: turn.user_message_is_new,
            traces,
            comparison,
            replica_id: self.replica_id.clone(),
            max_running: turn.max_running,
        };
        let reservation = turn.reservation;
        // The start writer launches the runs right after the commit, whether or not this
        // request is still waiting: a client that leaves meanwhile must not leave a run
        // persisted as running that nobody runs.
        let (done, launched) = oneshot::channel();
        let service = self.clone();
        let user = user.to_owned();
        self.starts.write(start, move |written| {
            let runs = written
                .map_err(|e| match e {
                    // Other replicas' runs filled the user's limit meanwhile.
                    StoreError::TooManyRuns(running) => busy(running),
                    e => e.into(),
                })
                .map(|start| service.run_written(&user, start, plans));
            let _ = done.send(runs);
        });
        let launched = launched.await.map_err(|_| ChatError::Unavailable("the run could not start".into()))?;
        // The runs are registered now: they count themselves.
        drop(reservation);
        launched
    }

    /// Registers and spawns the runs of a start that is in the database.
    fn run_written(&self, user: &str, start: RunStart, plans: Vec<RunPlan>) -> Vec<Arc<LiveRun>> {
        let mut runs = Vec::new();
        for plan in plans {
            let (run, mut emitter) =
                self.runs.register(plan.trace_id, plan.message_id, plan.conversation_id, user, self.log.clone());
            agent::announce(&plan, &mut emitter);
            tokio::spawn(agent::supervise(plan, emitter, self.store.clone(), self.runs.clone()));
            runs.push(run);
        }
        if start.new_conversation.is_some() && self.settings.chat.refine_titles {
            if let Some(run) = runs.first() {
                self.refine_title(user, start.user_message.conversation_id, &start.user_message.content, run.clone());
            }
        }
        runs
    }
}

/// The profile-independent part of a request, ready to persist.
struct Prepared {
    conversation_id: Uuid,
    system_prompt: Option<String>,
    existing_profile: Option<String>,
    user_message: Message,
    /// False when regenerating: the user's message is stored already.
    user_message_is_new: bool,
    /// The active branch up to the new message's parent.
    earlier: Vec<Message>,
    new_conversation: Option<Conversation>,
    action_result: Option<String>,
    /// The user's limit of running runs, checked again in the start's transaction where
    /// other replicas start runs too.
    max_running: Option<usize>,
    /// Room for the request's runs among its user's, until they are registered.
    reservation: Reservation,
}

/// The refusal of a request over its user's limit of running runs.
fn busy(running: usize) -> ChatError {
    ChatError::Busy {
        message: format!("{running} answers are still streaming; wait for one to finish"),
        retry_after: Duration::from_secs(1),
    }
}

/// One run of a request (a comparison has two).
struct Side {
    trace: Trace,
    plan: RunPlan,
}

impl ChatService {
    /// Replaces the first-message title by a short one the default profile's model writes,
    /// after the first answer, unless the user renamed the conversation meanwhile. Never
    /// blocks or fails a stream.
    fn refine_title(&self, user: &str, conversation_id: Uuid, first_message: &str, run: Arc<LiveRun>) {
        let (store, settings, providers) = (self.store.clone(), self.settings.clone(), self.providers.clone());
        let (user, first_message) = (user.to_owned(), first_message.to_owned());
        tokio::spawn(async move {
            run.finished().await;
            let profile = &settings.profiles[&settings.chat.default_profile];
            let Some(provider) = providers.get(&profile.provider) else {
                return;
            };
            let message = Message::new(conversation_id, None, Role::User, first_message.clone());
            let request = ModelRequest {
                model: profile.model.clone(),
                system_prompt: Some(TITLE_PROMPT.to_owned()),
                messages: vec![message],
                temperature: Some(0.2),
                max_tokens: Some(30),
                enable_thinking: false,
                thinking_budget: None,
                reasoning_effort: None,
                tools: Vec::new(),
            };
            let Some(text) = super::turn::complete_text(&*provider, &request).await else { return };
            let title: String = text.trim_matches('"').chars().take(settings.chat.title_max_chars).collect();
            if title.is_empty() {
                return;
            }
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

    /// The payload types the model may write here: global ones and the page's, with a marker.
    fn payload_types(&self, scope: &PageScope) -> Vec<LlmPayloadType> {
        self.settings
            .payload_types
            .iter()
            .filter(|(name, t)| t.source == PayloadSource::Llm && (t.is_global || scope.payload_types.contains(name)))
            .filter_map(|(name, t)| {
                let marker = t.parse_marker.clone()?;
                Some(LlmPayloadType { name: name.clone(), marker, settings: t.clone() })
            })
            .collect()
    }

    /// Runs the server handler of an executed action (an HTTP URL or a tool) and describes
    /// the outcome for the model. A failure is described, not raised: the turn goes on.
    async fn run_action(&self, action: Option<&Value>, context: Option<&Value>) -> String {
        let name = action.and_then(|a| a.get("action")).and_then(Value::as_str).unwrap_or_default();
        let data = action.and_then(|a| a.get("data")).cloned().unwrap_or(Value::Null);
        let Some(handler) = self.settings.actions.get(name) else {
            return format!("The user executed the client action `{name}` with data {data}.");
        };
        let result = if let Some(url) = &handler.url {
            let body = json!({"action": name, "data": data, "context": context});
            match self.http.post(url).json(&body).send().await {
                Ok(response) if response.status().is_success() => response.text().await.map_err(|e| e.to_string()),
                Ok(response) => Err(format!("the handler answered {}", response.status())),
                Err(e) => Err(format!("the handler could not be reached: {e}")),
            }
        } else if let Some(tool_name) = &handler.tool {
            match self.tools.all().into_iter().find(|t| t.tool.spec().name == *tool_name) {
                Some(available) => {
                    let (progress, _) = tokio::sync::mpsc::unbounded_channel();
                    let ctx = ToolCallContext { progress, cancel: CancellationToken::new() };
                    available.tool.call(data.clone(), ctx).await.map(|o| o.text).map_err(|e| e.message)
                }
                None => Err(format!("its tool `{tool_name}` is not available")),
            }
        } else {
            Err("it has no handler configured".to_owned())
        };
        match result {
            Ok(text) => format!("The user executed the action `{name}` with data {data}. Its result:\n{text}"),
            Err(problem) => {
                tracing::warn!(action = name, %problem, "server action failed");
                format!("The user executed the action `{name}` with data {data}, but it failed: {problem}.")
            }
        }
    }
}

fn not_found(field: &'static str, message: &str) -> ChatError {
    ChatError::NotFound { field, message: message.to_owned() }
}

/// A conversation's first title: the message's first line, cut to `max` characters.
pub fn title_from(message: &str, max: usize) -> String {
    let line = message.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("New conversation");
    let collapsed = line.split_whitespace().collect::<Vec<_>>().join(" ");
    if collapsed.chars().count() <= max {
        return collapsed;
    }
    let cut: String = collapsed.chars().take(max.saturating_sub(1)).collect();
    format!("{}…", cut.trim_end())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn titles_come_from_the_first_line() {
        assert_eq!(title_from("  Hello   world \nsecond", 60), "Hello world");
        assert_eq!(title_from("abcdefghij", 5), "abcd…");
        assert_eq!(title_from("\n\n", 7), "New co…");
    }
}
