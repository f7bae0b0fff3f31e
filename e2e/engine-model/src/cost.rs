//! The step-cost model: how long one engine step (one forward pass over the scheduled batch)
//! takes, as a roofline.
//!
//! ```text
//! compute = (flops_per_token × tokens + flops_per_sample × sampled
//!            + attention_flops_per_pair × attended) / flops_per_second
//! memory  = weight_bytes / weight_bandwidth + kv_bytes_per_token × context / kv_bandwidth
//! step    = step_overhead + max(compute, memory)          (0 for an empty batch)
//! ```
//! `tokens` are the batch's scheduled tokens, `sampled` the sequences that produce a token,
//! `attended` the (query, key) pairs of attention over each token's context and `context` the
//! KV-cache tokens each sequence touches (its cached context read plus its new tokens written).
//! Every coefficient is non-negative, so a step never gets faster when the batch grows.

use serde::{Deserialize, Serialize};

use crate::Nanos;

/// Constants of the roofline cost model. Rates are for the whole engine (all its GPUs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    /// Fixed time per step not covered by the roofline (scheduling, sampling, launches), ns.
    pub step_overhead_ns: u64,
    /// FLOPs per scheduled token in the linear layers: 2 × matmul parameters, `lm_head` apart.
    pub flops_per_token: f64,
    /// FLOPs per sampled token (`lm_head`, computed only for sampled positions): 2 × hidden ×
    /// vocabulary.
    pub flops_per_sample: f64,
    /// FLOPs per (query token, attended key) pair: `QKᵀ` and `PV`, 4 × layers × query heads ×
    /// head dim.
    pub attention_flops_per_pair: f64,
    /// Effective FLOP/s: peak dense tensor throughput × achieved utilisation.
    pub flops_per_second: f64,
    /// Weight bytes streamed from HBM each step (every layer plus `lm_head`; the embedding is a
    /// lookup and is not streamed).
    pub weight_bytes: f64,
    /// Effective HBM bytes/s when streaming weights.
    pub weight_bandwidth: f64,
    /// Effective HBM bytes/s for KV-cache reads and writes in attention (paged, scattered
    /// blocks: it can be well below the weight-streaming rate).
    pub kv_bandwidth: f64,
}

/// A cost model whose constants cannot produce a duration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CostError {
    /// A rate is zero, negative, infinite or NaN.
    #[error("cost model: {field} must be a positive finite number, got {value}")]
    BadRate {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// A coefficient is negative, infinite or NaN.
    #[error("cost model: {field} must be a non-negative finite number, got {value}")]
    BadCoefficient {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
}

impl CostError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::BadRate { .. } => "bad_rate",
            Self::BadCoefficient { .. } => "bad_coefficient",
        }
    }
}

/// What one step computed: the inputs of the cost model, also useful for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchShape {
    /// Sequences in the batch.
    pub num_seqs: u32,
    /// Sequences computing prompt (or recomputed) tokens: more than their last sampled token.
    pub num_prefill_seqs: u32,
    /// Sequences decoding: computing exactly their last sampled token.
    pub num_decode_seqs: u32,
    /// Tokens scheduled for prefill sequences.
    pub num_prefill_tokens: u64,
    /// Tokens scheduled for decode sequences (one each).
    pub num_decode_tokens: u64,
    /// Sequences that produce an output token this step (prefill complete, or decode).
    pub num_sampled: u32,
    /// (query token, key) pairs of attention: each new token attends to the sequence's cached
    /// context and to the new tokens up to itself.
    pub attended_tokens: u64,
    /// KV-cache tokens touched: per sequence, its cached context (read) plus its new tokens
    /// (written).
    pub context_tokens: u64,
}

impl BatchShape {
    /// Tokens scheduled in the step.
    pub fn num_tokens(&self) -> u64 {
        self.num_prefill_tokens + self.num_decode_tokens
    }

    /// Adds one sequence that has `cached` tokens of KV already and computes `new` more.
    pub fn add_seq(&mut self, cached: u64, new: u64, decode: bool, sampled: bool) {
        self.num_seqs += 1;
        if decode {
            self.num_decode_seqs += 1;
            self.num_decode_tokens += new;
        } else {
            self.num_prefill_seqs += 1;
            self.num_prefill_tokens += new;
        }
        if sampled {
            self.num_sampled += 1;
        }
        self.attended_tokens += new * cached + new * (new + 1) / 2;
        self.context_tokens += cached + new;
    }
}

/// A step's duration and its parts, in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepCost {
    /// The fixed overhead.
    pub overhead_ns: Nanos,
    /// The compute-bound time.
    pub compute_ns: Nanos,
    /// The memory-bound time.
    pub memory_ns: Nanos,
    /// `overhead + max(compute, memory)`; 0 for an empty batch.
    pub total_ns: Nanos,
}

impl CostModel {
    /// Checks that every rate is positive and every coefficient non-negative, all finite.
    pub fn validate(&self) -> Result<(), CostError> {
        for (field, value) in [
            ("flops_per_second", self.flops_per_second),
            ("weight_bandwidth", self.weight_bandwidth),
            ("kv_bandwidth", self.kv_bandwidth),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(CostError::BadRate { field, value });
            }
        }
        for (field, value) in [
            ("flops_per_token", self.flops_per_token),
            ("flops_per_sample", self.flops_per_sample),
            ("attention_flops_per_pair", self.attention_flops_per_pair),
            ("weight_bytes", self.weight_bytes),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(CostError::BadCoefficient { field, value });
            }
        }
        Ok(())
    }

    /// The cost of a step over `shape` with KV entries of `kv_bytes_per_token` bytes.
    pub fn step_cost(&self, shape: &BatchShape, kv_bytes_per_token: u64) -> StepCost {
        if shape.num_seqs == 0 {
            return StepCost::default();
        }
        let flops = self.flops_per_token * shape.num_tokens() as f64
            + self.flops_per_sample * f64::from(shape.num_sampled)
            + self.attention_flops_per_pair * shape.attended_tokens as f64;
        let compute = flops / self.flops_per_second;
        let kv_bytes = kv_bytes_per_token as f64 * shape.context_tokens as f64;
        let memory = self.weight_bytes / self.weight_bandwidth + kv_bytes / self.kv_bandwidth;
        let compute_ns = seconds_to_nanos(compute);
        let memory_ns = seconds_to_nanos(memory);
        StepCost {
            overhead_ns: self.step_overhead_ns,
            compute_ns,
            memory_ns,
            total_ns: self
                .step_overhead_ns
                .saturating_add(compute_ns.max(memory_ns)),
        }
    }

    /// The duration of a step over `shape`.
    pub fn duration(&self, shape: &BatchShape, kv_bytes_per_token: u64) -> Nanos {
        self.step_cost(shape, kv_bytes_per_token).total_ns
    }
}

/// Seconds to whole nanoseconds, rounded up (saturating; non-finite or negative → 0 or max).
fn seconds_to_nanos(s: f64) -> Nanos {
    // `as` saturates at the bounds and maps NaN to 0, which is what a duration wants.
    (s * 1e9).ceil() as Nanos
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        CostModel {
            step_overhead_ns: 1_000,
            flops_per_token: 1e9,
            flops_per_sample: 1e8,
            attention_flops_per_pair: 1e3,
            flops_per_second: 1e12,
            weight_bytes: 1e9,
            weight_bandwidth: 1e12,
            kv_bandwidth: 5e11,
        }
    }

    #[test]
    fn shape_counts_attention_pairs_and_context() {
        let mut s = BatchShape::default();
        s.add_seq(10, 4, false, true); // 4 new tokens after 10 cached: 40 + 10 pairs
        s.add_seq(99, 1, true, true);
        assert_eq!(s.attended_tokens, 50 + 100);
        assert_eq!(s.context_tokens, 14 + 100);
        assert_eq!((s.num_prefill_tokens, s.num_decode_tokens), (4, 1));
        assert_eq!((s.num_seqs, s.num_sampled), (2, 2));
    }

    #[test]
    fn roofline_takes_the_larger_side() {
        let m = model();
        let mut decode = BatchShape::default();
        decode.add_seq(0, 1, true, true);
        let c = m.step_cost(&decode, 100);
        // Memory: 1 ms of weights + 100 B / 5e11 B/s; compute: 1.1e9 + 1e3 FLOPs / 1e12.
        assert_eq!(c.memory_ns, 1_000_001);
        assert_eq!(c.compute_ns, 1_100_001);
        assert_eq!(c.total_ns, 1_000 + 1_100_001);
        assert_eq!(m.duration(&BatchShape::default(), 100), 0);
    }

    #[test]
    fn validate_rejects_zero_rates_and_negative_coefficients() {
        let mut m = model();
        m.kv_bandwidth = 0.0;
        assert_eq!(m.validate().unwrap_err().metric_label(), "bad_rate");
        let mut m = model();
        m.weight_bytes = -1.0;
        assert_eq!(m.validate().unwrap_err().metric_label(), "bad_coefficient");
        let mut m = model();
        m.flops_per_second = f64::NAN;
        assert!(m.validate().is_err());
        assert!(model().validate().is_ok());
    }
}
