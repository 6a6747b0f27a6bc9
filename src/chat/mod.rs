//! A chat run: validating and starting it (`service`), the model loop (`agent`), live runs
//! and their fan-out (`runs`) and the batched event log (`log`).

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
pub mod turn;

pub use log::EventLog;
pub use runs::{Frame, LiveRun, Runs};
pub use service::{CancelOutcome, ChatError, ChatRequest, ChatService};
