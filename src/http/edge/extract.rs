//! Extractors whose rejections are contract errors: JSON bodies (bad JSON, a wrong type, an
//! unknown field or enum value → 400 naming the field; too large → 413), UUIDs in paths,
//! query strings, and the current user from the configured auth mode.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::chat::start::idempotency::{IdempotencyKey, request_key};
use crate::ids::UserId;

use crate::http::AppState;
use crate::http::error::AppError;

/// A JSON body parsed into `T`, refused with the contract's envelope.
pub struct AppJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for AppJson<T> {
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, AppError> {
        let bytes = object_body(req, state).await?;
        parse_json(&bytes).map(AppJson)
    }
}

/// A request's body, which must be a JSON object (serde would also take an array as the
/// fields in order).
async fn object_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, AppError> {
    let bytes = Bytes::from_request(req, state).await.map_err(|rejection| match rejection {
        BytesRejection::FailedToBufferBody(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            AppError::PayloadTooLarge { field: None, message: "Request body is too large".into() }
        }
        other => AppError::Validation { field: None, message: other.body_text() },
    })?;
    if bytes.iter().find(|b| !b.is_ascii_whitespace()).is_some_and(|b| *b == b'[') {
        return Err(AppError::Validation { field: None, message: "The request body must be a JSON object".into() });
    }
    Ok(bytes)
}

/// A JSON body that starts a run, with the request's `Idempotency-Key` (CONTRACT.md §16):
/// the key and a hash of the endpoint and the body's bytes.
pub struct KeyedJson<T>(pub Option<IdempotencyKey>, pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for KeyedJson<T> {
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, AppError> {
        let path = req.uri().path().to_owned();
        let key = match req.headers().get("idempotency-key") {
            None => None,
            Some(value) => {
                let value = value
                    .to_str()
                    .map_err(|_| AppError::validation("Idempotency-Key", "Idempotency-Key must be visible ASCII"))?;
                Some(value.to_owned())
            }
        };
        let bytes = object_body(req, state).await?;
        let key = key.map(|key| request_key(&key, &path, &bytes)).transpose()?;
        parse_json(&bytes).map(|body| KeyedJson(key, body))
    }
}

/// Parses JSON, naming the field at fault where there is one. Text may not hold NUL
/// characters (Postgres cannot store them, and no client means them).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, AppError> {
    if has_nul(bytes) {
        return Err(AppError::Validation { field: None, message: "Text may not contain NUL characters".into() });
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(&mut deserializer);
    if parsed.is_ok() {
        deserializer.end().map_err(|e| AppError::Validation { field: None, message: format!("Invalid JSON: {e}") })?;
    }
    parsed.map_err(|error| {
        let inner = error.inner();
        let path = error.path().to_string();
        let field = if path != "." {
            Some(path)
        } else {
            // serde names a missing field only in its message: "missing field `message`".
            let text = inner.to_string();
            text.strip_prefix("missing field `").and_then(|rest| rest.split('`').next()).map(str::to_owned)
        };
        let message = if inner.is_syntax() || inner.is_eof() {
            format!("Invalid JSON: {inner}")
        } else {
            format!("Invalid request: {inner}")
        };
        AppError::Validation { field, message }
    })
}

/// Whether JSON text holds a `\u0000` escape (raw NUL bytes are not valid JSON anyway).
fn has_nul(bytes: &[u8]) -> bool {
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            if bytes[i + 1..].starts_with(b"u0000") {
                return true;
            }
            i += 2;
        } else {
            i += 1;
        }
    }
    false
}

/// A UUID path segment, as the kind of id `T` it names; a malformed one is a 400 on `field`
/// `id`.
pub struct IdPath<T>(pub T);

impl<T: From<Uuid>, S: Send + Sync> FromRequestParts<S> for IdPath<T> {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, AppError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| AppError::validation("id", e.body_text()))?;
        Uuid::try_parse(&raw)
            .map(|id| IdPath(T::from(id)))
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
            .map_err(|e| AppError::Validation { field: None, message: e.body_text() })
    }
}

/// The user a request acts for. Everything it reads or writes is scoped to this id.
#[derive(Debug, Clone)]
pub struct CurrentUser(pub UserId);

impl FromRequestParts<AppState> for CurrentUser {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, AppError> {
        let peer = parts.extensions.get::<axum::extract::ConnectInfo<std::net::SocketAddr>>().map(|c| c.0.ip());
        let user = state.auth.user(&parts.headers, peer)?;
        state.auth.admit(&user)?;
        Ok(CurrentUser(UserId::new(user)))
    }
}

#[cfg(test)]
mod tests {
    use super::has_nul;

    #[test]
    fn nul_escapes_are_found_and_escaped_backslashes_are_not() {
        assert!(has_nul(br#"{"m": "a\u0000b"}"#));
        assert!(!has_nul(br#"{"m": "a\\u0000b"}"#));
        assert!(!has_nul(br#"{"m": "\u00e9"}"#));
    }
}
