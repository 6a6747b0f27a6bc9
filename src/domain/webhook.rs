//! What a webhook says (CONTRACT.md §18): the message each reported change makes, as the
//! Standard Webhooks specification shapes it (`{"type", "timestamp", "data"}`), and which
//! endpoints take it. Pure: the store writes these rows in the same transaction as the change.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;

use super::{Comparison, Feedback, RunError, TraceStatus, Usage};
use crate::config::{WebhookEvent, WebhooksSettings};
use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId, UserId};

/// Which endpoints take which events: set once at start-up from `webhooks.<id>`.
#[derive(Debug, Clone, Default)]
pub struct Outbox {
    endpoints: Vec<(String, Vec<WebhookEvent>)>,
}

impl Outbox {
    pub fn new(settings: &WebhooksSettings) -> Self {
        let endpoints = settings.endpoints.iter().map(|(id, e)| (id.clone(), e.events.clone())).collect();
        Self { endpoints }
    }

    /// Whether some endpoint takes `event`: where none does, nothing is written.
    pub fn takes(&self, event: WebhookEvent) -> bool {
        self.endpoints.iter().any(|(_, events)| events.contains(&event))
    }

    /// The messages `report` makes, one per endpoint that takes its event.
    pub fn messages(&self, report: &Report, at: DateTime<Utc>) -> Vec<OutboxMessage> {
        let event = report.event();
        let takers: Vec<&str> =
            self.endpoints.iter().filter(|(_, events)| events.contains(&event)).map(|(id, _)| id.as_str()).collect();
        if takers.is_empty() {
            return Vec::new();
        }
        let body = serde_json::to_string(&Body {
            kind: event.as_str(),
            timestamp: at.to_rfc3339_opts(SecondsFormat::Millis, true),
            data: report,
        })
        .expect("a report serializes");
        takers
            .into_iter()
            .map(|endpoint| OutboxMessage {
                id: format!("msg_{}", uuid::Uuid::now_v7().simple()),
                endpoint: endpoint.to_owned(),
                event: event.as_str(),
                body: body.clone(),
                created_at: at,
            })
            .collect()
    }
}

/// One message for one endpoint, as the outbox keeps it: its id is the `webhook-id` of
/// every attempt.
#[derive(Debug, Clone)]
pub struct OutboxMessage {
    pub id: String,
    pub endpoint: String,
    pub event: &'static str,
    /// The JSON body, signed and sent as it is.
    pub body: String,
    pub created_at: DateTime<Utc>,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    timestamp: String,
    data: &'a Report,
}

/// A change a webhook reports: its `data`.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Report {
    Run(RunReport),
    Voted(VoteReport),
    Feedback(FeedbackReport),
}

impl Report {
    pub fn event(&self) -> WebhookEvent {
        match self {
            Report::Run(run) => Report::run_event(run.status),
            Report::Voted(_) => WebhookEvent::ComparisonVoted,
            Report::Feedback(_) => WebhookEvent::FeedbackCreated,
        }
    }

    /// The event of a run's report that has `status`.
    pub fn run_event(status: TraceStatus) -> WebhookEvent {
        match status {
            TraceStatus::Completed => WebhookEvent::RunCompleted,
            TraceStatus::Cancelled => WebhookEvent::RunCancelled,
            TraceStatus::Waiting => WebhookEvent::RunWaiting,
            _ => WebhookEvent::RunFailed,
        }
    }
}

/// A run that ended (`run.completed`, `run.failed` for an error or an interruption,
/// `run.cancelled`) or stopped to wait (`run.waiting`).
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub trace_id: TraceId,
    pub conversation_id: ConversationId,
    pub message_id: MessageId,
    pub user_id: UserId,
    pub status: TraceStatus,
    pub profile: String,
    pub model: String,
    pub usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ReportedError>,
    /// What a waiting run waits for: `approval` or `client_tool`, one per call.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waiting_for: Vec<&'static str>,
}

/// A failed run's error: its code and message (not the partial text).
#[derive(Debug, Clone, Serialize)]
pub struct ReportedError {
    pub code: String,
    pub message: String,
}

impl From<&RunError> for ReportedError {
    fn from(e: &RunError) -> Self {
        Self { code: e.code.clone(), message: e.message.clone() }
    }
}

/// A vote on an A/B comparison (a first vote, or a changed one).
#[derive(Debug, Clone, Serialize)]
pub struct VoteReport {
    pub comparison_id: ComparisonId,
    pub conversation_id: ConversationId,
    pub user_id: UserId,
    pub preference: super::Preference,
    pub profile_a: String,
    pub profile_b: String,
    pub model_a: String,
    pub model_b: String,
    pub trace_a: TraceId,
    pub trace_b: TraceId,
}

impl From<&Comparison> for VoteReport {
    fn from(c: &Comparison) -> Self {
        Self {
            comparison_id: c.comparison_id,
            conversation_id: c.conversation_id,
            user_id: c.user_id.clone(),
            preference: c.preference.unwrap_or(super::Preference::Tie),
            profile_a: c.profile_a.clone(),
            profile_b: c.profile_b.clone(),
            model_a: c.model_a.clone(),
            model_b: c.model_b.clone(),
            trace_a: c.trace_a,
            trace_b: c.trace_b,
        }
    }
}

/// Feedback given on an answer (set or changed; clearing it reports nothing).
#[derive(Debug, Clone, Serialize)]
pub struct FeedbackReport {
    pub message_id: MessageId,
    pub conversation_id: ConversationId,
    pub user_id: UserId,
    pub feedback: Feedback,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::WebhookSettings;

    fn outbox(endpoints: &[(&str, &[WebhookEvent])]) -> Outbox {
        let mut settings = WebhooksSettings::default();
        for (id, events) in endpoints {
            settings.endpoints.insert(
                (*id).to_owned(),
                WebhookSettings {
                    url: "http://127.0.0.1:1/".into(),
                    events: events.to_vec(),
                    secret_env: None,
                    secret_file: None,
                    secret: None,
                },
            );
        }
        Outbox::new(&settings)
    }

    fn run(status: TraceStatus) -> Report {
        Report::Run(RunReport {
            trace_id: TraceId::new(),
            conversation_id: ConversationId::new(),
            message_id: MessageId::new(),
            user_id: UserId::new("ann"),
            status,
            profile: "default".into(),
            model: "mock-1".into(),
            usage: Usage { input_tokens: 3, output_tokens: 4, ..Usage::default() },
            cost_usd: None,
            error: None,
            waiting_for: Vec::new(),
        })
    }

    #[test]
    fn a_report_goes_to_each_endpoint_that_takes_its_event_with_its_own_id() {
        use WebhookEvent::*;
        let outbox = outbox(&[
            ("billing", &[RunCompleted, RunFailed]),
            ("support", &[FeedbackCreated]),
            ("all", &[RunCompleted]),
        ]);
        let at = crate::domain::now();
        let messages = outbox.messages(&run(TraceStatus::Completed), at);
        let mut endpoints: Vec<&str> = messages.iter().map(|m| m.endpoint.as_str()).collect();
        endpoints.sort();
        assert_eq!(endpoints, ["all", "billing"]);
        assert_ne!(messages[0].id, messages[1].id, "each endpoint's message is its own");
        let body: serde_json::Value = serde_json::from_str(&messages[0].body).unwrap();
        assert_eq!(body["type"], "run.completed");
        assert_eq!(body["data"]["status"], "completed");
        assert_eq!(body["data"]["usage"]["output_tokens"], 4);
        assert!(body["data"].get("cost_usd").is_none(), "no price, no cost: never 0");
        assert_eq!(outbox.messages(&run(TraceStatus::Interrupted), at)[0].event, "run.failed");
        assert!(outbox.messages(&run(TraceStatus::Cancelled), at).is_empty(), "nobody takes run.cancelled");
        assert!(!outbox.takes(RunWaiting) && outbox.takes(FeedbackCreated));
    }
}
