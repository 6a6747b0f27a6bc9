//! The OpenAI Responses API over chatd's runs (CONTRACT.md §20): what the `openai` SDKs send
//! to `base_url = http://<chatd>/v1` (`body`), answered with the Response object and its
//! streaming events (`object`, `stream`). A response is a run: its id names the run's
//! trace, its conversation is a chatd conversation, its stream a function of the run's log.
//! Errors are OpenAI's shape (`object::rewrite`, over every `/v1` route).

pub mod body;
pub mod conversations;
pub mod object;
mod stream;
#[cfg(test)]
mod tests;

use axum::extract::{Path, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde::Deserialize;

use self::body::{CreateResponse, Placement};
use self::conversations::Item;
use self::object::{InputItem, InputItemList, Model, ModelList, Refused, Response, parse_response_id};
use self::stream::{ResponseEvents, ResponsesSse, replay, response_frames};
use crate::chat::Started;
use crate::chat::control::waits::WaitAnswer;
use crate::domain::Trace;
use crate::http::AppState;
use crate::http::chat::until_done;
use crate::http::error::AppError;
use crate::http::extract::{AppQuery, CurrentUser, KeyedJson};
use crate::http::sse::sse;
use crate::ids::{TraceId, UserId};

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

/// `POST /v1/responses`: a run, answered whole or streamed; or, when its input answers a
/// waiting run's calls, that run's events after its wait.
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
    if let Some(answers) = body.answers()? {
        return continued(&state, &user, &body, answers).await;
    }
    let mut request = body.request()?;
    match body.placement()? {
        Placement::New => {}
        Placement::Conversation(id) => request.conversation_id = Some(id),
        Placement::After(trace_id, _) => {
            let previous = state.store.get_trace(&user, trace_id).await.map_err(previous_missing)?;
            request.conversation_id = Some(previous.conversation_id);
            request.parent_message_id = Some(previous.message_id);
        }
    }
    request.idempotency_key = key;
    let profile = request.profile.clone().unwrap_or_default();
    let events = ResponseEvents::new().with_metadata(request.metadata.as_ref());
    if body.background {
        // Answered at once; the run goes on, its events readable from any replica.
        let response = match state.chat.start_once(&user, request).await? {
            Started::New(run) => Response {
                metadata: events.response().metadata,
                ..Response::begun(run.trace_id, run.conversation_id, run.message_id, &profile)
            },
            Started::Again(trace) => {
                let (events, logged) = response_log(&state, &trace, 0).await?;
                replay(events, logged.iter().filter_map(|e| e.event.as_ref()))
            }
        };
        return Ok(Json(Response { background: true, ..response }).into_response());
    }
    let (trace_id, frames) = match state.chat.start_once(&user, request).await? {
        // Until the run ends, or waits: the next response goes on from there.
        Started::New(run) => (run.trace_id, until_done(&state, run, false).boxed()),
        Started::Again(trace) => (trace.trace_id, state.chat.follow(*trace, 0, false).boxed()),
    };
    Ok(respond(&state, body.stream, trace_id, events, frames).await)
}

/// A response whose input answers the calls a run waits on (CONTRACT.md §15): they are
/// settled, and the run goes on; the response is its events after the wait. The run is
/// the one `previous_response_id` names, else the one the answered items name, else the
/// conversation's waiting run. Sent again once the run went on, it gets the same response.
async fn continued(
    state: &AppState,
    user: &UserId,
    body: &CreateResponse,
    answers: body::Answers,
) -> Result<HttpResponse, AppError> {
    let (trace_id, previous) = match (body.placement()?, answers.named) {
        (Placement::After(trace_id, from), _) => (trace_id, Some(from)),
        (_, Some(named)) => (named, None),
        (Placement::Conversation(id), None) => {
            let going = state.store.running_in_conversation(user, id).await?;
            let waiting = going.into_iter().find(|trace| trace.status == crate::domain::TraceStatus::Waiting);
            let trace = waiting.ok_or_else(|| AppError::Conflict("No response of this conversation waits".into()))?;
            (trace.trace_id, None)
        }
        (Placement::New, None) => {
            return Err(AppError::validation(
                "previous_response_id",
                "function_call_output and mcp_approval_response answer a response: give its previous_response_id",
            ));
        }
    };
    let trace = state.store.get_trace(user, trace_id).await.map_err(previous_missing)?;
    // Read once: what the wait asks, and (its events before the wait being the same after
    // it) what the response that goes on knows of the run.
    let logged = state.store.trace_events(trace_id, 0).await?;
    if trace.status == crate::domain::TraceStatus::Waiting {
        unanswered(&logged, &answers.answers)?;
    }
    let (trace, from) = match state.chat.answer_waits(user, trace.message_id, answers.answers).await? {
        Some(answered) => (answered.trace, answered.waited_to),
        None => {
            let after_previous = logged.iter().filter(|e| previous.is_some_and(|p| e.seq as u64 > p));
            let from = previous.and_then(|_| next_response(after_previous.map(|e| (e.seq as u64, e.event.as_ref()))));
            let from =
                from.ok_or_else(|| AppError::Conflict("That response does not wait for these answers".into()))?;
            (trace, from)
        }
    };
    let events = opening(&trace, from, &logged)?;
    if body.background {
        return Ok(Json(Response { background: true, ..events.response() }).into_response());
    }
    let trace_id = trace.trace_id;
    let frames = state.chat.follow(trace, from, false).boxed();
    Ok(respond(state, body.stream, trace_id, events, frames).await)
}

/// Refuses answers that leave a call of the run's wait unanswered (before any is settled):
/// the run goes on only once every call it waits on is, so a response of some would have
/// nothing to say.
fn unanswered(logged: &[crate::events::LoggedEvent], answers: &[WaitAnswer]) -> Result<(), AppError> {
    let waiting = logged.iter().rev().map_while(|e| e.event.as_ref().filter(|e| stream::is_request(e)));
    let missing: Vec<String> = waiting
        .filter_map(|request| match request {
            crate::events::Event::ToolResultRequest(r) => {
                let answered = answers.iter().any(|a| matches!(a, WaitAnswer::Result { tool_call_id, .. } if *tool_call_id == r.tool_call_id));
                (!answered).then(|| format!("function_call_output for {}", r.tool_call_id))
            }
            crate::events::Event::ToolApprovalRequest(r) => {
                let answered = answers.iter().any(|a| matches!(a, WaitAnswer::Approval { approval_id, .. } if approval_id.to_string() == r.approval_id));
                (!answered).then(|| format!("mcp_approval_response for {}", r.tool))
            }
            _ => None,
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(AppError::validation(
        "input",
        format!("answer every call the response waits on; missing: {}", missing.join(", ")),
    ))
}

/// Where the response after the one whose events are `logged` begins: the seq of the last
/// request of the wait that ended it, if the run went on after it.
fn next_response<'a>(logged: impl Iterator<Item = (u64, Option<&'a crate::events::Event>)>) -> Option<u64> {
    let mut cut = stream::Cut::default();
    let mut last = None;
    for (seq, event) in logged {
        if !cut.keeps(event) {
            return last;
        }
        last = Some(seq);
    }
    None
}

/// A response's events, streamed, or read to its end and answered whole. Answered whole
/// once its run's log has it too (where the run ended or waits in this process): the
/// response, read right after from another replica, is the one answered.
async fn respond(
    state: &AppState,
    stream: bool,
    trace_id: TraceId,
    events: ResponseEvents,
    frames: futures_util::stream::BoxStream<'static, crate::chat::Frame>,
) -> HttpResponse {
    let frames = response_frames(frames);
    if stream {
        return responses_sse(sse(state, frames, ResponsesSse::new(events, None)));
    }
    let response = answered(events, frames).await;
    state.chat.logged(trace_id).await;
    Json(response).into_response()
}

fn previous_missing(e: crate::store::StoreError) -> AppError {
    match e {
        crate::store::StoreError::NotFound => {
            AppError::NotFound { field: Some("previous_response_id".into()), message: "Response not found".into() }
        }
        e => e.into(),
    }
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
    let (trace, from) = response_of(&state, &user, &id).await?;
    if query.stream {
        let (events, _) = response_log(&state, &trace, from).await?;
        let frames = response_frames(run_frames(&state, &user, trace.trace_id, from).await?);
        return Ok(responses_sse(sse(&state, frames, ResponsesSse::new(events, query.starting_after))));
    }
    // Read right after its stream ended, on any replica, the response is the one the stream
    // ended with (its log's last events are written a moment after).
    let (trace, whole) = state.chat.whole_log(trace).await?;
    // An ended run whose process died before it logged its end ends as its followers hear.
    let unlogged = crate::chat::ending_never_logged(&trace, &whole);
    let (events, logged) = response_events(&trace, from, whole)?;
    let ending = unlogged.iter().flatten().filter_map(crate::chat::Frame::event);
    Ok(Json(replay(events, logged.iter().filter_map(|e| e.event.as_ref()).chain(ending))).into_response())
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
    let (trace, from) = response_of(&state, &user, &id).await?;
    let (events, _) = response_log(&state, &trace, from).await?;
    match state.chat.cancel(&user, crate::chat::CancelTarget::Trace(trace.trace_id)).await {
        Ok(_) | Err(crate::chat::ControlError::Ended(_)) => {}
        Err(e) => return Err(e.into()),
    }
    // Its end, heard live or read from its log: the response it came to.
    let frames = response_frames(run_frames(&state, &user, trace.trace_id, from).await?);
    Ok(Json(answered(events, frames).await).into_response())
}

/// `GET /v1/responses/{id}/input_items`: what the response was sent: its user message, or
/// (a response that goes on after a wait) its answers to the calls its run waited on.
#[utoipa::path(get, operation_id = "openai_list_input_items", path = "/v1/responses/{id}/input_items", tag = "openai",
    params(
        ("id" = String, Path, description = "`resp_<trace id>`, or `resp_<trace id>_<seq>`"),
        ("after" = Option<String>, Query, description = "The items after this one, in the order asked"),
        ("limit" = Option<u32>, Query, description = "1..100; default 20"),
        ("order" = Option<String>, Query, description = "`desc` (default) or `asc`"),
    ),
    responses((status = 200, description = "The input items", body = InputItemList), Refused))]
pub async fn input_items(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    Path(id): Path<String>,
    AppQuery(query): AppQuery<conversations::ItemsQuery>,
) -> Result<Json<InputItemList>, AppError> {
    let (trace, from) = response_of(&state, &user, &id).await?;
    let items = if from == 0 {
        let message = state
            .store
            .get_message(&user, trace.user_message_id)
            .await
            .map_err(AppError::missing("Response not found"))?;
        vec![InputItem::Message(Item::of(&message).ok_or_else(|| AppError::not_found("Response not found"))?)]
    } else {
        let logged = state.store.trace_events(trace.trace_id, 0).await?;
        if !ends_a_wait(&logged, from) {
            return Err(AppError::not_found("Response not found"));
        }
        let logged: Vec<(u64, &crate::events::Event)> =
            logged.iter().filter_map(|e| Some((e.seq as u64, e.event.as_ref()?))).collect();
        let key = trace.trace_id.0.simple().to_string();
        stream::answers_sent(&key, from, &logged).into_iter().map(InputItem::Answer).collect()
    };
    let (items, has_more) = query.page(items, InputItem::id)?;
    let (first_id, last_id) = (items.first().map(|i| i.id().to_owned()), items.last().map(|i| i.id().to_owned()));
    Ok(Json(InputItemList { object: "list", data: items, first_id, last_id, has_more }))
}

/// A run's frames after `from`, live to its end or to where it waits, from its log where
/// it ended.
async fn run_frames(
    state: &AppState,
    user: &UserId,
    trace_id: TraceId,
    from: u64,
) -> Result<futures_util::stream::BoxStream<'static, crate::chat::Frame>, AppError> {
    Ok(match state.chat.resume(user, trace_id, from, false).await? {
        crate::chat::Resumed::Frames(frames) => frames,
        crate::chat::Resumed::HeardAll => futures_util::stream::empty().boxed(),
    })
}

/// The response a run's frames come to, read to their end.
async fn answered(events: ResponseEvents, frames: impl futures_util::Stream<Item = crate::chat::Frame>) -> Response {
    let frames_read: Vec<crate::chat::Frame> = frames.collect().await;
    replay(events, frames_read.iter().filter_map(crate::chat::Frame::event))
}

/// The user's response `id`: its run's trace, and the seq after which its events begin.
async fn response_of(state: &AppState, user: &UserId, id: &str) -> Result<(Trace, u64), AppError> {
    let (trace_id, from) = parse_response_id(id).ok_or_else(|| AppError::not_found("Response not found"))?;
    let trace = state.store.get_trace(user, trace_id).await.map_err(AppError::missing("Response not found"))?;
    Ok((trace, from))
}

/// The run's log read for its response beginning after `from`: the events that build it,
/// knowing what came before, and the logged events after `from`. A response that goes on
/// after a wait begins right after that wait's last request: any other `from` is none.
async fn response_log(
    state: &AppState,
    trace: &Trace,
    from: u64,
) -> Result<(ResponseEvents, Vec<crate::events::LoggedEvent>), AppError> {
    response_events(trace, from, state.store.trace_events(trace.trace_id, 0).await?)
}

/// [`response_log`] of the run's whole log, read already.
fn response_events(
    trace: &Trace,
    from: u64,
    mut logged: Vec<crate::events::LoggedEvent>,
) -> Result<(ResponseEvents, Vec<crate::events::LoggedEvent>), AppError> {
    let events = opening(trace, from, &logged)?;
    let at = logged.partition_point(|e| (e.seq as u64) <= from);
    Ok((events, logged.split_off(at)))
}

/// The events that build `trace`'s response beginning after `from`, knowing the run's
/// `logged` events before it (any `from` but where a wait ended is no response's).
fn opening(trace: &Trace, from: u64, logged: &[crate::events::LoggedEvent]) -> Result<ResponseEvents, AppError> {
    if from == 0 {
        return Ok(ResponseEvents::of(trace));
    }
    let events = ResponseEvents::new().with_metadata(trace.metadata.as_ref());
    if !ends_a_wait(logged, from) {
        return Err(AppError::not_found("Response not found"));
    }
    let earlier = logged.iter().take_while(|e| e.seq as u64 <= from);
    Ok(events.after(from, earlier.filter_map(|e| Some((e.seq as u64, e.event.as_ref()?)))))
}

/// Whether a wait's requests end at seq `from` of a run's log: where a response that goes on
/// after a wait begins (any other `from` is no response's).
fn ends_a_wait(logged: &[crate::events::LoggedEvent], from: u64) -> bool {
    let at = logged.partition_point(|e| (e.seq as u64) <= from);
    let request =
        |e: Option<&crate::events::LoggedEvent>| e.and_then(|e| e.event.as_ref()).is_some_and(stream::is_request);
    at > 0 && logged[at - 1].seq as u64 == from && request(logged.get(at - 1)) && !request(logged.get(at))
}

/// The events' stream as OpenAI serves it (`text/event-stream`, no caching).
fn responses_sse(mut response: HttpResponse) -> HttpResponse {
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
