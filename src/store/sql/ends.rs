//! Where runs' ends wait for their turn in the writers' queue, and how those that wait go
//! together: where the backend writes several ends as one ([`Backend::ENDS_TOGETHER`]),
//! ends that may go together take one turn, and the end that gets it takes the ends waiting
//! then into its own statement and tells each how its own end went. Ends that go alone take
//! turns of their own.
//!
//! [`Backend::ENDS_TOGETHER`]: super::Backend::ENDS_TOGETHER

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use tokio::sync::{Semaphore, SemaphorePermit, oneshot};

use crate::ids::ConversationId;
use crate::store::{RunFinish, StoreError};

/// The turns runs' ends take, and the ends waiting for one.
pub(crate) struct Ends {
    /// For ends written on their own.
    turns: Semaphore,
    /// For ends that may go together: one at a time, so that those that come meanwhile wait
    /// and go together in the next statement.
    together: Semaphore,
    waiting: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    ends: VecDeque<Waits>,
    tickets: u64,
}

/// An end waiting for a turn: a copy of its record (another end's statement may write it),
/// boxed (the waiting moves its ends as they leave it), and where it hears how that went.
pub(super) struct Waits {
    ticket: u64,
    pub finish: Box<RunFinish>,
    tell: oneshot::Sender<Told>,
}

/// How an end taken into another's statement went.
#[derive(Clone, Copy)]
pub(super) enum Told {
    /// The statement closed the run's trace and wrote the rest of its end.
    Written,
    /// The run had already ended (or is another user's): nothing of this end was written.
    Ended,
    /// The statement failed as a whole: the end is written again on its own, so that it
    /// hears its own outcome (the one that failed the group fails alone). Also where the end
    /// that took it was dropped before it told how its statement went (its run's task
    /// cancelled mid-write, by a hand-over that came as the run began its end): the
    /// statement may then have committed, and the end, written again, finds its run ended
    /// by its own record (see `finish_run`).
    Alone,
}

/// Where an end stands once it has asked for a turn.
pub(super) enum Turn<'a> {
    /// It holds a turn, and writes itself and any ends it takes.
    Held(SemaphorePermit<'a>),
    /// Another end's statement took it, and told it how it went.
    Told(Told),
}

impl Ends {
    /// `turns`: how many ends written on their own are written at once.
    pub(crate) fn new(turns: usize) -> Self {
        Self { turns: Semaphore::new(turns), together: Semaphore::new(1), waiting: Mutex::default() }
    }

    /// A turn for an end written on its own, waited for.
    pub(super) async fn turn(&self) -> Result<SemaphorePermit<'_>, StoreError> {
        closed_if_err(self.turns.acquire().await)
    }

    /// The turn for an end that other ends' statements may take meanwhile (`finish`,
    /// copied only where it has to wait): the turn, or how another end's statement wrote it.
    pub(super) async fn turn_or_taken(&self, finish: &RunFinish) -> Result<Turn<'_>, StoreError> {
        if let Ok(turn) = self.together.try_acquire() {
            return Ok(Turn::Held(turn));
        }
        // An end whose future is dropped while it waits (its run handed over, say) leaves
        // the waiting: no later statement writes it.
        let (mut queued, mut told) = self.wait(Box::new(finish.clone()));
        tokio::select! {
            biased;
            told = &mut told => {
                // The statement that told it took it out of the waiting.
                queued.there = false;
                Ok(Turn::Told(told.unwrap_or(Told::Alone)))
            }
            turn = self.together.acquire() => {
                let turn = closed_if_err(turn)?;
                if queued.leave() {
                    return Ok(Turn::Held(turn));
                }
                // Taken into a statement while its turn came: that statement tells it.
                drop(turn);
                Ok(Turn::Told(told.await.unwrap_or(Told::Alone)))
            }
        }
    }

    /// Up to `most` ends waiting now, in the order they came, each of a conversation none of
    /// the others (nor `taken`'s) is of: one statement updates each conversation once. It
    /// stops once it has `most`: a burst of ends (fifty thousand answers finishing within
    /// seconds) leaves thousands waiting, and each statement takes a few of them.
    pub(super) fn take(&self, mut taken: HashSet<ConversationId>, most: usize) -> Vec<Waits> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let mut group = Vec::new();
        // An end left is one of a conversation already in the group (the other of an A/B
        // pair, say): few, so those taken are near the front, where taking one out moves only
        // the ends before it.
        let mut at = 0;
        while group.len() < most && at < waiting.ends.len() {
            if !conversation(&waiting.ends[at].finish).is_some_and(|c| taken.insert(c)) {
                at += 1;
            } else if let Some(end) = waiting.ends.remove(at) {
                group.push(end);
            }
        }
        group
    }

    /// Puts `finish` in the waiting: where it hears how a statement that takes it went.
    fn wait(&self, finish: Box<RunFinish>) -> (Queued<'_>, oneshot::Receiver<Told>) {
        let (tell, told) = oneshot::channel();
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.tickets += 1;
        let ticket = waiting.tickets;
        waiting.ends.push_back(Waits { ticket, finish, tell });
        (Queued { ends: self, ticket, there: true }, told)
    }

    /// Takes the end with `ticket` out of the waiting; false where a statement took it.
    fn leave(&self, ticket: u64) -> bool {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let Some(at) = waiting.ends.iter().position(|w| w.ticket == ticket) else { return false };
        waiting.ends.remove(at);
        true
    }
}

/// An end in the waiting: taken out when dropped, where it is still there.
struct Queued<'a> {
    ends: &'a Ends,
    ticket: u64,
    /// Whether it may still be there (once out, no need to look).
    there: bool,
}

impl Queued<'_> {
    /// Takes the end out of the waiting; false where a statement took it.
    fn leave(&mut self) -> bool {
        self.there = false;
        self.ends.leave(self.ticket)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.there {
            self.leave();
        }
    }
}

fn closed_if_err<T, E>(turn: Result<T, E>) -> Result<T, StoreError> {
    turn.map_err(|_| StoreError::Unavailable("the store is closed".into()))
}

impl Waits {
    pub(super) fn tell(self, told: Told) {
        // An end that stopped waiting (its future dropped) hears nothing; its end stands.
        let _ = self.tell.send(told);
    }
}

/// The conversation an end's answer goes to; none for an end without one (those go alone).
pub(super) fn conversation(finish: &RunFinish) -> Option<ConversationId> {
    finish.assistant_message.as_ref().map(|m| m.conversation_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Message, Role, TraceStatus, Usage};
    use crate::ids::{TraceId, UserId};

    fn end_of(conversation: ConversationId) -> RunFinish {
        RunFinish {
            trace_id: TraceId::new(),
            user_id: UserId::new("ann"),
            status: TraceStatus::Completed,
            ended_at: chrono::Utc::now(),
            usage: Usage::default(),
            cost_usd: None,
            error: None,
            spans: Vec::new(),
            assistant_message: Some(Message::new(conversation, None, Role::Assistant, "hi".into())),
        }
    }

    #[test]
    fn a_group_takes_the_first_ends_of_conversations_apart_and_leaves_the_rest_in_order() {
        let ends = Ends::new(1);
        let [a, b, c, d, e] = std::array::from_fn(|_| ConversationId::new());
        // The fourth end has no answer, so no conversation: a statement never takes it.
        let mut waiting: Vec<RunFinish> = [a, b, a, c, c, d, a, e].into_iter().map(end_of).collect();
        waiting[3].assistant_message = None;
        let ids: Vec<TraceId> = waiting.iter().map(|f| f.trace_id).collect();
        let _queued: Vec<_> = waiting.into_iter().map(|f| ends.wait(Box::new(f))).collect();
        let taken = |group: Vec<Waits>| group.into_iter().map(|w| w.finish.trace_id).collect::<Vec<_>>();

        // The taker's own conversation (c) is left, as is a second end of `a`; it stops at 3.
        assert_eq!(taken(ends.take(HashSet::from([c]), 3)), [ids[0], ids[1], ids[5]]);
        // What is left is in the order it came: a, none, c, a, e.
        assert_eq!(taken(ends.take(HashSet::new(), 2)), [ids[2], ids[4]]);
        assert_eq!(taken(ends.take(HashSet::new(), 10)), [ids[6], ids[7]]);
        assert!(ends.take(HashSet::new(), 10).is_empty());
    }
}
