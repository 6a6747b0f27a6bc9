//! What a waiting run keeps in the store (CONTRACT.md §15): the calls it waits for, and the
//! state its continuation starts from, written when it parks and handed whole to whichever
//! replica settles its last call (or cancels it).

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::NewEvent;
use crate::domain::{Span, Trace, Usage};
use crate::ids::{TraceId, UserId};

/// What a call waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitKind {
    /// A person's approval (`tools.require_approval`).
    Approval,
    /// A client tool's result, from the frontend.
    ClientTool,
}

impl WaitKind {
    pub fn as_str(self) -> &'static str {
        match self {
            WaitKind::Approval => "approval",
            WaitKind::ClientTool => "client_tool",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "approval" => Some(WaitKind::Approval),
            "client_tool" => Some(WaitKind::ClientTool),
            _ => None,
        }
    }
}

/// How a waiting call was settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settlement {
    Approved,
    Denied {
        reason: Option<String>,
    },
    /// Its approval was not decided within `tools.approval_timeout_secs`.
    Expired,
    /// A client tool's result.
    Result {
        output: String,
        is_error: bool,
    },
}

impl Settlement {
    pub fn outcome(&self) -> &'static str {
        match self {
            Settlement::Approved => "approved",
            Settlement::Denied { .. } => "denied",
            Settlement::Expired => "expired",
            Settlement::Result { .. } => "result",
        }
    }
}

/// One call a run waits for.
#[derive(Debug, Clone, PartialEq)]
pub struct Wait {
    /// The approval id, for an approval.
    pub id: Uuid,
    pub trace_id: TraceId,
    pub user_id: UserId,
    pub kind: WaitKind,
    pub tool_call_id: String,
    pub tool: String,
    pub input: Value,
    pub created_at: DateTime<Utc>,
    /// When an undecided approval expires.
    pub expires_at: Option<DateTime<Utc>>,
    pub settled: Option<Settlement>,
}

/// A run that stops to wait, written in one transaction: its trace becomes `waiting` with
/// its checkpoint, its calls' waits, and the request events that announce them (logged with
/// the rest, so that a decision can never come before the log shows what it decides).
#[derive(Debug, Clone)]
pub struct RunPark {
    pub trace_id: TraceId,
    pub checkpoint: Value,
    pub usage: Usage,
    /// What the run cost so far, where known.
    pub cost_usd: Option<f64>,
    pub spans: Vec<Span>,
    pub waits: Vec<Wait>,
    pub events: Vec<NewEvent>,
}

/// Which waiting call a decision or result is for.
#[derive(Debug, Clone, Copy)]
pub enum WaitKey<'a> {
    Approval(Uuid),
    Call(TraceId, &'a str),
}

/// A waiting run handed to the replica that will continue (or cancel) it: it is `running`
/// again, on that replica.
#[derive(Debug, Clone)]
pub struct Claim {
    pub trace: Trace,
    pub checkpoint: Value,
    pub waits: Vec<Wait>,
}

/// What settling a call came to.
#[derive(Debug, Clone)]
pub struct Settled {
    pub wait: Wait,
    /// Set when it was the run's last open call: the run is this replica's to continue.
    pub claimed: Option<Claim>,
}
