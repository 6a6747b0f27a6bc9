//! The branch rules (CONTRACT.md §4, §16), as pure functions of a conversation's messages and
//! its going runs: which messages make the active branch, where a new message goes, and which
//! leaf a branch chosen in the middle ends at. The store applies what they decide.

use super::{Message, Role, Trace};
use crate::ids::MessageId;

/// Returns the branch that ends at `leaf`, oldest first, from all of a conversation's
/// messages. Messages not on that branch (other regenerations) are left out.
pub fn branch(messages: &[Message], leaf: Option<MessageId>) -> Vec<Message> {
    branch_through(messages, &[], leaf)
}

/// [`branch`], across the answers of runs still going: a message queued behind a run
/// (CONTRACT.md §16) follows an answer that is not stored yet. `pending` holds, for each
/// going run, its answer's id and its question's.
pub fn branch_through(
    messages: &[Message],
    pending: &[(MessageId, MessageId)],
    leaf: Option<MessageId>,
) -> Vec<Message> {
    let by_id: std::collections::HashMap<MessageId, &Message> = messages.iter().map(|m| (m.id, m)).collect();
    let mut path = Vec::new();
    let mut next = leaf;
    let mut steps = 0;
    while let Some(id) = next {
        steps += 1;
        if steps > messages.len() + pending.len() + 1 {
            break; // a cycle would be a corrupt store; never loop forever on one
        }
        next = match by_id.get(&id) {
            Some(message) => {
                path.push((*message).clone());
                message.parent_id
            }
            None => match pending.iter().find(|(answer, _)| *answer == id) {
                Some((_, question)) => Some(*question),
                None => break,
            },
        };
    }
    path.reverse();
    path
}

/// Each going run's answer id with its question's, for [`branch_through`].
pub fn pending(going: &[Trace]) -> Vec<(MessageId, MessageId)> {
    going.iter().map(|t| (t.message_id, t.user_message_id)).collect()
}

/// Where a new message goes in its conversation: under `parent`, and, for a regenerate, as
/// the stored question it asks again.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub parent: Option<MessageId>,
    /// The user message a regenerate asks again (its answer becomes a sibling of the earlier
    /// ones); `None` for a new message.
    pub regenerates: Option<Message>,
}

/// Where a message with `text` goes, sent to a conversation of `history` whose active leaf is
/// `leaf`, with `going` its runs going (oldest first), naming `named` as its parent (or not),
/// with new files or not. `None`: `named` is no message of the conversation.
///
/// - Naming nothing, it continues the active branch: after the leaf, or, where the leaf is a
///   question whose answer is still being written, after that answer (a message queued behind
///   a run follows its answer; the `b` side of a comparison is passed over).
/// - Naming an answer (stored, or being written), it continues from that answer.
/// - Naming a user message with the same text and no new files, it regenerates that
///   message's answer; with other text or new files it is an edit, a sibling of that message.
pub fn place(
    history: &[Message],
    going: &[Trace],
    leaf: Option<MessageId>,
    named: Option<MessageId>,
    text: &str,
    new_files: bool,
) -> Option<Placement> {
    let continues = |parent| Some(Placement { parent, regenerates: None });
    let Some(id) = named else {
        return continues(end_of_queue(history, going, leaf));
    };
    if going.iter().any(|t| t.message_id == id) {
        return continues(Some(id));
    }
    let message = history.iter().find(|m| m.id == id)?;
    match message.role {
        Role::User if message.content == text && !new_files => {
            Some(Placement { parent: message.parent_id, regenerates: Some(message.clone()) })
        }
        Role::User => continues(message.parent_id),
        _ => continues(Some(message.id)),
    }
}

/// Where the active branch ends once its going runs have answered: after the answer being
/// written to the leaf, and after each message queued behind that answer in turn. The leaf
/// and the runs are read apart, so the leaf may be older than the queue: a message queued
/// meanwhile (on another replica) is found through its parent, not missed.
fn end_of_queue(history: &[Message], going: &[Trace], leaf: Option<MessageId>) -> Option<MessageId> {
    let on_a = |t: &&Trace| t.variant.as_deref() != Some("b");
    let Some(mut answer) = going.iter().filter(on_a).find(|t| Some(t.user_message_id) == leaf).map(|t| t.message_id)
    else {
        return leaf;
    };
    // Each step takes a run off the queue: at most as many steps as runs.
    for _ in 0..going.len() {
        let asked_after = |t: &&Trace| history.iter().any(|m| m.id == t.user_message_id && m.parent_id == Some(answer));
        match going.iter().filter(on_a).find(asked_after) {
            Some(next) => answer = next.message_id,
            None => break,
        }
    }
    Some(answer)
}

/// The leaf a branch chosen at `message` ends at: down its newest descendants (CONTRACT.md
/// §9). `all` is every message of the conversation, oldest first.
pub fn newest_leaf(all: &[Message], message: MessageId) -> MessageId {
    let mut leaf = message;
    let mut steps = 0;
    while let Some(child) = all.iter().rev().find(|m| m.parent_id == Some(leaf)) {
        leaf = child.id;
        steps += 1;
        if steps > all.len() {
            break; // a cycle would be a corrupt store; never loop forever on one
        }
    }
    leaf
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Trace;
    use crate::ids::{ConversationId, UserId};

    #[test]
    fn branch_follows_parents_from_the_leaf() {
        let conversation = ConversationId::new();
        let root = Message::new(conversation, None, Role::User, "q".into());
        let first = Message::new(conversation, Some(root.id), Role::Assistant, "a1".into());
        let second = Message::new(conversation, Some(root.id), Role::Assistant, "a2".into());
        let all = vec![root.clone(), first, second.clone()];
        let ids: Vec<_> = branch(&all, Some(second.id)).iter().map(|m| m.id).collect();
        assert_eq!(ids, vec![root.id, second.id]);
        assert!(branch(&all, None).is_empty());
    }

    #[test]
    fn branch_through_crosses_answers_still_being_written() {
        let conversation = ConversationId::new();
        let first = Message::new(conversation, None, Role::User, "q1".into());
        // q2 was queued behind the answer to q1 (not stored yet), q3 behind q2's.
        let (answer1, answer2) = (MessageId::new(), MessageId::new());
        let second = Message::new(conversation, Some(answer1), Role::User, "q2".into());
        let third = Message::new(conversation, Some(answer2), Role::User, "q3".into());
        let all = vec![first.clone(), second.clone(), third.clone()];
        let pending = [(answer1, first.id), (answer2, second.id)];
        let ids: Vec<_> = branch_through(&all, &pending, Some(third.id)).iter().map(|m| m.id).collect();
        assert_eq!(ids, vec![first.id, second.id, third.id]);
        // Without them the branch stops at the first missing answer.
        assert_eq!(branch(&all, Some(third.id)).len(), 1);
        // A pending answer that names itself as its question never loops.
        assert!(branch_through(&[], &[(answer1, answer1)], Some(answer1)).is_empty());
    }

    fn answer_going(question: &Message) -> Trace {
        Trace::start(&UserId::new("ann"), question, "m", "p")
    }

    #[test]
    fn a_new_message_continues_the_active_branch_and_queues_behind_an_answer_being_written() {
        let conversation = ConversationId::new();
        let question = Message::new(conversation, None, Role::User, "q".into());
        let answer = Message::new(conversation, Some(question.id), Role::Assistant, "a".into());
        let history = vec![question.clone(), answer.clone()];
        let after = place(&history, &[], Some(answer.id), None, "next", false).unwrap();
        assert_eq!(after, Placement { parent: Some(answer.id), regenerates: None });
        // The leaf is a question whose answer is being written: after that answer.
        let going = answer_going(&question);
        let queued = place(
            std::slice::from_ref(&question),
            std::slice::from_ref(&going),
            Some(question.id),
            None,
            "next",
            false,
        );
        assert_eq!(queued.unwrap().parent, Some(going.message_id));
        // A message queued behind that answer since the leaf was read (another replica's):
        // after its answer, not beside it.
        let next = Message::new(conversation, Some(going.message_id), Role::User, "next".into());
        let next_going = answer_going(&next);
        let (history, going_both) = (vec![question.clone(), next.clone()], [going.clone(), next_going.clone()]);
        let behind_both = place(&history, &going_both, Some(question.id), None, "later", false);
        assert_eq!(behind_both.unwrap().parent, Some(next_going.message_id));
        // The `b` side of a comparison is passed over.
        let b = Trace { variant: Some("b".into()), ..answer_going(&question) };
        let beside_b = place(std::slice::from_ref(&question), &[b], Some(question.id), None, "next", false);
        assert_eq!(beside_b.unwrap().parent, Some(question.id));
        // A new conversation's first message has no parent.
        assert_eq!(place(&[], &[], None, None, "hello", false).unwrap().parent, None);
    }

    #[test]
    fn naming_a_message_continues_regenerates_or_edits() {
        let conversation = ConversationId::new();
        let question = Message::new(conversation, None, Role::User, "q".into());
        let answer = Message::new(conversation, Some(question.id), Role::Assistant, "a".into());
        let follow_up = Message::new(conversation, Some(answer.id), Role::User, "more".into());
        let history = vec![question.clone(), answer.clone(), follow_up.clone()];
        let from_answer = place(&history, &[], Some(follow_up.id), Some(answer.id), "other", false).unwrap();
        assert_eq!(from_answer, Placement { parent: Some(answer.id), regenerates: None });
        let regenerate = place(&history, &[], Some(follow_up.id), Some(follow_up.id), "more", false).unwrap();
        assert_eq!(regenerate, Placement { parent: Some(answer.id), regenerates: Some(follow_up.clone()) });
        // Other text, or the same text with new files: an edit, beside the message.
        let edit = place(&history, &[], None, Some(follow_up.id), "changed", false).unwrap();
        assert_eq!(edit, Placement { parent: Some(answer.id), regenerates: None });
        let with_files = place(&history, &[], None, Some(follow_up.id), "more", true).unwrap();
        assert_eq!(with_files.regenerates, None);
        // An answer still being written may be named.
        let going = answer_going(&follow_up);
        let behind = place(&history, std::slice::from_ref(&going), None, Some(going.message_id), "x", false);
        assert_eq!(behind.unwrap().parent, Some(going.message_id));
        // A message of no conversation here.
        assert_eq!(place(&history, &[], None, Some(MessageId::new()), "x", false), None);
    }

    #[test]
    fn a_branch_chosen_in_the_middle_ends_at_its_newest_descendants() {
        let conversation = ConversationId::new();
        let question = Message::new(conversation, None, Role::User, "q".into());
        let old = Message::new(conversation, Some(question.id), Role::Assistant, "a1".into());
        let new = Message::new(conversation, Some(question.id), Role::Assistant, "a2".into());
        let next = Message::new(conversation, Some(old.id), Role::User, "q2".into());
        let all = vec![question.clone(), old.clone(), new.clone(), next.clone()];
        assert_eq!(newest_leaf(&all, question.id), new.id);
        assert_eq!(newest_leaf(&all, old.id), next.id);
        assert_eq!(newest_leaf(&all, next.id), next.id);
    }
}
