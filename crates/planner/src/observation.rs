//! What the planner observes each interval, and the load it predicts.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::Role;

/// The pool's load and latency over the last interval, as the operator reads them from the
/// EPP's metrics (or Prometheus).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metrics {
    /// Requests per second.
    pub rps: f64,
    /// Mean prompt length, tokens.
    pub isl_tokens: f64,
    /// Mean output length, tokens.
    pub osl_tokens: f64,
    /// TTFT at the SLO's percentile, milliseconds (`None`: no request finished its first
    /// token in the interval).
    pub ttft_ms: Option<f64>,
    /// Inter-token latency at the SLO's percentile, milliseconds.
    pub itl_ms: Option<f64>,
    /// Mean requests waiting per engine (informational; no mode reads it yet).
    pub queue_depth: Option<f64>,
    /// Requests on the decode role's ready engines, running or waiting, at the end of the
    /// interval (a disaggregated pool; `None`: unknown). Unlike the output length, which shows
    /// only as requests complete, it grows as soon as longer answers start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_requests: Option<f64>,
}

impl Metrics {
    /// Whether every figure is a finite, non-negative number and a non-zero request rate
    /// comes with non-zero lengths. Zero requests per second is a valid (idle) interval.
    pub fn is_valid(&self) -> bool {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        ok(self.rps)
            && ok(self.isl_tokens)
            && ok(self.osl_tokens)
            && [
                self.ttft_ms,
                self.itl_ms,
                self.queue_depth,
                self.decode_requests,
            ]
            .into_iter()
            .flatten()
            .all(ok)
            && (self.rps == 0.0 || (self.isl_tokens > 0.0 && self.osl_tokens > 0.0))
    }

    /// The load the interval observed: its request rate and mean lengths.
    pub fn load(&self) -> Load {
        Load {
            rps: self.rps,
            isl_tokens: self.isl_tokens,
            osl_tokens: self.osl_tokens,
        }
    }
}

/// One interval's observation.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Observation {
    /// Seconds on any monotonic clock (the operator's wall clock, a replay's virtual time).
    pub at_s: f64,
    /// The interval's metrics; `None` when they could not be read.
    pub metrics: Option<Metrics>,
    /// Each role's replicas now (its `/scale` `spec.replicas`).
    pub replicas: BTreeMap<Role, u32>,
    /// Each role's replicas serving (ready); a role missing here counts all its replicas.
    /// Loads per replica divide by these, so replicas still starting do not read as idle.
    #[serde(default)]
    pub ready: BTreeMap<Role, u32>,
}

/// A load: request rate and mean lengths.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Load {
    /// Requests per second.
    pub rps: f64,
    /// Mean prompt length, tokens.
    pub isl_tokens: f64,
    /// Mean output length, tokens.
    pub osl_tokens: f64,
}

impl Load {
    /// Prompt tokens per second.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.rps * self.isl_tokens
    }

    /// Output tokens per second.
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.rps * self.osl_tokens
    }

    /// The mean context of a decoding sequence: the prompt and half the output.
    pub fn decode_context(&self) -> f64 {
        self.isl_tokens + self.osl_tokens / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_validity() {
        let m = Metrics {
            rps: 2.0,
            isl_tokens: 1000.0,
            osl_tokens: 100.0,
            ttft_ms: Some(300.0),
            itl_ms: None,
            queue_depth: Some(0.0),
            decode_requests: None,
        };
        assert!(m.is_valid());
        let idle = Metrics {
            rps: 0.0,
            isl_tokens: 0.0,
            osl_tokens: 0.0,
            ..m
        };
        assert!(idle.is_valid());
        for bad in [
            Metrics { rps: f64::NAN, ..m },
            Metrics { rps: -1.0, ..m },
            Metrics {
                isl_tokens: 0.0,
                ..m
            },
            Metrics {
                ttft_ms: Some(f64::INFINITY),
                ..m
            },
            Metrics {
                queue_depth: Some(-2.0),
                ..m
            },
        ] {
            assert!(!bad.is_valid(), "{bad:?}");
        }
        let load = Load {
            rps: 2.0,
            isl_tokens: 1000.0,
            osl_tokens: 100.0,
        };
        assert_eq!(load.prefill_tokens_per_s(), 2000.0);
        assert_eq!(load.decode_tokens_per_s(), 200.0);
        assert_eq!(load.decode_context(), 1050.0);
    }
}
