//! A small seeded generator (SplitMix64) for the synthetic workloads: deterministic across
//! platforms and releases, which a general-purpose RNG crate does not promise.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// SplitMix64 (Steele, Lea and Flood, 2014): one 64-bit add and a mix per draw.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix(u64);

impl SplitMix {
    /// A generator for stream `stream` of the workload seeded with `seed`: streams of one seed
    /// are independent of each other and of how many other streams are drawn.
    pub(crate) fn stream(seed: u64, stream: u64) -> Self {
        Self(xxh3_64_with_seed(&stream.to_le_bytes(), seed))
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        // The top 53 bits fill an f64 mantissa exactly.
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi` (`lo` when `hi < lo`).
    pub(crate) fn between(&mut self, lo: u32, hi: u32) -> u32 {
        let width = u64::from(hi.saturating_sub(lo)) + 1;
        // `next % width < width <= 2^32`, so the sum stays within `lo..=hi`.
        lo.saturating_add(u32::try_from(self.next_u64() % width).unwrap_or(0))
    }

    /// Exponentially distributed with mean `mean` (inverse transform).
    pub(crate) fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    /// Shuffles `items` in place (Fisher–Yates).
    pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = usize::try_from(self.next_u64() % (i as u64 + 1)).unwrap_or(0);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn draws_stay_in_range(seed: u64, lo in 0u32..10_000, width in 0u32..10_000) {
            let mut r = SplitMix::stream(seed, 0);
            for _ in 0..50 {
                let x = r.between(lo, lo + width);
                prop_assert!((lo..=lo + width).contains(&x));
                let u = r.unit();
                prop_assert!((0.0..1.0).contains(&u));
                prop_assert!(r.exponential(2.0) >= 0.0);
            }
        }

        #[test]
        fn a_shuffle_is_a_permutation(seed: u64, n in 0usize..64) {
            let mut v: Vec<usize> = (0..n).collect();
            SplitMix::stream(seed, 1).shuffle(&mut v);
            let mut sorted = v.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn streams_are_deterministic_and_distinct() {
        let a: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(SplitMix::stream(7, 1), |r, _: u64| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(SplitMix::stream(7, 1), |r, _: u64| Some(r.next_u64()))
            .collect();
        let c: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(SplitMix::stream(7, 2), |r, _: u64| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn the_exponential_mean_is_close() {
        let mut r = SplitMix::stream(3, 0);
        let n = 20_000;
        let mean = (0..n).map(|_| r.exponential(5.0)).sum::<f64>() / f64::from(n);
        assert!((mean - 5.0).abs() < 0.2, "{mean}");
    }
}
