//! chatd's API tests: one binary, a real server per test, real HTTP and SSE.

mod fixture;
mod helpers;

mod auth;
mod chat;
mod chunking;
mod conversations;
mod providers;
mod store;
mod tools;
