//! Webhook delivery (CONTRACT.md §18): a task of its own claims due messages from the
//! outbox (one replica each at a time), signs each as the Standard Webhooks specification
//! says with its own library, and POSTs it; a 2xx ends its retries, a 410 disables its
//! endpoint until the endpoint's configuration changes, anything else is tried again after
//! `webhooks.retry_base_secs` doubling with jitter, and `failed` after
//! `webhooks.max_attempts`. Nothing here runs on a stream's path: a run's end only writes
//! the message, in its own transaction.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::{WebhookSettings, WebhooksSettings};
use crate::domain::now;
use crate::domain::webhook::Outbox;
use crate::store::{Attempted, Claimed, DeliveryStatus, Store};

/// How often the outbox is looked at for due messages: messages this process writes wake
/// the task at once; other replicas' messages, and attempts falling due, are found by
/// looking.
const POLL_EVERY: Duration = Duration::from_secs(1);
/// How often the outbox's depth is read for `/metrics`.
const DEPTH_EVERY: Duration = Duration::from_secs(5);
/// Delivered, failed and disabled messages are kept this long for
/// `GET /api/webhooks/deliveries`, then deleted.
const KEEP_FOR: chrono::Duration = chrono::Duration::days(7);
/// How often old messages are deleted.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);
/// What is kept of a receiver's answer to an attempt that failed: its start.
const ANSWER_KEPT: usize = 512;
/// What is read of a receiver's answer at most: the rest is not waited for.
const ANSWER_READ: usize = 4096;

/// How a receiver answered an attempt.
enum Answer {
    /// 2xx: delivered.
    Accepted(u16),
    /// 410 Gone: the endpoint is disabled.
    Gone,
    /// Any other status, with the start of what it said.
    Refused { status: u16, said: String },
    /// No answer: why (a refused connection, a timeout, a connection closed).
    None(String),
}

/// One endpoint as the deliverer uses it.
struct Endpoint {
    url: String,
    signer: standardwebhooks::Webhook,
    /// What its configuration was when it was disabled, compared at the next start.
    fingerprint: String,
}

/// Writes what this store reports to the outbox from now on, and starts the delivery task
/// (both only where endpoints are configured).
pub fn start(store: Arc<dyn Store>, settings: &WebhooksSettings, shutdown: CancellationToken) {
    if settings.endpoints.is_empty() {
        return;
    }
    store.report_to(Outbox::new(settings));
    let deliverer = match Deliverer::new(store, settings) {
        Ok(deliverer) => Arc::new(deliverer),
        Err(e) => {
            tracing::error!(error = %e, "webhooks cannot be delivered: their HTTP client could not be built");
            return;
        }
    };
    tokio::spawn(deliverer.run(shutdown));
}

struct Deliverer {
    store: Arc<dyn Store>,
    endpoints: HashMap<String, Endpoint>,
    /// Endpoints that answered 410 (here or on another replica), until their configuration
    /// changes.
    disabled: Mutex<HashSet<String>>,
    client: reqwest::Client,
    retry_base: Duration,
    max_attempts: u32,
    concurrency: usize,
    /// How long a claim holds a message: past the attempt's timeout.
    hold: Duration,
}

impl Deliverer {
    fn new(store: Arc<dyn Store>, settings: &WebhooksSettings) -> Result<Self, reqwest::Error> {
        let endpoints = settings
            .endpoints
            .iter()
            .filter_map(|(id, e)| {
                let secret = e.secret.as_ref()?.expose();
                let signer = standardwebhooks::Webhook::new(secret).ok()?;
                Some((id.clone(), Endpoint { url: e.url.clone(), signer, fingerprint: fingerprint(e) }))
            })
            .collect();
        let client = reqwest::Client::builder()
            .connect_timeout(settings.connect_timeout())
            .timeout(settings.timeout())
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("chatd/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Self {
            store,
            endpoints,
            disabled: Mutex::default(),
            client,
            retry_base: settings.retry_base(),
            max_attempts: settings.max_attempts,
            concurrency: settings.concurrency,
            hold: settings.timeout() + Duration::from_secs(30),
        })
    }

    async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        self.reconcile_disabled().await;
        let mut attempts = JoinSet::new();
        let mut poll = tokio::time::interval(POLL_EVERY);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut depth = tokio::time::interval(DEPTH_EVERY);
        let mut prune = tokio::time::interval(PRUNE_EVERY);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.store.outbox_written() => {}
                _ = poll.tick() => {}
                _ = depth.tick() => {
                    self.reconcile_disabled().await;
                    if let Ok(n) = self.store.outbox_depth().await {
                        metrics::gauge!("chatd_webhook_outbox_depth").set(n as f64);
                    }
                    continue;
                }
                _ = prune.tick() => {
                    if let Err(e) = self.store.prune_outbox(now() - KEEP_FOR).await {
                        tracing::warn!(error = %e, "could not delete old webhook deliveries");
                    }
                    continue;
                }
                Some(_) = attempts.join_next(), if !attempts.is_empty() => {}
            }
            let room = self.concurrency.saturating_sub(attempts.len());
            if room == 0 {
                continue;
            }
            let at = now();
            let held_until = at + chrono::Duration::from_std(self.hold).unwrap_or(chrono::Duration::seconds(60));
            let claimed = match self.store.claim_deliveries(at, held_until, room as u32).await {
                Ok(claimed) => claimed,
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the webhook outbox");
                    continue;
                }
            };
            for message in claimed {
                attempts.spawn(self.clone().attempt(message));
            }
        }
    }

    /// Endpoints disabled by a 410 stay so while their configuration is the same; one whose
    /// configuration changed is enabled again.
    async fn reconcile_disabled(&self) {
        let Ok(disabled) = self.store.disabled_endpoints().await else { return };
        let mut still = HashSet::new();
        for (id, was) in disabled {
            match self.endpoints.get(&id) {
                Some(endpoint) if endpoint.fingerprint != was => {
                    if self.store.enable_endpoint(&id).await.is_ok() {
                        tracing::info!(endpoint = %id, "webhook endpoint enabled again: its configuration changed");
                    }
                }
                _ => {
                    still.insert(id);
                }
            }
        }
        *self.disabled.lock().expect("disabled endpoints") = still;
    }

    /// One attempt at one message, and what the outbox keeps of it.
    async fn attempt(self: Arc<Self>, message: Claimed) {
        let endpoint_id = message.endpoint.clone();
        let Some(endpoint) = self.endpoints.get(&endpoint_id) else {
            let error = format!("no webhook endpoint {endpoint_id} is configured");
            self.record(&message, DeliveryStatus::Failed, None, Some(error)).await;
            return;
        };
        if self.disabled.lock().expect("disabled endpoints").contains(&endpoint_id) {
            let _ = self.store.drop_pending(&endpoint_id, now()).await;
            metrics::counter!("chatd_webhook_deliveries_total", "endpoint" => endpoint_id, "outcome" => "disabled")
                .increment(1);
            return;
        }
        let (status, error) = match self.send(endpoint, &message).await {
            Answer::Accepted(status) => {
                self.record(&message, DeliveryStatus::Delivered, Some(status), None).await;
                return;
            }
            Answer::Gone => {
                tracing::warn!(endpoint = %endpoint_id, "webhook endpoint answered 410 Gone: disabled until its configuration changes");
                self.disabled.lock().expect("disabled endpoints").insert(endpoint_id.clone());
                if let Err(e) = self.store.disable_endpoint(&endpoint_id, &endpoint.fingerprint, now()).await {
                    tracing::warn!(error = %e, "could not record a disabled webhook endpoint");
                }
                metrics::counter!("chatd_webhook_deliveries_total", "endpoint" => endpoint_id, "outcome" => "disabled")
                    .increment(1);
                return;
            }
            Answer::Refused { status, said } if said.is_empty() => (Some(status), format!("HTTP {status}")),
            Answer::Refused { status, said } => (Some(status), format!("HTTP {status}: {said}")),
            Answer::None(why) => (None, why),
        };
        let error = format!("attempt {} of {}: {error}", message.attempts, self.max_attempts);
        let outcome =
            if message.attempts >= self.max_attempts { DeliveryStatus::Failed } else { DeliveryStatus::Pending };
        self.record(&message, outcome, status, Some(error)).await;
    }

    /// Signs and POSTs the message: how the receiver answered (a failing answer with its
    /// first bytes), or why it did not.
    async fn send(&self, endpoint: &Endpoint, message: &Claimed) -> Answer {
        let timestamp = now().timestamp();
        let signature = match endpoint.signer.sign(&message.id, timestamp, message.body.as_bytes()) {
            Ok(signature) => signature,
            Err(e) => return Answer::None(format!("could not sign: {e}")),
        };
        let sent = self
            .client
            .post(&endpoint.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(standardwebhooks::HEADER_WEBHOOK_ID, &message.id)
            .header(standardwebhooks::HEADER_WEBHOOK_TIMESTAMP, timestamp.to_string())
            .header(standardwebhooks::HEADER_WEBHOOK_SIGNATURE, signature)
            .body(message.body.clone())
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(e) => return Answer::None(describe_error(&e)),
        };
        match response.status().as_u16() {
            status @ 200..=299 => Answer::Accepted(status),
            410 => Answer::Gone,
            status => Answer::Refused { status, said: read_start(response).await },
        }
    }

    async fn record(&self, message: &Claimed, status: DeliveryStatus, http_status: Option<u16>, error: Option<String>) {
        let at = now();
        let next_attempt_at = match status {
            DeliveryStatus::Pending => at + backoff(self.retry_base, message.attempts),
            _ => at,
        };
        let outcome = match status {
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Pending => "retry",
            DeliveryStatus::Failed => "failed",
            DeliveryStatus::Disabled => "disabled",
        };
        metrics::counter!("chatd_webhook_deliveries_total", "endpoint" => message.endpoint.clone(), "outcome" => outcome)
            .increment(1);
        if status == DeliveryStatus::Failed {
            tracing::warn!(id = %message.id, endpoint = %message.endpoint, error = ?error, "webhook delivery failed for good");
        }
        let attempted = Attempted { status, next_attempt_at, http_status, error, at };
        if let Err(e) = self.store.record_attempt(&message.id, &attempted).await {
            // The claim lapses and the message is tried again: at least once.
            tracing::warn!(error = %e, id = %message.id, "could not record a webhook attempt");
        }
    }
}

/// The wait before the attempt after `attempts` failed ones: `base` doubling, each wait
/// between 0.75 and 1.25 of that (so that receivers that came back are not hit by every
/// message at once).
pub fn backoff(base: Duration, attempts: u32) -> chrono::Duration {
    let doubled = base.as_secs_f64() * 2f64.powi(attempts.saturating_sub(1).min(30) as i32);
    let jittered = doubled * (0.75 + fastrand::f64() * 0.5);
    chrono::Duration::milliseconds((jittered.min(86_400.0) * 1000.0) as i64)
}

/// What an endpoint's configuration is: a change to its URL, events or secret enables it
/// again after a 410.
fn fingerprint(endpoint: &WebhookSettings) -> String {
    let mut hash = Sha256::new();
    hash.update(endpoint.url.as_bytes());
    for event in &endpoint.events {
        hash.update(b"\0");
        hash.update(event.as_str().as_bytes());
    }
    hash.update(b"\0");
    hash.update(endpoint.secret.as_ref().map(|s| s.expose()).unwrap_or_default().as_bytes());
    let digest = hash.finalize();
    digest.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

fn describe_error(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timed out".into()
    } else if e.is_connect() {
        format!("could not connect: {}", std::error::Error::source(e).map_or_else(|| e.to_string(), |s| s.to_string()))
    } else {
        format!("the connection failed: {e}")
    }
}

/// The start of an answer's body, read up to [`ANSWER_READ`] bytes and cut to
/// [`ANSWER_KEPT`] characters.
async fn read_start(response: reqwest::Response) -> String {
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while body.len() < ANSWER_READ {
        match stream.next().await {
            Some(Ok(chunk)) => body.extend_from_slice(&chunk),
            _ => break,
        }
    }
    body.truncate(ANSWER_READ);
    String::from_utf8_lossy(&body).chars().take(ANSWER_KEPT).collect::<String>().trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_wait_doubles_within_its_jitter() {
        let base = Duration::from_secs(5);
        for attempts in 1..=8u32 {
            let expected = 5.0 * 2f64.powi(attempts as i32 - 1);
            for _ in 0..50 {
                let wait = backoff(base, attempts).num_milliseconds() as f64 / 1000.0;
                assert!(wait >= expected * 0.75 - 0.001 && wait <= expected * 1.25 + 0.001, "{attempts}: {wait}");
            }
        }
    }
}
