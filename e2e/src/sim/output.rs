//! What the simulator "generates": plausible words from the tokenizer's vocabulary (single-token
//! words that re-encode to themselves, so a client resending the output as history gets the same
//! ids back), and an output length that honours `max_tokens`, `ignore_eos` and a configured mean.

use std::collections::HashMap;

/// A small pseudo-random generator (SplitMix64): deterministic per seed, no dependencies.
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform float in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The word tokens output is made of, with their text.
#[derive(Debug, Clone)]
pub struct OutputVocab {
    ids: Vec<u32>,
    text: HashMap<u32, String>,
}

impl OutputVocab {
    /// Builds the vocabulary from word token ids and the served tokenizer's `decode`.
    pub fn new(words: &[u32], decode: impl Fn(u32) -> Option<String>) -> Self {
        let mut ids = Vec::new();
        let mut text = HashMap::new();
        for &id in words {
            if let Some(t) = decode(id)
                && !t.is_empty()
                && !text.contains_key(&id)
            {
                text.insert(id, t);
                ids.push(id);
            }
        }
        Self { ids, text }
    }

    /// `len` tokens drawn with `rng`.
    pub fn generate(&self, rng: &mut SplitMix, len: usize) -> Vec<u32> {
        if self.ids.is_empty() {
            return vec![0; len];
        }
        (0..len)
            .map(|_| {
                let i = (rng.next_u64() % self.ids.len() as u64) as usize;
                self.ids.get(i).copied().unwrap_or(0)
            })
            .collect()
    }

    /// The text of generated tokens.
    pub fn text(&self, ids: &[u32]) -> String {
        ids.iter()
            .filter_map(|id| self.text.get(id).map(String::as_str))
            .collect()
    }
}

/// How many tokens to generate, and whether the request ends on EOS (`"stop"`) rather than the
/// length bound. With `ignore_eos` it is exactly `max_tokens`; otherwise EOS comes after a
/// geometrically distributed length with mean `mean_output` (capped at `max_tokens`).
pub fn output_len(
    max_tokens: u32,
    ignore_eos: bool,
    mean_output: u32,
    rng: &mut SplitMix,
) -> (u32, bool) {
    let max_tokens = max_tokens.max(1);
    if ignore_eos || mean_output == 0 {
        return (max_tokens, false);
    }
    let p = 1.0 / f64::from(mean_output.max(1));
    let u = rng.next_f64().max(f64::MIN_POSITIVE);
    let len = (u.ln() / (1.0 - p).ln()).ceil().max(1.0);
    if len >= f64::from(max_tokens) {
        (max_tokens, false)
    } else {
        (len as u32, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ignore_eos_gives_exactly_max_tokens() {
        let mut rng = SplitMix::new(1);
        assert_eq!(output_len(40, true, 5, &mut rng), (40, false));
        assert_eq!(output_len(0, true, 5, &mut rng), (1, false));
    }

    #[test]
    fn eos_lengths_have_the_configured_mean_and_respect_the_cap() {
        let mut rng = SplitMix::new(7);
        let n = 20_000;
        let mut sum = 0u64;
        for _ in 0..n {
            let (len, stop) = output_len(10_000, false, 100, &mut rng);
            assert!((1..=10_000).contains(&len));
            assert!(stop || len == 10_000);
            sum += u64::from(len);
        }
        let mean = sum as f64 / f64::from(n);
        assert!((mean - 100.0).abs() < 5.0, "mean {mean}");
        assert_eq!(output_len(3, false, 1_000_000, &mut rng).0, 3);
    }

    #[test]
    fn vocab_round_trips_text() {
        let words: Vec<u32> = "the quick brown fox".bytes().map(u32::from).collect();
        let v = OutputVocab::new(&words, |id| char::from_u32(id).map(|c| c.to_string()));
        let mut rng = SplitMix::new(3);
        let ids = v.generate(&mut rng, 50);
        assert_eq!(ids.len(), 50);
        assert_eq!(v.text(&ids).chars().count(), 50);
    }
}
