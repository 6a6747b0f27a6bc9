//! One side of a request, planned: its trace, and the run with its profile's model, the
//! page's tools and payload types, the system prompt, and the diagnostics a client may ask for.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::events::{DiagnosticMessage, Diagnostics};

use super::attachments::FileReader;
use crate::chat::errors::{ChatError, not_found, unknown_profile};
use crate::chat::request::ClientTool;
use crate::chat::run::agent::{Fallback, Gate, RunPlan, ToolLimits};
use crate::chat::run::context::ContextKeeper;
use crate::chat::run::payloads::LlmPayloadType;
use crate::chat::run::prompt::{self, PromptParts};
use crate::chat::shared::Shared;
use crate::config::pages::{Location, PageScope};
use crate::config::{PayloadSource, ProfileSettings, PromptCache, ProviderKind};
use crate::domain::{Message, Trace};
use crate::ids::{ComparisonId, ConversationId, UserId};
use crate::providers::transport::Retries;
use crate::providers::{InputMessage, ModelRequest, ToolSpec};

/// What a run may use (see [`Planner::equip`]).
pub(in crate::chat) struct Equipment {
    pub(in crate::chat) scope: PageScope,
    pub(in crate::chat) tools: Vec<std::sync::Arc<dyn crate::tools::Tool>>,
    pub(in crate::chat) specs: Vec<ToolSpec>,
    pub(in crate::chat) gates: HashMap<String, Gate>,
    pub(in crate::chat) payload_types: Vec<LlmPayloadType>,
}

/// One run of a request (a comparison has two).
pub(in crate::chat) struct Side {
    pub(in crate::chat) trace: Trace,
    pub(in crate::chat) plan: RunPlan,
}

/// What a run is asked, as planning reads it: from a request being started, or from a
/// queued run whose turn came (CONTRACT.md §16).
pub(in crate::chat) struct Ask<'a> {
    pub(in crate::chat) conversation_id: ConversationId,
    pub(in crate::chat) new_conversation: bool,
    pub(in crate::chat) system_prompt: Option<&'a str>,
    /// The branch up to the question.
    pub(in crate::chat) earlier: &'a [Message],
    pub(in crate::chat) user_message: &'a Message,
    pub(in crate::chat) action_result: Option<&'a str>,
    pub(in crate::chat) context: Option<&'a Value>,
    pub(in crate::chat) client_tools: &'a [ClientTool],
    pub(in crate::chat) diagnostics: bool,
    /// The request's own instructions, added to the system prompt's.
    pub(in crate::chat) instructions: Option<&'a str>,
    /// The request's output limit and temperature, over the profile's.
    pub(in crate::chat) max_tokens: Option<u32>,
    pub(in crate::chat) temperature: Option<f64>,
    /// Kept with its trace (the Responses API's `metadata`).
    pub(in crate::chat) metadata: Option<&'a Value>,
}

/// What a run was asked beside its message, kept with its trace where it is not all
/// defaults: a queued run is planned from it when its turn comes (CONTRACT.md §16), and a
/// run whose process died before it completed a step, when it is continued (§19).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub(in crate::chat) struct Asked {
    pub(in crate::chat) context: Option<Value>,
    pub(in crate::chat) client_tools: Vec<ClientTool>,
    pub(in crate::chat) diagnostics: bool,
    /// An executed action's outcome (it ran when the message was sent).
    pub(in crate::chat) action_result: Option<String>,
    /// The request's own instructions, output limit and temperature (CONTRACT.md §20).
    pub(in crate::chat) instructions: Option<String>,
    pub(in crate::chat) max_tokens: Option<u32>,
    pub(in crate::chat) temperature: Option<f64>,
}

impl Asked {
    /// What a trace keeps of it: nothing where it is all defaults.
    pub(in crate::chat) fn kept(&self) -> Option<Value> {
        let defaults = self.context.is_none()
            && self.client_tools.is_empty()
            && !self.diagnostics
            && self.action_result.is_none()
            && self.instructions.is_none()
            && self.max_tokens.is_none()
            && self.temperature.is_none();
        (!defaults).then(|| serde_json::to_value(self).expect("plain data"))
    }
}

/// Plans runs: the model, tools, prompt and context a run will use.
#[derive(Clone)]
pub(in crate::chat) struct Planner {
    settings: std::sync::Arc<crate::config::Settings>,
    providers: crate::providers::Providers,
    prices: std::sync::Arc<crate::pricing::Prices>,
    tools: std::sync::Arc<crate::tools::Registry>,
    store: std::sync::Arc<dyn crate::store::Store>,
    files: crate::files::Files,
}

impl Planner {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self {
            settings: shared.settings.clone(),
            providers: shared.providers.clone(),
            prices: shared.prices.clone(),
            tools: shared.tools.clone(),
            store: shared.store.clone(),
            files: shared.files.clone(),
        }
    }

    /// One side of a request: the trace and the run plan for `profile_name`.
    pub(in crate::chat) fn plan(
        &self,
        user: &UserId,
        turn: &Ask<'_>,
        profile_name: &str,
        comparison: Option<(ComparisonId, &str)>,
    ) -> Result<Side, ChatError> {
        let field = match comparison {
            Some((_, "a")) => "profile_a",
            Some(_) => "profile_b",
            None => "profile",
        };
        let profile =
            self.settings.profiles.get(profile_name).ok_or_else(|| not_found(field, &unknown_profile(profile_name)))?;
        let provider = self.providers.get(&profile.provider).ok_or_else(|| not_found(field, "Profile not found"))?;
        let kind = self.settings.providers.get(&profile.provider).map_or(ProviderKind::Mock, |p| p.kind);
        super::attachments::check_modalities(&turn.user_message.attachments, profile_name, profile, kind)?;
        let trace = Trace {
            comparison_id: comparison.map(|(id, _)| id),
            variant: comparison.map(|(_, v)| v.to_owned()),
            traceparent: crate::report::otlp::incoming_traceparent(),
            metadata: turn.metadata.cloned(),
            ..Trace::start(user, turn.user_message, &profile.model, profile_name)
        };
        let Equipment { scope, tools, specs, gates, payload_types } =
            self.equip(profile, turn.context, turn.client_tools)?;
        let parts = PromptParts {
            base: turn.system_prompt.or(profile.system_prompt.as_deref()),
            scope: &scope,
            context: turn.context,
            history: turn.earlier,
            tools: &specs,
            payload_types: &payload_types,
            actions: &self.settings.actions,
            instructions: turn.instructions,
        };
        let system_prompt = prompt::system_prompt(&parts);
        let notes = prompt::notes(&parts, turn.action_result);
        let messages: Vec<InputMessage> =
            turn.earlier.iter().chain([turn.user_message]).filter_map(InputMessage::of).collect();
        let diagnostics = (turn.diagnostics && self.settings.chat.allow_diagnostics).then(|| {
            Box::new(Diagnostics {
                model: profile.model.clone(),
                max_tokens: turn.max_tokens.or(profile.max_tokens),
                max_iterations: profile.max_iterations,
                temperature: turn.temperature.or(profile.temperature),
                tools: specs.iter().map(|t| t.name.clone()).collect(),
                system_prompt: system_prompt.clone(),
                notes: notes.clone(),
                messages: turn
                    .earlier
                    .iter()
                    .chain([turn.user_message])
                    .map(|m| DiagnosticMessage { role: m.role, content: m.content.clone() })
                    .collect(),
                context: turn.context.cloned(),
                raw_llm_response: String::new(),
            })
        });
        let plan = RunPlan {
            conversation_id: turn.conversation_id,
            user_message_id: turn.user_message.id,
            message_id: trace.message_id,
            trace_id: trace.trace_id,
            profile: profile_name.to_owned(),
            provider_id: profile.provider.clone(),
            provider,
            request: ModelRequest {
                model: profile.model.clone(),
                system_prompt: Some(system_prompt.into()),
                messages: Arc::new(messages),
                temperature: turn.temperature.or(profile.temperature),
                max_tokens: turn.max_tokens.or(profile.max_tokens),
                enable_thinking: profile.enable_thinking,
                thinking_budget: profile.thinking_budget,
                reasoning_effort: profile.reasoning_effort.clone(),
                tools: Arc::new(specs),
                notes,
                prompt_cache: (profile.prompt_cache == PromptCache::Auto).then_some(profile.prompt_cache_ttl),
                cache_key: Some(turn.conversation_id.to_string()),
            },
            tools,
            max_iterations: profile.max_iterations,
            payload_types,
            limits: self.tool_limits(),
            diagnostics,
            comparison: comparison.map(|(id, variant)| (id, variant.to_owned())),
            context_limit: profile.context_limit,
            context: ContextKeeper::new(self.store.clone(), user, turn.conversation_id, turn.new_conversation),
            summarize_dropped: self.settings.chat.summarize_dropped,
            user_id: user.clone(),
            gates,
            approval_timeout: self.approval_timeout(),
            context_value: turn.context.cloned(),
            client_tools: turn.client_tools.to_vec(),
            files: FileReader::new(self.files.clone(), user, profile.modalities.clone(), kind),
            retries: self.retries(&profile.provider),
            fallbacks: self.fallbacks(profile),
            prices: self.prices.clone(),
            budgets: crate::domain::budget::Budgets::of(&self.settings, user.as_str(), crate::domain::now()),
            early: None,
        };
        Ok(Side { trace, plan })
    }

    pub(in crate::chat) fn settings(&self) -> &crate::config::Settings {
        &self.settings
    }

    /// How often a call to provider `id` is tried again.
    fn retries(&self, id: &str) -> Retries {
        self.settings.providers.get(id).map(Retries::of).unwrap_or_default()
    }

    /// The profiles that answer instead of `profile` when its model fails (config checked
    /// that each is one), in order.
    fn fallbacks(&self, profile: &ProfileSettings) -> Vec<Fallback> {
        let configured = profile.fallbacks.iter().filter_map(|id| Some((id, self.settings.profiles.get(id)?)));
        configured
            .filter_map(|(id, fallback)| {
                Some(Fallback {
                    profile: id.clone(),
                    provider_id: fallback.provider.clone(),
                    provider: self.providers.get(&fallback.provider)?,
                    retries: self.retries(&fallback.provider),
                    model: fallback.model.clone(),
                    temperature: fallback.temperature,
                    max_tokens: fallback.max_tokens,
                    enable_thinking: fallback.enable_thinking,
                    thinking_budget: fallback.thinking_budget,
                    reasoning_effort: fallback.reasoning_effort.clone(),
                })
            })
            .collect()
    }

    /// What a run of `profile` may use, for a request with this context and client tools:
    /// the page's scope, the tools (and their specs for the model, client tools last), which
    /// calls wait (CONTRACT.md §15), and the payload types.
    pub(in crate::chat) fn equip(
        &self,
        profile: &ProfileSettings,
        context: Option<&Value>,
        client_tools: &[ClientTool],
    ) -> Result<Equipment, ChatError> {
        let scope = PageScope::resolve(&self.settings, Location::of_context(context));
        let tools = self.tools.for_request(&scope, &profile.tools);
        let mut specs: Vec<ToolSpec> = tools.iter().map(|t| t.spec()).collect();
        let patterns: Vec<String> =
            self.settings.tools.require_approval.iter().chain(&profile.require_approval).cloned().collect();
        let mut gates: HashMap<String, Gate> =
            self.tools.matching(&tools, &patterns).into_iter().map(|name| (name, Gate::Approval)).collect();
        for client in self.client_tools(client_tools, &specs)? {
            gates.insert(client.name.clone(), Gate::Client);
            specs.push(ToolSpec {
                name: client.name.clone(),
                description: client.description.clone(),
                input_schema: client.parameters.clone(),
            });
        }
        let payload_types = self.payload_types(&scope);
        Ok(Equipment { scope, tools, specs, gates, payload_types })
    }

    /// How long an approval may wait (checked at load: finite, above 0).
    pub(in crate::chat) fn approval_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.settings.tools.approval_timeout_secs)
    }

    pub(in crate::chat) fn tool_limits(&self) -> ToolLimits {
        let limits = &self.settings.tools;
        ToolLimits {
            timeout: Duration::from_secs_f64(limits.timeout_secs.max(0.001)),
            max_output_chars: limits.max_output_chars,
            max_retries: limits.max_retries,
        }
    }

    /// The client tools of a request: those it declares, then config's (`client_tools.<name>`)
    /// it does not. A name that is not a tool name, or that a server tool has, is refused.
    fn client_tools(&self, declared: &[ClientTool], server: &[ToolSpec]) -> Result<Vec<ClientTool>, ChatError> {
        let configured = self.settings.client_tools.iter().map(|(name, t)| ClientTool {
            name: name.clone(),
            description: t.description.clone(),
            parameters: t.parameters.clone(),
        });
        let mut tools: Vec<ClientTool> = Vec::new();
        for tool in declared.iter().cloned().chain(configured) {
            let valid = !tool.name.is_empty()
                && tool.name.len() <= 64
                && tool.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !valid {
                return Err(ChatError::Invalid {
                    field: "client_tools",
                    message: format!(
                        "Client tool name {:?} is not a tool name: 1 to 64 letters, digits, '_' or '-'",
                        tool.name
                    ),
                });
            }
            if server.iter().any(|s| s.name == tool.name) {
                return Err(ChatError::Invalid {
                    field: "client_tools",
                    message: format!("Client tool {:?} has the name of a server tool", tool.name),
                });
            }
            if !tools.iter().any(|t| t.name == tool.name) {
                tools.push(tool);
            }
        }
        Ok(tools)
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
}

impl Planner {
    /// The plan of a run whose trace is stored already, from the start: a queued run whose
    /// turn came, or a run continued that had completed no step. Planned as it was asked, on
    /// the branch as it is now (the answers before it stored).
    pub(in crate::chat) async fn plan_stored(&self, trace: &Trace, asked: &Asked) -> Result<RunPlan, String> {
        let user = &trace.user_id;
        let conversation = self.store.get_conversation(user, trace.conversation_id).await.map_err(|e| e.to_string())?;
        let history = self.store.messages(user, trace.conversation_id).await.map_err(|e| e.to_string())?;
        let question =
            history.iter().find(|m| m.id == trace.user_message_id).ok_or_else(|| "its message is gone".to_owned())?;
        let earlier = crate::domain::branch(&history, question.parent_id);
        let ask = Ask {
            conversation_id: trace.conversation_id,
            new_conversation: false,
            system_prompt: conversation.system_prompt.as_deref(),
            earlier: &earlier,
            user_message: question,
            action_result: asked.action_result.as_deref(),
            context: asked.context.as_ref(),
            client_tools: &asked.client_tools,
            diagnostics: asked.diagnostics,
            instructions: asked.instructions.as_deref(),
            max_tokens: asked.max_tokens,
            temperature: asked.temperature,
            metadata: trace.metadata.as_ref(),
        };
        let comparison = trace.comparison_id.zip(trace.variant.as_deref());
        let mut side = self.plan(user, &ask, &trace.profile, comparison).map_err(|e| e.to_string())?;
        // The trace it was stored with, not the new one planning drew.
        side.plan.trace_id = trace.trace_id;
        side.plan.message_id = trace.message_id;
        Ok(side.plan)
    }

    /// The run's plan again, for its continuation: its profile's model, fallbacks and tools
    /// as config has them now (a fallback that answered before the wait does not stay), the
    /// request as it was.
    pub(in crate::chat) fn replan(
        &self,
        trace: &Trace,
        checkpoint: &super::agent::Checkpoint,
    ) -> Result<RunPlan, String> {
        let profile = self
            .settings
            .profiles
            .get(&trace.profile)
            .ok_or_else(|| format!("its profile '{}' is no longer configured", trace.profile))?;
        let provider = self
            .providers
            .get(&profile.provider)
            .ok_or_else(|| format!("its provider '{}' is gone", profile.provider))?;
        let Equipment { tools, gates, payload_types, .. } =
            self.equip(profile, checkpoint.context.as_ref(), &checkpoint.client_tools).map_err(|e| e.to_string())?;
        Ok(RunPlan {
            conversation_id: trace.conversation_id,
            user_message_id: trace.user_message_id,
            message_id: trace.message_id,
            trace_id: trace.trace_id,
            profile: trace.profile.clone(),
            provider_id: profile.provider.clone(),
            provider,
            request: ModelRequest {
                model: profile.model.clone(),
                temperature: profile.temperature,
                max_tokens: profile.max_tokens,
                enable_thinking: profile.enable_thinking,
                thinking_budget: profile.thinking_budget,
                reasoning_effort: profile.reasoning_effort.clone(),
                ..checkpoint.request()
            },
            tools,
            max_iterations: profile.max_iterations,
            payload_types,
            limits: self.tool_limits(),
            diagnostics: None,
            comparison: trace.comparison_id.zip(trace.variant.clone()),
            context_limit: profile.context_limit,
            context: ContextKeeper::new(self.store.clone(), &trace.user_id, trace.conversation_id, false),
            summarize_dropped: self.settings.chat.summarize_dropped,
            user_id: trace.user_id.clone(),
            gates,
            approval_timeout: self.approval_timeout(),
            context_value: checkpoint.context.clone(),
            client_tools: checkpoint.client_tools.clone(),
            files: crate::chat::run::attachments::FileReader::new(
                self.files.clone(),
                &trace.user_id,
                profile.modalities.clone(),
                self.settings.providers.get(&profile.provider).map_or(crate::config::ProviderKind::Mock, |p| p.kind),
            ),
            retries: self.retries(&profile.provider),
            fallbacks: self.fallbacks(profile),
            prices: self.prices.clone(),
            budgets: crate::domain::budget::Budgets::of(&self.settings, trace.user_id.as_str(), crate::domain::now()),
            early: None,
        })
    }
}
