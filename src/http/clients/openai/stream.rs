//! The OpenAI Responses API's streaming events (CONTRACT.md §20), as a function of one run's
//! [`Event`]s in order: what the `openai` SDKs' stream accumulators and the Agents SDK read.
//! Each event's `sequence_number` counts the events before it from 0, so the numbers are a
//! function of the run's log: the same live, replayed, and on every replica.
//!
//! Every item is added before its deltas and done before the response ends, and the
//! terminal event carries the whole `output` (the Agents SDK builds its result from it
//! alone). Text a `step_reset` voided stays in the stream as an item done `incomplete`, and
//! is left out of the response's `output`.
//!
//! A run that waits (CONTRACT.md §15) is several responses: each wait's requests end one
//! (`completed`, with its `function_call` and `mcp_approval_request` items), and the run's
//! events after them are the next one's, `resp_<trace id>_<seq>` after the seq of the last
//! request ([`Cut`] finds where a response's events end).

use serde::Serialize;
use serde_json::Value;

use super::object::{Answer, IncompleteDetails, OutputItem, OutputText, Response, ResponseError, Status, SummaryText};
use crate::chat::Frame;
use crate::domain::Trace;
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
    ArgumentsDelta { item_id: &'a str, output_index: usize, delta: &'a str },
    Call { item_id: &'a str, output_index: usize },
}

/// Whether `event` is a waiting run's request (a client tool's call, or a call waiting for
/// approval): the requests of a wait end the response they are in.
pub(super) fn is_request(event: &Event) -> bool {
    matches!(event, Event::ToolApprovalRequest(_) | Event::ToolResultRequest(_))
}

/// Where one response's events end in its run's events: after a wait's requests, at the
/// first event that is not one.
#[derive(Default)]
pub struct Cut {
    waited: bool,
}

impl Cut {
    /// Whether `event`, the next of the run, is still the response's.
    pub fn keeps(&mut self, event: Option<&Event>) -> bool {
        let request = event.is_some_and(is_request);
        let past = self.waited && !request;
        self.waited = request;
        !past
    }
}

/// `frames` of a run, from a response's first, cut where that response ends.
pub fn response_frames(
    frames: impl futures_util::Stream<Item = Frame> + Send + 'static,
) -> impl futures_util::Stream<Item = Frame> + Send + 'static {
    use futures_util::StreamExt;
    let mut cut = Cut::default();
    frames.take_while(move |frame| std::future::ready(cut.keeps(frame.event())))
}

/// A tool call of the run.
struct Call {
    id: String,
    tool: String,
    /// Its input, as JSON text.
    arguments: String,
    /// A client tool's (a `function_call`, never an `mcp_call`).
    client: bool,
    /// Its `mcp_call` item in this response, once it ran.
    item: Option<usize>,
}

/// The Responses events of one run, and the response they build.
pub struct ResponseEvents {
    response: Response,
    /// The next event's `sequence_number`.
    next: u64,
    open: Open,
    /// Output items voided by a `step_reset`: streamed, but not in the response's `output`.
    voided: Vec<usize>,
    /// The first output item of the model call going on (what a `step_reset` voids).
    step_first: usize,
    /// How many text items and reasoning items this run opened (their ids' suffixes).
    opened: usize,
    /// The run's tool calls so far.
    calls: Vec<Call>,
    /// Whether `response.created` was sent (a continuation's is, at its first event).
    begun: bool,
    /// The last event was a wait's request: a stream that ends here ends the response
    /// ([`end`](Self::end)).
    waiting: bool,
}

impl ResponseEvents {
    /// A run's first response: its `start` event begins it.
    pub fn new() -> Self {
        Self {
            response: Response::default(),
            next: 0,
            open: Open::Nothing,
            voided: Vec::new(),
            step_first: 0,
            opened: 0,
            calls: Vec::new(),
            begun: false,
            waiting: false,
        }
    }

    /// The response that goes on after a wait whose last request was the run's event
    /// `from`, knowing the run's calls from its events up to it (`logged`, from its `start`).
    pub fn after<'a>(self, from: u64, logged: impl IntoIterator<Item = (u64, &'a Event)>) -> Self {
        let (mut earlier, mut scratch) = (self, Vec::new());
        for (_, event) in logged.into_iter().take_while(|(seq, _)| *seq <= from) {
            earlier.translate(event, &mut scratch);
            scratch.clear();
        }
        let before = earlier.response;
        let response = Response {
            id: format!("{}_{from}", before.id),
            created_at: before.created_at,
            model: before.model,
            conversation: before.conversation,
            message_id: before.message_id,
            trace_id: before.trace_id,
            metadata: before.metadata,
            from,
            ..Response::default()
        };
        let calls = earlier.calls.into_iter().map(|call| Call { item: None, ..call }).collect();
        Self { response, calls, ..Self::new() }
    }

    /// A run's first response read from its log, begun by its `trace` (a log read just
    /// after the run began may not have its `start` yet), with the `metadata` it was
    /// started with.
    pub fn of(trace: &Trace) -> Self {
        let response = Response::begun(trace.trace_id, trace.conversation_id, trace.message_id, &trace.profile);
        Self { response, ..Self::new() }.with_metadata(trace.metadata.as_ref())
    }

    /// With the `metadata` its run was started with.
    pub fn with_metadata(mut self, metadata: Option<&Value>) -> Self {
        if let Some(Value::Object(metadata)) = metadata {
            self.response.metadata = metadata.clone();
        }
        self
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
        if let Event::Start(start) = event {
            let metadata = std::mem::take(&mut self.response.metadata);
            self.response = Response { metadata, ..Response::started(start) };
        }
        self.begin(out);
        self.waiting = is_request(event);
        match event {
            Event::Start(_) => {}
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
                // Sent as it is (the answer's text is its items' text), without the tool
                // markers: a call is an item of its own.
                if is_tool_marker(text) || text.is_empty() {
                    return;
                }
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
            // Each model call says its own items.
            Event::StepStart { .. } => {
                self.close(out);
                self.step_first = self.response.output.len();
            }
            Event::StepReset { .. } => {
                let said = self.step_first..self.response.output.len();
                self.voided.extend(said.filter(|&i| {
                    matches!(self.response.output[i], OutputItem::Message { .. } | OutputItem::Reasoning { .. })
                }));
                self.close(out);
            }
            // A server tool's call is an item once it runs (a call that waits for approval
            // is a request first, and runs in the response that goes on after it).
            Event::ToolStart(start) => self.calls.push(Call {
                id: start.tool_call_id.clone(),
                tool: start.tool.clone(),
                arguments: serde_json::to_string(&start.input).unwrap_or_default(),
                client: false,
                item: None,
            }),
            Event::ToolProgress(progress) => {
                self.call_item(&progress.tool_call_id, out);
            }
            Event::ToolOutput { tool_call_id, output, .. } => {
                if let Some(index) = self.call_item(tool_call_id, out)
                    && let OutputItem::McpCall { output: kept, .. } = &mut self.response.output[index]
                {
                    kept.get_or_insert_default().push_str(output);
                }
            }
            Event::ToolComplete(complete) => {
                let ran = complete.status != crate::domain::ToolStatus::Denied;
                let Some(index) = self.call(&complete.tool_call_id).filter(|c| ran || c.item.is_some()) else { return };
                let Some(index) = index.item.or_else(|| self.call_item(&complete.tool_call_id, out)) else { return };
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
            Event::ToolResultRequest(request) => {
                // Run by the client: never an `mcp_call`.
                match self.calls.iter_mut().find(|c| c.id == request.tool_call_id) {
                    Some(call) => call.client = true,
                    None => self.calls.push(Call {
                        id: request.tool_call_id.clone(),
                        tool: request.tool.clone(),
                        arguments: String::new(),
                        client: true,
                        item: None,
                    }),
                }
                self.close(out);
                let arguments = serde_json::to_string(&request.input).unwrap_or_default();
                let index = self.response.output.len();
                let item_id = format!("fc_{}_{}", self.response.trace_key(), request.index);
                self.response.output.push(OutputItem::FunctionCall {
                    id: item_id.clone(),
                    call_id: request.tool_call_id.clone(),
                    name: request.tool.clone(),
                    arguments: String::new(),
                    status: "in_progress",
                });
                self.item_event("response.output_item.added", index, out);
                let fields = Fields::ArgumentsDelta { item_id: &item_id, output_index: index, delta: &arguments };
                self.push("response.function_call_arguments.delta", fields, out);
                let fields = Fields::Arguments { item_id: &item_id, output_index: index, arguments: &arguments };
                self.push("response.function_call_arguments.done", fields, out);
                if let OutputItem::FunctionCall { arguments: kept, status, .. } = &mut self.response.output[index] {
                    *kept = arguments;
                    *status = "completed";
                }
                self.item_event("response.output_item.done", index, out);
            }
            Event::ToolApprovalRequest(request) => {
                self.close(out);
                let index = self.response.output.len();
                self.response.output.push(OutputItem::McpApprovalRequest {
                    id: format!("mcpr_{}_{}", self.response.trace_key(), request.approval_id.replace('-', "")),
                    server_label: server_label(&request.tool).to_owned(),
                    name: request.tool.clone(),
                    arguments: serde_json::to_string(&request.input).unwrap_or_default(),
                });
                self.item_event("response.output_item.added", index, out);
                self.item_event("response.output_item.done", index, out);
            }
            Event::Usage(usage) => self.response.usage = Some((**usage).into()),
            Event::Complete { payload } => {
                self.settle(out);
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
                self.settle(out);
                self.response.status = Status::Cancelled;
                self.response.incomplete_details = Some(IncompleteDetails { reason: "cancelled" });
                self.lifecycle("response.incomplete", out);
            }
            Event::Error(error) => {
                self.settle(out);
                self.response.status = Status::Failed;
                self.response.error = Some(ResponseError::of(&error.code, &error.message));
                self.lifecycle("response.failed", out);
            }
            _ => {}
        }
    }

    /// Where the events end without the run's own ending: a response whose run waits ends
    /// `completed` with its requests' items.
    pub fn end(&mut self, out: &mut Vec<(&'static str, String)>) {
        if !std::mem::take(&mut self.waiting) {
            return;
        }
        self.settle(out);
        self.response.status = Status::Completed;
        self.response.usage.get_or_insert_with(|| crate::domain::Usage::default().into());
        self.lifecycle("response.completed", out);
    }

    /// Before the response ends: the open item is done, and so is any call cut short (its
    /// status `incomplete`).
    fn settle(&mut self, out: &mut Vec<(&'static str, String)>) {
        self.close(out);
        for index in 0..self.response.output.len() {
            if let OutputItem::McpCall { status, .. } = &mut self.response.output[index]
                && *status == "in_progress"
            {
                *status = "incomplete";
                self.item_event("response.output_item.done", index, out);
            }
        }
    }

    /// `response.created` and `.in_progress`, before the response's first other event.
    fn begin(&mut self, out: &mut Vec<(&'static str, String)>) {
        if !std::mem::replace(&mut self.begun, true) {
            self.lifecycle("response.created", out);
            self.lifecycle("response.in_progress", out);
        }
    }

    fn call(&self, tool_call_id: &str) -> Option<&Call> {
        self.calls.iter().find(|c| c.id == tool_call_id)
    }

    /// The output item of server tool call `tool_call_id`, added now if it is not yet.
    fn call_item(&mut self, tool_call_id: &str, out: &mut Vec<(&'static str, String)>) -> Option<usize> {
        let slot = self.calls.iter().position(|c| c.id == tool_call_id && !c.client)?;
        if let Some(index) = self.calls[slot].item {
            return Some(index);
        }
        self.close(out);
        let index = self.response.output.len();
        let call = &mut self.calls[slot];
        call.item = Some(index);
        let item_id = format!("mcp_{}", call.id);
        let arguments = call.arguments.clone();
        self.response.output.push(OutputItem::McpCall {
            id: item_id.clone(),
            server_label: server_label(&call.tool).to_owned(),
            name: call.tool.clone(),
            arguments: arguments.clone(),
            output: None,
            error: None,
            status: "in_progress",
        });
        self.item_event("response.output_item.added", index, out);
        let fields = Fields::Arguments { item_id: &item_id, output_index: index, arguments: &arguments };
        self.push("response.mcp_call_arguments.done", fields, out);
        self.push("response.mcp_call.in_progress", Fields::Call { item_id: &item_id, output_index: index }, out);
        Some(index)
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
        if let OutputItem::Reasoning { summary, .. } = &mut self.response.output[index] {
            summary.push(SummaryText { kind: "summary_text", text: String::new() });
        }
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
        if let OutputItem::Message { content, .. } = &mut self.response.output[index] {
            content.push(OutputText {
                kind: "output_text",
                text: String::new(),
                annotations: Vec::new(),
                logprobs: Vec::new(),
            });
        }
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
            OutputItem::Reasoning { summary, status, .. } => {
                *status = if voided { "incomplete" } else { "completed" };
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
            OutputItem::McpCall { .. } | OutputItem::FunctionCall { .. } | OutputItem::McpApprovalRequest { .. } => {}
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
    pub fn new(events: ResponseEvents, starting_after: Option<u64>) -> Self {
        Self { events, starting_after, scratch: Vec::new() }
    }

    /// Writes the events translated since `first`, those after `starting_after`.
    fn write(&mut self, first: u64, out: &mut String) {
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

impl Encoder for ResponsesSse {
    type Item = Frame;

    fn encode(&mut self, frame: &Frame, out: &mut String) {
        let Some(event) = frame.event() else { return };
        let first = self.events.next;
        self.events.translate(event, &mut self.scratch);
        self.write(first, out);
    }

    fn end(&mut self, out: &mut String) {
        let first = self.events.next;
        self.events.end(&mut self.scratch);
        self.write(first, out);
    }
}

/// What the response that goes on after the wait whose last request was seq `from` was
/// sent, as the run's log (`logged`, in order) shows its calls settled: a client tool's
/// output, an approval's decision, for each request of that wait.
pub fn answers_sent(trace_key: &str, from: u64, logged: &[(u64, &Event)]) -> Vec<Answer> {
    let at = logged.partition_point(|(seq, _)| *seq <= from);
    let requests = logged[..at].iter().rev().take_while(|(_, e)| is_request(e)).collect::<Vec<_>>();
    let mut cut = Cut::default();
    let after: Vec<&Event> = logged[at..].iter().map(|(_, e)| *e).take_while(|e| cut.keeps(Some(e))).collect();
    let output = |id: &str| {
        after.iter().find_map(|e| match e {
            Event::ToolOutput { tool_call_id, output, .. } if tool_call_id == id => Some(output.clone()),
            _ => None,
        })
    };
    let ended = |id: &str| {
        after.iter().find_map(|e| match e {
            Event::ToolComplete(c) if c.tool_call_id == id => Some(c.status),
            _ => None,
        })
    };
    requests
        .into_iter()
        .rev()
        .filter_map(|(_, request)| match request {
            Event::ToolResultRequest(r) => Some(Answer::FunctionCallOutput {
                id: format!("fco_{trace_key}_{}", r.index),
                call_id: r.tool_call_id.clone(),
                output: output(&r.tool_call_id).unwrap_or_default(),
                status: "completed",
            }),
            // Settled, since the run went on: a denied call (or one whose approval expired)
            // ends `denied`; an approved one runs.
            Event::ToolApprovalRequest(r) => {
                let approval = r.approval_id.replace('-', "");
                Some(Answer::McpApprovalResponse {
                    id: format!("mcpa_{trace_key}_{approval}"),
                    approval_request_id: format!("mcpr_{trace_key}_{approval}"),
                    approve: ended(&r.tool_call_id) != Some(crate::domain::ToolStatus::Denied),
                })
            }
            _ => None,
        })
        .collect()
}

/// The response a run's `events` build, from the response's first (the run's `start`, for
/// its first response) to where it ends.
pub fn replay<'a>(mut translated: ResponseEvents, events: impl IntoIterator<Item = &'a Event>) -> Response {
    let (mut scratch, mut cut) = (Vec::new(), Cut::default());
    for event in events.into_iter().take_while(|event| cut.keeps(Some(event))) {
        translated.translate(event, &mut scratch);
        scratch.clear();
    }
    translated.end(&mut scratch);
    translated.response()
}

impl Response {
    fn started(start: &StartEvent) -> Self {
        Self::begun(start.trace_id, start.conversation_id, start.message_id, &start.profile)
    }
}
