//! Files (CONTRACT.md §14): `POST /api/files` stores a multipart upload for the user as it
//! streams in, `GET /api/files/{id}` gives its bytes back to its owner, `DELETE` removes it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, FromRequest, Multipart, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::{StreamExt, TryStreamExt};

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
    request: Request,
) -> Result<(StatusCode, Json<StoredFile>), AppError> {
    let heads = PartHeads::default();
    let request = heads.guard(request);
    let multipart = Multipart::from_request(request, &state).await;
    let mut multipart =
        multipart.map_err(|e| AppError::validation(FIELD, format!("Send multipart/form-data: {}", e.body_text())))?;
    let bad = |e: axum::extract::multipart::MultipartError| {
        if let Some(refused) = heads.refused() {
            AppError::validation(FIELD, refused)
        } else if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
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
    // refused, and the file with it. What may follow is bounded as the part's head was.
    heads.file_ended();
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

/// The most a multipart upload may send before its file's bytes begin (a preamble, the
/// boundary, the part's headers), and after them (the closing boundary, or a second part's
/// head, refused anyway). The multipart parser under axum holds a part's headers whole in
/// memory however long they are (100 uploads with 20 MiB of headers took 2.9 GB).
pub const MAX_PART_HEAD: usize = 8 * 1024;

/// Bounds what an upload's body holds outside its file part: shared by the body, which
/// counts and checks what passes, and the handler, which says when the file part ended.
#[derive(Clone, Default)]
struct PartHeads(Arc<HeadState>);

#[derive(Default)]
struct HeadState {
    /// Bytes the body has passed on.
    passed: AtomicU64,
    /// Past this many bytes the body stops (0: no bound yet).
    bound: AtomicU64,
    /// Whether the body stopped for a head too long.
    refused: AtomicBool,
    /// Whether the bound was set by the end of the file part (else by the head).
    after_file: AtomicBool,
}

impl PartHeads {
    /// The request with its body checked as it passes: the first part's head must end
    /// within [`MAX_PART_HEAD`] bytes.
    fn guard(&self, request: Request) -> Request {
        let (parts, body) = request.into_parts();
        let boundary = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).and_then(boundary);
        let state = self.0.clone();
        let mut data = body.into_data_stream();
        let guarded = async_stream::stream! {
            let mut head = boundary.map(|b| HeadScan::new(&b));
            while let Some(chunk) = data.next().await {
                let chunk = match chunk {
                    Ok(chunk) => chunk,
                    Err(e) => {
                        yield Err(std::io::Error::other(e));
                        return;
                    }
                };
                if let Some(scan) = head.as_mut() {
                    match scan.feed(&chunk) {
                        Some(true) => head = None,
                        Some(false) => {
                            state.refused.store(true, Ordering::Relaxed);
                            yield Err(std::io::Error::other("a multipart part's head is too long"));
                            return;
                        }
                        None => {}
                    }
                }
                let passed = state.passed.fetch_add(chunk.len() as u64, Ordering::Relaxed) + chunk.len() as u64;
                let bound = state.bound.load(Ordering::Relaxed);
                if bound != 0 && passed > bound {
                    state.refused.store(true, Ordering::Relaxed);
                    yield Err(std::io::Error::other("too much after the file part"));
                    return;
                }
                yield Ok(chunk);
            }
        };
        Request::from_parts(parts, Body::from_stream(guarded))
    }

    /// The file part's bytes have all been read: what follows is bounded.
    fn file_ended(&self) {
        let passed = self.0.passed.load(Ordering::Relaxed);
        self.0.after_file.store(true, Ordering::Relaxed);
        self.0.bound.store(passed + MAX_PART_HEAD as u64, Ordering::Relaxed);
    }

    /// Why the body was stopped, if it was.
    fn refused(&self) -> Option<String> {
        self.0.refused.load(Ordering::Relaxed).then(|| match self.0.after_file.load(Ordering::Relaxed) {
            true => "Send one part, named \"file\", and nothing else".to_owned(),
            false => format!("A multipart part's headers are longer than {MAX_PART_HEAD} bytes"),
        })
    }
}

/// The boundary a multipart content type names.
fn boundary(content_type: &str) -> Option<String> {
    content_type.split(';').skip(1).find_map(|param| {
        let (name, value) = param.split_once('=')?;
        name.trim().eq_ignore_ascii_case("boundary").then(|| value.trim().trim_matches('"').to_owned())
    })
}

/// Finds where the first part's head ends (the blank line after its boundary) in the
/// first [`MAX_PART_HEAD`] bytes of a body, however the body comes in chunks.
struct HeadScan {
    delimiter: Vec<u8>,
    seen: Vec<u8>,
}

impl HeadScan {
    fn new(boundary: &str) -> Self {
        Self { delimiter: format!("--{boundary}").into_bytes(), seen: Vec::new() }
    }

    /// `Some(true)` once the head ended within the bound, `Some(false)` once it cannot,
    /// `None` while it may still.
    fn feed(&mut self, chunk: &[u8]) -> Option<bool> {
        let room = MAX_PART_HEAD - self.seen.len();
        self.seen.extend_from_slice(&chunk[..chunk.len().min(room)]);
        let ended = memchr::memmem::find(&self.seen, &self.delimiter)
            .and_then(|at| memchr::memmem::find(&self.seen[at..], b"\r\n\r\n"))
            .is_some();
        match (ended, self.seen.len() >= MAX_PART_HEAD) {
            (true, _) => Some(true),
            (false, true) => Some(false),
            (false, false) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The verdict on a whole body at once.
    fn verdict(body: &[u8]) -> Option<bool> {
        HeadScan::new("b0undary").feed(body)
    }

    #[test]
    fn a_head_ends_within_the_bound_or_is_refused() {
        let short = b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nbytes";
        assert_eq!(verdict(short), Some(true));
        let long = format!("--b0undary\r\nX-Pad: {}\r\n\r\nbytes", "p".repeat(MAX_PART_HEAD));
        assert_eq!(verdict(long.as_bytes()), Some(false));
        // A blank line in a preamble is no part's head.
        let preamble = format!("pre\r\n\r\namble--b0undary\r\nX-Pad: {}", "p".repeat(MAX_PART_HEAD));
        assert_eq!(verdict(preamble.as_bytes()), Some(false));
        assert_eq!(verdict(b"--b0undary\r\nContent-Dispo"), None);
        assert_eq!(boundary("multipart/form-data; boundary=\"a b\""), Some("a b".to_owned()));
        assert_eq!(boundary("multipart/form-data;BOUNDARY=xyz"), Some("xyz".to_owned()));
    }

    proptest! {
        /// However a body is cut into chunks, the verdict is the whole body's.
        #[test]
        fn any_chunking_gives_the_verdict_of_the_whole(pad in 0usize..(2 * MAX_PART_HEAD), cuts in prop::collection::vec(1usize..4096, 0..12)) {
            let body = format!("--b0undary\r\nX-Pad: {}\r\n\r\nfile bytes", "p".repeat(pad)).into_bytes();
            let whole = verdict(&body);
            let mut scan = HeadScan::new("b0undary");
            let mut rest = &body[..];
            let mut said = None;
            for cut in cuts.into_iter().chain([usize::MAX]) {
                let (chunk, after) = rest.split_at(cut.min(rest.len()));
                rest = after;
                said = scan.feed(chunk);
                if said.is_some() || rest.is_empty() {
                    break;
                }
            }
            prop_assert_eq!(said, whole);
        }
    }
}
