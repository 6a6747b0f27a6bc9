//! The one error type at the edge: every failure that is not inside an SSE stream becomes the
//! contract's JSON envelope `{code, message, field?}` with its status. Internal causes are
//! logged, never sent.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::chat::{ChatError, ControlError};
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("{message}")]
    Validation { field: Option<String>, message: String },
    #[error("{0}")]
    Unauthorized(String),
    #[error("{message}")]
    NotFound { field: Option<String>, message: String },
    #[error("{0}")]
    Conflict(String),
    #[error("{message}")]
    PayloadTooLarge { field: Option<String>, message: String },
    #[error("{0}")]
    Unavailable(String),
    #[error("{message}")]
    RateLimited { message: String, retry_after: std::time::Duration },
    /// A budget is spent (CONTRACT.md §18).
    #[error("{message}")]
    QuotaExceeded { message: String, retry_after: std::time::Duration },
    #[error("This method is not allowed here")]
    MethodNotAllowed,
    #[error("internal error")]
    Internal,
}

/// The contract's error body, as it is written (see `views::ErrorBody` for its schema).
#[derive(Serialize)]
pub(crate) struct Envelope<'a> {
    pub code: &'static str,
    pub message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<&'a str>,
}

impl AppError {
    pub fn validation(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Validation { field: Some(field.into()), message: message.into() }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::NotFound { field: None, message: message.into() }
    }

    /// Maps a store error, naming what was missing when it was `NotFound`:
    /// `.map_err(AppError::missing("Trace not found"))`.
    pub fn missing(message: &'static str) -> impl FnOnce(StoreError) -> AppError {
        move |error| match error {
            StoreError::NotFound => AppError::not_found(message),
            e => e.into(),
        }
    }

    fn parts(&self) -> (StatusCode, &'static str, Option<&str>) {
        match self {
            AppError::Validation { field, .. } => (StatusCode::BAD_REQUEST, "VALIDATION_ERROR", field.as_deref()),
            AppError::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "UNAUTHORIZED", None),
            AppError::NotFound { field, .. } => (StatusCode::NOT_FOUND, "NOT_FOUND", field.as_deref()),
            AppError::Conflict(_) => (StatusCode::CONFLICT, "CONFLICT", None),
            AppError::PayloadTooLarge { field, .. } => {
                (StatusCode::PAYLOAD_TOO_LARGE, "PAYLOAD_TOO_LARGE", field.as_deref())
            }
            AppError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "SERVICE_UNAVAILABLE", None),
            AppError::RateLimited { .. } => (StatusCode::TOO_MANY_REQUESTS, "RATE_LIMITED", None),
            AppError::QuotaExceeded { .. } => (StatusCode::TOO_MANY_REQUESTS, "QUOTA_EXCEEDED", None),
            // Not a contract code: the closest is a bad request, with the HTTP status that says why.
            AppError::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, "VALIDATION_ERROR", None),
            AppError::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", None),
        }
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let (status, code, field) = self.parts();
        let message = self.to_string();
        let mut response = (status, Json(Envelope { code, message: &message, field })).into_response();
        if let AppError::RateLimited { retry_after, .. } | AppError::QuotaExceeded { retry_after, .. } = &self {
            let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

impl From<StoreError> for AppError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::NotFound => AppError::not_found("Not found"),
            StoreError::Conflict(message) => AppError::Conflict(message),
            error if error.is_unavailable() => {
                tracing::error!(%error, "database unavailable");
                AppError::Unavailable("Database unavailable".into())
            }
            error => {
                tracing::error!(%error, "store error");
                AppError::Internal
            }
        }
    }
}

impl From<ChatError> for AppError {
    fn from(error: ChatError) -> Self {
        match error {
            ChatError::Invalid { field, message } => AppError::validation(field, message),
            ChatError::TooLarge { field, message } => AppError::PayloadTooLarge { field: Some(field.into()), message },
            ChatError::NotFound { field, message } => AppError::NotFound { field: Some(field.into()), message },
            ChatError::Conflict(message) => AppError::Conflict(message),
            ChatError::Unavailable(message) => AppError::Unavailable(message),
            ChatError::Busy { message, retry_after } => AppError::RateLimited { message, retry_after },
            ChatError::QuotaExceeded { message, retry_after } => AppError::QuotaExceeded { message, retry_after },
            ChatError::Store(e) => e.into(),
        }
    }
}

impl From<ControlError> for AppError {
    fn from(error: ControlError) -> Self {
        match error {
            ControlError::Missing(_) => AppError::not_found(error.to_string()),
            ControlError::Ended(message) => AppError::Conflict(message.into()),
            ControlError::Conflict(message) => AppError::Conflict(message),
            ControlError::NoAnswer => AppError::Unavailable(error.to_string()),
            ControlError::Store(e) => e.into(),
        }
    }
}
