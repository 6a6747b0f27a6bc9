//! Why a start, or a control of a run, was refused: the errors the http layer turns into the
//! contract's envelope (CONTRACT.md §2).

use std::time::Duration;

use crate::store::StoreError;

/// Why a chat request was refused before its stream opened.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{message}")]
    Invalid { field: &'static str, message: String },
    #[error("{message}")]
    TooLarge { field: &'static str, message: String },
    #[error("{message}")]
    NotFound { field: &'static str, message: String },
    /// A run of the conversation is going, and the request's `multitask` is `reject`.
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Unavailable(String),
    /// Too many runs at once for this user.
    #[error("{message}")]
    Busy { message: String, retry_after: Duration },
    /// The user's budget is spent (CONTRACT.md §18) until `retry_after`.
    #[error("{message}")]
    QuotaExceeded { message: String, retry_after: Duration },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why nothing was cancelled.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No such run or comparison of this user's ("Trace", "Comparison").
    #[error("{0} not found")]
    Missing(&'static str),
    /// The run ended first, or another cancel is stopping it.
    #[error("{0}")]
    Ended(&'static str),
    /// Decided already, expired, or its run ended (a waiting call, CONTRACT.md §15).
    #[error("{0}")]
    Conflict(String),
    /// The process running it did not answer in time.
    #[error("The run did not answer the cancel; try again")]
    NoAnswer,
    #[error(transparent)]
    Store(StoreError),
}

impl ControlError {
    /// Maps a store error, naming what was missing when it was `NotFound`.
    pub fn missing(what: &'static str) -> impl FnOnce(StoreError) -> ControlError {
        move |error| match error {
            StoreError::NotFound => ControlError::Missing(what),
            error => ControlError::Store(error),
        }
    }
}

impl From<StoreError> for ControlError {
    fn from(error: StoreError) -> Self {
        ControlError::Store(error)
    }
}

/// The refusal of a request over its user's limit of running runs.
pub(in crate::chat) fn busy(running: usize) -> ChatError {
    ChatError::Busy {
        message: format!("{running} answers are still streaming; wait for one to finish"),
        retry_after: Duration::from_secs(1),
    }
}

/// The 404 message for a profile name that no profile has. It names the name that was asked
/// for (a client that sends a name from an example gets told which one), cut to
/// [`ECHOED_NAME_CHARS`] characters: a request must not make the answer as long as itself.
pub fn unknown_profile(name: &str) -> String {
    let shown: String = match name.char_indices().nth(ECHOED_NAME_CHARS) {
        Some((end, _)) => format!("{}…", &name[..end]),
        None => name.to_owned(),
    };
    format!("Profile '{shown}' not found: GET /api/profiles lists the configured ones")
}

/// How much of an unknown name an error message repeats.
const ECHOED_NAME_CHARS: usize = 100;

pub(in crate::chat) fn not_found(field: &'static str, message: &str) -> ChatError {
    ChatError::NotFound { field, message: message.to_owned() }
}
