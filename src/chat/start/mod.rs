//! Starting a run: a request checked before any stream opens (`prepare`), its runs planned,
//! written with its message in a group commit (`starts`) and launched (`starter`); once per
//! `Idempotency-Key` (`idempotency`); a client library's turn read onto a request
//! (`clients`); new messages of a conversation take turns (`turns`); titles (`titles`).

pub mod budget;
pub mod clients;
pub mod idempotency;
pub(in crate::chat) mod prepare;
pub mod starter;
pub(in crate::chat) mod starts;
pub(in crate::chat) mod titles;
pub(in crate::chat) mod turns;
