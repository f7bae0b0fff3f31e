//! A seeded random source shared by concurrent decisions: SplitMix64 over an atomic counter,
//! so drawing is one `fetch_add` and a few multiplies, with no lock. A single caller making the
//! same calls in the same order sees the same numbers for the same seed.

use std::sync::atomic::{AtomicU64, Ordering};

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective mix of 64 bits.
pub(crate) const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[derive(Debug)]
pub(crate) struct SeededRng {
    state: AtomicU64,
}

impl SeededRng {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed),
        }
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&self) -> u64 {
        let s = self.state.fetch_add(GAMMA, Ordering::Relaxed);
        mix(s.wrapping_add(GAMMA))
    }

    /// A uniform number in `[0, 1)` drawn from `bits`.
    pub(crate) fn unit(bits: u64) -> f64 {
        (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform index below `n` (`n > 0`) drawn from `bits`, without modulo bias worth noting
    /// (multiply-shift over 64 bits).
    pub(crate) fn below(bits: u64, n: usize) -> usize {
        ((u128::from(bits) * n as u128) >> 64) as usize
    }
}

/// A per-candidate tie-break key: a random permutation of endpoints per decision `salt`.
pub(crate) const fn tie_key(salt: u64, endpoint: u32) -> u64 {
    mix(salt ^ (endpoint as u64).wrapping_mul(GAMMA))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let a = SeededRng::new(7);
        let b = SeededRng::new(7);
        let c = SeededRng::new(8);
        let xs: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        let zs: Vec<u64> = (0..8).map(|_| c.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
    }

    #[test]
    fn draws_are_in_range_and_spread() {
        let r = SeededRng::new(1);
        let mut counts = [0u32; 4];
        for _ in 0..4000 {
            let bits = r.next_u64();
            let u = SeededRng::unit(bits);
            assert!((0.0..1.0).contains(&u));
            counts[SeededRng::below(bits, 4)] += 1;
        }
        for c in counts {
            assert!((800..1200).contains(&c), "{counts:?}");
        }
        assert_eq!(SeededRng::below(u64::MAX, 3), 2);
    }
}
