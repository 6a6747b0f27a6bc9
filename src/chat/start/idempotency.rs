//! `Idempotency-Key` (CONTRACT.md §16): a POST that starts a run may name a key; the same key
//! from the same user within a day gets the run the key first started, from its first event,
//! never a second run. The key and a hash of the request are written in the start's own
//! transaction, so the database decides between replicas; within one process, requests with
//! the same key take turns, so repeats wait for the first instead of racing it (and never
//! count against the user's limit of running runs). The whole flow is here: the key of a
//! request, the start run once per key, a repeat found while its run is going, and the
//! hourly sweep of expired keys; the store only records and reads them.

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::chat::errors::ChatError;
use crate::chat::request::Begun;
use crate::domain::{Trace, now};
use crate::ids::UserId;
use crate::store::{Store, StoreError};

/// What a request that may repeat an earlier one started.
pub enum Started<T> {
    /// A new run (or comparison).
    New(T),
    /// The run its `Idempotency-Key` started before, to follow from its first event.
    Again(Box<Trace>),
}

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

/// Runs `start` unless `key` names a run already (then that run); requests with one key
/// take turns, and a start that loses the key to another replica (or finds that its key's
/// run is the one going, [`repeat_of_going_run`]) gets the winner's run.
pub(in crate::chat) async fn once<T>(
    store: &dyn Store,
    turns: &KeyTurns,
    user: &UserId,
    key: Option<IdempotencyKey>,
    start: impl Future<Output = Result<Begun<T>, ChatError>>,
) -> Result<Started<T>, ChatError> {
    let Some(key) = key else { return started(start.await?) };
    let _turn = turns.take((user.clone(), key.key.clone())).await;
    if let Some(trace) = keyed_run(store, user, &key).await? {
        return Ok(Started::Again(Box::new(trace)));
    }
    match start.await? {
        Begun::KeyTaken => match keyed_run(store, user, &key).await? {
            Some(trace) => Ok(Started::Again(Box::new(trace))),
            None => Err(ChatError::Unavailable(
                "The request with this Idempotency-Key ended meanwhile; send it again".into(),
            )),
        },
        begun => started(begun),
    }
}

/// A start that began its runs; the outcomes a start looks again for do not reach here
/// (a moved start looks again itself, a client's taken chat is read again by its caller).
fn started<T>(begun: Begun<T>) -> Result<Started<T>, ChatError> {
    match begun {
        Begun::Started(t) => Ok(Started::New(t)),
        Begun::KeyTaken | Begun::Moved | Begun::ChatTaken => {
            Err(ChatError::Unavailable("The run could not start just now; try again".into()))
        }
    }
}

/// For a start that finds runs of its conversation going: whether it repeats the request
/// whose run is one of them (its first try's client left before the answer; it went to
/// another replica). That run is its answer, never a second message that would refuse or
/// stop it: the start ends there, and [`once`] answers with the run.
pub async fn repeat_of_going_run(
    store: &dyn Store,
    user: &UserId,
    key: Option<&IdempotencyKey>,
) -> Result<bool, ChatError> {
    Ok(match key {
        Some(key) => keyed_run(store, user, key).await?.is_some(),
        None => false,
    })
}

/// Forgets keys past [`KEY_LIFETIME`] every hour, until `shutdown` (a key is also forgotten
/// when it is next used after it expired).
pub fn spawn_expiry(store: Arc<dyn Store>, shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(3600));
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let lifetime = chrono::Duration::from_std(KEY_LIFETIME).expect("a day");
            if let Err(e) = store.forget_keys_before(now() - lifetime).await {
                tracing::warn!(error = %e, "could not forget expired idempotency keys");
            }
        }
    });
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
