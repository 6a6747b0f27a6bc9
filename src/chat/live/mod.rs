//! A run while it lives: its state and fan-out to followers (`runs`), the one end of every
//! run (`ending`), its batched event log (`log`), following it from a seq (`replay`), other
//! processes' news of their runs (`news`), and the seam between one process and several
//! (`cluster`).

pub mod cluster;
pub mod ending;
pub mod log;
pub mod news;
pub mod replay;
pub mod runs;
