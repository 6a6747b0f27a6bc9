//! The kinds of id, each its own type: a trace id cannot be passed where a message id is
//! asked for. On the wire and in both databases an id is what it wraps (a UUID, or the
//! user's name from authentication), so the types change no stored or sent byte.
//!
//! ```compile_fail
//! fn cancel(_: chatd::ids::TraceId) {}
//! cancel(chatd::ids::MessageId::new()); // a message id is not a trace id
//! ```
//! ```
//! fn cancel(_: chatd::ids::TraceId) {}
//! cancel(chatd::ids::TraceId::new());
//! ```

use serde::{Deserialize, Serialize};
use std::fmt;
use uuid::Uuid;

macro_rules! uuid_id {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type,
            utoipa::ToSchema,
        )]
        #[serde(transparent)]
        #[sqlx(transparent)]
        #[schema(value_type = String, format = Uuid)]
        pub struct $name(pub Uuid);

        impl $name {
            /// A new time-ordered id (UUID v7).
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }

            pub fn parse(text: &str) -> Result<Self, uuid::Error> {
                Uuid::try_parse(text).map(Self)
            }
        }

        impl From<Uuid> for $name {
            fn from(id: Uuid) -> Self {
                Self(id)
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

uuid_id!(
    /// A conversation.
    ConversationId
);
uuid_id!(
    /// A message, the user's or the assistant's.
    MessageId
);
uuid_id!(
    /// A run and its trace.
    TraceId
);
uuid_id!(
    /// An A/B comparison of two runs.
    ComparisonId
);
uuid_id!(
    /// A stored file (an attachment, CONTRACT.md §14).
    FileId
);

/// Whom a row belongs to: the subject authentication found (or the anonymous user).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type, utoipa::ToSchema)]
#[serde(transparent)]
#[sqlx(transparent)]
#[schema(value_type = String)]
pub struct UserId(String);

impl UserId {
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_its_uuid_on_the_wire() {
        let id = TraceId::new();
        assert_eq!(serde_json::to_string(&id).unwrap(), format!("\"{}\"", id.0));
        assert_eq!(serde_json::from_str::<TraceId>(&format!("\"{id}\"")).unwrap(), id);
        assert_eq!(TraceId::parse(&id.to_string()).unwrap(), id);
        assert!(MessageId::parse("not-a-uuid").is_err());
        let user = UserId::new("ann");
        assert_eq!(serde_json::to_string(&user).unwrap(), "\"ann\"");
    }
}
