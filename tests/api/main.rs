//! chatd's API tests: one binary, a real server per test, real HTTP and SSE.

mod helpers;

mod auth;
mod chat;
mod conversations;
mod store;
