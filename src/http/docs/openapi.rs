//! The OpenAPI 3.1 document of the whole API (`GET /openapi.json`, also printed by
//! `chatd openapi`); `/docs` renders it (see `web.rs`). The handlers carry their own
//! `#[utoipa::path]`; the bodies they answer with are in [`views`](crate::http::views).

use utoipa::OpenApi;

use crate::http::views::{ErrorBody, Event, LegacyEvent};

#[derive(OpenApi)]
#[openapi(
    info(title = "chatd", description = "A chat backend for LLM apps: streamed, persisted, resumable runs. \
        Errors outside a stream are `ErrorBody`; streams are Server-Sent Events whose data is an `Event`."),
    paths(
        crate::http::chat::stream, crate::http::chat::resume, crate::http::chat::cancel,
        crate::http::conversations::list, crate::http::conversations::create, crate::http::conversations::load,
        crate::http::conversations::patch, crate::http::conversations::delete, crate::http::conversations::feedback,
        crate::http::conversations::siblings, crate::http::conversations::activate, crate::http::conversations::stream,
        crate::http::records::traces::by_id, crate::http::records::traces::by_message, crate::http::records::usage::usage,
        crate::http::records::deliveries::deliveries,
        crate::http::ab::stream, crate::http::ab::show, crate::http::ab::vote, crate::http::ab::change_vote, crate::http::ab::leaderboard,
        crate::http::legacy::stream, crate::http::legacy::load, crate::http::legacy::list,
        crate::http::health::healthz, crate::http::health::ready, crate::http::health::metrics, crate::http::health::profiles,
        crate::http::tools::list,
        crate::http::clients::ai_sdk::chat, crate::http::clients::ai_sdk::resume, crate::http::clients::agui::run,
        crate::http::clients::openai::models, crate::http::clients::openai::create, crate::http::clients::openai::retrieve,
        crate::http::clients::openai::cancel, crate::http::clients::openai::input_items,
        crate::http::clients::openai::conversations::create, crate::http::clients::openai::conversations::retrieve,
        crate::http::clients::openai::conversations::update, crate::http::clients::openai::conversations::delete,
        crate::http::clients::openai::conversations::items,
        crate::http::waits::decide, crate::http::waits::tool_result,
        crate::http::files::upload, crate::http::files::download, crate::http::files::delete,
    ),
    components(schemas(Event, ErrorBody, LegacyEvent, crate::http::clients::openai::object::ErrorBody)),
    tags(
        (name = "chat", description = "Send a message; resume or cancel its run"),
        (name = "conversations", description = "Conversations, messages, feedback and branches"),
        (name = "traces", description = "What a run did"),
        (name = "usage", description = "What runs spent, and the webhooks that reported them"),
        (name = "ab", description = "A/B comparisons and votes"),
        (name = "legacy", description = "The older vocabulary of the same API"),
        (name = "clients", description = "The same runs for the AI SDK's useChat and AG-UI clients"),
        (name = "openai", description = "The same runs as the OpenAI Responses API, for the openai SDKs (errors in OpenAI's shape)"),
        (name = "files", description = "Attachments: upload, read back, delete"),
        (name = "health", description = "Liveness, readiness, profiles, tools"),
    )
)]
pub struct ApiDoc;

/// The document as JSON.
pub fn document() -> String {
    ApiDoc::openapi().to_pretty_json().expect("the document serializes")
}
