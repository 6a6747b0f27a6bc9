//! Controlling runs from outside their task: cancelling them (`cancel`), holding queued ones
//! until their turn (`queue`), answering waits and going on after them (`waits`), and the
//! process's own life: orphans at start-up, heartbeats, the drain (`lifecycle`).

pub mod cancel;
pub mod lifecycle;
pub mod queue;
pub mod waits;
