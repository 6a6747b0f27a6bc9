//! What a resume of the AI SDK's stream replays (CONTRACT.md §13.1): the run's events so
//! far without what a `step_reset` voided, so that a client rebuilding the message from its
//! first chunk has no voided parts (a retried model call, a run continued after its server
//! died, §19).

use crate::chat::Frame;
use crate::events::Event;

/// Leaves out what a `step_reset` voided (CONTRACT.md §13.1): for each reset of step `k`,
/// the frames from the last `step_start {k}` before it through the reset itself. A replay
/// to a client that rebuilds the message from its first chunk then has no voided parts.
pub fn drop_voided(frames: Vec<Frame>) -> Vec<Frame> {
    let step_of = |frame: &Frame, reset: bool| match frame.event() {
        Some(Event::StepStart { step }) if !reset => Some(*step),
        Some(Event::StepReset { step, .. }) if reset => Some(*step),
        _ => None,
    };
    let mut kept: Vec<Frame> = Vec::with_capacity(frames.len());
    for frame in frames {
        if let Some(step) = step_of(&frame, true) {
            if let Some(start) = kept.iter().rposition(|f| step_of(f, false) == Some(step)) {
                kept.truncate(start);
                continue;
            }
        }
        kept.push(frame);
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_leaves_out_what_a_step_reset_voided() {
        let text = |t: &str| Event::TextDelta { text: t.into() };
        let events = [
            Event::StepStart { step: 0 },
            text("kept "),
            Event::StepStart { step: 1 },
            text("void"),
            Event::StepReset { step: 1, reason: "overloaded".into() },
            Event::StepStart { step: 1 },
            text("again, "),
            Event::StepReset { step: 1, reason: "overloaded".into() },
            Event::StepStart { step: 1 },
            text("answer"),
        ];
        let frames = events.into_iter().zip(1..).map(|(event, seq)| Frame::new(seq, event)).collect();
        let kept: Vec<u64> = drop_voided(frames).iter().map(|f| f.seq).collect();
        assert_eq!(kept, [1, 2, 9, 10], "the voided attempts and their resets go; the last start stays");
    }
}
