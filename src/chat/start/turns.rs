//! Requests that must not overlap take turns in this process: those with one
//! `Idempotency-Key`, and new messages of one conversation (CONTRACT.md §16). Across
//! replicas the database decides; within one process, a turn makes the second request see
//! what the first did.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// The turns of requests, by what they share.
pub struct Turns<K> {
    turns: Arc<Mutex<HashMap<K, Arc<tokio::sync::Mutex<()>>>>>,
}

impl<K> Clone for Turns<K> {
    fn clone(&self) -> Self {
        Self { turns: self.turns.clone() }
    }
}

impl<K> Default for Turns<K> {
    fn default() -> Self {
        Self { turns: Arc::default() }
    }
}

impl<K: Hash + Eq + Clone + Send + 'static> Turns<K> {
    /// Waits for `key`'s turn; it lasts as long as the returned guard.
    pub async fn take(&self, key: K) -> Turn<K> {
        let lock = self.turns.lock().expect("never poisoned").entry(key.clone()).or_default().clone();
        let guard = lock.clone().lock_owned().await;
        Turn { turns: self.clone(), key, lock, _guard: guard }
    }
}

/// One request's turn.
pub struct Turn<K: Hash + Eq> {
    turns: Turns<K>,
    key: K,
    lock: Arc<tokio::sync::Mutex<()>>,
    _guard: tokio::sync::OwnedMutexGuard<()>,
}

impl<K: Hash + Eq> Drop for Turn<K> {
    fn drop(&mut self) {
        let mut turns = self.turns.turns.lock().expect("never poisoned");
        // The map, this turn and its guard hold it: nobody else waits.
        if Arc::strong_count(&self.lock) <= 3 {
            turns.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_key_at_a_time_and_nothing_kept_after() {
        let turns = Turns::<u32>::default();
        let first = turns.take(1).await;
        let other = turns.take(2).await; // another key does not wait
        let waiting = tokio::spawn({
            let turns = turns.clone();
            async move { turns.take(1).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "the same key waits for the first turn");
        drop(first);
        let second = waiting.await.unwrap();
        drop((second, other));
        assert!(turns.turns.lock().unwrap().is_empty());
    }
}
