//! `Idempotency-Key` (CONTRACT.md §16): a POST that starts a run may name a key; the same key
//! from the same user within a day gets the run the key first started, from its first event,
//! never a second run. The key and a hash of the request are written in the start's own
//! transaction, so the database decides between replicas; within one process, requests with
//! the same key take turns, so repeats wait for the first instead of racing it (and never
//! count against the user's limit of running runs).

use std::time::Duration;

use sha2::{Digest, Sha256};

use super::request::ChatError;
use crate::domain::{Trace, now};
use crate::ids::UserId;
use crate::store::{Store, StoreError};

/// How long a key names its run.
pub const KEY_LIFETIME: Duration = Duration::from_secs(24 * 60 * 60);

pub use crate::domain::IdempotencyKey;

/// The key of a request to `path` with `body`; 400 for a key that is not 1 to 255 visible
/// ASCII characters.
pub fn request_key(key: &str, path: &str, body: &[u8]) -> Result<IdempotencyKey, ChatError> {
    let key = key.trim();
    if key.is_empty() || key.len() > 255 || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ChatError::Invalid {
            field: "Idempotency-Key",
            message: "Idempotency-Key must be 1 to 255 visible ASCII characters".into(),
        });
    }
    let mut hash = Sha256::new();
    hash.update(path.as_bytes());
    hash.update([0]);
    hash.update(body);
    let request_hash = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(IdempotencyKey { key: key.to_owned(), request_hash })
}

/// Requests with the same key take turns in this process.
pub type KeyTurns = super::turns::Turns<(UserId, String)>;

/// The run `key` names for `user`, if it names one still: the same request again gets its
/// trace; another request with the key is refused. An expired key is forgotten.
pub async fn keyed_run(store: &dyn Store, user: &UserId, key: &IdempotencyKey) -> Result<Option<Trace>, ChatError> {
    let Some(run) = store.keyed_run(user, &key.key).await? else { return Ok(None) };
    if now() - run.created_at > chrono::Duration::from_std(KEY_LIFETIME).expect("a day is a duration") {
        store.forget_key(user, &key.key, run.trace_id).await?;
        return Ok(None);
    }
    if run.request_hash != key.request_hash {
        return Err(ChatError::Invalid {
            field: "Idempotency-Key",
            message: "This Idempotency-Key was used for another request: send a new key for a new request".into(),
        });
    }
    match store.get_trace(user, run.trace_id).await {
        Ok(trace) => Ok(Some(trace)),
        // Its conversation was deleted since: the key names nothing any more.
        Err(StoreError::NotFound) => {
            store.forget_key(user, &key.key, run.trace_id).await?;
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_of_the_endpoint_and_the_body() {
        let a = request_key("k-1", "/api/chat/stream", b"{\"message\":\"hi\"}").unwrap();
        assert_eq!(a, request_key(" k-1 ", "/api/chat/stream", b"{\"message\":\"hi\"}").unwrap());
        assert_ne!(
            a.request_hash,
            request_key("k-1", "/api/chat/stream", b"{\"message\":\"ho\"}").unwrap().request_hash
        );
        assert_ne!(a.request_hash, request_key("k-1", "/api/ui/chat", b"{\"message\":\"hi\"}").unwrap().request_hash);
        for bad in ["", "   ", "a b", "é", &"x".repeat(256)] {
            assert!(request_key(bad, "/", b"").is_err(), "{bad:?}");
        }
    }
}
