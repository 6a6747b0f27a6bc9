//! The webhook outbox (CONTRACT.md §18): messages written in the same transaction as what
//! they report, delivered at least once by one replica at a time.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;

use super::StoreError;
use crate::domain::webhook::Outbox;

/// What a backend keeps of the outbox: which endpoints take which reports (set once, at
/// start-up), and the signal that this process wrote messages (the delivery task waits on
/// it, instead of looking every moment).
#[derive(Debug, Default)]
pub struct OutboxState {
    pub takers: std::sync::OnceLock<Outbox>,
    pub written: tokio::sync::Notify,
}

/// What a delivery is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryStatus {
    /// Not delivered yet: due at `next_attempt_at`.
    Pending,
    /// A receiver answered 2xx.
    Delivered,
    /// Every attempt failed (`webhooks.max_attempts`).
    Failed,
    /// Its endpoint answered 410 Gone: not tried again until its configuration changes.
    Disabled,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Delivered => "delivered",
            Self::Failed => "failed",
            Self::Disabled => "disabled",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        [Self::Pending, Self::Delivered, Self::Failed, Self::Disabled].into_iter().find(|s| s.as_str() == text)
    }
}

/// A message claimed for an attempt: this process holds it until `held_until`.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub id: String,
    pub endpoint: String,
    pub body: String,
    /// Attempts made, this one included.
    pub attempts: u32,
}

/// How an attempt ended, as the outbox keeps it.
#[derive(Debug, Clone)]
pub struct Attempted {
    pub status: DeliveryStatus,
    /// When a pending message is tried next.
    pub next_attempt_at: DateTime<Utc>,
    /// The receiver's HTTP status, where it answered.
    pub http_status: Option<u16>,
    pub error: Option<String>,
    pub at: DateTime<Utc>,
}

/// A delivery as `GET /api/webhooks/deliveries` shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Delivery {
    /// The `webhook-id` of every attempt.
    pub id: String,
    pub endpoint: String,
    #[serde(rename = "type")]
    pub event: String,
    pub status: DeliveryStatus,
    pub attempts: u32,
    /// The receiver's HTTP status at the last attempt, where it answered.
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub created_at: DateTime<Utc>,
    /// When a pending delivery is tried next.
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub delivered_at: Option<DateTime<Utc>>,
}

/// Which deliveries to list, newest first.
#[derive(Debug, Clone, Default)]
pub struct DeliveryFilter {
    pub status: Option<DeliveryStatus>,
    pub endpoint: Option<String>,
    pub limit: u32,
}

#[async_trait]
pub trait OutboxStore: Send + Sync + 'static {
    /// From now on, what this store writes that an endpoint of `outbox` takes is put in the
    /// outbox in the same transaction (set once, at start-up).
    fn report_to(&self, outbox: Outbox);
    /// Returns once this process has written messages since the last call (at once if it
    /// has); other processes' messages are found by looking.
    async fn outbox_written(&self);
    /// Claims up to `limit` messages due at `now` for one attempt each, held until
    /// `held_until` (a process that dies meanwhile lets them fall due again then); their
    /// attempts are counted at the claim. Replicas never claim the same message at once.
    async fn claim_deliveries(
        &self,
        now: DateTime<Utc>,
        held_until: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<Claimed>, StoreError>;
    /// Records how an attempt at message `id` ended.
    async fn record_attempt(&self, id: &str, attempted: &Attempted) -> Result<(), StoreError>;
    /// Disables an endpoint (a 410): its pending messages become `disabled`, and it stays so
    /// while its configuration keeps the `fingerprint` it had.
    async fn disable_endpoint(&self, endpoint: &str, fingerprint: &str, at: DateTime<Utc>) -> Result<(), StoreError>;
    /// The disabled endpoints, each with the fingerprint of its configuration then.
    async fn disabled_endpoints(&self) -> Result<Vec<(String, String)>, StoreError>;
    /// Enables an endpoint again (its configuration changed).
    async fn enable_endpoint(&self, endpoint: &str) -> Result<(), StoreError>;
    /// Marks the pending messages of `endpoint` `disabled`.
    async fn drop_pending(&self, endpoint: &str, at: DateTime<Utc>) -> Result<u64, StoreError>;
    async fn deliveries(&self, filter: &DeliveryFilter) -> Result<Vec<Delivery>, StoreError>;
    /// Messages not delivered yet.
    async fn outbox_depth(&self) -> Result<u64, StoreError>;
    /// Deletes delivered, failed and disabled messages created before `before`.
    async fn prune_outbox(&self, before: DateTime<Utc>) -> Result<u64, StoreError>;
}
