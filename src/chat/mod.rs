//! A chat run: validating and starting it (`service`), the model loop (`agent`), live runs
//! and their fan-out (`runs`), the batched event log (`log`) and run starts written in groups
//! (`starts`).

pub mod agent;
pub mod arena;
pub mod clean;
pub mod context;
pub mod lifecycle;
pub mod log;
pub mod markers;
pub mod payloads;
pub mod prompt;
pub mod runs;
pub mod service;
mod starts;
pub mod turn;

pub use log::EventLog;
pub use runs::{Frame, LiveRun, Runs};
pub use service::{CancelOutcome, ChatError, ChatRequest, ChatService};
