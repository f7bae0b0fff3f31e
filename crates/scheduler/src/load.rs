//! Engine-reported load: the latest sample per endpoint (scraped from the engine's metrics or
//! received on `kvgate.load.…`), ignored once older than the configured age.
//!
//! A sample is a picture of the past: a request that was running when it was taken may have
//! finished since. The book counts the completions the EPP observes on each endpoint after its
//! latest sample ([`LoadBook::note_finished`]) and reads the sample with that many fewer
//! requests (running first, then waiting), so a sample taken during the previous request does
//! not make a nearly idle endpoint look busy until the next one arrives (without this, bounded
//! load sent back-to-back requests of one conversation away from the pod holding its prefix).

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

    /// The sample with `finished` of its requests gone: running first, then waiting.
    #[must_use]
    pub const fn without_finished(mut self, finished: u32) -> Self {
        let from_running = if finished < self.running {
            finished
        } else {
            self.running
        };
        self.running -= from_running;
        self.waiting = self.waiting.saturating_sub(finished - from_running);
        self
    }
}

/// An endpoint's latest sample and the completions seen since it was recorded.
#[derive(Debug, Clone, Copy)]
struct Slot {
    sample: EngineLoad,
    finished_since: u32,
}

impl Slot {
    fn current(&self, now: Millis, max_age: Millis) -> Option<EngineLoad> {
        self.sample
            .is_fresh(now, max_age)
            .then(|| self.sample.without_finished(self.finished_since))
    }
}

/// The latest engine sample per endpoint, shared between the ingestion side (writes) and
/// scheduling decisions (reads, one lock hold per decision).
#[derive(Debug, Default)]
pub struct LoadBook {
    samples: RwLock<HashMap<EndpointId, Slot>>,
}

impl LoadBook {
    /// An empty book.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> RwLockReadGuard<'_, HashMap<EndpointId, Slot>> {
        self.samples.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `sample` for `endpoint` unless a newer one is already kept (samples may arrive
    /// out of order); a recorded sample starts a new count of completions. `kv_usage` is
    /// clamped to 0..=1.
    pub fn record(&self, endpoint: EndpointId, sample: EngineLoad) {
        let sample = sample.sanitized();
        let fresh = Slot {
            sample,
            finished_since: 0,
        };
        let mut samples = self.samples.write().unwrap_or_else(PoisonError::into_inner);
        let slot = samples.entry(endpoint).or_insert(fresh);
        if sample.at >= slot.sample.at {
            *slot = fresh;
        }
    }

    /// The EPP saw a request on `endpoint` finish: its latest sample reads one request fewer
    /// until the next sample is recorded. Nothing happens for an endpoint without a sample.
    pub fn note_finished(&self, endpoint: EndpointId) {
        let mut samples = self.samples.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = samples.get_mut(&endpoint) {
            slot.finished_since = slot.finished_since.saturating_add(1);
        }
    }

    /// Forgets `endpoint` (it left the pool).
    pub fn remove(&self, endpoint: EndpointId) {
        self.samples
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&endpoint);
    }

    /// `endpoint`'s latest sample if it is at most `max_age` old at `now`, less the requests
    /// seen finishing since it was recorded.
    pub fn fresh(&self, endpoint: EndpointId, now: Millis, max_age: Millis) -> Option<EngineLoad> {
        self.read()
            .get(&endpoint)
            .and_then(|s| s.current(now, max_age))
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
                .map(|e| samples.get(e).and_then(|s| s.current(now, max_age))),
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
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn completions_after_a_sample_lower_it_until_the_next_sample() {
        let book = LoadBook::new();
        let age = Millis(1_000);
        book.note_finished(ep(1));
        assert!(
            book.fresh(ep(1), Millis(0), age).is_none(),
            "no sample, nothing to lower"
        );
        book.record(
            ep(1),
            EngineLoad {
                waiting: 1,
                running: 1,
                kv_usage: 0.1,
                at: Millis(10),
            },
        );
        book.note_finished(ep(1));
        let s = book.fresh(ep(1), Millis(20), age).unwrap();
        assert_eq!((s.running, s.waiting), (0, 1), "running first");
        book.note_finished(ep(1));
        book.note_finished(ep(1));
        let s = book.fresh(ep(1), Millis(20), age).unwrap();
        assert_eq!((s.running, s.waiting), (0, 0), "never below zero");
        book.record(ep(1), sample(2, 30));
        let s = book.fresh(ep(1), Millis(40), age).unwrap();
        assert_eq!((s.running, s.waiting), (1, 2), "a new sample starts over");
    }

    proptest! {
        /// Against a model: the read is the last recorded sample's running + waiting minus the
        /// completions noted after it, floored at zero; older samples arriving late are ignored.
        #[test]
        fn reads_match_a_model(ops in proptest::collection::vec((any::<bool>(), 0u32..4, 0u32..4, 0u64..20), 0..60)) {
            let book = LoadBook::new();
            let mut model: Option<(u64, u32, u32, u32)> = None; // at, running, waiting, finished
            for (is_record, running, waiting, at) in ops {
                if is_record {
                    book.record(ep(1), EngineLoad { waiting, running, kv_usage: 0.0, at: Millis(at) });
                    if model.is_none_or(|(last, ..)| at >= last) {
                        model = Some((at, running, waiting, 0));
                    }
                } else {
                    book.note_finished(ep(1));
                    if let Some(m) = &mut model {
                        m.3 += 1;
                    }
                }
                let got = book.fresh(ep(1), Millis(0), Millis(u64::MAX)).map(|s| (s.running, s.waiting));
                let want = model.map(|(_, r, w, f)| {
                    let r2 = r.saturating_sub(f);
                    (r2, w.saturating_sub(f - (r - r2)))
                });
                prop_assert_eq!(got, want);
            }
        }
    }

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
