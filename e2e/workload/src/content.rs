//! Synthesized token content: spans of deterministic pseudo-random token ids.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A run of `len` synthesized tokens, all determined by `seed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Span {
    /// Equal seeds give equal tokens.
    pub seed: u64,
    /// How many tokens.
    pub len: u32,
}

/// The token ids synthesized content is drawn from: `[lo, hi)`.
///
/// The default, `[1000, 100000)`, avoids the low ids most vocabularies reserve (bytes,
/// special tokens) and stays below every common vocabulary's size (Qwen3: 151,936;
/// Llama 3: 128,256), so a real engine accepts the ids as a token-id prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vocab {
    /// Lowest id, inclusive.
    pub lo: u32,
    /// Highest id, exclusive; greater than `lo`.
    pub hi: u32,
}

impl Default for Vocab {
    fn default() -> Self {
        Self {
            lo: 1_000,
            hi: 100_000,
        }
    }
}

impl Vocab {
    /// The `i`-th token of the content seeded with `seed`.
    #[must_use]
    pub fn token(&self, seed: u64, i: u32) -> u32 {
        let width = u64::from(self.hi.saturating_sub(self.lo).max(1));
        let h = xxh3_64_with_seed(&i.to_le_bytes(), seed);
        // `h % width < width <= u32::MAX`, so the narrowing cannot lose bits.
        self.lo + u32::try_from(h % width).unwrap_or(0)
    }

    /// Appends the tokens of `span` to `out`.
    pub fn extend(&self, span: Span, out: &mut Vec<u32>) {
        out.extend((0..span.len).map(|i| self.token(span.seed, i)));
    }

    /// The tokens of `spans`, concatenated.
    #[must_use]
    pub fn tokens(&self, spans: &[Span]) -> Vec<u32> {
        let total: usize = spans.iter().map(|s| s.len as usize).sum();
        let mut out = Vec::with_capacity(total);
        for span in spans {
            self.extend(*span, &mut out);
        }
        out
    }
}

/// The answer the discrete-event replay gives to turn `turn` of session `session`: `len`
/// tokens that depend only on (session, turn), so a replay is reproducible and two sessions
/// never share an answer by accident.
#[must_use]
pub fn synth_answer(vocab: &Vocab, session: u64, turn: u32, len: u32) -> Vec<u32> {
    let seed = xxh3_64_with_seed(&session.to_le_bytes(), 0xA45E_u64 ^ u64::from(turn) << 32);
    vocab.tokens(&[Span { seed, len }])
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

    proptest! {
        #[test]
        fn tokens_stay_in_range_and_are_deterministic(seed: u64, len in 0u32..300, lo in 0u32..1000, width in 1u32..5000) {
            let v = Vocab { lo, hi: lo + width };
            let a = v.tokens(&[Span { seed, len }]);
            prop_assert_eq!(a.len(), len as usize);
            prop_assert!(a.iter().all(|t| (lo..lo + width).contains(t)));
            prop_assert_eq!(a, v.tokens(&[Span { seed, len }]));
        }

        #[test]
        fn a_span_is_a_prefix_of_a_longer_one_with_the_same_seed(seed: u64, a in 0u32..200, b in 0u32..200) {
            let v = Vocab::default();
            let short = v.tokens(&[Span { seed, len: a.min(b) }]);
            let long = v.tokens(&[Span { seed, len: a.max(b) }]);
            prop_assert_eq!(&long[..short.len()], &short[..]);
        }
    }

    #[test]
    fn different_seeds_give_different_content() {
        let v = Vocab::default();
        assert_ne!(
            v.tokens(&[Span { seed: 1, len: 16 }]),
            v.tokens(&[Span { seed: 2, len: 16 }])
        );
        assert_ne!(synth_answer(&v, 1, 0, 16), synth_answer(&v, 1, 1, 16));
        assert_ne!(synth_answer(&v, 1, 0, 16), synth_answer(&v, 2, 0, 16));
    }
}
