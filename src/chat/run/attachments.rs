//! A message's attachments (CONTRACT.md §14): what a request names is checked and stored
//! before the stream opens (a file id of the user's, a `data:` URL stored like an upload, an
//! `http(s)` URL fetched where config allows), and each profile takes only the kinds its
//! `modalities` name. Before each model call the files of the request are read, once a run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;

use crate::chat::errors::ChatError;
use crate::chat::request::AttachmentRef;
use crate::chat::shared::Shared;
use crate::config::{Modality, ProfileSettings, ProviderKind};
use crate::domain::Attachment;
use crate::files::{FileError, Files};
use crate::ids::{FileId, UserId};
use crate::providers::{FileContent, InputMessage, ModelRequest, ProviderError, ProviderErrorKind};

/// A request's attachments, ready to store with its message; `stored` are the files this
/// request stored itself, deleted again if the request is refused after all.
#[derive(Debug, Default)]
pub(in crate::chat) struct Resolved {
    pub(in crate::chat) attachments: Vec<Attachment>,
    pub(in crate::chat) stored: Vec<FileId>,
}

/// Checks, stores and drops the files requests attach.
#[derive(Clone)]
pub(in crate::chat) struct Attachments {
    files: crate::files::Files,
}

impl Attachments {
    pub(in crate::chat) fn new(shared: &Shared) -> Self {
        Self { files: shared.files.clone() }
    }

    /// Checks and stores what a request attaches. Files it stored are deleted again when
    /// a later attachment is refused.
    pub(in crate::chat) async fn resolve(&self, user: &UserId, refs: &[AttachmentRef]) -> Result<Resolved, ChatError> {
        let max = self.files.settings().max_per_message;
        if refs.len() > max {
            return Err(invalid(format!("A message carries at most {max} attachments (files.max_per_message)")));
        }
        let mut resolved = Resolved::default();
        for (i, attachment) in refs.iter().enumerate() {
            match self.attachment(user, i, attachment).await {
                Ok((file, stored)) => {
                    if stored {
                        resolved.stored.push(file.id);
                    }
                    resolved.attachments.push(file.attachment());
                }
                Err(e) => {
                    self.drop_files(user, &resolved.stored).await;
                    return Err(e);
                }
            }
        }
        Ok(resolved)
    }

    /// One attachment's file, and whether this request stored it.
    async fn attachment(
        &self,
        user: &UserId,
        i: usize,
        attachment: &AttachmentRef,
    ) -> Result<(crate::domain::StoredFile, bool), ChatError> {
        let at = |e: FileError| file_error(e, i);
        match (attachment.file_id, attachment.url.as_deref()) {
            (Some(id), None) => {
                if attachment.name.is_some() {
                    return Err(invalid(format!("attachments[{i}]: a stored file has its name already")));
                }
                Ok((self.files.get(user, id).await.map_err(at)?, false))
            }
            (None, Some(url)) if scheme(url) == Some("data") => {
                let (declared, bytes) = data_url(url).map_err(|why| invalid(format!("attachments[{i}]: {why}")))?;
                let name = attachment.name.clone().unwrap_or_else(|| default_name(&declared));
                Ok((self.files.store_bytes(user, &name, bytes).await.map_err(at)?, true))
            }
            (None, Some(url)) if matches!(scheme(url), Some("http" | "https")) => {
                Ok((self.files.fetch(user, url, attachment.name.as_deref()).await.map_err(at)?, true))
            }
            (None, Some(_)) => Err(invalid(format!("attachments[{i}]: the url must be a data: or http(s) URL"))),
            _ => Err(invalid(format!("attachments[{i}]: give either file_id or url"))),
        }
    }

    /// Deletes files a refused request stored.
    pub(in crate::chat) async fn drop_files(&self, user: &UserId, ids: &[FileId]) {
        for id in ids {
            if let Err(e) = self.files.delete(user, *id).await {
                tracing::warn!(error = %e, file_id = %id, "could not delete a refused request's file");
            }
        }
    }
}

/// Refuses an attachment the profile cannot take, naming it.
pub(in crate::chat) fn check_modalities(
    attachments: &[Attachment],
    profile_name: &str,
    profile: &ProfileSettings,
    provider: ProviderKind,
) -> Result<(), ChatError> {
    for (i, file) in attachments.iter().enumerate() {
        if let Some(max) = provider.max_inline_bytes(file.is_image()).filter(|max| file.size > *max) {
            return Err(invalid(format!(
                "attachments[{i}] ({}, {} bytes) is larger than profile '{profile_name}''s provider takes ({max} bytes)",
                file.name, file.size
            )));
        }
        let needs = modality(file);
        if !profile.modalities.contains(&needs) {
            let takes: Vec<&str> = profile.modalities.iter().map(|m| modality_name(*m)).collect();
            return Err(invalid(format!(
                "attachments[{i}] ({}, {}) cannot go to profile '{profile_name}', which takes {} (its modalities)",
                file.name,
                file.media_type,
                takes.join(", ")
            )));
        }
    }
    Ok(())
}

fn modality(file: &Attachment) -> Modality {
    if file.is_image() {
        Modality::Image
    } else if file.is_pdf() {
        Modality::Pdf
    } else {
        Modality::Text
    }
}

fn modality_name(modality: Modality) -> &'static str {
    match modality {
        Modality::Text => "text",
        Modality::Image => "image",
        Modality::Pdf => "pdf",
    }
}

fn invalid(message: String) -> ChatError {
    ChatError::Invalid { field: "attachments", message }
}

fn file_error(error: FileError, i: usize) -> ChatError {
    match error {
        FileError::TooLarge { .. } => {
            ChatError::TooLarge { field: "attachments", message: format!("attachments[{i}]: {error}") }
        }
        FileError::Invalid(why) => invalid(format!("attachments[{i}]: {why}")),
        FileError::CutShort => invalid(format!("attachments[{i}]: the remote file was cut short")),
        FileError::NotFound => {
            ChatError::NotFound { field: "attachments", message: format!("attachments[{i}]: file not found") }
        }
        FileError::Storage(e) => {
            tracing::error!(error = %e, "file storage");
            ChatError::Unavailable("File storage unavailable".into())
        }
        FileError::Store(e) => e.into(),
    }
}

/// A `data:` URL's declared media type and its bytes (base64 only).
/// A URL's scheme, lowercased: schemes are case-insensitive (RFC 3986 §3.1), so
/// `HTTP://…` and `Data:…` are what they say.
fn scheme(url: &str) -> Option<&'static str> {
    let (scheme, _) = url.split_once(':')?;
    ["data", "http", "https"].into_iter().find(|known| scheme.eq_ignore_ascii_case(known))
}

fn data_url(url: &str) -> Result<(String, Bytes), String> {
    let rest = url.get(5..).filter(|_| scheme(url) == Some("data")).ok_or("not a data: URL")?;
    let (header, data) = rest.split_once(',').ok_or("a data: URL needs a ',' before its data")?;
    let Some(declared) = header.strip_suffix(";base64") else {
        return Err("only base64 data: URLs are taken (data:<type>;base64,<data>)".into());
    };
    let bytes = BASE64.decode(data.trim()).map_err(|e| format!("the data: URL's base64 does not decode ({e})"))?;
    Ok((declared.split(';').next().unwrap_or_default().to_owned(), Bytes::from(bytes)))
}

/// A name for a file sent without one, from the type its sender declared.
fn default_name(declared: &str) -> String {
    let extension = match declared {
        "image/png" => ".png",
        "image/jpeg" => ".jpg",
        "image/gif" => ".gif",
        "image/webp" => ".webp",
        "application/pdf" => ".pdf",
        "text/markdown" => ".md",
        "text/csv" => ".csv",
        "application/json" => ".json",
        "text/plain" => ".txt",
        _ => "",
    };
    format!("attachment{extension}")
}

/// Reads a run's files before its model calls: each file once a run, only those the
/// profile takes.
#[derive(Clone)]
pub struct FileReader {
    files: Files,
    user: UserId,
    modalities: Vec<Modality>,
    provider: ProviderKind,
    read: Arc<Mutex<HashMap<FileId, FileContent>>>,
}

impl FileReader {
    pub fn new(files: Files, user: &UserId, modalities: Vec<Modality>, provider: ProviderKind) -> Self {
        Self { files, user: user.clone(), modalities, provider, read: Arc::default() }
    }

    /// Fills in the content of every file of `request`. A file whose row is there and whose
    /// bytes cannot be read fails the model call: an answer that silently lacks a file the
    /// user sent is worse than an error that says so.
    ///
    /// The messages are copied only where a file is unread (the run's own request keeps
    /// none of the files' contents: a call's copy has them).
    pub async fn read(&self, request: &mut ModelRequest) -> Result<(), ProviderError> {
        let unread = |message: &InputMessage| match message {
            InputMessage::User { files, .. } => files.iter().any(|f| f.content == FileContent::Unread),
            _ => false,
        };
        if !request.messages.iter().any(unread) {
            return Ok(());
        }
        for message in Arc::make_mut(&mut request.messages) {
            let InputMessage::User { files, .. } = message else { continue };
            for input in files.iter_mut().filter(|f| f.content == FileContent::Unread) {
                let known = self.read.lock().expect("never poisoned").get(&input.file.file_id).cloned();
                let content = match known {
                    Some(content) => content,
                    None => {
                        let content = self.content(&input.file).await?;
                        self.read.lock().expect("never poisoned").insert(input.file.file_id, content.clone());
                        content
                    }
                };
                input.content = content;
            }
        }
        Ok(())
    }

    async fn content(&self, file: &Attachment) -> Result<FileContent, ProviderError> {
        let needs = modality(file);
        if !self.modalities.contains(&needs) {
            return Ok(FileContent::Left(format!("this model takes no {} files", modality_name(needs))));
        }
        // A file sent with another profile may be too large for this one's provider.
        if let Some(max) = self.provider.max_inline_bytes(file.is_image()).filter(|max| file.size > *max) {
            return Ok(FileContent::Left(format!("it is larger than this model's provider takes ({max} bytes)")));
        }
        // A file its user deleted is not sent, even where other files share its bytes.
        let unreadable = |e: FileError| {
            tracing::error!(error = %e, file_id = %file.file_id, sha256 = %file.sha256, "an attachment's bytes cannot be read");
            ProviderError::new(
                ProviderErrorKind::Unavailable,
                format!("The attachment {} could not be read from the file storage", file.name),
            )
        };
        let found = match self.files.get(&self.user, file.file_id).await {
            Ok(found) => found,
            Err(FileError::NotFound) => return Ok(FileContent::Left("the file was deleted".into())),
            Err(e) => return Err(unreadable(e)),
        };
        let bytes = self.files.bytes(&found.sha256).await.map_err(unreadable)?;
        Ok(match needs {
            Modality::Text => FileContent::Text(String::from_utf8_lossy(&bytes).into_owned()),
            _ => FileContent::Bytes(bytes),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_urls_decode_or_say_why_not() {
        let (declared, bytes) = data_url("data:text/plain;base64,aGVsbG8=").unwrap();
        assert_eq!((declared.as_str(), &bytes[..]), ("text/plain", &b"hello"[..]));
        assert!(data_url("data:text/plain;base64,@@@").unwrap_err().contains("base64"));
        assert!(data_url("data:text/plain,hello").unwrap_err().contains("only base64"));
        assert!(data_url("data:text/plain;base64").unwrap_err().contains("','"));
        assert_eq!(default_name("image/png"), "attachment.png");
        let (declared, _) = data_url("DATA:text/plain;base64,aGVsbG8=").unwrap();
        assert_eq!(declared, "text/plain", "schemes are case-insensitive");
    }

    #[test]
    fn schemes_are_read_whatever_their_case() {
        assert_eq!(scheme("HTTP://example.com/a.png"), Some("http"));
        assert_eq!(scheme("Https://example.com/a.png"), Some("https"));
        assert_eq!(scheme("Data:text/plain;base64,aA=="), Some("data"));
        assert_eq!(scheme("ftp://example.com/a.png"), None);
        assert_eq!(scheme("no scheme"), None);
    }
}
