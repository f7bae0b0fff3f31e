//! Percentiles by the nearest-rank method.
//!
//! For `n` values sorted ascending, the p-th percentile (0 < p ≤ 100) is the value at rank
//! `⌈p/100 · n⌉` (1-based): the smallest value such that at least p % of the values are less
//! than or equal to it. It is always one of the observed values (no interpolation), p100 is the
//! maximum, and any p ≤ 100/n gives the minimum.

use serde::{Deserialize, Serialize};

/// Ascending, NaN-free samples ready for percentile queries.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sorted(Vec<f64>);

impl Sorted {
    /// Sorts `values`, dropping NaNs.
    #[must_use]
    pub fn new(mut values: Vec<f64>) -> Self {
        values.retain(|v| !v.is_nan());
        values.sort_unstable_by(f64::total_cmp);
        Self(values)
    }

    /// How many samples.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No samples.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The nearest-rank `p`-th percentile; `None` when empty. `p` is clamped to `(0, 100]`.
    #[must_use]
    pub fn percentile(&self, p: f64) -> Option<f64> {
        let n = self.0.len();
        if n == 0 {
            return None;
        }
        let p = if p.is_nan() {
            100.0
        } else {
            p.clamp(0.0, 100.0)
        };
        // The tiny slack keeps p·n/100 that is an integer in exact arithmetic (95 % of 20) from
        // rounding up to the next rank.
        let rank = (p / 100.0 * n as f64 - 1e-9).ceil().max(1.0);
        let index = (rank as usize).min(n) - 1;
        self.0.get(index).copied()
    }

    /// The arithmetic mean; `None` when empty.
    #[must_use]
    pub fn mean(&self) -> Option<f64> {
        (!self.0.is_empty()).then(|| self.0.iter().sum::<f64>() / self.0.len() as f64)
    }

    /// The standard summary of these samples.
    #[must_use]
    pub fn stats(&self) -> Stats {
        Stats {
            p50: self.percentile(50.0),
            p90: self.percentile(90.0),
            p95: self.percentile(95.0),
            p99: self.percentile(99.0),
            mean: self.mean(),
        }
    }
}

/// p50, p90, p95, p99 and mean of one measurement; `None` without samples.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 95th percentile.
    pub p95: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
    /// Mean.
    pub mean: Option<f64>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use proptest::prelude::*;

    /// The definition, literally: the smallest observed value v with #{x ≤ v} ≥ p/100 · n.
    fn naive(values: &[f64], p: f64) -> Option<f64> {
        let n = values.len() as f64;
        let mut candidates = values.to_vec();
        candidates.sort_by(f64::total_cmp);
        candidates.into_iter().find(|&v| {
            let at_most = values.iter().filter(|&&x| x <= v).count() as f64;
            at_most * 100.0 >= p * n
        })
    }

    proptest! {
        #[test]
        fn nearest_rank_matches_the_definition(
            values in prop::collection::vec(-1_000i32..1_000, 1..60),
            p in prop::sample::select(vec![1.0, 10.0, 25.0, 50.0, 90.0, 95.0, 99.0, 100.0]),
        ) {
            let values: Vec<f64> = values.into_iter().map(f64::from).collect();
            let sorted = Sorted::new(values.clone());
            prop_assert_eq!(sorted.percentile(p), naive(&values, p));
        }

        #[test]
        fn percentiles_are_monotone_and_bounded(values in prop::collection::vec(0.0f64..1e6, 1..80)) {
            let s = Sorted::new(values.clone()).stats();
            let min = values.iter().copied().fold(f64::INFINITY, f64::min);
            let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let (p50, p90, p95, p99) = (s.p50.unwrap(), s.p90.unwrap(), s.p95.unwrap(), s.p99.unwrap());
            prop_assert!(min <= p50 && p50 <= p90 && p90 <= p95 && p95 <= p99 && p99 <= max);
            let mean = s.mean.unwrap();
            prop_assert!(min - 1e-6 <= mean && mean <= max + 1e-6);
        }
    }

    #[test]
    fn known_values() {
        let s = Sorted::new((1..=20).map(f64::from).collect());
        assert_eq!(s.percentile(50.0), Some(10.0));
        assert_eq!(s.percentile(95.0), Some(19.0));
        assert_eq!(s.percentile(99.0), Some(20.0));
        assert_eq!(s.percentile(0.0), Some(1.0));
        assert_eq!(s.mean(), Some(10.5));
        let empty = Sorted::new(vec![f64::NAN]);
        assert!(empty.is_empty());
        assert_eq!(empty.stats(), Stats::default());
    }
}
