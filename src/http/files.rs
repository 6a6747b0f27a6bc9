//! Files (CONTRACT.md §14): `POST /api/files` stores a multipart upload for the user as it
//! streams in, `GET /api/files/{id}` gives its bytes back to its owner, `DELETE` removes it.

use axum::body::Body;
use axum::extract::multipart::MultipartRejection;
use axum::extract::{DefaultBodyLimit, Multipart, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::TryStreamExt;

use super::AppState;
use super::error::AppError;
use super::extract::{CurrentUser, IdPath};
use super::views::*;
use crate::domain::StoredFile;
use crate::files::FileError;
use crate::ids::FileId;

/// Room for a multipart body's framing beside the file itself: the body's limit must not
/// stop a read before the file's own limit does (413 `field: "attachments"` either way).
const FRAMING_BYTES: u64 = 1024 * 1024;

pub fn routes(max_bytes: u64) -> Router<AppState> {
    let limit = usize::try_from(max_bytes.saturating_add(FRAMING_BYTES)).unwrap_or(usize::MAX);
    Router::new()
        .route("/api/files", post(upload).layer(DefaultBodyLimit::max(limit)))
        .route("/api/files/{id}", get(download).delete(delete))
}

/// The field a refused file is named by (CONTRACT.md §14), on upload as in a message.
const FIELD: &str = "attachments";

impl From<FileError> for AppError {
    fn from(error: FileError) -> Self {
        file_error(error, FIELD)
    }
}

/// A file error as the contract's envelope, naming `field` where the input is at fault.
pub fn file_error(error: FileError, field: &str) -> AppError {
    match error {
        FileError::TooLarge { .. } => {
            AppError::PayloadTooLarge { field: Some(field.to_owned()), message: error.to_string() }
        }
        FileError::Invalid(message) => AppError::validation(field, message),
        FileError::CutShort => AppError::validation(field, error.to_string()),
        FileError::NotFound => AppError::NotFound { field: None, message: "File not found".into() },
        FileError::Storage(e) => {
            tracing::error!(error = %e, "file storage");
            AppError::Unavailable("File storage unavailable".into())
        }
        FileError::Store(e) => e.into(),
    }
}

/// The multipart body of an upload: one part named `file`, with its file name.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct Upload {
    #[schema(value_type = String, format = Binary)]
    file: Vec<u8>,
}

#[utoipa::path(post, operation_id = "upload_file", path = "/api/files", tag = "files",
    request_body(content = Upload, content_type = "multipart/form-data"),
    responses((status = 201, description = "Stored; its kind is read from its bytes", body = StoredFile), Refused,
        (status = 413, description = "Larger than files.max_bytes (refused as soon as it is passed)", body = ErrorBody)))]
async fn upload(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<(StatusCode, Json<StoredFile>), AppError> {
    let mut multipart =
        multipart.map_err(|e| AppError::validation(FIELD, format!("Send multipart/form-data: {}", e.body_text())))?;
    let bad = |e: axum::extract::multipart::MultipartError| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            file_error(FileError::TooLarge { max: state.files.max_bytes() }, FIELD)
        } else {
            AppError::validation(FIELD, format!("The multipart body is malformed: {}", e.body_text()))
        }
    };
    let Some(field) = multipart.next_field().await.map_err(bad)? else {
        return Err(AppError::validation(FIELD, "Send the file as a multipart part named \"file\""));
    };
    if field.name() != Some("file") {
        return Err(AppError::validation(FIELD, "Send the file as a multipart part named \"file\""));
    }
    let name = field.file_name().unwrap_or("file").to_owned();
    let max = state.files.max_bytes();
    let body = field.map_err(move |e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE { FileError::TooLarge { max } } else { FileError::CutShort }
    });
    let file = state.files.upload(&user, &name, body).await?;
    // The part was the whole body; anything after it (or a body that breaks after it) is
    // refused, and the file with it.
    let rest = match multipart.next_field().await {
        Ok(None) => Ok(()),
        Ok(Some(_)) => Err(AppError::validation(FIELD, "Send one part, named \"file\", and nothing else")),
        Err(e) => Err(bad(e)),
    };
    if let Err(refused) = rest {
        let _ = state.files.delete(&user, file.id).await;
        return Err(refused);
    }
    Ok((StatusCode::CREATED, Json(file)))
}

#[utoipa::path(get, operation_id = "download_file", path = "/api/files/{id}", tag = "files",
    params(("id" = Uuid, Path, description = "File id")),
    responses((status = 200, description = "The file's bytes, with its media type", content_type = "application/octet-stream"), Refused, Missing))]
async fn download(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<FileId>,
) -> Result<Response, AppError> {
    let file = state.files.get(&user, id).await?;
    let bytes = state.files.stream(&file.sha256).await?;
    let mut response = Body::from_stream(bytes).into_response();
    let headers = response.headers_mut();
    // Text is UTF-8 (it was checked so); nothing served here may run as a page.
    let text = file.media_type.starts_with("text/") || file.media_type == "application/json";
    let media_type = if text { format!("{}; charset=utf-8", file.media_type) } else { file.media_type.clone() };
    if let Ok(media_type) = HeaderValue::from_str(&media_type) {
        headers.insert(header::CONTENT_TYPE, media_type);
    }
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static("sandbox; default-src 'none'"));
    headers.insert(header::CONTENT_LENGTH, file.size.into());
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("private, max-age=3600"));
    if let Ok(disposition) = HeaderValue::from_str(&format!("inline; filename*=UTF-8''{}", encode(&file.name))) {
        headers.insert(header::CONTENT_DISPOSITION, disposition);
    }
    Ok(response)
}

#[utoipa::path(delete, operation_id = "delete_file", path = "/api/files/{id}", tag = "files",
    params(("id" = Uuid, Path, description = "File id")),
    responses((status = 204, description = "Deleted; messages that carried it still show its name"), Refused, Missing))]
async fn delete(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    IdPath(id): IdPath<FileId>,
) -> Result<StatusCode, AppError> {
    state.files.delete(&user, id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A file name for `filename*` (RFC 8187): unreserved bytes as they are, the rest %XX.
fn encode(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
