//! Sessions, turns, pacing: what a workload is.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::content::{Span, Vocab};

/// One turn of a session: the user's new tokens and the answer length asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Turn {
    /// The tokens this turn appends to the conversation before the answer.
    pub user: Vec<Span>,
    /// Output tokens asked for. Requests are sent with `ignore_eos`, so an engine that honours
    /// it (vLLM, `kvgate-sim`) generates exactly this many.
    pub max_tokens: u32,
    /// Pause between the previous turn's last token and this turn's request (zero for the
    /// first turn: a session's first turn is paced by [`Pacing`]).
    #[serde(with = "millis")]
    pub think: Duration,
}

/// A conversation: turns sent one after another, each resending the whole history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    /// Unique within its workload.
    pub id: u64,
    /// Open loop: when the first turn is sent, from the start of the run. Closed loop: unused.
    #[serde(with = "millis")]
    pub start: Duration,
    /// A label for grouping results: the trace, the conversation starter, the shared-prefix
    /// group. Sessions of one group are expected to share a prefix.
    pub group: u32,
    /// At least one.
    pub turns: Vec<Turn>,
}

impl Session {
    /// The prompt of turn `k`: every earlier turn's user tokens followed by its answer, then
    /// turn `k`'s user tokens. `answers` holds the answers of turns `0..k` (more are ignored).
    /// `None` when `k` is out of range or fewer than `k` answers are given.
    #[must_use]
    pub fn prompt(&self, vocab: &Vocab, k: usize, answers: &[Vec<u32>]) -> Option<Vec<u32>> {
        if k >= self.turns.len() || answers.len() < k {
            return None;
        }
        let mut out = Vec::new();
        for (turn, answer) in self.turns.iter().zip(answers).take(k) {
            for span in &turn.user {
                vocab.extend(*span, &mut out);
            }
            out.extend_from_slice(answer);
        }
        for span in &self.turns.get(k)?.user {
            vocab.extend(*span, &mut out);
        }
        Some(out)
    }

    /// Total user tokens over all turns (answers excluded).
    #[must_use]
    pub fn user_tokens(&self) -> u64 {
        self.turns
            .iter()
            .flat_map(|t| &t.user)
            .map(|s| u64::from(s.len))
            .sum()
    }
}

/// How sessions are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum Pacing {
    /// Each session starts at its [`Session::start`], whatever the system's state (a trace, a
    /// Poisson process). Overload shows as growing latency.
    Open,
    /// `concurrency` sessions in flight; when one ends, the next session in the list starts.
    Closed {
        /// Sessions in flight, at least one.
        concurrency: u32,
    },
}

/// A named list of sessions and how to pace them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    /// For reports: `mooncake`, `doks`, `shared-prefix`, …
    pub name: String,
    /// How sessions start.
    pub pacing: Pacing,
    /// The token ids content is drawn from.
    pub vocab: Vocab,
    /// In start order for open loop; in the order they are taken for closed loop.
    pub sessions: Vec<Session>,
}

impl Workload {
    /// Requests the workload sends if every session runs to its end.
    #[must_use]
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
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

    fn turn(seed: u64, len: u32) -> Turn {
        Turn {
            user: vec![Span { seed, len }],
            max_tokens: 4,
            think: Duration::ZERO,
        }
    }

    #[test]
    fn the_prompt_is_the_history_then_the_new_user_tokens() {
        let v = Vocab::default();
        let s = Session {
            id: 7,
            start: Duration::ZERO,
            group: 0,
            turns: vec![turn(1, 5), turn(2, 3)],
        };
        let first = s.prompt(&v, 0, &[]).unwrap();
        assert_eq!(first, v.tokens(&[Span { seed: 1, len: 5 }]));
        let answer = vec![9, 9];
        let second = s.prompt(&v, 1, std::slice::from_ref(&answer)).unwrap();
        let mut want = first.clone();
        want.extend(&answer);
        want.extend(v.tokens(&[Span { seed: 2, len: 3 }]));
        assert_eq!(second, want);
        assert!(s.prompt(&v, 1, &[]).is_none(), "missing answer");
        assert!(
            s.prompt(&v, 2, &[answer.clone(), answer]).is_none(),
            "no turn 2"
        );
        assert_eq!(s.user_tokens(), 8);
    }

    #[test]
    fn sessions_round_trip_through_json() {
        let s = Session {
            id: 1,
            start: Duration::from_millis(1500),
            group: 3,
            turns: vec![turn(1, 5)],
        };
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Session>(&json).unwrap(), s);
        let p = serde_json::to_string(&Pacing::Closed { concurrency: 60 }).unwrap();
        assert_eq!(p, r#"{"mode":"closed","concurrency":60}"#);
    }
}
