//! The OpenAI Responses API's streaming events (CONTRACT.md §20), as a function of one run's
//! [`Event`]s in order: what the `openai` SDKs' stream accumulators and the Agents SDK read.
//! Each event's `sequence_number` counts the events before it from 0, so the numbers are a
//! function of the run's log: the same live, replayed, and on every replica.
//!
//! Every item is added before its deltas and done before the response ends, and the
//! terminal event carries the whole `output` (the Agents SDK builds its result from it
//! alone). Text a `step_reset` voided stays in the stream as an item done `incomplete`, and
//! is left out of the response's `output`.

use serde::Serialize;
use serde_json::Value;

use super::object::{IncompleteDetails, OutputItem, Response, ResponseError, Status, response_id};
use crate::chat::Frame;
use crate::events::parts::{Open, is_tool_marker, part_delta};
use crate::events::{Event, StartEvent};
use crate::http::sse::Encoder;

/// One streaming event: its type and fields, numbered.
#[derive(Debug, Serialize)]
struct Numbered<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    sequence_number: u64,
    #[serde(flatten)]
    fields: Fields<'a>,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Fields<'a> {
    Lifecycle { response: &'a Response },
    Item { output_index: usize, item: &'a OutputItem },
    Part { item_id: &'a str, output_index: usize, content_index: usize, part: Value },
    SummaryPart { item_id: &'a str, output_index: usize, summary_index: usize, part: Value },
    TextDelta { item_id: &'a str, output_index: usize, content_index: usize, delta: &'a str, logprobs: [(); 0] },
    TextDone { item_id: &'a str, output_index: usize, content_index: usize, text: &'a str, logprobs: [(); 0] },
    SummaryDelta { item_id: &'a str, output_index: usize, summary_index: usize, delta: &'a str },
    SummaryDone { item_id: &'a str, output_index: usize, summary_index: usize, text: &'a str },
    Arguments { item_id: &'a str, output_index: usize, arguments: &'a str },
    Call { item_id: &'a str, output_index: usize },
}

/// The Responses events of one run, and the response they build.
pub struct ResponseEvents {
    response: Response,
    /// The next event's `sequence_number`.
    next: u64,
    open: Open,
    /// Output items voided by a `step_reset`: streamed, but not in the response's `output`.
    voided: Vec<usize>,
    /// How many text items and reasoning items this run opened (their ids' suffixes).
    opened: usize,
    /// Each server tool call's item, by its call id.
    calls: Vec<(String, usize)>,
}

impl ResponseEvents {
    pub fn new() -> Self {
        Self {
            response: Response::default(),
            next: 0,
            open: Open::Nothing,
            voided: Vec::new(),
            opened: 0,
            calls: Vec::new(),
        }
    }

    /// The response as the events so far built it (its `output` without voided items).
    pub fn response(&self) -> Response {
        let mut response = self.response.clone();
        response.output =
            response.output.into_iter().enumerate().filter(|(i, _)| !self.voided.contains(i)).map(|(_, o)| o).collect();
        response
    }

    /// The Responses events `event` makes, each serialized with its number.
    pub fn translate(&mut self, event: &Event, out: &mut Vec<(&'static str, String)>) {
        match event {
            Event::Start(start) => {
                self.response = Response::started(start);
                self.lifecycle("response.created", out);
                self.lifecycle("response.in_progress", out);
            }
            Event::ThinkingDelta { text } => {
                let Some(text) = part_delta(&self.open, text) else { return };
                if !matches!(self.open, Open::Reasoning(_)) {
                    self.close(out);
                    self.open_reasoning(out);
                }
                let index = self.response.output.len() - 1;
                if let OutputItem::Reasoning { summary, .. } = &mut self.response.output[index] {
                    summary[0].text.push_str(text);
                }
                let item_id = self.item_id(index);
                let fields =
                    Fields::SummaryDelta { item_id: &item_id, output_index: index, summary_index: 0, delta: text };
                self.push("response.reasoning_summary_text.delta", fields, out);
            }
            Event::TextDelta { text } => {
                if is_tool_marker(text) {
                    return;
                }
                let Some(text) = part_delta(&self.open, text) else { return };
                if !matches!(self.open, Open::Text(_)) {
                    self.close(out);
                    self.open_message(out);
                }
                let index = self.response.output.len() - 1;
                if let OutputItem::Message { content, .. } = &mut self.response.output[index] {
                    content[0].text.push_str(text);
                }
                let item_id = self.item_id(index);
                let fields = Fields::TextDelta {
                    item_id: &item_id,
                    output_index: index,
                    content_index: 0,
                    delta: text,
                    logprobs: [],
                };
                self.push("response.output_text.delta", fields, out);
            }
            // What this model call said is void: its open item ends here, and is not in the
            // response's output.
            Event::StepReset { .. } if !matches!(self.open, Open::Nothing) => {
                let index = self.response.output.len() - 1;
                self.voided.push(index);
                self.close(out);
            }
            Event::ToolStart(start) => {
                self.close(out);
                let arguments = serde_json::to_string(&start.input).unwrap_or_default();
                let index = self.response.output.len();
                let item_id = format!("mcp_{}", start.tool_call_id);
                self.response.output.push(OutputItem::McpCall {
                    id: item_id.clone(),
                    server_label: server_label(&start.tool).to_owned(),
                    name: start.tool.clone(),
                    arguments: arguments.clone(),
                    output: None,
                    error: None,
                    status: "in_progress",
                });
                self.calls.push((start.tool_call_id.clone(), index));
                self.item_event("response.output_item.added", index, out);
                self.push(
                    "response.mcp_call_arguments.done",
                    Fields::Arguments { item_id: &item_id, output_index: index, arguments: &arguments },
                    out,
                );
                self.push(
                    "response.mcp_call.in_progress",
                    Fields::Call { item_id: &item_id, output_index: index },
                    out,
                );
            }
            Event::ToolOutput { tool_call_id, output, .. } => {
                if let Some(index) = self.call(tool_call_id)
                    && let OutputItem::McpCall { output: kept, .. } = &mut self.response.output[index]
                {
                    kept.get_or_insert_default().push_str(output);
                }
            }
            Event::ToolComplete(complete) => {
                let Some(index) = self.call(&complete.tool_call_id) else { return };
                let ok = matches!(complete.status, crate::domain::ToolStatus::Success);
                if let OutputItem::McpCall { status, error, output, .. } = &mut self.response.output[index] {
                    *status = if ok { "completed" } else { "failed" };
                    if !ok {
                        *error = Some(
                            output.clone().unwrap_or_else(|| format!("the tool call ended: {:?}", complete.status)),
                        );
                    }
                }
                let item_id = self.item_id(index);
                let kind = if ok { "response.mcp_call.completed" } else { "response.mcp_call.failed" };
                self.push(kind, Fields::Call { item_id: &item_id, output_index: index }, out);
                self.item_event("response.output_item.done", index, out);
            }
            Event::Usage(usage) => self.response.usage = Some((**usage).into()),
            Event::Complete { payload } => {
                self.close(out);
                self.response.usage = Some(payload.usage.into());
                self.response.status = match payload.finish_reason.as_str() {
                    "length" | "budget" => Status::Incomplete,
                    _ => Status::Completed,
                };
                if self.response.status == Status::Incomplete {
                    let reason = if payload.finish_reason == "length" { "max_output_tokens" } else { "budget" };
                    self.response.incomplete_details = Some(IncompleteDetails { reason });
                }
                let kind = match self.response.status {
                    Status::Incomplete => "response.incomplete",
                    _ => "response.completed",
                };
                self.lifecycle(kind, out);
            }
            Event::Cancelled(_) => {
                self.close(out);
                self.response.status = Status::Cancelled;
                self.response.incomplete_details = Some(IncompleteDetails { reason: "cancelled" });
                self.lifecycle("response.incomplete", out);
            }
            Event::Error(error) => {
                self.close(out);
                self.response.status = Status::Failed;
                self.response.error = Some(ResponseError::of(&error.code, &error.message));
                self.lifecycle("response.failed", out);
            }
            _ => {}
        }
    }

    fn call(&self, tool_call_id: &str) -> Option<usize> {
        self.calls.iter().find(|(id, _)| id == tool_call_id).map(|(_, index)| *index)
    }

    fn item_id(&self, index: usize) -> String {
        self.response.output[index].id().to_owned()
    }

    fn open_reasoning(&mut self, out: &mut Vec<(&'static str, String)>) {
        self.opened += 1;
        let id = format!("rs_{}_{}", self.response.message_key(), self.opened);
        let index = self.response.output.len();
        self.response.output.push(OutputItem::reasoning(id.clone()));
        self.open = Open::Reasoning(id.clone());
        self.item_event("response.output_item.added", index, out);
        let part = serde_json::json!({"type": "summary_text", "text": ""});
        let fields = Fields::SummaryPart { item_id: &id, output_index: index, summary_index: 0, part };
        self.push("response.reasoning_summary_part.added", fields, out);
    }

    fn open_message(&mut self, out: &mut Vec<(&'static str, String)>) {
        self.opened += 1;
        // The run's answer is its first message item: its id is the stored message's.
        let id = match self.response.output.iter().any(|o| matches!(o, OutputItem::Message { .. })) {
            false => format!("msg_{}", self.response.message_key()),
            true => format!("msg_{}_{}", self.response.message_key(), self.opened),
        };
        let index = self.response.output.len();
        self.response.output.push(OutputItem::message(id.clone()));
        self.open = Open::Text(id.clone());
        self.item_event("response.output_item.added", index, out);
        let part = serde_json::json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
        let fields = Fields::Part { item_id: &id, output_index: index, content_index: 0, part };
        self.push("response.content_part.added", fields, out);
    }

    /// Ends the open reasoning or message item: its text's `done`, its part's, the item's.
    fn close(&mut self, out: &mut Vec<(&'static str, String)>) {
        let open = std::mem::take(&mut self.open);
        if matches!(open, Open::Nothing) {
            return;
        }
        let index = self.response.output.len() - 1;
        let voided = self.voided.contains(&index);
        let item_id = self.item_id(index);
        match &mut self.response.output[index] {
            OutputItem::Reasoning { summary, .. } => {
                let text = summary[0].text.clone();
                let fields =
                    Fields::SummaryDone { item_id: &item_id, output_index: index, summary_index: 0, text: &text };
                self.push("response.reasoning_summary_text.done", fields, out);
                let part = serde_json::json!({"type": "summary_text", "text": text});
                let fields = Fields::SummaryPart { item_id: &item_id, output_index: index, summary_index: 0, part };
                self.push("response.reasoning_summary_part.done", fields, out);
            }
            OutputItem::Message { content, status, .. } => {
                *status = if voided { "incomplete" } else { "completed" };
                let text = content[0].text.clone();
                let fields = Fields::TextDone {
                    item_id: &item_id,
                    output_index: index,
                    content_index: 0,
                    text: &text,
                    logprobs: [],
                };
                self.push("response.output_text.done", fields, out);
                let part = serde_json::json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                let fields = Fields::Part { item_id: &item_id, output_index: index, content_index: 0, part };
                self.push("response.content_part.done", fields, out);
            }
            OutputItem::McpCall { .. } => {}
        }
        self.item_event("response.output_item.done", index, out);
    }

    fn lifecycle(&mut self, kind: &'static str, out: &mut Vec<(&'static str, String)>) {
        let response = self.response();
        self.push(kind, Fields::Lifecycle { response: &response }, out);
    }

    fn item_event(&mut self, kind: &'static str, index: usize, out: &mut Vec<(&'static str, String)>) {
        let item = self.response.output[index].clone();
        self.push(kind, Fields::Item { output_index: index, item: &item }, out);
    }

    fn push(&mut self, kind: &'static str, fields: Fields<'_>, out: &mut Vec<(&'static str, String)>) {
        let event = Numbered { kind, sequence_number: self.next, fields };
        self.next += 1;
        out.push((kind, serde_json::to_string(&event).expect("events serialize")));
    }
}

/// The MCP server a tool belongs to (`server:tool`), or `chatd` for its own tools.
fn server_label(tool: &str) -> &str {
    tool.split_once(':').map_or("chatd", |(server, _)| server)
}

/// A run's events as the Responses API streams them: `event: <type>` and `data: <json>`,
/// only those numbered after `starting_after` (a resume).
pub struct ResponsesSse {
    events: ResponseEvents,
    starting_after: Option<u64>,
    scratch: Vec<(&'static str, String)>,
}

impl ResponsesSse {
    pub fn new(starting_after: Option<u64>) -> Self {
        Self { events: ResponseEvents::new(), starting_after, scratch: Vec::new() }
    }
}

impl Encoder for ResponsesSse {
    type Item = Frame;

    fn encode(&mut self, frame: &Frame, out: &mut String) {
        let Some(event) = frame.event.as_deref() else { return };
        let first = self.events.next;
        self.events.translate(event, &mut self.scratch);
        for (n, (kind, data)) in self.scratch.drain(..).enumerate() {
            if self.starting_after.is_some_and(|after| first + (n as u64) <= after) {
                continue;
            }
            out.push_str("event: ");
            out.push_str(kind);
            out.push_str("\ndata: ");
            out.push_str(&data);
            out.push_str("\n\n");
        }
    }
}

/// The response `events` of a whole run build (`StartEvent` first).
pub fn replay<'a>(events: impl IntoIterator<Item = &'a Event>) -> Response {
    let mut translated = ResponseEvents::new();
    let mut scratch = Vec::new();
    for event in events {
        translated.translate(event, &mut scratch);
        scratch.clear();
    }
    translated.response()
}

impl Response {
    fn started(start: &StartEvent) -> Self {
        Response {
            id: response_id(start.trace_id),
            // When the run started, from its time-ordered id: the same on every replay.
            created_at: start.trace_id.0.get_timestamp().map_or(0, |t| t.to_unix().0 as i64),
            model: start.profile.clone(),
            conversation: Some(super::object::ConversationRef {
                id: super::object::conversation_id(start.conversation_id),
            }),
            message_id: Some(start.message_id),
            ..Response::default()
        }
    }
}
