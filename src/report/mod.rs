//! What chatd tells the operator's other systems: Prometheus metrics (pulled from
//! `/metrics`), signed webhooks delivered from a durable outbox, and each run's trace
//! exported over OTLP (CONTRACT.md §18).

pub mod metrics;
pub mod otlp;
pub mod webhooks;
