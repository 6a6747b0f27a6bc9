//! One side of a request, planned: its trace, and the run with its profile's model, the
//! page's tools and payload types, the system prompt, and the diagnostics a client may ask for.

use std::time::Duration;

use crate::events::{DiagnosticMessage, Diagnostics};

use super::agent::{RunPlan, ToolLimits};
use super::context::ContextKeeper;
use super::core::Core;
use super::payloads::LlmPayloadType;
use super::prompt::{self, PromptParts};
use super::request::{ChatError, ChatRequest, Prepared, not_found};
use crate::config::PayloadSource;
use crate::domain::Trace;
use crate::ids::{ComparisonId, UserId};
use crate::pages::{Location, PageScope};
use crate::providers::{InputMessage, ModelRequest, ToolSpec};

/// One run of a request (a comparison has two).
pub(super) struct Side {
    pub(super) trace: Trace,
    pub(super) plan: RunPlan,
}

impl Core {
    /// One side of a request: the trace and the run plan for `profile_name`.
    pub(super) fn plan(
        &self,
        user: &UserId,
        request: &ChatRequest,
        turn: &Prepared,
        profile_name: &str,
        comparison: Option<(ComparisonId, &str)>,
    ) -> Result<Side, ChatError> {
        let field = match comparison {
            Some((_, "a")) => "profile_a",
            Some(_) => "profile_b",
            None => "profile",
        };
        let profile = self
            .settings
            .profiles
            .get(profile_name)
            .ok_or_else(|| not_found(field, "Profile not found: GET /api/profiles lists the configured ones"))?;
        let provider = self.providers.get(&profile.provider).ok_or_else(|| not_found(field, "Profile not found"))?;
        let trace = Trace {
            comparison_id: comparison.map(|(id, _)| id),
            variant: comparison.map(|(_, v)| v.to_owned()),
            ..Trace::start(user, &turn.user_message, &profile.model, profile_name)
        };
        let scope = PageScope::resolve(&self.settings, Location::of_context(request.context.as_ref()));
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
        let messages: Vec<InputMessage> =
            turn.earlier.iter().chain([&turn.user_message]).filter_map(InputMessage::of).collect();
        let diagnostics = (request.diagnostics && self.settings.chat.allow_diagnostics).then(|| {
            Box::new(Diagnostics {
                model: profile.model.clone(),
                max_tokens: profile.max_tokens,
                max_iterations: profile.max_iterations,
                temperature: profile.temperature,
                tools: specs.iter().map(|t| t.name.clone()).collect(),
                system_prompt: system_prompt.clone(),
                messages: turn
                    .earlier
                    .iter()
                    .chain([&turn.user_message])
                    .map(|m| DiagnosticMessage { role: m.role, content: m.content.clone() })
                    .collect(),
                context: request.context.clone(),
                raw_llm_response: String::new(),
            })
        });
        let limits = &self.settings.tools;
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
