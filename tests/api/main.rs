//! chatd's API tests: one binary, a real server per test, real HTTP and SSE.

mod fixture;
mod helpers;

mod ab;
mod auth;
mod branching;
mod chat;
mod chunking;
mod clients;
mod compat;
mod connections;
mod context;
mod conversations;
mod deploy;
mod faults;
mod files;
mod idempotency;
mod legacy;
mod mcp;
mod money;
mod multitask;
mod openapi;
mod otlp;
mod providers;
mod queue;
mod readme;
mod responses;
mod runs;
mod s3;
mod security;
mod store;
mod takeover;
mod tools;
mod waits;
mod web;
mod webhooks;
