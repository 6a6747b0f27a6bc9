//! The A/B leaderboard: wins, losses, ties and both-bad per model, and an Elo rating computed
//! from the votes in the order they were cast (start 1000, K = 32; a tie and "both bad" count
//! as a draw for the rating). Comparisons of a model against itself change nothing.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::domain::{Comparison, Preference};

pub const START: f64 = 1000.0;
pub const K: f64 = 32.0;

#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Standing {
    pub model: String,
    pub rating: f64,
    pub wins: u32,
    pub losses: u32,
    pub ties: u32,
    pub both_bad: u32,
    pub votes: u32,
}

impl Standing {
    fn new(model: &str) -> Self {
        Self { model: model.to_owned(), rating: START, wins: 0, losses: 0, ties: 0, both_bad: 0, votes: 0 }
    }
}

/// The standings from voted comparisons (oldest vote first), best rating first.
pub fn leaderboard(comparisons: &[Comparison]) -> Vec<Standing> {
    let mut table: BTreeMap<String, Standing> = BTreeMap::new();
    for c in comparisons {
        let Some(preference) = c.preference else {
            continue;
        };
        if c.model_a == c.model_b {
            continue;
        }
        let a = table.entry(c.model_a.clone()).or_insert_with(|| Standing::new(&c.model_a)).rating;
        let b = table.entry(c.model_b.clone()).or_insert_with(|| Standing::new(&c.model_b)).rating;
        let expected_a = 1.0 / (1.0 + 10f64.powf((b - a) / 400.0));
        let score_a = match preference {
            Preference::A => 1.0,
            Preference::B => 0.0,
            Preference::Tie | Preference::BothBad => 0.5,
        };
        let delta = K * (score_a - expected_a);
        for (model, sign, won, lost) in [
            (&c.model_a, 1.0, preference == Preference::A, preference == Preference::B),
            (&c.model_b, -1.0, preference == Preference::B, preference == Preference::A),
        ] {
            let s = table.get_mut(model).expect("inserted above");
            s.rating += sign * delta;
            s.votes += 1;
            match preference {
                Preference::Tie => s.ties += 1,
                Preference::BothBad => s.both_bad += 1,
                _ if won => s.wins += 1,
                _ if lost => s.losses += 1,
                _ => {}
            }
        }
    }
    let mut standings: Vec<Standing> = table
        .into_values()
        .map(|mut s| {
            s.rating = (s.rating * 10.0).round() / 10.0;
            s
        })
        .collect();
    standings.sort_by(|x, y| y.rating.total_cmp(&x.rating).then_with(|| x.model.cmp(&y.model)));
    standings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::now;
    use crate::ids::{ComparisonId, ConversationId, MessageId, TraceId, UserId};

    fn vote(a: &str, b: &str, preference: Preference) -> Comparison {
        Comparison {
            comparison_id: ComparisonId::new(),
            conversation_id: ConversationId::new(),
            user_id: UserId::new("u"),
            user_message_id: MessageId::new(),
            trace_a: TraceId::new(),
            trace_b: TraceId::new(),
            profile_a: a.into(),
            profile_b: b.into(),
            model_a: a.into(),
            model_b: b.into(),
            preference: Some(preference),
            voted_at: Some(now()),
            vote_history: Vec::new(),
            created_at: now(),
        }
    }

    #[test]
    fn elo_arithmetic_on_known_votes() {
        // Equal ratings: the winner gains K/2 = 16.
        let table = leaderboard(&[vote("x", "y", Preference::A)]);
        assert_eq!(
            table[0],
            Standing { model: "x".into(), rating: 1016.0, wins: 1, losses: 0, ties: 0, both_bad: 0, votes: 1 }
        );
        assert_eq!(table[1].rating, 984.0);
        // Then y beats x: expected for y = 1/(1+10^(32/400)) = 0.45405; y gains 32 * 0.54595 = 17.47.
        let table = leaderboard(&[vote("x", "y", Preference::A), vote("x", "y", Preference::B)]);
        let y = table.iter().find(|s| s.model == "y").unwrap();
        assert_eq!(y.rating, 1001.5);
        assert_eq!((y.wins, y.losses), (1, 1));
        // A tie between unequal ratings moves them toward each other; both_bad likewise.
        let table = leaderboard(&[
            vote("x", "y", Preference::A),
            vote("x", "y", Preference::Tie),
            vote("y", "x", Preference::BothBad),
        ]);
        let x = table.iter().find(|s| s.model == "x").unwrap();
        assert_eq!((x.ties, x.both_bad, x.votes), (1, 1, 3));
        assert!(x.rating > 1000.0 && x.rating < 1016.0, "{}", x.rating);
        let total: f64 = table.iter().map(|s| s.rating).sum();
        assert!((total - 2000.0).abs() < 0.11, "Elo keeps the sum: {total}");
        // Self-comparisons and unvoted ones count for nothing.
        let mut unvoted = vote("x", "z", Preference::A);
        unvoted.preference = None;
        assert!(leaderboard(&[vote("x", "x", Preference::A), unvoted]).is_empty());
    }
}
