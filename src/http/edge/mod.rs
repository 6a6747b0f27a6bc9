//! What every request passes through: who it acts for (`auth`), its input read into types
//! whose rejections are contract errors (`extract`), and the one error envelope (`error`).

pub mod auth;
pub mod error;
pub mod extract;
