//! How every run ends: [`end`] saves what is kept of it (with one policy for a database
//! that cannot take writes just now), emits its one terminal event and `done`, and seals its
//! log. A run that completes, fails, is cancelled (running, queued or waiting), panics, or
//! cannot go on after a wait ends here; a run whose process died is closed by [`save`] alone
//! (nobody hears it live; a replay of its log adds the terminal event it never sent).

use std::sync::Arc;
use std::time::Duration;

use super::runs::Emitter;
use crate::domain::{RunError, TraceStatus};
use crate::events::{ErrorEvent, Event};
use crate::store::{RunFinish, Store, StoreError};

/// What a run's end is made of. (The record is boxed, as [`save`] takes it: an async
/// function keeps an argument and the local it moves it into apart, each as large as the
/// record, for every layer it passes, and runs end many at once.)
pub struct End {
    /// What is stored of the run; `None` where nothing of it is left to store (its
    /// conversation was deleted).
    pub record: Option<Box<RunFinish>>,
    /// `complete`, `cancelled` or `error`.
    pub terminal: Event,
}

impl End {
    /// An end whose record is stored.
    pub fn saving(record: RunFinish, terminal: Event) -> Self {
        Self { record: Some(Box::new(record)), terminal }
    }
}

/// How long a run's end keeps trying to save its result while the database cannot take
/// writes: a short fault (a disk full for a moment) costs the client a wait, not its answer.
const SAVE_FOR: Duration = Duration::from_secs(5);
/// How long the record of a run whose result could not be saved is tried again, after its
/// client heard so: its trace must not stay open once the database is back.
const SAVE_LATER_FOR: Duration = Duration::from_secs(3600);

/// Ends a run: its record saved first (a load right after `complete` sees the answer), then
/// its terminal event and `done`, then its log sealed. Where the record cannot be saved, the
/// client hears that instead of the ending it would have had, and the record is closed later
/// as what the client saw.
pub async fn end(store: &Arc<dyn Store>, emitter: &mut Emitter, end: End) {
    let run = emitter.run().clone();
    run.set_ending();
    let saved = match end.record {
        Some(record) => {
            let saved = save(store, record).await;
            if saved {
                crate::report::otlp::export_run(store.clone(), run.user_id.clone(), run.trace_id);
            }
            saved
        }
        None => true,
    };
    let terminal = match saved {
        true => end.terminal,
        false => Event::Error(Box::new(ErrorEvent {
            code: "SERVICE_UNAVAILABLE".into(),
            message: "The answer could not be saved".into(),
            retryable: true,
            message_id: run.message_id,
            trace_id: run.trace_id,
        })),
    };
    emitter.emit(terminal);
    emitter.emit(Event::Done {
        conversation_id: run.conversation_id,
        message_id: run.message_id,
        trace_id: run.trace_id,
    });
    if let Err(e) = emitter.seal().await {
        tracing::error!(error = %e, trace_id = %run.trace_id, "the run's last events could not be logged");
    }
}

/// Saves a run's record: tried again with backoff for [`SAVE_FOR`] while the database is
/// unavailable; past that, closed in the background as an error with what it had said
/// (tried for [`SAVE_LATER_FOR`]; after that, at the next start, as interrupted). False when
/// the record could not be saved as it was. A run with no answer to keep that ended
/// elsewhere, or whose conversation is gone, has nothing left to save: no failure. (One with
/// an answer was not saved, and says so.)
pub async fn save(store: &Arc<dyn Store>, record: Box<RunFinish>) -> bool {
    match retry_while_unavailable(&**store, &record, SAVE_FOR).await {
        Ok(()) => true,
        Err(StoreError::NotFound | StoreError::Conflict(_)) if record.assistant_message.is_none() => true,
        Err(e) => {
            tracing::error!(error = %e, trace_id = %record.trace_id, "could not save the run's end");
            if e.is_unavailable() {
                save_later(store, unsaved(*record));
            }
            false
        }
    }
}

/// Saves a run's result, trying again (with backoff) for up to `within` while the database
/// is unavailable. Other errors are final.
async fn retry_while_unavailable(store: &dyn Store, record: &RunFinish, within: Duration) -> Result<(), StoreError> {
    let deadline = tokio::time::Instant::now() + within;
    let mut pause = Duration::from_millis(50);
    loop {
        match store.finish_run(record).await {
            Err(e) if e.is_unavailable() && tokio::time::Instant::now() + pause < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            result => return result,
        }
    }
}

/// What is recorded of a run whose client was told its answer could not be saved: an error
/// with what it had said so far, and no assistant message, as that client saw it.
fn unsaved(mut record: RunFinish) -> RunFinish {
    let partial_text = record.assistant_message.take().map(|m| m.content).unwrap_or_default();
    record.status = TraceStatus::Error;
    record.error = Some(RunError::new("SERVICE_UNAVAILABLE", "The answer could not be saved", Some(partial_text)));
    record
}

/// Keeps trying to close the trace of a run whose result could not be saved, in the
/// background.
fn save_later(store: &Arc<dyn Store>, record: RunFinish) {
    let store = store.clone();
    tokio::spawn(async move {
        let trace_id = record.trace_id;
        match retry_while_unavailable(&*store, &record, SAVE_LATER_FOR).await {
            Ok(()) => tracing::info!(%trace_id, "closed the trace of a run whose answer could not be saved"),
            Err(e) => tracing::error!(%trace_id, error = %e, "gave up closing the trace of a run"),
        }
    });
}
