//! Running a run: what it will use (`plan`: the model, tools, prompt and context), the model
//! loop with its tools and waits (`agent`), one model call's stream split into thinking and
//! answer (`turn`, `markers`, `clean`, `scan`), the payloads sent (`payloads`, `prompt`,
//! `context`), attachments read for the model (`attachments`) and executed actions
//! (`actions`).

pub(in crate::chat) mod actions;
pub mod agent;
pub mod attachments;
pub mod clean;
pub mod context;
pub mod markers;
pub mod payloads;
pub(in crate::chat) mod plan;
pub mod prompt;
pub(in crate::chat) mod scan;
pub mod turn;
