//! Server-side handlers of actions a user executed (`actions.*`: an HTTP URL or a tool):
//! their outcome goes to the model as part of the turn.

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::chat::shared::Shared;
use crate::tools::ToolCallContext;

/// Runs the server handlers of executed actions.
#[derive(Clone)]
pub(in crate::chat) struct Actions {
    settings: std::sync::Arc<crate::config::Settings>,
    tools: std::sync::Arc<crate::tools::Registry>,
    http: reqwest::Client,
}

impl Actions {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self { settings: shared.settings.clone(), tools: shared.tools.clone(), http: shared.http.clone() }
    }

    /// Runs the server handler of an executed action (an HTTP URL or a tool) and describes
    /// the outcome for the model. A failure is described, not raised: the turn goes on.
    pub(in crate::chat) async fn run_action(&self, action: Option<&Value>, context: Option<&Value>) -> String {
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
            match self.tools.all().into_iter().find(|t| t.tool.name() == tool_name) {
                Some(available) => {
                    let (progress, _) = tokio::sync::mpsc::unbounded_channel();
                    let ctx = ToolCallContext { progress, cancel: CancellationToken::new(), idempotency_key: None };
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
