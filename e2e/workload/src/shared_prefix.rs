//! A shared-prefix workload like llm-d's benchmarks (inference-perf's `shared_prefix` data):
//! groups of users behind one long system prompt per group, each user asking a few short
//! questions, requests arriving as a Poisson process.
//!
//! Every request is a single-turn session: the group's system prompt, the user's own context
//! (optional, empty by default), then one question. Which request comes next is a seeded
//! shuffle over all groups, users and questions, so every group's prefix is in use throughout
//! the run; arrival gaps are exponential with mean `1 / qps`.

use std::time::Duration;

use crate::content::{Span, Vocab};
use crate::rng::SplitMix;
use crate::session::{Pacing, Session, Turn, Workload};

/// The workload's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPrefixOptions {
    /// Groups, each with its own system prompt.
    pub groups: u32,
    /// Users per group.
    pub users_per_group: u32,
    /// Questions per user: requests = groups × users × questions.
    pub questions_per_user: u32,
    /// Length of a group's system prompt.
    pub system_prompt_tokens: u32,
    /// Length of each user's own context after the system prompt (0: none).
    pub user_context_tokens: u32,
    /// Length of each question.
    pub question_tokens: u32,
    /// `max_tokens` of each request (at least 1).
    pub output_tokens: u32,
    /// Mean arrival rate, requests per second; finite and positive.
    pub qps: f64,
    /// Seeds every draw.
    pub seed: u64,
    /// Token ids of the synthesized content.
    pub vocab: Vocab,
}

impl Default for SharedPrefixOptions {
    fn default() -> Self {
        Self {
            groups: 8,
            users_per_group: 8,
            questions_per_user: 4,
            system_prompt_tokens: 2_000,
            user_context_tokens: 0,
            question_tokens: 50,
            output_tokens: 50,
            qps: 10.0,
            seed: 1,
            vocab: Vocab::default(),
        }
    }
}

/// Options that cannot make a workload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharedPrefixError {
    /// `qps` is zero, negative or not finite.
    #[error("qps must be finite and positive")]
    Qps,
    /// More requests than fit in memory sensibly.
    #[error("{0} requests is more than the {MAX_REQUESTS} a shared-prefix workload may have")]
    TooLarge(u64),
}

/// The most requests a shared-prefix workload may have.
pub const MAX_REQUESTS: u64 = 10_000_000;

const ORDER_STREAM: u64 = 1;
const ARRIVAL_STREAM: u64 = 2;
const CONTENT_STREAM: u64 = 3;

/// The workload, named `shared-prefix`, open loop. Session ids are
/// `(group × users + user) × questions + question`; `group` is the group.
pub fn shared_prefix(options: &SharedPrefixOptions) -> Result<Workload, SharedPrefixError> {
    if !(options.qps.is_finite() && options.qps > 0.0) {
        return Err(SharedPrefixError::Qps);
    }
    let users = u64::from(options.users_per_group);
    let questions = u64::from(options.questions_per_user);
    let total = u64::from(options.groups) * users * questions;
    if total > MAX_REQUESTS {
        return Err(SharedPrefixError::TooLarge(total));
    }
    let seed_of = |kind: u64, index: u64| {
        SplitMix::stream(options.seed ^ CONTENT_STREAM, kind << 56 | index).next_u64()
    };
    let mut ids: Vec<u64> = (0..total).collect();
    SplitMix::stream(options.seed, ORDER_STREAM).shuffle(&mut ids);
    let mut arrivals = SplitMix::stream(options.seed, ARRIVAL_STREAM);
    let mean_gap = 1.0 / options.qps;
    let mut at = 0.0f64;
    let sessions = ids
        .into_iter()
        .map(|id| {
            let user = id / questions.max(1);
            let group = user / users.max(1);
            let mut spans = vec![Span {
                seed: seed_of(1, group),
                len: options.system_prompt_tokens,
            }];
            if options.user_context_tokens > 0 {
                spans.push(Span {
                    seed: seed_of(2, user),
                    len: options.user_context_tokens,
                });
            }
            spans.push(Span {
                seed: seed_of(3, id),
                len: options.question_tokens,
            });
            let start = Duration::try_from_secs_f64(at).unwrap_or(Duration::MAX);
            at += arrivals.exponential(mean_gap);
            Session {
                id,
                start,
                group: u32::try_from(group).unwrap_or(u32::MAX),
                turns: vec![Turn {
                    user: spans,
                    max_tokens: options.output_tokens.max(1),
                    think: Duration::ZERO,
                }],
            }
        })
        .collect();
    Ok(Workload {
        name: "shared-prefix".into(),
        pacing: Pacing::Open,
        vocab: options.vocab,
        sessions,
    })
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

    #[test]
    fn counts_prefixes_and_arrival_rate() {
        let options = SharedPrefixOptions {
            groups: 10,
            users_per_group: 20,
            questions_per_user: 10,
            qps: 50.0,
            ..SharedPrefixOptions::default()
        };
        let w = shared_prefix(&options).unwrap();
        assert_eq!(w.pacing, Pacing::Open);
        assert_eq!(w.sessions.len(), 2_000);
        assert!(w.sessions.windows(2).all(|p| p[0].start <= p[1].start));
        let span = w.sessions.last().unwrap().start.as_secs_f64();
        let rate = 1_999.0 / span;
        assert!((rate - 50.0).abs() < 5.0, "rate {rate}");
        let mut ids: Vec<u64> = w.sessions.iter().map(|s| s.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..2_000).collect::<Vec<_>>());
        let prompt = |s: &Session| s.prompt(&w.vocab, 0, &[]).unwrap();
        for s in &w.sessions {
            assert_eq!(s.group as u64, s.id / 200);
            let p = prompt(s);
            assert_eq!(p.len(), 2_050);
            let peer = w.sessions.iter().find(|o| o.group == s.group).unwrap();
            assert_eq!(
                p[..2_000],
                prompt(peer)[..2_000],
                "one system prompt per group"
            );
        }
        let a = prompt(&w.sessions[0]);
        let other = w
            .sessions
            .iter()
            .find(|o| o.group != w.sessions[0].group)
            .unwrap();
        assert_ne!(a[..2_000], prompt(other)[..2_000]);
    }

    #[test]
    fn bad_options_are_errors() {
        let zero = SharedPrefixOptions {
            qps: 0.0,
            ..SharedPrefixOptions::default()
        };
        assert_eq!(shared_prefix(&zero), Err(SharedPrefixError::Qps));
        let huge = SharedPrefixOptions {
            groups: 10_000,
            users_per_group: 10_000,
            ..SharedPrefixOptions::default()
        };
        assert!(matches!(
            shared_prefix(&huge),
            Err(SharedPrefixError::TooLarge(_))
        ));
    }

    proptest! {
        #[test]
        fn deterministic_per_seed(seed: u64, groups in 1u32..5, users in 1u32..5, questions in 1u32..4, context in 0u32..3) {
            let options = SharedPrefixOptions {
                groups, users_per_group: users, questions_per_user: questions,
                user_context_tokens: context, seed, ..SharedPrefixOptions::default()
            };
            let w = shared_prefix(&options).unwrap();
            prop_assert_eq!(&w, &shared_prefix(&options).unwrap());
            prop_assert_eq!(w.sessions.len() as u32, groups * users * questions);
            for s in &w.sessions {
                let spans = &s.turns[0].user;
                prop_assert_eq!(spans.len(), if context > 0 { 3 } else { 2 });
            }
        }
    }
}
