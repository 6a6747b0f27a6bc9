//! A chat run, in folders by job: starting it (`start`), running it (`run`: the plan and the
//! model loop), the run while it lives (`live`: its state, its end, its log, following it,
//! the cluster seam) and controlling it from outside (`control`: cancel, queue, waits, the
//! process's life). `service` composes the rooms, each built from the `shared` parts;
//! `request` and `errors` are what a start reads and how it is refused; `arena` ranks the
//! profiles of A/B comparisons.

pub mod arena;
pub mod control;
pub mod errors;
pub mod live;
pub mod request;
pub mod run;
pub mod service;
mod shared;
pub mod start;

pub use control::cancel::{CancelTarget, Cancelled};
pub use errors::{ChatError, ControlError};
pub use live::log::EventLog;
pub use live::replay::{Resumed, ending_never_logged};
pub use live::runs::{Frame, LiveRun, Runs};
pub use request::{AttachmentRef, ChatRequest, InteractionType};
pub use service::ChatService;
pub use start::clients::{ClientTurn, Intent, bounded, last_user_message};
pub use start::idempotency::Started;
