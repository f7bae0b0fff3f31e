//! A byte budget for background work: a token bucket, pure (the caller passes the time).
//!
//! The bucket holds up to one second of budget and starts full. A job is admitted when the
//! bucket is not in debt, and its whole size is charged, so one large job may overdraw it; the
//! debt is repaid at the configured rate before the next job is admitted. Over any interval of
//! `t` seconds the bytes admitted are therefore at most `rate × (1 + t)` plus the largest job.

/// Fixed-point scale: bucket levels are bytes × 10⁹ (byte-nanoseconds per second), so a refill
/// over whole nanoseconds is exact.
const SCALE: i128 = 1_000_000_000;

/// A byte budget refilled at a fixed rate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ByteBudget {
    /// Bytes per second.
    rate: u64,
    /// Most the bucket holds, scaled (one second of budget).
    cap: i128,
    /// Current level, scaled; negative while in debt.
    level: i128,
    /// When the level was last brought up to date, in nanoseconds on the caller's clock.
    last_ns: u64,
}

impl ByteBudget {
    /// A full bucket refilled at `bytes_per_second`, whose clock starts at `now_ns`.
    pub fn new(bytes_per_second: u64, now_ns: u64) -> Self {
        let cap = i128::from(bytes_per_second) * SCALE;
        Self {
            rate: bytes_per_second,
            cap,
            level: cap,
            last_ns: now_ns,
        }
    }

    /// Admits a job of `bytes` at `now_ns` (charging it) unless the bucket is in debt. A clock
    /// that goes backwards refills nothing.
    pub fn try_take(&mut self, now_ns: u64, bytes: u64) -> bool {
        if now_ns > self.last_ns {
            let elapsed = i128::from(now_ns - self.last_ns);
            self.level = self
                .level
                .saturating_add(i128::from(self.rate).saturating_mul(elapsed))
                .min(self.cap);
            self.last_ns = now_ns;
        }
        if self.level < 0 {
            return false;
        }
        self.level = self
            .level
            .saturating_sub(i128::from(bytes).saturating_mul(SCALE));
        true
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use proptest::prelude::*;

    /// The bucket in closed form: the level just before a call at `t` is the least, over every
    /// earlier instant `s` where the bucket could have been full (the start and each earlier
    /// call), of `cap + rate·(t − s) − (bytes admitted at or after s)`. Admit when it is ≥ 0.
    fn naive(rate: u64, calls: &[(u64, u64)]) -> Vec<bool> {
        let cap = i128::from(rate) * SCALE;
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        let mut out = Vec::new();
        let mut starts = vec![0u64];
        for &(t, bytes) in calls {
            let level = starts
                .iter()
                .filter(|&&s| s <= t)
                .map(|&s| {
                    let charged: i128 = admitted
                        .iter()
                        .filter(|(at, _)| *at >= s)
                        .map(|(_, b)| i128::from(*b) * SCALE)
                        .sum();
                    cap + i128::from(rate) * i128::from(t - s) - charged
                })
                .min()
                .unwrap();
            let ok = level >= 0;
            if ok {
                admitted.push((t, bytes));
            }
            out.push(ok);
            starts.push(t);
        }
        out
    }

    /// Calls at non-decreasing times (gaps up to 2 s), jobs up to 4 MB, rates up to 1 MB/s.
    fn calls() -> impl Strategy<Value = (u64, Vec<(u64, u64)>)> {
        (
            1u64..1_000_000,
            prop::collection::vec((0u64..2_000_000_000, 0u64..4_000_000), 0..40),
        )
            .prop_map(|(rate, gaps)| {
                let mut t = 0;
                let calls = gaps
                    .into_iter()
                    .map(|(gap, bytes)| {
                        t += gap;
                        (t, bytes)
                    })
                    .collect();
                (rate, calls)
            })
    }

    proptest! {
        #[test]
        fn admits_exactly_what_the_closed_form_admits((rate, calls) in calls()) {
            let mut b = ByteBudget::new(rate, 0);
            let got: Vec<bool> = calls.iter().map(|&(t, n)| b.try_take(t, n)).collect();
            prop_assert_eq!(got, naive(rate, &calls));
        }

        #[test]
        fn admitted_bytes_stay_within_the_rate_plus_one_second_and_one_job((rate, calls) in calls()) {
            let mut b = ByteBudget::new(rate, 0);
            let mut total: u128 = 0;
            let mut largest: u128 = 0;
            for &(t, n) in &calls {
                if b.try_take(t, n) {
                    total += u128::from(n);
                    largest = largest.max(u128::from(n));
                }
                let allowed = u128::from(rate) * (1_000_000_000 + u128::from(t)) / 1_000_000_000;
                prop_assert!(total <= allowed + largest);
            }
        }
    }

    #[test]
    fn debt_is_repaid_at_the_rate() {
        let mut b = ByteBudget::new(1000, 0);
        assert!(
            b.try_take(0, 3000),
            "a full bucket admits even an overdraft"
        );
        // 2000 bytes of debt: refused until 2 s later.
        assert!(!b.try_take(1_999_999_999, 1));
        assert!(b.try_take(2_000_000_000, 1));
    }

    #[test]
    fn a_clock_going_back_refills_nothing() {
        let mut b = ByteBudget::new(1000, 5_000_000_000);
        assert!(b.try_take(5_000_000_000, 1001));
        assert!(!b.try_take(0, 1));
        assert!(!b.try_take(5_000_000_000, 1));
    }
}
