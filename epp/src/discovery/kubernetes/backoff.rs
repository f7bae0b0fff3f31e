//! How long a failed watch waits before it lists again: exponential from [`MIN_DELAY`], capped
//! at the configured maximum (`--kube-max-backoff-ms`, 2 s by default, where kube-rs's default
//! grows to 30 s and left the EPP on a stale view for up to half a minute after the API server
//! came back), with jitter so that replicas do not retry in lockstep. Pure: the caller sleeps.

use std::time::Duration;

/// The first retry's nominal delay.
pub const MIN_DELAY: Duration = Duration::from_millis(100);

/// Capped exponential backoff with "equal jitter": each delay is uniform in
/// `[nominal / 2, nominal]`, and the nominal delay doubles up to the cap.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    nominal: Duration,
    rng: u64,
}

impl Backoff {
    /// Delays from `min` up to `max` (`max` is raised to `min` if lower); `seed` drives the
    /// jitter.
    pub fn new(min: Duration, max: Duration, seed: u64) -> Self {
        Self {
            min,
            max: max.max(min),
            nominal: min,
            rng: seed | 1,
        }
    }

    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        let nominal = self.nominal;
        self.nominal = (self.nominal * 2).min(self.max);
        // xorshift64: jitter needs no quality, only spread.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let half = nominal / 2;
        let spread = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
        let jitter = if spread == 0 { 0 } else { self.rng % spread };
        half + Duration::from_nanos(jitter)
    }

    /// Back to the first delay (after a successful list).
    pub fn reset(&mut self) {
        self.nominal = self.min;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Against the model: the nominal delay of attempt n is min·2ⁿ capped at max, and each
        /// delay lies in [nominal/2, nominal]; a reset starts over.
        #[test]
        fn delays_follow_the_capped_doubling(
            min_ms in 1u64..500,
            max_ms in 1u64..5000,
            seed in any::<u64>(),
            steps in prop::collection::vec(any::<bool>(), 1..40),
        ) {
            let (min, max) = (Duration::from_millis(min_ms), Duration::from_millis(max_ms));
            let mut b = Backoff::new(min, max, seed);
            let mut attempt = 0u32;
            for reset in steps {
                if reset {
                    b.reset();
                    attempt = 0;
                    continue;
                }
                let nominal = min
                    .checked_mul(2u32.saturating_pow(attempt.min(30)))
                    .unwrap_or(Duration::MAX)
                    .min(max.max(min));
                let d = b.next_delay();
                prop_assert!(d <= nominal && d >= nominal / 2, "{d:?} vs {nominal:?}");
                attempt += 1;
            }
        }
    }

    #[test]
    fn the_default_cap_retries_within_two_seconds() {
        let mut b = Backoff::new(MIN_DELAY, Duration::from_secs(2), 7);
        let delays: Vec<Duration> = (0..20).map(|_| b.next_delay()).collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_secs(2)));
        assert!(delays[0] <= MIN_DELAY);
        assert!(delays[19] >= Duration::from_secs(1), "the cap is reached");
    }
}
