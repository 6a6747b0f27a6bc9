//! The OpenAPI 3.1 document of the whole API (`GET /openapi.json`, also printed by
//! `chatd openapi`); `/docs` renders it (see `web.rs`). The handlers carry their own
//! `#[utoipa::path]`; the bodies they answer with are in [`views`](super::views).

use utoipa::OpenApi;

use super::views::{ErrorBody, Event, LegacyEvent};

#[derive(OpenApi)]
#[openapi(
    info(title = "chatd", description = "A chat backend for LLM apps: streamed, persisted, resumable runs. \
        Errors outside a stream are `ErrorBody`; streams are Server-Sent Events whose data is an `Event`."),
    paths(
        super::chat::stream, super::chat::resume, super::chat::cancel,
        super::conversations::list, super::conversations::create, super::conversations::load,
        super::conversations::patch, super::conversations::delete, super::conversations::feedback,
        super::conversations::siblings, super::conversations::activate, super::conversations::stream,
        super::traces::by_id, super::traces::by_message,
        super::ab::stream, super::ab::show, super::ab::vote, super::ab::change_vote, super::ab::leaderboard,
        super::legacy::stream, super::legacy::load, super::legacy::list,
        super::health::healthz, super::health::ready, super::health::metrics, super::health::profiles,
        super::tools::list,
        super::ai_sdk::chat, super::ai_sdk::resume, super::agui::run,
        super::waits::decide, super::waits::tool_result,
        super::files::upload, super::files::download, super::files::delete,
    ),
    components(schemas(Event, ErrorBody, LegacyEvent)),
    tags(
        (name = "chat", description = "Send a message; resume or cancel its run"),
        (name = "conversations", description = "Conversations, messages, feedback and branches"),
        (name = "traces", description = "What a run did"),
        (name = "ab", description = "A/B comparisons and votes"),
        (name = "legacy", description = "The older vocabulary of the same API"),
        (name = "clients", description = "The same runs for the AI SDK's useChat and AG-UI clients"),
        (name = "files", description = "Attachments: upload, read back, delete"),
        (name = "health", description = "Liveness, readiness, profiles, tools"),
    )
)]
pub struct ApiDoc;

/// The document as JSON.
pub fn document() -> String {
    ApiDoc::openapi().to_pretty_json().expect("the document serializes")
}
