//! The prefill leg's retry policy, pure: which failures are retried (502, 503, 504, connection
//! errors and timeouts — llm-d's set plus connect errors), how many attempts in all, and the
//! exponential backoff between them.

use std::time::Duration;

use axum::http::StatusCode;

/// Why one prefill attempt failed (a bounded metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failure {
    /// TCP connect refused or failed.
    Connect,
    /// No response head within the per-attempt timeout.
    Timeout,
    /// The connection broke after it was made.
    Io,
    /// 502 Bad Gateway.
    Status502,
    /// 503 Service Unavailable.
    Status503,
    /// 504 Gateway Timeout.
    Status504,
    /// Any other non-success status (not retried).
    StatusOther,
    /// A 2xx whose body has no usable `kv_transfer_params` (not retried).
    BadResponse,
}

impl Failure {
    /// Every variant, for metric exposition.
    pub const ALL: [Self; 8] = [
        Self::Connect,
        Self::Timeout,
        Self::Io,
        Self::Status502,
        Self::Status503,
        Self::Status504,
        Self::StatusOther,
        Self::BadResponse,
    ];

    /// The failure a response status is, if it is one.
    pub fn from_status(status: StatusCode) -> Option<Self> {
        match status.as_u16() {
            200..=299 => None,
            502 => Some(Self::Status502),
            503 => Some(Self::Status503),
            504 => Some(Self::Status504),
            _ => Some(Self::StatusOther),
        }
    }

    /// Whether another attempt may help.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Self::Connect
                | Self::Timeout
                | Self::Io
                | Self::Status502
                | Self::Status503
                | Self::Status504
        )
    }

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Timeout => "timeout",
            Self::Io => "io",
            Self::Status502 => "status_502",
            Self::Status503 => "status_503",
            Self::Status504 => "status_504",
            Self::StatusOther => "status_other",
            Self::BadResponse => "bad_response",
        }
    }

    /// The index of this variant in [`Failure::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// How the prefill leg retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all (at least 1).
    pub max_attempts: u32,
    /// Delay before the second attempt; doubles after each further failure.
    pub backoff: Duration,
    /// Upper bound on one delay.
    pub max_backoff: Duration,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Try again after this delay.
    RetryAfter(Duration),
    /// Stop: the failure is final.
    GiveUp,
}

/// The retry state of one prefill leg.
#[derive(Debug, Clone)]
pub struct Retrier {
    policy: RetryPolicy,
    attempts: u32,
}

impl Retrier {
    /// A leg that has made no attempt yet.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            attempts: 0,
        }
    }

    /// Records that an attempt starts; returns its 1-based number.
    pub fn start_attempt(&mut self) -> u32 {
        self.attempts = self.attempts.saturating_add(1);
        self.attempts
    }

    /// Attempts started so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Decides after the current attempt failed.
    pub fn after_failure(&self, failure: Failure) -> Step {
        if !failure.retryable() || self.attempts >= self.policy.max_attempts.max(1) {
            return Step::GiveUp;
        }
        let doublings = self.attempts.saturating_sub(1).min(30);
        let delay = self
            .policy
            .backoff
            .saturating_mul(1u32 << doublings)
            .min(self.policy.max_backoff);
        Step::RetryAfter(delay)
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
    use proptest::prelude::*;

    fn policy(max_attempts: u32, backoff_ms: u64, max_ms: u64) -> RetryPolicy {
        RetryPolicy {
            max_attempts,
            backoff: Duration::from_millis(backoff_ms),
            max_backoff: Duration::from_millis(max_ms),
        }
    }

    #[test]
    fn statuses_classify() {
        assert_eq!(Failure::from_status(StatusCode::OK), None);
        assert_eq!(
            Failure::from_status(StatusCode::SERVICE_UNAVAILABLE),
            Some(Failure::Status503)
        );
        assert_eq!(
            Failure::from_status(StatusCode::BAD_REQUEST),
            Some(Failure::StatusOther)
        );
        assert!(!Failure::StatusOther.retryable());
        for (i, f) in Failure::ALL.iter().enumerate() {
            assert_eq!(f.index(), i);
        }
    }

    #[test]
    fn backoff_doubles_then_caps() {
        let mut r = Retrier::new(policy(5, 10, 25));
        let mut delays = Vec::new();
        loop {
            r.start_attempt();
            match r.after_failure(Failure::Status503) {
                Step::RetryAfter(d) => delays.push(d.as_millis()),
                Step::GiveUp => break,
            }
        }
        assert_eq!(delays, vec![10, 20, 25, 25]);
        assert_eq!(r.attempts(), 5);
    }

    fn arb_failure() -> impl Strategy<Value = Failure> {
        prop::sample::select(Failure::ALL.to_vec())
    }

    proptest! {
        /// Against a naive model: attempts stop at the first final failure or at max_attempts,
        /// and each delay is min(backoff·2^(n−1), cap) for the n-th retry.
        #[test]
        fn matches_naive_model(
            max_attempts in 0u32..8,
            backoff in 0u64..1000,
            cap in 0u64..5000,
            failures in prop::collection::vec(arb_failure(), 1..12),
        ) {
            let p = policy(max_attempts, backoff, cap);
            let mut r = Retrier::new(p);
            let mut real = Vec::new();
            for f in &failures {
                r.start_attempt();
                let step = r.after_failure(*f);
                real.push(step);
                if step == Step::GiveUp { break; }
            }
            let mut model = Vec::new();
            let limit = max_attempts.max(1) as usize;
            for (i, f) in failures.iter().enumerate() {
                let n = i + 1;
                let retry = matches!(f, Failure::Connect | Failure::Timeout | Failure::Io
                    | Failure::Status502 | Failure::Status503 | Failure::Status504);
                if !retry || n >= limit {
                    model.push(Step::GiveUp);
                    break;
                }
                let d = (backoff as u128 * (1u128 << (n - 1))).min(cap as u128);
                model.push(Step::RetryAfter(Duration::from_millis(d as u64)));
            }
            prop_assert_eq!(real, model);
            prop_assert!(r.attempts() as usize <= limit);
        }
    }
}
