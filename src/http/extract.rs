//! Extractors whose rejections are contract errors: JSON bodies (bad JSON, a wrong type, an
//! unknown field or enum value → 400 naming the field; too large → 413), UUIDs in paths,
//! query strings, and the current user from the configured auth mode.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::StatusCode;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use super::AppState;
use super::error::AppError;
use crate::config::AuthMode;

/// A JSON body parsed into `T`, refused with the contract's envelope.
pub struct AppJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for AppJson<T> {
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, AppError> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|rejection| match rejection {
                BytesRejection::FailedToBufferBody(e)
                    if e.status() == StatusCode::PAYLOAD_TOO_LARGE =>
                {
                    AppError::PayloadTooLarge {
                        field: None,
                        message: "Request body is too large".into(),
                    }
                }
                other => AppError::Validation {
                    field: None,
                    message: other.body_text(),
                },
            })?;
        parse_json(&bytes).map(AppJson)
    }
}

/// Parses JSON, naming the field at fault where there is one.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, AppError> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(&mut deserializer);
    if parsed.is_ok() {
        deserializer.end().map_err(|e| AppError::Validation {
            field: None,
            message: format!("Invalid JSON: {e}"),
        })?;
    }
    parsed.map_err(|error| {
        let inner = error.inner();
        let path = error.path().to_string();
        let field = if path != "." {
            Some(path)
        } else {
            // serde names a missing field only in its message: "missing field `message`".
            let text = inner.to_string();
            text.strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next())
                .map(str::to_owned)
        };
        let message = if inner.is_syntax() || inner.is_eof() {
            format!("Invalid JSON: {inner}")
        } else {
            format!("Invalid request: {inner}")
        };
        AppError::Validation { field, message }
    })
}

/// A UUID path segment; a malformed one is a 400 on `field` `id`.
pub struct IdPath(pub Uuid);

impl<S: Send + Sync> FromRequestParts<S> for IdPath {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, AppError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| AppError::validation("id", e.body_text()))?;
        Uuid::try_parse(&raw)
            .map(IdPath)
            .map_err(|_| AppError::validation("id", "Invalid id: expected a UUID"))
    }
}

/// A query string parsed into `T`.
pub struct AppQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for AppQuery<T> {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, AppError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(value)| AppQuery(value))
            .map_err(|e| AppError::Validation {
                field: None,
                message: e.body_text(),
            })
    }
}

/// The user a request acts for. Everything it reads or writes is scoped to this id.
#[derive(Debug, Clone)]
pub struct CurrentUser(pub String);

/// The user of auth mode `none` when no `X-Client-Id` is sent.
const LOCAL_USER: &str = "local";
const MAX_USER_ID_CHARS: usize = 200;

impl FromRequestParts<AppState> for CurrentUser {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, AppError> {
        let auth = &state.settings.auth;
        match auth.mode {
            AuthMode::None => {
                let client = parts
                    .headers
                    .get("x-client-id")
                    .map(|v| v.to_str().map(str::trim));
                match client {
                    None => Ok(CurrentUser(LOCAL_USER.to_owned())),
                    Some(Ok("")) => Ok(CurrentUser(LOCAL_USER.to_owned())),
                    Some(Ok(id)) if id.chars().count() <= MAX_USER_ID_CHARS => {
                        Ok(CurrentUser(id.to_owned()))
                    }
                    _ => Err(AppError::validation(
                        "X-Client-Id",
                        "X-Client-Id must be visible ASCII, at most 200 characters",
                    )),
                }
            }
            AuthMode::Token => {
                let token = parts
                    .headers
                    .get(AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
                    .map(str::trim);
                token
                    .and_then(|t| auth.tokens.get(t))
                    .map(|user| CurrentUser(user.clone()))
                    .ok_or_else(|| AppError::Unauthorized("Missing or invalid credentials".into()))
            }
        }
    }
}
