//! The canary generation probe: a tiny completion request to the engine (one token, no stream)
//! that must come back with a generated token within a deadline. A single slow answer does not
//! flip readiness; `threshold` consecutive failures make the pod unready, one success makes it
//! ready again.

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt as _;

use super::readiness::Readiness;
use crate::proxy::upstream::Upstream;

/// The consecutive-failure counter behind the canary's verdict (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanaryTracker {
    threshold: u32,
    consecutive_failures: u32,
}

impl CanaryTracker {
    /// Healthy until `threshold` (≥ 1) failures in a row.
    pub fn new(threshold: u32) -> Self {
        Self {
            threshold: threshold.max(1),
            consecutive_failures: 0,
        }
    }

    /// Records one probe; returns whether the canary counts as healthy now.
    pub fn record(&mut self, ok: bool) -> bool {
        if ok {
            self.consecutive_failures = 0;
        } else {
            self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        }
        self.healthy()
    }

    /// Whether fewer than `threshold` failures happened in a row.
    pub fn healthy(&self) -> bool {
        self.consecutive_failures < self.threshold
    }
}

/// What the canary sends.
#[derive(Debug, Clone)]
pub struct CanaryConfig {
    /// The engine's authority.
    pub engine: String,
    /// The served model name.
    pub model: String,
    /// Between probes.
    pub interval: Duration,
    /// A token must come back within this.
    pub deadline: Duration,
    /// Consecutive failures that make the pod unready.
    pub threshold: u32,
}

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// No answer in time.
    #[error("no token within {0:?}")]
    Deadline(Duration),
    /// Transport failure.
    #[error("request failed: {0}")]
    Request(String),
    /// A non-200 answer.
    #[error("status {0}")]
    Status(StatusCode),
    /// 200 but no generated token.
    #[error("no generated token in the answer")]
    NoToken,
}

/// One probe.
pub async fn probe(client: &Upstream, config: &CanaryConfig) -> Result<(), ProbeError> {
    let body = serde_json::json!({
        "model": config.model,
        "prompt": "kvgate canary",
        "max_tokens": 1,
        "stream": false,
    })
    .to_string();
    let req = Request::post(format!("http://{}/v1/completions", config.engine))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .map_err(|e| ProbeError::Request(e.to_string()))?;
    let work = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| ProbeError::Request(e.to_string()))?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| ProbeError::Request(e.to_string()))?
            .to_bytes();
        if status != StatusCode::OK {
            return Err(ProbeError::Status(status));
        }
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|_| ProbeError::NoToken)?;
        let tokens = v
            .pointer("/usage/completion_tokens")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        if tokens == 0 {
            return Err(ProbeError::NoToken);
        }
        Ok(())
    };
    tokio::time::timeout(config.deadline, work)
        .await
        .unwrap_or(Err(ProbeError::Deadline(config.deadline)))
}

/// Probes every `interval`, feeding readiness. Runs until dropped.
pub async fn run(client: Upstream, config: CanaryConfig, readiness: Readiness) {
    let mut tracker = CanaryTracker::new(config.threshold);
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let result = probe(&client, &config).await;
        let was = tracker.healthy();
        if let Err(e) = &result {
            tracing::warn!(error = %e, "canary generation failed");
        }
        let now = tracker.record(result.is_ok());
        if was != now {
            tracing::warn!(healthy = now, "canary verdict changed");
        }
        readiness.set_canary_ok(now);
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

    proptest! {
        /// Against a naive model: healthy iff the last `threshold` results are not all failures
        /// (or fewer than `threshold` results exist).
        #[test]
        fn matches_naive_model(threshold in 0u32..6, results in prop::collection::vec(any::<bool>(), 0..40)) {
            let mut t = CanaryTracker::new(threshold);
            let k = threshold.max(1) as usize;
            for (i, &r) in results.iter().enumerate() {
                let got = t.record(r);
                let seen = &results[..=i];
                let want = seen.len() < k || seen[seen.len() - k..].iter().any(|&ok| ok);
                prop_assert_eq!(got, want);
            }
        }
    }
}
