//! Controlling runs from outside their task: cancelling them (`cancel`), holding queued ones
//! until their turn (`queue`), answering waits and going on after them (`waits`), and the
//! process's own life: heartbeats, the drain (`lifecycle`); and continuing the runs of
//! processes that died (`takeover`).

pub mod cancel;
pub mod lifecycle;
pub mod queue;
pub mod takeover;
pub mod waits;
