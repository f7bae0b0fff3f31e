//! Engine-reported load: the latest sample per endpoint (scraped from the engine's metrics or
//! received on `kvgate.load.…`), ignored once older than the configured age.

use std::collections::HashMap;
use std::sync::{PoisonError, RwLock, RwLockReadGuard};

use kv_index::{EndpointId, Millis};

/// One load sample from an engine.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineLoad {
    /// Requests queued in the engine, not yet scheduled (vLLM `num_requests_waiting`).
    pub waiting: u32,
    /// Requests the engine is running (vLLM `num_requests_running`).
    pub running: u32,
    /// Fraction of the engine's KV cache in use, 0..=1 (vLLM `kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// When the sample was taken or received, on the EPP's monotonic clock.
    pub at: Millis,
}

impl EngineLoad {
    /// The sample with `kv_usage` forced into 0..=1 (NaN counts as 0).
    fn sanitized(mut self) -> Self {
        self.kv_usage = if self.kv_usage.is_nan() {
            0.0
        } else {
            self.kv_usage.clamp(0.0, 1.0)
        };
        self
    }

    /// Whether the sample is at most `max_age` old at `now` (a sample from the future is fresh).
    pub const fn is_fresh(&self, now: Millis, max_age: Millis) -> bool {
        now.0.saturating_sub(self.at.0) <= max_age.0
    }
}

/// The latest engine sample per endpoint, shared between the ingestion side (writes) and
/// scheduling decisions (reads, one lock hold per decision).
#[derive(Debug, Default)]
pub struct LoadBook {
    samples: RwLock<HashMap<EndpointId, EngineLoad>>,
}

impl LoadBook {
    /// An empty book.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> RwLockReadGuard<'_, HashMap<EndpointId, EngineLoad>> {
        self.samples.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `sample` for `endpoint` unless a newer one is already kept (samples may arrive
    /// out of order). `kv_usage` is clamped to 0..=1.
    pub fn record(&self, endpoint: EndpointId, sample: EngineLoad) {
        let sample = sample.sanitized();
        let mut samples = self.samples.write().unwrap_or_else(PoisonError::into_inner);
        let slot = samples.entry(endpoint).or_insert(sample);
        if sample.at >= slot.at {
            *slot = sample;
        }
    }

    /// Forgets `endpoint` (it left the pool).
    pub fn remove(&self, endpoint: EndpointId) {
        self.samples
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&endpoint);
    }

    /// `endpoint`'s latest sample if it is at most `max_age` old at `now`.
    pub fn fresh(&self, endpoint: EndpointId, now: Millis, max_age: Millis) -> Option<EngineLoad> {
        self.read()
            .get(&endpoint)
            .copied()
            .filter(|s| s.is_fresh(now, max_age))
    }

    /// Appends [`LoadBook::fresh`] of each of `endpoints` (in order) to `out`, under one lock
    /// hold.
    pub fn fresh_into(
        &self,
        endpoints: &[EndpointId],
        now: Millis,
        max_age: Millis,
        out: &mut Vec<Option<EngineLoad>>,
    ) {
        let samples = self.read();
        out.extend(
            endpoints
                .iter()
                .map(|e| samples.get(e).copied().filter(|s| s.is_fresh(now, max_age))),
        );
    }

    /// Endpoints with a sample, fresh or not.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether no endpoint has a sample.
    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(i: u32) -> EndpointId {
        EndpointId::new(i).unwrap()
    }

    fn sample(waiting: u32, at: u64) -> EngineLoad {
        EngineLoad {
            waiting,
            running: 1,
            kv_usage: 0.5,
            at: Millis(at),
        }
    }

    #[test]
    fn stale_samples_are_ignored() {
        let book = LoadBook::new();
        book.record(ep(1), sample(3, 1_000));
        let age = Millis(500);
        assert_eq!(
            book.fresh(ep(1), Millis(1_500), age).map(|s| s.waiting),
            Some(3)
        );
        assert_eq!(book.fresh(ep(1), Millis(1_501), age), None);
        // A sample stamped after `now` (another thread's clock read) counts as fresh.
        assert!(book.fresh(ep(1), Millis(900), age).is_some());
        assert_eq!(book.fresh(ep(2), Millis(1_000), age), None);
    }

    #[test]
    fn an_older_sample_does_not_replace_a_newer_one() {
        let book = LoadBook::new();
        book.record(ep(0), sample(5, 2_000));
        book.record(ep(0), sample(9, 1_000));
        assert_eq!(
            book.fresh(ep(0), Millis(2_000), Millis(10))
                .unwrap()
                .waiting,
            5
        );
        book.record(ep(0), sample(7, 2_000));
        assert_eq!(
            book.fresh(ep(0), Millis(2_000), Millis(10))
                .unwrap()
                .waiting,
            7
        );
        book.remove(ep(0));
        assert!(book.is_empty());
    }

    #[test]
    fn kv_usage_is_clamped() {
        let book = LoadBook::new();
        let mut s = sample(0, 0);
        s.kv_usage = 3.0;
        book.record(ep(0), s);
        s.kv_usage = f64::NAN;
        book.record(ep(1), s);
        let mut out = Vec::new();
        book.fresh_into(&[ep(0), ep(1), ep(2)], Millis(0), Millis(1), &mut out);
        assert_eq!(out[0].unwrap().kv_usage, 1.0);
        assert_eq!(out[1].unwrap().kv_usage, 0.0);
        assert_eq!(out[2], None);
        assert_eq!(book.len(), 2);
    }
}
