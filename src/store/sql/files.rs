//! Files' rows (see [`FileStore`]); the lock on their bytes is each backend's.

use chrono::{DateTime, Utc};
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};
use uuid::Uuid;

use super::{Backend, Conn, Row, write};
use crate::domain::StoredFile;
use crate::ids::{FileId, UserId};
use crate::store::rows::*;
use crate::store::*;

#[async_trait::async_trait]
impl<B> FileStore for B
where
    B: Backend,
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'r> FileRow: FromRow<'r, Row<B>>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
{
    async fn lock_bytes(&self, sha256: &str) -> Result<Box<dyn BytesLock + '_>, StoreError> {
        self.bytes_lock(sha256).await
    }

    async fn get_file(&self, user: &UserId, id: FileId) -> Result<StoredFile, StoreError> {
        let sql = format!("select {FILE_COLUMNS} from files where id = $1 and user_id = $2");
        let row: Option<FileRow> = sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(self.pool()).await?;
        row.map(StoredFile::from).ok_or(StoreError::NotFound)
    }

    async fn delete_file(&self, user: &UserId, id: FileId) -> Result<StoredFile, StoreError> {
        let sql = format!("delete from files where id = $1 and user_id = $2 returning {FILE_COLUMNS}");
        let row: Option<FileRow> =
            write(self, async |conn| Ok(sqlx::query_as(&sql).bind(id).bind(user).fetch_optional(conn).await?)).await?;
        row.map(StoredFile::from).ok_or(StoreError::NotFound)
    }
}

/// Writes a file's row on `conn` (see [`BytesLock::insert_file`]).
pub(in crate::store) async fn insert_file<B: Backend>(conn: &mut Conn<B>, file: &StoredFile) -> Result<(), StoreError>
where
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'q> Uuid: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> String: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> i64: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> DateTime<Utc>: Encode<'q, B::Db> + Type<B::Db>,
    for<'q> Option<i64>: Encode<'q, B::Db> + Type<B::Db>,
{
    sqlx::query(
        "insert into files (id, user_id, name, media_type, size, sha256, width, height, created_at) \
         values ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(file.id.0)
    .bind(file.user_id.as_str().to_owned())
    .bind(file.name.clone())
    .bind(file.media_type.clone())
    .bind(file.size as i64)
    .bind(file.sha256.clone())
    .bind(file.width.map(i64::from))
    .bind(file.height.map(i64::from))
    .bind(file.created_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Whether any file has the bytes with this sha256, read on `conn`.
pub(in crate::store) async fn bytes_used<B: Backend>(conn: &mut Conn<B>, sha256: &str) -> Result<bool, StoreError>
where
    for<'c> &'c mut Conn<B>: Executor<'c, Database = B::Db>,
    for<'q> <B::Db as Database>::Arguments<'q>: IntoArguments<'q, B::Db>,
    for<'q> &'q str: Encode<'q, B::Db> + Type<B::Db>,
    for<'r> (bool,): FromRow<'r, Row<B>>,
{
    // `exists` is a boolean on both backends (a bare `select 1` is an int4 on Postgres).
    let (used,): (bool,) =
        sqlx::query_as("select exists (select 1 from files where sha256 = $1)").bind(sha256).fetch_one(conn).await?;
    Ok(used)
}
