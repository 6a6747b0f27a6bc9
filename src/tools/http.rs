//! HTTP tools from config: chatd POSTs the model's arguments as JSON to the tool's URL. The
//! answer is the result: `{"text": …, "payload": …}` hands the client a payload, any other
//! JSON or text goes to the model as it is.

use async_trait::async_trait;
use serde_json::Value;

use super::{Tool, ToolCallContext, ToolError, ToolOutput, ToolSpec};
use crate::config::HttpToolSettings;

pub struct HttpTool {
    name: String,
    settings: HttpToolSettings,
    client: reqwest::Client,
}

impl HttpTool {
    pub fn new(name: &str, settings: HttpToolSettings, client: reqwest::Client) -> Self {
        Self { name: name.to_owned(), settings, client }
    }
}

#[async_trait]
impl Tool for HttpTool {
    fn name(&self) -> &str {
        &self.name
    }

    fn idempotent(&self) -> bool {
        self.settings.idempotent
    }

    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: self.name.clone(),
            description: self.settings.description.clone(),
            input_schema: self.settings.input_schema.clone(),
        }
    }

    async fn call(&self, input: Value, ctx: ToolCallContext) -> Result<ToolOutput, ToolError> {
        let mut request = self.client.post(&self.settings.url).json(&input);
        if let Some(key) = &ctx.idempotency_key {
            request = request.header("idempotency-key", key);
        }
        let request = request.send();
        let response = tokio::select! {
            () = ctx.cancel.cancelled() => return Err(ToolError::new("cancelled")),
            response = request => response.map_err(|e| {
                tracing::warn!(tool = %self.name, error = %e, "HTTP tool unreachable");
                ToolError::retryable("The tool could not be reached")
            })?,
        };
        let status = response.status();
        let body = tokio::select! {
            () = ctx.cancel.cancelled() => return Err(ToolError::new("cancelled")),
            body = response.text() => body.map_err(|_| ToolError::retryable("The tool's answer broke off"))?,
        };
        if status.is_server_error() {
            return Err(ToolError::retryable(format!("The tool failed ({status})")));
        }
        if !status.is_success() {
            let detail = crate::providers::transport::provider_message(&body);
            return Err(ToolError::new(format!("The tool refused the call ({status}): {detail}")));
        }
        Ok(match serde_json::from_str::<Value>(&body) {
            Ok(Value::Object(mut object)) if object.get("text").is_some_and(Value::is_string) => {
                let text = object.remove("text").and_then(|t| t.as_str().map(str::to_owned)).unwrap_or_default();
                ToolOutput { text, payload: object.remove("payload") }
            }
            Ok(Value::String(text)) => ToolOutput { text, payload: None },
            Ok(other) => ToolOutput { text: other.to_string(), payload: None },
            Err(_) => ToolOutput { text: body, payload: None },
        })
    }
}
