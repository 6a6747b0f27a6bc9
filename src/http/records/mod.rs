//! What was recorded of runs, for their users and the operator: traces, spend, and
//! webhook deliveries.

pub mod deliveries;
pub mod traces;
pub mod usage;

use axum::Router;

use super::AppState;

pub fn routes() -> Router<AppState> {
    Router::new().merge(traces::routes()).merge(usage::routes()).merge(deliveries::routes())
}
