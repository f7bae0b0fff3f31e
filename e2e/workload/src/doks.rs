//! The workload of seed 001, the DOKS demo: multi-turn conversations over a few long shared
//! conversation starters, at a fixed number of conversations in flight.
//!
//! From the seed: 10 starters (Wikipedia excerpts) of ~3,500–4,000 tokens; each conversation
//! picks one and runs 3–5 turns; turn 1 sends the starter and a question, later turns a
//! follow-up question generated from the previous answer (a small model plays the user), and
//! every turn resends the whole history; answers average ~830 tokens (a representative
//! conversation: 555, 818, 1,008, 875, 888). The loop is closed with no think time: the seed's
//! end-to-end latency is its request count times the per-request latency.
//!
//! Questions are synthesized: the seed's per-turn input growth (~3,500 → 4,100 → 5,000 with
//! answers of 555 and 818) leaves ~50–100 tokens for a question.

use std::time::Duration;

use crate::content::{Span, Vocab};
use crate::rng::SplitMix;
use crate::session::{Pacing, Session, Turn, Workload};

/// An inclusive range of token counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tokens {
    /// Least.
    pub min: u32,
    /// Most, at least `min`.
    pub max: u32,
}

impl Tokens {
    /// `min..=max`.
    #[must_use]
    pub const fn new(min: u32, max: u32) -> Self {
        Self { min, max }
    }

    fn draw(self, rng: &mut SplitMix) -> u32 {
        rng.between(self.min, self.max)
    }
}

/// The DOKS workload's shape. [`Default`] is the seed's.
#[derive(Debug, Clone, PartialEq)]
pub struct DoksOptions {
    /// Conversations to generate; a closed loop takes them in order.
    pub sessions: usize,
    /// Conversations in flight.
    pub concurrency: u32,
    /// Seeds every draw.
    pub seed: u64,
    /// Shared conversation starters.
    pub starters: u32,
    /// Length of each starter.
    pub starter_tokens: Tokens,
    /// Length of the question sent with the starter on turn 1.
    pub question_tokens: Tokens,
    /// Length of a follow-up question on later turns.
    pub followup_tokens: Tokens,
    /// Turns per conversation.
    pub turns: Tokens,
    /// Answer length (`max_tokens`) of each turn: uniform on this range. The default,
    /// 555–1,105, has the seed's mean of 830 and its shortest answer.
    pub output_tokens: Tokens,
    /// Token ids of the synthesized content.
    pub vocab: Vocab,
    /// Think time before each follow-up turn (0 in the seed's closed loop; the replay's
    /// fidelity calibration uses 3 s for the seed's small-model "user").
    pub think: Duration,
}

impl Default for DoksOptions {
    fn default() -> Self {
        Self {
            sessions: 1_000,
            concurrency: 60,
            seed: 1,
            starters: 10,
            starter_tokens: Tokens::new(3_500, 4_000),
            question_tokens: Tokens::new(50, 100),
            followup_tokens: Tokens::new(25, 100),
            turns: Tokens::new(3, 5),
            output_tokens: Tokens::new(555, 1_105),
            vocab: Vocab::default(),
            think: Duration::ZERO,
        }
    }
}

// Stream numbers of the generator: starters, then one per session.
const STARTER_STREAM: u64 = 1 << 62;
const SESSION_STREAM: u64 = 1 << 63;

/// The starter spans: `starters` seeded spans of drawn lengths.
fn starters(options: &DoksOptions) -> Vec<Span> {
    let mut rng = SplitMix::stream(options.seed, STARTER_STREAM);
    (0..options.starters)
        .map(|_| Span {
            seed: rng.next_u64(),
            len: options.starter_tokens.draw(&mut rng),
        })
        .collect()
}

/// The DOKS workload, named `doks`, closed loop at `options.concurrency` (at least 1).
/// Session `i` depends only on the seed and `i`, so a longer workload extends a shorter one.
/// `group` is the starter's index.
#[must_use]
pub fn doks(options: &DoksOptions) -> Workload {
    let starters = starters(options);
    let sessions = (0..options.sessions as u64)
        .map(|id| {
            let mut rng = SplitMix::stream(options.seed, SESSION_STREAM | id);
            let pick = rng.between(0, options.starters.saturating_sub(1));
            let starter = starters.get(pick as usize).copied();
            let turns = options.turns.draw(&mut rng).max(1);
            let turns = (0..turns)
                .map(|k| {
                    let len = if k == 0 {
                        options.question_tokens
                    } else {
                        options.followup_tokens
                    }
                    .draw(&mut rng);
                    let question = Span {
                        seed: rng.next_u64(),
                        len,
                    };
                    let user = match starter {
                        Some(starter) if k == 0 => vec![starter, question],
                        _ => vec![question],
                    };
                    Turn {
                        user,
                        max_tokens: options.output_tokens.draw(&mut rng).max(1),
                        think: if k == 0 {
                            Duration::ZERO
                        } else {
                            options.think
                        },
                    }
                })
                .collect();
            Session {
                id,
                start: Duration::ZERO,
                group: pick,
                turns,
            }
        })
        .collect();
    Workload {
        name: "doks".into(),
        pacing: Pacing::Closed {
            concurrency: options.concurrency.max(1),
        },
        vocab: options.vocab,
        sessions,
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]
    use super::*;
    use proptest::prelude::*;

    fn mean(xs: impl Iterator<Item = f64>) -> f64 {
        let (sum, n) = xs.fold((0.0, 0.0), |(s, n), x| (s + x, n + 1.0));
        sum / n
    }

    #[test]
    fn the_distributions_match_the_seed() {
        let w = doks(&DoksOptions {
            sessions: 4_000,
            ..DoksOptions::default()
        });
        assert_eq!(w.pacing, Pacing::Closed { concurrency: 60 });
        assert_eq!(w.sessions.len(), 4_000);
        let turns = mean(w.sessions.iter().map(|s| s.turns.len() as f64));
        assert!((turns - 4.0).abs() < 0.05, "turns {turns}");
        assert!(w.sessions.iter().all(|s| (3..=5).contains(&s.turns.len())));
        let out = mean(
            w.sessions
                .iter()
                .flat_map(|s| &s.turns)
                .map(|t| f64::from(t.max_tokens)),
        );
        assert!((out - 830.0).abs() < 8.0, "output {out}");
        let starter = mean(w.sessions.iter().map(|s| f64::from(s.turns[0].user[0].len)));
        assert!((3_500.0..=4_000.0).contains(&starter));
        let question = mean(w.sessions.iter().map(|s| f64::from(s.turns[0].user[1].len)));
        assert!((question - 75.0).abs() < 1.5, "question {question}");
        let followup = mean(
            w.sessions
                .iter()
                .flat_map(|s| &s.turns[1..])
                .map(|t| f64::from(t.user[0].len)),
        );
        assert!((followup - 62.5).abs() < 1.5, "follow-up {followup}");
        let mut per_starter = [0u32; 10];
        for s in &w.sessions {
            per_starter[s.group as usize] += 1;
        }
        assert!(
            per_starter.iter().all(|&n| (300..=500).contains(&n)),
            "{per_starter:?}"
        );
        assert!(
            w.sessions
                .iter()
                .flat_map(|s| &s.turns)
                .all(|t| t.think.is_zero())
        );
        let thinking = doks(&DoksOptions {
            sessions: 20,
            think: Duration::from_millis(3_000),
            ..DoksOptions::default()
        });
        for s in &thinking.sessions {
            assert!(s.turns[0].think.is_zero());
            assert!(
                s.turns[1..]
                    .iter()
                    .all(|t| t.think == Duration::from_secs(3))
            );
        }
    }

    #[test]
    fn sessions_of_one_starter_share_it_as_a_prefix() {
        let w = doks(&DoksOptions {
            sessions: 200,
            ..DoksOptions::default()
        });
        let first = |g: u32| w.sessions.iter().find(|s| s.group == g).unwrap();
        for s in &w.sessions {
            let other = first(s.group);
            let len = s.turns[0].user[0].len as usize;
            let a = s.prompt(&w.vocab, 0, &[]).unwrap();
            let b = other.prompt(&w.vocab, 0, &[]).unwrap();
            assert_eq!(a[..len], b[..len]);
            if other.id != s.id {
                assert_ne!(a[len..], b[len..], "questions differ");
            }
        }
        let distinct: std::collections::HashSet<u64> =
            w.sessions.iter().map(|s| s.turns[0].user[0].seed).collect();
        assert_eq!(distinct.len(), 10);
    }

    proptest! {
        #[test]
        fn deterministic_and_a_longer_workload_extends_a_shorter_one(seed: u64, n in 1usize..40) {
            let short = doks(&DoksOptions { sessions: n, seed, ..DoksOptions::default() });
            let long = doks(&DoksOptions { sessions: n + 5, seed, ..DoksOptions::default() });
            prop_assert_eq!(&long.sessions[..n], &short.sessions[..]);
            prop_assert_eq!(&short, &doks(&DoksOptions { sessions: n, seed, ..DoksOptions::default() }));
            for s in &short.sessions {
                prop_assert!(s.turns.iter().all(|t| (555..=1_105).contains(&t.max_tokens)));
                prop_assert!((3..=5).contains(&s.turns.len()));
            }
        }
    }
}
