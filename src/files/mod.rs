//! Files users attach to messages (CONTRACT.md §14). The bytes go to a storage named by
//! `files.url` through `object_store` (the local filesystem, or any S3-compatible store),
//! content-addressed by sha256 so that the same bytes are kept once; each file's row (its
//! owner, name, kind and size) goes to the database.
//!
//! An upload streams: its bytes go to a temporary object as they arrive, hashed, counted and
//! sniffed on the way; past `files.max_bytes` it stops at once. Only a whole file of a kind
//! chatd takes becomes `blobs/<sha256>`; anything else leaves nothing behind.

pub mod kind;
mod remote;

use std::sync::Arc;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, WriteMultipart};
use sha2::{Digest, Sha256};

use self::kind::Sniffer;
pub use self::remote::RemoteError;
use crate::config::FileSettings;
use crate::domain::{StoredFile, now};
use crate::ids::{FileId, UserId};
use crate::store::{BytesLock, Store, StoreError};

/// Why a file could not be stored, read or deleted.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// Past `files.max_bytes`.
    #[error("The file is larger than {max} bytes")]
    TooLarge { max: u64 },
    /// Not a file chatd takes, or a bad name (the message says which).
    #[error("{0}")]
    Invalid(String),
    #[error("File not found")]
    NotFound,
    /// The upload's body failed before its end (the client went away).
    #[error("The upload was cut short")]
    CutShort,
    /// The file storage failed.
    #[error("file storage: {0}")]
    Storage(#[from] object_store::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Stores, reads and deletes files; cheap to clone.
#[derive(Clone)]
pub struct Files {
    objects: Arc<dyn ObjectStore>,
    store: Arc<dyn Store>,
    settings: Arc<FileSettings>,
}

impl Files {
    /// Opens the storage `files.url` names (a `file://` folder is created here).
    pub fn open(settings: &FileSettings, store: Arc<dyn Store>) -> Result<Self, String> {
        let objects: Arc<dyn ObjectStore> = if let Some(folder) = settings.url.strip_prefix("file://") {
            std::fs::create_dir_all(folder).map_err(|e| format!("files.url: cannot create {folder}: {e}"))?;
            Arc::new(
                object_store::local::LocalFileSystem::new_with_prefix(folder).map_err(|e| format!("files.url: {e}"))?,
            )
        } else if let Some(rest) = settings.url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            let mut builder = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
            if let Some(endpoint) = &settings.s3_endpoint {
                builder = builder
                    .with_endpoint(endpoint)
                    .with_allow_http(endpoint.starts_with("http://"))
                    .with_virtual_hosted_style_request(false);
            }
            let s3 = builder.build().map_err(|e| format!("files.url: {e}"))?;
            Arc::new(object_store::prefix::PrefixStore::new(s3, prefix.trim_matches('/')))
        } else {
            return Err(format!("files.url is '{}': give file://FOLDER or s3://BUCKET/PREFIX", settings.url));
        };
        Ok(Self { objects, store, settings: Arc::new(settings.clone()) })
    }

    pub fn max_bytes(&self) -> u64 {
        self.settings.max_bytes
    }

    pub fn settings(&self) -> &FileSettings {
        &self.settings
    }

    /// Stores a file for `user` from its bytes as they come.
    pub async fn upload(
        &self,
        user: &UserId,
        name: &str,
        body: impl Stream<Item = Result<Bytes, FileError>>,
    ) -> Result<StoredFile, FileError> {
        kind::check_name(name).map_err(FileError::Invalid)?;
        let max = self.settings.max_bytes;
        let temporary = Path::from(format!("tmp/{}", uuid::Uuid::now_v7()));
        let mut upload = Upload::start(&self.objects, &temporary).await?;
        let received = receive(&mut upload, name, max, body).await;
        let (kind, sha256) = match received {
            Ok(received) => received,
            Err(e) => {
                // Gone before the answer: a refused file leaves nothing behind.
                upload.abort().await;
                return Err(e);
            }
        };
        let size = upload.finish().await?;
        let file = StoredFile {
            id: FileId::new(),
            user_id: user.clone(),
            name: name.to_owned(),
            media_type: kind.media_type.to_owned(),
            size,
            sha256,
            width: kind.width,
            height: kind.height,
            created_at: now(),
        };
        let kept = self.keep(&temporary, &file).await;
        if kept.is_err() {
            let _ = self.objects.delete(&temporary).await;
        }
        kept.map(|()| file)
    }

    /// Stores a file held in memory (a `data:` URL's bytes).
    pub async fn store_bytes(&self, user: &UserId, name: &str, bytes: Bytes) -> Result<StoredFile, FileError> {
        self.upload(user, name, futures_util::stream::iter([Ok(bytes)])).await
    }

    /// Fetches a remote file (`files.fetch_remote`) and stores it.
    pub async fn fetch(&self, user: &UserId, url: &str, name: Option<&str>) -> Result<StoredFile, FileError> {
        let (name_from_url, body) = remote::fetch(url, &self.settings).await.map_err(|e| match e {
            RemoteError::TooLarge => FileError::TooLarge { max: self.settings.max_bytes },
            e => FileError::Invalid(e.to_string()),
        })?;
        let body = body.map(|piece| {
            piece.map_err(|e| match e.is_timeout() {
                true => FileError::Invalid("The remote file took longer than files.fetch_timeout_secs".into()),
                false => FileError::CutShort,
            })
        });
        self.upload(user, name.unwrap_or(&name_from_url), body).await
    }

    /// Makes the temporary object the file's bytes (unless the same bytes are kept
    /// already), then writes its row: under the lock on these bytes, so that a deletion of
    /// the last other file with them cannot take them between the look and the row.
    async fn keep(&self, temporary: &Path, file: &StoredFile) -> Result<(), FileError> {
        let mut lock = self.store.lock_bytes(&file.sha256).await?;
        let kept = async {
            let blob = blob_path(&file.sha256);
            match self.objects.head(&blob).await {
                Ok(_) => self.objects.delete(temporary).await?,
                Err(object_store::Error::NotFound { .. }) => self.objects.rename(temporary, &blob).await?,
                Err(e) => return Err(FileError::from(e)),
            }
            if let Err(e) = lock.insert_file(file).await {
                self.delete_if_unused(&mut *lock, &file.sha256).await;
                return Err(e.into());
            }
            Ok(())
        }
        .await;
        lock.release().await;
        kept
    }

    /// The user's file.
    pub async fn get(&self, user: &UserId, id: FileId) -> Result<StoredFile, FileError> {
        self.store.get_file(user, id).await.map_err(|e| match e {
            StoreError::NotFound => FileError::NotFound,
            e => e.into(),
        })
    }

    /// A file's bytes as they are read.
    pub async fn stream(
        &self,
        sha256: &str,
    ) -> Result<impl Stream<Item = Result<Bytes, object_store::Error>> + Send + 'static, FileError> {
        Ok(self.objects.get(&blob_path(sha256)).await?.into_stream())
    }

    /// A file's bytes, whole (for a model call).
    pub async fn bytes(&self, sha256: &str) -> Result<Bytes, FileError> {
        match self.objects.get(&blob_path(sha256)).await {
            Ok(result) => Ok(result.bytes().await?),
            Err(object_store::Error::NotFound { .. }) => Err(FileError::NotFound),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes the user's file, and its bytes if no other file has them.
    pub async fn delete(&self, user: &UserId, id: FileId) -> Result<(), FileError> {
        let file = self.store.delete_file(user, id).await.map_err(|e| match e {
            StoreError::NotFound => FileError::NotFound,
            e => e.into(),
        })?;
        self.forget(&[file.sha256]).await;
        Ok(())
    }

    /// Deletes the bytes of these files where no file has them any more, each under the
    /// lock on its bytes (see [`keep`](Self::keep)). A failure is logged: the bytes stay,
    /// unreachable, and the caller's deletion stands.
    pub async fn forget(&self, sha256s: &[String]) {
        for sha256 in sha256s {
            match self.store.lock_bytes(sha256).await {
                Ok(mut lock) => {
                    self.delete_if_unused(&mut *lock, sha256).await;
                    lock.release().await;
                }
                Err(e) => tracing::warn!(error = %e, sha256, "could not lock a file's bytes to delete them; they stay"),
            }
        }
    }

    /// Deletes the bytes if no file has them; `lock` is the lock on them.
    async fn delete_if_unused(&self, lock: &mut dyn BytesLock, sha256: &str) {
        match lock.used().await {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => {
                tracing::warn!(error = %e, "could not tell whether a file's bytes are still used; they stay");
                return;
            }
        }
        match self.objects.delete(&blob_path(sha256)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => tracing::warn!(error = %e, sha256, "could not delete a file's bytes"),
        }
    }
}

/// Writes an upload's body to `upload` as it comes, checking its size as it goes; its kind
/// and sha256 once it is whole.
async fn receive(
    upload: &mut Upload,
    name: &str,
    max: u64,
    body: impl Stream<Item = Result<Bytes, FileError>>,
) -> Result<(kind::Kind, String), FileError> {
    let mut sniffer = Sniffer::new();
    let mut hash = Sha256::new();
    let mut body = std::pin::pin!(body);
    while let Some(piece) = body.next().await {
        let piece = piece?;
        if sniffer.size() + piece.len() as u64 > max {
            return Err(FileError::TooLarge { max });
        }
        sniffer.feed(&piece);
        hash.update(&piece);
        upload.write(piece).await?;
    }
    let kind = sniffer.finish(name).map_err(FileError::Invalid)?;
    Ok((kind, hex(&hash.finalize())))
}

/// Where the bytes with this sha256 are kept.
fn blob_path(sha256: &str) -> Path {
    Path::from(format!("blobs/{}/{sha256}", &sha256[..2.min(sha256.len())]))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A temporary object being written. Dropped before [`finish`](Upload::finish) (a refused
/// file, a client gone mid-upload), it is aborted, so no part of it stays.
struct Upload {
    writer: Option<WriteMultipart>,
    size: u64,
}

/// Parts being sent to the storage at once, at most: bounds an upload's memory.
const PARTS_IN_FLIGHT: usize = 2;

impl Upload {
    async fn start(objects: &Arc<dyn ObjectStore>, path: &Path) -> Result<Self, FileError> {
        let upload = objects.put_multipart(path).await?;
        Ok(Self { writer: Some(WriteMultipart::new(upload)), size: 0 })
    }

    async fn write(&mut self, piece: Bytes) -> Result<(), FileError> {
        let writer = self.writer.as_mut().expect("an upload is written until it finishes");
        writer.wait_for_capacity(PARTS_IN_FLIGHT).await?;
        self.size += piece.len() as u64;
        writer.put(piece);
        Ok(())
    }

    /// Removes what was written of it.
    async fn abort(mut self) {
        if let Some(writer) = self.writer.take() {
            if let Err(e) = writer.abort().await {
                tracing::warn!(error = %e, "could not abort an unfinished upload");
            }
        }
    }

    async fn finish(mut self) -> Result<u64, FileError> {
        let writer = self.writer.take().expect("an upload finishes once");
        writer.finish().await?;
        Ok(self.size)
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take() {
            tokio::spawn(async move {
                if let Err(e) = writer.abort().await {
                    tracing::warn!(error = %e, "could not abort an unfinished upload");
                }
            });
        }
    }
}
