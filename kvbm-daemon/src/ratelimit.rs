//! A connection's offload budget: a token bucket of bytes (pure; the caller passes the clock).
//!
//! One connector that offloads at full rate evicts every other connector's blocks in LRU order.
//! With `--connector-offload-bytes-per-s`, each connection may store at most that many bytes
//! per second, in bursts of up to one second's worth (or one block, if larger): the blocks of
//! an offload past its budget are not read and count as `skipped`.

use std::time::{Duration, Instant};

/// Bytes a connection may offload, refilled at `rate` per second up to `capacity`.
#[derive(Debug, Clone)]
pub struct ByteBucket {
    rate: u64,
    capacity: u64,
    level: u64,
    /// When `level` was last brought up to date, minus the time worth of any part byte.
    last: Instant,
}

impl ByteBucket {
    /// A full bucket of `rate` bytes per second, holding at least `block_bytes`.
    pub fn new(rate: u64, block_bytes: u64, now: Instant) -> Self {
        let capacity = rate.max(block_bytes).max(1);
        Self {
            rate: rate.max(1),
            capacity,
            level: capacity,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last);
        let earned = elapsed.as_nanos() * u128::from(self.rate) / 1_000_000_000;
        if earned == 0 {
            return;
        }
        let room = u128::from(self.capacity - self.level);
        if earned >= room {
            self.level = self.capacity;
            self.last = now;
        } else {
            // `earned < room <= u64::MAX`; keep the time worth of the part byte not yet earned.
            self.level += u64::try_from(earned).unwrap_or(u64::MAX);
            let spent_nanos = earned * 1_000_000_000 / u128::from(self.rate);
            self.last += Duration::from_nanos(u64::try_from(spent_nanos).unwrap_or(u64::MAX));
        }
    }

    /// How many of `blocks` leading blocks of `block_bytes` may be stored now; takes their bytes.
    pub fn grant(&mut self, now: Instant, blocks: usize, block_bytes: u64) -> usize {
        self.refill(now);
        let fit = self.level / block_bytes.max(1);
        let n = usize::try_from(fit).unwrap_or(usize::MAX).min(blocks);
        self.level -= n as u64 * block_bytes.max(1);
        n
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::indexing_slicing,
        clippy::cast_possible_truncation
    )]
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_full_bucket_grants_a_seconds_worth_then_refills_at_the_rate() {
        let t0 = Instant::now();
        let mut b = ByteBucket::new(4000, 1000, t0);
        assert_eq!(b.grant(t0, 10, 1000), 4);
        assert_eq!(b.grant(t0, 10, 1000), 0);
        assert_eq!(b.grant(t0 + Duration::from_millis(499), 10, 1000), 1);
        assert_eq!(b.grant(t0 + Duration::from_millis(500), 10, 1000), 1);
        assert_eq!(
            b.grant(t0 + Duration::from_secs(60), 10, 1000),
            4,
            "capped at capacity"
        );
    }

    #[test]
    fn a_block_larger_than_the_rate_still_passes_once_a_block_is_earned() {
        let t0 = Instant::now();
        let mut b = ByteBucket::new(100, 1000, t0);
        assert_eq!(b.grant(t0, 3, 1000), 1);
        assert_eq!(b.grant(t0 + Duration::from_secs(9), 3, 1000), 0);
        assert_eq!(b.grant(t0 + Duration::from_secs(10), 3, 1000), 1);
    }

    proptest! {
        /// Against a naive bucket advanced one millisecond at a time (the rate a multiple of
        /// 1,000 bytes per second, so each millisecond earns whole bytes): the same grants.
        #[test]
        fn grants_equal_a_naive_millisecond_bucket(
            rate_k in 1u64..50,
            block in 1u64..5000,
            steps in proptest::collection::vec((0u64..1500, 0usize..20), 1..60),
        ) {
            let rate = rate_k * 1000;
            let t0 = Instant::now();
            let mut b = ByteBucket::new(rate, block, t0);
            let capacity = rate.max(block);
            let (mut level, mut ms) = (capacity, 0u64);
            for (dt, want) in steps {
                for _ in 0..dt {
                    level = (level + rate / 1000).min(capacity);
                }
                ms += dt;
                let naive = ((level / block) as usize).min(want);
                level -= naive as u64 * block;
                prop_assert_eq!(b.grant(t0 + Duration::from_millis(ms), want, block), naive);
            }
        }
    }
}
