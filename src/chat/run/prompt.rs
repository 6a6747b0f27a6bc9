//! The system prompt, in sections (seed 003): identity, capabilities, custom instructions,
//! guidelines; and the request's notes: its context, the payload manifest, an action's
//! result. Empty sections are left out. The system prompt holds only what stays the same
//! from one turn to the next, so that the provider's prompt cache keeps it with the history
//! after it; the notes change with each request and go after the history (CONTRACT.md §21).

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::Value;

use super::payloads::{LlmPayloadType, SUGGESTED_ACTIONS, SUGGESTED_VALUES};
use crate::config::ActionSettings;
use crate::config::pages::PageScope;
use crate::domain::Message;
use crate::providers::ToolSpec;

pub struct PromptParts<'a> {
    /// The conversation's or the profile's own system prompt.
    pub base: Option<&'a str>,
    pub scope: &'a PageScope,
    /// The request's `context`, as the frontend sent it.
    pub context: Option<&'a Value>,
    /// Earlier messages, for the payload manifest.
    pub history: &'a [Message],
    pub tools: &'a [ToolSpec],
    pub payload_types: &'a [LlmPayloadType],
    pub actions: &'a BTreeMap<String, ActionSettings>,
    /// The request's own instructions (the Responses API's `instructions`), after the
    /// profile's and the page's.
    pub instructions: Option<&'a str>,
}

const DEFAULT_IDENTITY: &str = "You are a helpful assistant.";

pub fn system_prompt(parts: &PromptParts<'_>) -> String {
    let mut prompt = String::new();
    let (identity, extra) = match (&parts.scope.identity, parts.base) {
        (Some(page), base) => (page.as_str(), base),
        (None, Some(base)) => (base, None),
        (None, None) => (DEFAULT_IDENTITY, None),
    };
    section(&mut prompt, "Identity", identity);

    let mut capabilities = String::new();
    if !parts.tools.is_empty() {
        capabilities.push_str("Tools you can call:\n");
        for tool in parts.tools {
            let _ = writeln!(capabilities, "- {}: {}", tool.name, tool.description);
        }
    }
    if !parts.payload_types.is_empty() {
        capabilities.push_str(
            "Structured payloads you can produce (write the marker, then the JSON, at the end of your answer):\n",
        );
        for kind in parts.payload_types {
            let how = kind.settings.llm_instructions.as_deref().unwrap_or("");
            let _ = writeln!(capabilities, "- {}: `{} {{…}}` {how}", kind.name, kind.marker);
        }
    }
    if !parts.actions.is_empty() {
        capabilities.push_str("Server actions you may suggest (handler \"server\"):\n");
        for (name, action) in parts.actions {
            let _ = writeln!(capabilities, "- {name}: {}", action.description);
        }
    }
    if !capabilities.is_empty() {
        section(&mut prompt, "Capabilities", capabilities.trim_end());
    }

    let instructions: Vec<&str> = extra
        .into_iter()
        .chain(parts.scope.instructions.iter().map(String::as_str))
        .chain(parts.instructions)
        .collect();
    if !instructions.is_empty() {
        section(&mut prompt, "Instructions", &instructions.join("\n\n"));
    }

    section(
        &mut prompt,
        "Guidelines",
        &format!(
            "- Answer in Markdown.\n\
             - Tool results are shown to the user where you called the tool; summarise them instead of repeating them.\n\
             - To offer quick replies, end with a line `{SUGGESTED_VALUES} [{{\"label\": \"…\", \"value\": \"…\"}}]`.\n\
             - To offer buttons, end with a line `{SUGGESTED_ACTIONS} [{{\"label\": \"…\", \"action\": \"…\", \"handler\": \"client\" or \"server\", \"data\": {{}}}}]`.\n\
             - Write these markers only when they help, each at most once, with valid JSON."
        ),
    );
    prompt.trim_end().to_owned()
}

/// What the request adds after the history: the page context it sent, the payloads of the
/// conversation so far, and the result of the action it executed. `None` when it adds
/// nothing.
pub fn notes(parts: &PromptParts<'_>, action_result: Option<&str>) -> Option<String> {
    let mut notes = String::new();
    if let Some(context) = parts.context.filter(|c| c.as_object().is_some_and(|o| !o.is_empty())) {
        let json = serde_json::to_string_pretty(context).unwrap_or_default();
        section(&mut notes, "Context", &format!("What the user is looking at now:\n```json\n{json}\n```"));
    }
    let mut manifest = String::new();
    for payload in parts.history.iter().flat_map(|m| &m.payloads) {
        let id = payload["payload_id"].as_str().unwrap_or("?");
        let kind = payload["type"].as_str().unwrap_or("?");
        let summary = payload["summary"].as_str().unwrap_or("");
        let _ = writeln!(manifest, "- {id} ({kind}): {summary}");
    }
    if !manifest.is_empty() {
        section(&mut notes, "Payloads in this conversation", &format!("Refer to them by id.\n{manifest}"));
    }
    if let Some(outcome) = action_result {
        section(&mut notes, "Action result", outcome);
    }
    let notes = notes.trim_end();
    (!notes.is_empty()).then(|| notes.to_owned())
}

fn section(prompt: &mut String, title: &str, body: &str) {
    let _ = write!(prompt, "## {title}\n{body}\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sections_appear_only_with_content() {
        let scope = PageScope {
            identity: Some("You help with reports.".into()),
            instructions: vec!["Be terse.".into()],
            ..PageScope::default()
        };
        let tools = [ToolSpec { name: "search".into(), description: "Finds articles".into(), input_schema: json!({}) }];
        let context = json!({"current_page": "reports"});
        let parts = PromptParts {
            base: Some("Base prompt."),
            scope: &scope,
            context: Some(&context),
            history: &[],
            tools: &tools,
            payload_types: &[],
            actions: &BTreeMap::new(),
            instructions: Some("Answer in French."),
        };
        let prompt = system_prompt(&parts);
        assert!(prompt.starts_with("## Identity\nYou help with reports."));
        // What changes per request is in the notes, after the history: never in the prompt.
        assert!(!prompt.contains("## Context") && !prompt.contains("reports\""));
        let notes = notes(&parts, Some("Saved.")).unwrap();
        assert!(notes.starts_with("## Context\nWhat the user is looking at now:"), "{notes}");
        assert!(notes.ends_with("## Action result\nSaved."), "{notes}");
        assert_eq!(super::notes(&PromptParts { context: None, ..parts }, None), None);
        assert!(prompt.contains("- search: Finds articles"));
        assert!(prompt.contains("## Instructions\nBase prompt.\n\nBe terse.\n\nAnswer in French."));
        assert!(prompt.contains(SUGGESTED_VALUES));
        assert!(!prompt.contains("Payloads in this conversation"));
    }
}
