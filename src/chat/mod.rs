//! A chat run: validating and starting it (`service`; a client library's turn: `clients`), the model loop (`agent`), live runs
//! and their fan-out (`runs`), following a run from a seq (`replay`), cancelling runs
//! (`control`), other processes' news of their runs (`news`), the batched event log (`log`)
//! and run starts written in groups (`starts`).

mod actions;
pub mod agent;
pub mod arena;
pub mod attachments;
pub mod clean;
pub mod clients;
pub mod cluster;
pub mod context;
pub mod control;
mod core;
pub mod ending;
pub mod idempotency;
pub mod lifecycle;
pub mod log;
pub mod markers;
pub mod news;
pub mod payloads;
mod plan;
pub mod prompt;
pub mod queue;
pub mod replay;
pub mod request;
pub mod runs;
mod scan;
pub mod service;
mod starts;
mod titles;
pub mod turn;
mod turns;
pub mod waits;

pub use attachments::AttachmentRef;
pub use clients::{ClientTurn, Intent, bounded, last_user_message};
pub use control::{CancelTarget, Cancelled, ControlError};
pub use idempotency::Started;
pub use log::EventLog;
pub use replay::Resumed;
pub use request::{ChatError, ChatRequest, InteractionType};
pub use runs::{Frame, LiveRun, Runs};
pub use service::ChatService;
