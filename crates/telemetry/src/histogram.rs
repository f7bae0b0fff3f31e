//! A fixed-bucket histogram with lock-free observation.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bucket bounds used across kvgate, in base units.
pub mod buckets {
    /// Latencies from 50 µs to 60 s (decisions, TTFT, request duration).
    pub const SECONDS: &[f64] = &[
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    /// Per-token latencies from 1 ms to 2 s (TPOT / ITL).
    pub const TOKEN_SECONDS: &[f64] = &[
        0.001, 0.002_5, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
        0.5, 1.0, 2.0,
    ];
    /// Token counts from 1 to 256 Ki.
    pub const TOKENS: &[f64] = &[
        1.0, 8.0, 32.0, 128.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0,
        131_072.0, 262_144.0,
    ];
    /// Sizes from 64 B to 64 MiB.
    pub const BYTES: &[f64] = &[
        64.0,
        256.0,
        1024.0,
        4096.0,
        16384.0,
        65536.0,
        262_144.0,
        1_048_576.0,
        4_194_304.0,
        16_777_216.0,
        67_108_864.0,
    ];
}

/// A cumulative histogram over fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One counter per bound plus the overflow (`+Inf`) bucket, not cumulative.
    counts: Box<[AtomicU64]>,
    /// The sum of observations, as `f64` bits.
    sum_bits: AtomicU64,
}

/// A point-in-time copy of a [`Histogram`], cumulative as Prometheus wants it.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// `(upper bound, observations ≤ bound)`, ascending.
    pub buckets: Vec<(f64, u64)>,
    /// All observations.
    pub count: u64,
    /// Their sum.
    pub sum: f64,
}

impl Histogram {
    /// A histogram over `bounds` (ascending; a bound that is not greater than the previous one
    /// is ignored by `observe`, which finds the first bound ≥ the value).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Records one observation. NaN is ignored.
    pub fn observe(&self, v: f64) {
        if v.is_nan() {
            return;
        }
        let i = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        if let Some(c) = self.counts.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        let mut cur = self.sum_bits.load(Ordering::Relaxed);
        loop {
            let next = (f64::from_bits(cur) + v).to_bits();
            match self.sum_bits.compare_exchange_weak(
                cur,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(seen) => cur = seen,
            }
        }
    }

    /// Records a duration in seconds.
    pub fn observe_duration(&self, d: std::time::Duration) {
        self.observe(d.as_secs_f64());
    }

    /// A cumulative copy. Concurrent observations may be half-visible (a count without its
    /// sum), which Prometheus tolerates between scrapes.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut running = 0u64;
        let mut buckets = Vec::with_capacity(self.bounds.len());
        for (b, c) in self.bounds.iter().zip(self.counts.iter()) {
            running = running.saturating_add(c.load(Ordering::Relaxed));
            buckets.push((*b, running));
        }
        let overflow = self.counts.last().map_or(0, |c| c.load(Ordering::Relaxed));
        HistogramSnapshot {
            buckets,
            count: running.saturating_add(overflow),
            sum: f64::from_bits(self.sum_bits.load(Ordering::Relaxed)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;
    use proptest::prelude::*;

    const B: &[f64] = &[1.0, 2.0, 5.0];

    #[test]
    fn buckets_are_cumulative_with_overflow() {
        let h = Histogram::new(B);
        for v in [0.5, 1.0, 1.5, 4.0, 9.0, f64::NAN] {
            h.observe(v);
        }
        let s = h.snapshot();
        assert_eq!(s.buckets, vec![(1.0, 2), (2.0, 3), (5.0, 4)]);
        assert_eq!(s.count, 5);
        assert!((s.sum - 16.0).abs() < 1e-9);
    }

    #[test]
    fn shared_bound_lists_ascend() {
        for b in [
            buckets::SECONDS,
            buckets::TOKEN_SECONDS,
            buckets::TOKENS,
            buckets::BYTES,
        ] {
            assert!(b.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn concurrent_observers_lose_nothing() {
        let h = std::sync::Arc::new(Histogram::new(B));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let h = std::sync::Arc::clone(&h);
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        h.observe(1.5);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = h.snapshot();
        assert_eq!(s.count, 40_000);
        assert!((s.sum - 60_000.0).abs() < 1e-6);
    }

    proptest! {
        #[test]
        fn matches_a_naive_count(values in proptest::collection::vec(0.0f64..10.0, 0..200)) {
            let h = Histogram::new(B);
            for v in &values {
                h.observe(*v);
            }
            let s = h.snapshot();
            for (bound, n) in &s.buckets {
                prop_assert_eq!(*n, values.iter().filter(|v| **v <= *bound).count() as u64);
            }
            prop_assert_eq!(s.count, values.len() as u64);
        }
    }
}
