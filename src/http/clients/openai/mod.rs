//! The OpenAI Responses API over chatd's runs (CONTRACT.md §20): what the `openai` SDKs send
//! to `base_url = http://<chatd>/v1` (`body`), answered with the Response object and its
//! streaming events (`object`, `stream`). A response is a run: its id names the run's
//! trace, its conversation is a chatd conversation, its stream a function of the run's log.
//! Errors are OpenAI's shape (`object::rewrite`, over every `/v1` route).

pub mod body;
pub mod conversations;
pub mod object;
mod stream;

use axum::extract::{Path, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde::Deserialize;

use self::body::{CreateResponse, Placement};
use self::conversations::{Item, ItemList};
use self::object::{Model, ModelList, Refused, Response, parse_id};
use self::stream::{ResponsesSse, replay};
use crate::chat::Started;
use crate::http::AppState;
use crate::http::chat::until_done;
use crate::http::error::AppError;
use crate::http::extract::{AppQuery, CurrentUser, KeyedJson};
use crate::http::sse::sse;
use crate::ids::TraceId;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/responses", post(create))
        .route("/v1/responses/{id}", get(retrieve))
        .route("/v1/responses/{id}/cancel", post(cancel))
        .route("/v1/responses/{id}/input_items", get(input_items))
        .merge(conversations::routes())
        .layer(axum::middleware::map_response(object::rewrite))
}

/// `GET /v1/models`: the profiles, as models.
#[utoipa::path(get, operation_id = "openai_list_models", path = "/v1/models", tag = "openai",
    responses((status = 200, description = "The profiles, as models", body = ModelList), Refused))]
pub async fn models(State(state): State<AppState>, CurrentUser(_): CurrentUser) -> Json<ModelList> {
    let created = 0;
    let data = state
        .settings
        .profiles
        .iter()
        .map(|(id, p)| Model { id: id.clone(), object: "model", created, owned_by: p.provider.clone() })
        .collect();
    Json(ModelList { object: "list", data })
}

/// `POST /v1/responses`: a run, answered whole or streamed.
#[utoipa::path(post, operation_id = "openai_create_response", path = "/v1/responses", tag = "openai",
    request_body = CreateResponse,
    responses(
        (status = 200, description = "The Response (`stream: false`), or its events as SSE (`stream: true`: `event: <type>`, `data: <event>`)", body = Response),
        Refused))]
pub async fn create(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    KeyedJson(key, body): KeyedJson<CreateResponse>,
) -> Result<HttpResponse, AppError> {
    body.check()?;
    let mut request = body.request()?;
    match body.placement()? {
        Placement::New => {}
        Placement::Conversation(id) => request.conversation_id = Some(id),
        Placement::After(trace_id) => {
            let previous = state.store.get_trace(&user, trace_id).await.map_err(|e| match e {
                crate::store::StoreError::NotFound => AppError::NotFound {
                    field: Some("previous_response_id".into()),
                    message: "Response not found".into(),
                },
                e => e.into(),
            })?;
            request.conversation_id = Some(previous.conversation_id);
            request.parent_message_id = Some(previous.message_id);
        }
    }
    request.idempotency_key = key;
    let profile = request.profile.clone().unwrap_or_default();
    if body.background {
        // Answered at once; the run goes on, its events readable from any replica.
        let response = match state.chat.start_once(&user, request).await? {
            Started::New(run) => Response::begun(run.trace_id, run.conversation_id, run.message_id, &profile),
            Started::Again(trace) => stored(&state, trace.trace_id).await?,
        };
        return Ok(Json(Response { background: true, ..response }).into_response());
    }
    let frames = match state.chat.start_once(&user, request).await? {
        // Until the run ends, or waits (a response of a run that waits is part of what is
        // not built yet: it ends there).
        Started::New(run) => until_done(&state, run, false).boxed(),
        Started::Again(trace) => state.chat.follow(*trace, 0, false).boxed(),
    };
    if body.stream {
        return Ok(responses_sse(sse(&state, frames, ResponsesSse::new(None))));
    }
    // Answered whole: the run's events, to its end, through the same translation as a stream.
    Ok(Json(answered(frames).await).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrieveQuery {
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    starting_after: Option<u64>,
    /// Accepted: chatd adds no obfuscation.
    #[serde(default)]
    #[allow(dead_code)]
    include_obfuscation: Option<bool>,
}

/// `GET /v1/responses/{id}`: the response as it stands; with `stream=true`, its events
/// (after `starting_after`), live to its end, from any replica.
#[utoipa::path(get, operation_id = "openai_retrieve_response", path = "/v1/responses/{id}", tag = "openai",
    params(
        ("id" = String, Path, description = "`resp_<trace id>`"),
        ("stream" = Option<bool>, Query, description = "Its events as SSE, live to its end"),
        ("starting_after" = Option<u64>, Query, description = "With `stream`: only the events numbered after this"),
        ("include_obfuscation" = Option<bool>, Query, description = "Accepted; chatd adds no obfuscation"),
    ),
    responses(
        (status = 200, description = "The Response, or (`stream=true`) its events as SSE", body = Response),
        Refused))]
pub async fn retrieve(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path(id): Path<String>,
    AppQuery(query): AppQuery<RetrieveQuery>,
) -> Result<HttpResponse, AppError> {
    let trace_id = response_trace(&id)?;
    let trace = state.store.get_trace(&user, trace_id).await.map_err(AppError::missing("Response not found"))?;
    if query.stream {
        let frames = run_frames(&state, &user, trace_id, true).await?;
        return Ok(responses_sse(sse(&state, frames, ResponsesSse::new(query.starting_after))));
    }
    Ok(Json(stored(&state, trace.trace_id).await?).into_response())
}

/// `POST /v1/responses/{id}/cancel`: cancels its run (CONTRACT.md §6) and answers the
/// response once the run ended; a response that had ended already is answered as it is.
#[utoipa::path(post, operation_id = "openai_cancel_response", path = "/v1/responses/{id}/cancel", tag = "openai",
    params(("id" = String, Path, description = "`resp_<trace id>`")),
    responses((status = 200, description = "The Response, `cancelled` (or as it ended)", body = Response), Refused))]
pub async fn cancel(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path(id): Path<String>,
) -> Result<HttpResponse, AppError> {
    let trace_id = response_trace(&id)?;
    state.store.get_trace(&user, trace_id).await.map_err(AppError::missing("Response not found"))?;
    match state.chat.cancel(&user, crate::chat::CancelTarget::Trace(trace_id)).await {
        Ok(_) | Err(crate::chat::ControlError::Ended(_)) => {}
        Err(e) => return Err(e.into()),
    }
    // Its end, heard live or read from its log: the response it came to.
    let frames = run_frames(&state, &user, trace_id, false).await?;
    Ok(Json(answered(frames).await).into_response())
}

/// `GET /v1/responses/{id}/input_items`: what the response was asked (its user message).
#[utoipa::path(get, operation_id = "openai_list_input_items", path = "/v1/responses/{id}/input_items", tag = "openai",
    params(
        ("id" = String, Path, description = "`resp_<trace id>`"),
        ("after" = Option<String>, Query, description = "Accepted: a response has one input item"),
        ("limit" = Option<u32>, Query, description = "Accepted"),
        ("order" = Option<String>, Query, description = "Accepted"),
    ),
    responses((status = 200, description = "The input items", body = ItemList), Refused))]
pub async fn input_items(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path(id): Path<String>,
    AppQuery(query): AppQuery<ListQuery>,
) -> Result<Json<ItemList>, AppError> {
    let trace_id = response_trace(&id)?;
    let trace = state.store.get_trace(&user, trace_id).await.map_err(AppError::missing("Response not found"))?;
    let message =
        state.store.get_message(&user, trace.user_message_id).await.map_err(AppError::missing("Response not found"))?;
    let item = Item::of(&message).ok_or_else(|| AppError::not_found("Response not found"))?;
    // One item: nothing comes after it.
    let data = if query.after.as_deref() == Some(item.id.as_str()) { Vec::new() } else { vec![item] };
    Ok(Json(ItemList::of(data, false)))
}

/// The list's query: a response has one input item, so only `after` changes the answer.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub struct ListQuery {
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<u32>,
    #[serde(default)]
    order: Option<String>,
    #[serde(default, rename = "include[]")]
    include: Option<String>,
}

/// A run's frames from its first, live to its end (or, without `through_waits`, to where it
/// waits), from its log where it ended.
async fn run_frames(
    state: &AppState,
    user: &crate::ids::UserId,
    trace_id: TraceId,
    through_waits: bool,
) -> Result<futures_util::stream::BoxStream<'static, crate::chat::Frame>, AppError> {
    Ok(match state.chat.resume(user, trace_id, 0, through_waits).await? {
        crate::chat::Resumed::Frames(frames) => frames,
        crate::chat::Resumed::HeardAll => futures_util::stream::empty().boxed(),
    })
}

/// The response a run's frames come to, read to their end.
async fn answered(frames: impl futures_util::Stream<Item = crate::chat::Frame>) -> Response {
    let events: Vec<_> = frames.filter_map(|frame| async move { frame.event }).collect().await;
    replay(events.iter().map(|e| &**e))
}

/// A response as its run's log has it now.
async fn stored(state: &AppState, trace_id: TraceId) -> Result<Response, AppError> {
    let logged = state.store.trace_events(trace_id, 0).await?;
    Ok(replay(logged.iter().filter_map(|e| e.event.as_ref())))
}

fn response_trace(id: &str) -> Result<TraceId, AppError> {
    parse_id("resp", id).map(TraceId::from).ok_or_else(|| AppError::not_found("Response not found"))
}

/// The events' stream as OpenAI serves it (`text/event-stream`, no caching).
fn responses_sse(mut response: HttpResponse) -> HttpResponse {
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
