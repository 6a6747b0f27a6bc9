//! Turning captured marker blocks and tool payloads into the `complete` payload's fields:
//! `suggested_values`, `suggested_actions` and `custom_payload`s (with a `payload_id` and a
//! `summary`), each checked against its shape or configured JSON schema. What does not fit
//! becomes a warning in the trace, never a failed run.

use serde_json::{Value, json};

use super::markers::Captured;
use crate::config::PayloadTypeSettings;
use crate::domain::{SuggestedAction, SuggestedValue};

pub const SUGGESTED_VALUES: &str = "SUGGESTED_VALUES:";
pub const SUGGESTED_ACTIONS: &str = "SUGGESTED_ACTIONS:";

/// A payload type the model may write in this request, by marker.
#[derive(Debug, Clone)]
pub struct LlmPayloadType {
    pub name: String,
    pub marker: String,
    pub settings: PayloadTypeSettings,
}

/// What the captured blocks of one run amount to.
#[derive(Debug, Default)]
pub struct Extracted {
    pub suggested_values: Vec<SuggestedValue>,
    pub suggested_actions: Vec<SuggestedAction>,
    pub payloads: Vec<Value>,
    pub warnings: Vec<String>,
}

pub fn extract(captured: &[Captured], types: &[LlmPayloadType]) -> Extracted {
    let mut out = Extracted::default();
    for block in captured {
        let Ok(value) = serde_json::from_str::<Value>(&block.json) else {
            out.warnings.push(format!("{}: invalid JSON", block.marker));
            continue;
        };
        match block.marker.as_str() {
            SUGGESTED_VALUES => match suggested_values(&value) {
                Some(values) => out.suggested_values.extend(values),
                None => out.warnings.push(format!("{SUGGESTED_VALUES} expected a list of {{label, value}}")),
            },
            SUGGESTED_ACTIONS => match serde_json::from_value::<Vec<SuggestedAction>>(value) {
                Ok(actions) => out.suggested_actions.extend(actions),
                Err(e) => out.warnings.push(format!("{SUGGESTED_ACTIONS} {e}")),
            },
            marker => {
                let Some(kind) = types.iter().find(|t| t.marker == marker) else {
                    continue;
                };
                if let Some(schema) = &kind.settings.schema {
                    if let Err(problem) = check(schema, &value, "$") {
                        out.warnings.push(format!("{marker} does not match the {} schema: {problem}", kind.name));
                        continue;
                    }
                }
                out.payloads.push(custom_payload(&kind.name, value, None));
            }
        }
    }
    out
}

/// `[{label, value}]`, or plain strings that are both.
fn suggested_values(value: &Value) -> Option<Vec<SuggestedValue>> {
    value
        .as_array()?
        .iter()
        .map(|item| match item {
            Value::String(s) => Some(SuggestedValue { label: s.clone(), value: s.clone() }),
            item => {
                let label = item.get("label")?.as_str()?.to_owned();
                let value = item.get("value").and_then(Value::as_str).map_or_else(|| label.clone(), str::to_owned);
                Some(SuggestedValue { label, value })
            }
        })
        .collect()
}

/// A payload as the client gets it: `{payload_id, type, data, summary}`. The summary is
/// `summary`, else the data's own `summary`, else the type's name.
pub fn custom_payload(kind: &str, data: Value, summary: Option<&str>) -> Value {
    let summary = summary
        .or_else(|| data.get("summary").and_then(Value::as_str))
        .map_or_else(|| kind.replace('_', " "), |s| s.chars().take(200).collect());
    let id = uuid::Uuid::now_v7().simple().to_string();
    json!({"payload_id": &id[id.len() - 8..], "type": kind, "data": data, "summary": summary})
}

/// Checks `value` against the parts of JSON Schema payload schemas use: `type`, `enum`,
/// `required`, `properties`, `items`, `minItems`. Other keywords are not checked.
pub fn check(schema: &Value, value: &Value, path: &str) -> Result<(), String> {
    if let Some(kind) = schema.get("type").and_then(Value::as_str) {
        let fits = match kind {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "number" => value.is_number(),
            "integer" => value.is_i64() || value.is_u64(),
            "boolean" => value.is_boolean(),
            "null" => value.is_null(),
            _ => true,
        };
        if !fits {
            return Err(format!("{path} should be {kind}"));
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
        if !allowed.contains(value) {
            return Err(format!("{path} is not one of the allowed values"));
        }
    }
    if let Some(required) = schema.get("required").and_then(Value::as_array) {
        for key in required.iter().filter_map(Value::as_str) {
            if value.get(key).is_none() {
                return Err(format!("{path}.{key} is required"));
            }
        }
    }
    if let (Some(properties), Some(object)) = (schema.get("properties").and_then(Value::as_object), value.as_object()) {
        for (key, property) in properties {
            if let Some(field) = object.get(key) {
                check(property, field, &format!("{path}.{key}"))?;
            }
        }
    }
    if let Some(items) = value.as_array() {
        if let Some(min) = schema.get("minItems").and_then(Value::as_u64) {
            if (items.len() as u64) < min {
                return Err(format!("{path} needs at least {min} items"));
            }
        }
        if let Some(item_schema) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                check(item_schema, item, &format!("{path}[{i}]"))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PayloadSource;

    fn schema_type() -> LlmPayloadType {
        LlmPayloadType {
            name: "schema_proposal".into(),
            marker: "SCHEMA_PROPOSAL:".into(),
            settings: PayloadTypeSettings {
                source: PayloadSource::Llm,
                parse_marker: Some("SCHEMA_PROPOSAL:".into()),
                llm_instructions: None,
                schema: Some(
                    json!({"type": "object", "required": ["fields"], "properties": {"fields": {"type": "array", "items": {"type": "string"}}}}),
                ),
                is_global: true,
            },
        }
    }

    fn block(marker: &str, json: &str) -> Captured {
        Captured { marker: marker.into(), json: json.into() }
    }

    #[test]
    fn blocks_become_fields() {
        let extracted = extract(
            &[
                block(SUGGESTED_VALUES, r#"[{"label": "Yes, proceed", "value": "yes"}, "No"]"#),
                block(
                    SUGGESTED_ACTIONS,
                    r#"[{"label": "Apply", "action": "apply_schema", "handler": "server", "data": {"schema_id": 1}, "style": "primary"}]"#,
                ),
                block("SCHEMA_PROPOSAL:", r#"{"fields": ["a", "b"], "summary": "Two fields"}"#),
            ],
            &[schema_type()],
        );
        assert_eq!(extracted.suggested_values[1], SuggestedValue { label: "No".into(), value: "No".into() });
        assert_eq!(extracted.suggested_actions[0].handler, "server");
        let payload = &extracted.payloads[0];
        assert_eq!(payload["type"], "schema_proposal");
        assert_eq!(payload["summary"], "Two fields");
        assert_eq!(payload["payload_id"].as_str().unwrap().len(), 8);
        assert!(extracted.warnings.is_empty());
    }

    #[test]
    fn misfits_are_warnings() {
        let extracted = extract(
            &[block(SUGGESTED_VALUES, r#"{"label": 1}"#), block("SCHEMA_PROPOSAL:", r#"{"fields": [1]}"#)],
            &[schema_type()],
        );
        assert!(extracted.payloads.is_empty() && extracted.suggested_values.is_empty());
        assert_eq!(extracted.warnings.len(), 2);
        assert!(extracted.warnings[1].contains("$.fields[0] should be string"), "{:?}", extracted.warnings);
    }
}
