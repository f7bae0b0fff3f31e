//! Endpoint health from the load scrapes. An endpoint whose `/metrics` cannot be read
//! [`HealthConfig::fail_after`] times in a row (connection refused, a timeout, a 5xx from the
//! sidecar in front of a dead engine) is out of rotation until a scrape succeeds again. The
//! scraper polls every endpoint each 200 ms, so a dead engine stops being picked within about
//! a second instead of waiting for discovery to notice (a pod's readiness, a file's update).
//!
//! Out of rotation means "not ready" for the scheduler, unless every ready endpoint is down:
//! then the scrapes themselves are the likelier fault (a network policy, the metrics port), and
//! routing carries on as if all were healthy. The state machine is pure ([`Tracker`]); the
//! [`HealthBook`] shares it between the scraper (writes) and the picker (reads).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use kv_index::EndpointId;
use scheduler::Endpoint;

/// When an endpoint is taken out of rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Consecutive failed scrapes that take an endpoint out (0 disables health tracking).
    pub fail_after: u32,
}

impl Default for HealthConfig {
    /// Three failures: about 0.6 s at the default scrape interval.
    fn default() -> Self {
        Self { fail_after: 3 }
    }
}

/// A change of an endpoint's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Out of rotation.
    Down,
    /// Back in rotation.
    Up,
}

/// One endpoint's health: consecutive failures, and whether it is out of rotation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tracker {
    failures: u32,
    down: bool,
}

impl Tracker {
    /// Takes one scrape's outcome; returns the transition it caused.
    pub fn observe(&mut self, ok: bool, fail_after: u32) -> Option<Transition> {
        if ok {
            self.failures = 0;
            return std::mem::take(&mut self.down).then_some(Transition::Up);
        }
        self.failures = self.failures.saturating_add(1);
        if !self.down && fail_after > 0 && self.failures >= fail_after {
            self.down = true;
            return Some(Transition::Down);
        }
        None
    }

    /// Whether the endpoint is out of rotation.
    pub fn is_down(&self) -> bool {
        self.down
    }
}

#[derive(Debug, Default)]
struct State {
    trackers: HashMap<EndpointId, Tracker>,
    down: HashSet<EndpointId>,
}

/// Every endpoint's [`Tracker`], shared.
#[derive(Debug, Default)]
pub struct HealthBook {
    config: HealthConfig,
    state: RwLock<State>,
    /// `state.down.len()`, read without the lock on every routing decision.
    down: AtomicUsize,
    /// Endpoints taken out of rotation, ever.
    marked_down: AtomicU64,
}

impl HealthBook {
    /// A book taking endpoints out after `config.fail_after` failures.
    pub fn new(config: HealthConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// Records one scrape of `endpoint` (at `addr`, for the log).
    pub fn observe(&self, endpoint: EndpointId, addr: std::net::SocketAddr, ok: bool) {
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        let transition = state
            .trackers
            .entry(endpoint)
            .or_default()
            .observe(ok, self.config.fail_after);
        match transition {
            Some(Transition::Down) => {
                state.down.insert(endpoint);
                self.marked_down.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    endpoint = endpoint.get(),
                    %addr,
                    failures = self.config.fail_after,
                    "engine unreachable: endpoint out of rotation until a scrape succeeds"
                );
            }
            Some(Transition::Up) => {
                state.down.remove(&endpoint);
                tracing::info!(endpoint = endpoint.get(), %addr, "engine reachable again: endpoint back in rotation");
            }
            None => return,
        }
        self.down.store(state.down.len(), Ordering::Relaxed);
    }

    /// Forgets endpoints not in `live` (they left the pool).
    pub fn retain(&self, live: &HashSet<EndpointId>) {
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        state.trackers.retain(|id, _| live.contains(id));
        state.down.retain(|id| live.contains(id));
        self.down.store(state.down.len(), Ordering::Relaxed);
    }

    /// Endpoints out of rotation now.
    pub fn down_count(&self) -> usize {
        self.down.load(Ordering::Relaxed)
    }

    /// Endpoints taken out of rotation since the start.
    pub fn marked_down_total(&self) -> u64 {
        self.marked_down.load(Ordering::Relaxed)
    }

    /// `endpoints` with those out of rotation marked not ready, unless that would leave no
    /// ready endpoint (then unchanged). Allocates only while some endpoint is down.
    pub fn mask(&self, endpoints: Arc<Vec<Endpoint>>) -> Arc<Vec<Endpoint>> {
        if self.down_count() == 0 {
            return endpoints;
        }
        let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
        let out = |e: &Endpoint| e.ready && state.down.contains(&e.id);
        let taken = endpoints.iter().filter(|e| out(e)).count();
        let ready = endpoints.iter().filter(|e| e.ready).count();
        if taken == 0 || taken == ready {
            return endpoints;
        }
        let masked = endpoints
            .iter()
            .map(|e| {
                let mut e = e.clone();
                if out(&e) {
                    e.ready = false;
                }
                e
            })
            .collect();
        Arc::new(masked)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;
    use proptest::prelude::*;

    fn ep(i: u32) -> Endpoint {
        Endpoint::new(
            EndpointId::new(i).unwrap(),
            format!("10.0.0.{i}:8000").parse().unwrap(),
        )
    }

    proptest! {
        /// Against the naive rule: down exactly while the trailing run of failures is at least
        /// `fail_after` long; a transition reported exactly when that changes.
        #[test]
        fn agrees_with_the_trailing_failures_rule(
            fail_after in 0u32..5,
            scrapes in proptest::collection::vec(proptest::bool::weighted(0.4), 0..80),
        ) {
            let mut t = Tracker::default();
            let mut seen: Vec<bool> = Vec::new();
            let mut was_down = false;
            for ok in scrapes {
                seen.push(ok);
                let trailing = seen.iter().rev().take_while(|ok| !**ok).count() as u32;
                let down = fail_after > 0 && trailing >= fail_after;
                let want = match (was_down, down) {
                    (false, true) => Some(Transition::Down),
                    (true, false) => Some(Transition::Up),
                    _ => None,
                };
                prop_assert_eq!(t.observe(ok, fail_after), want);
                prop_assert_eq!(t.is_down(), down);
                was_down = down;
            }
        }
    }

    #[test]
    fn a_down_endpoint_is_masked_until_a_scrape_succeeds() {
        let book = HealthBook::new(HealthConfig::default());
        let eps = Arc::new(vec![ep(1), ep(2), ep(3)]);
        let addr = eps[1].address;
        for _ in 0..2 {
            book.observe(eps[1].id, addr, false);
        }
        assert!(
            Arc::ptr_eq(&book.mask(Arc::clone(&eps)), &eps),
            "two failures"
        );
        book.observe(eps[1].id, addr, false);
        assert_eq!(book.down_count(), 1);
        let masked = book.mask(Arc::clone(&eps));
        let ready: Vec<bool> = masked.iter().map(|e| e.ready).collect();
        assert_eq!(ready, [true, false, true]);
        book.observe(eps[1].id, addr, true);
        assert_eq!(book.down_count(), 0);
        assert!(Arc::ptr_eq(&book.mask(Arc::clone(&eps)), &eps));
        assert_eq!(book.marked_down_total(), 1);
    }

    #[test]
    fn when_every_ready_endpoint_is_down_nothing_is_masked() {
        let book = HealthBook::new(HealthConfig { fail_after: 1 });
        let mut not_ready = ep(3);
        not_ready.ready = false;
        let eps = Arc::new(vec![ep(1), ep(2), not_ready]);
        book.observe(eps[0].id, eps[0].address, false);
        book.observe(eps[1].id, eps[1].address, false);
        assert_eq!(book.down_count(), 2);
        assert!(Arc::ptr_eq(&book.mask(Arc::clone(&eps)), &eps));
    }

    #[test]
    fn departed_endpoints_are_forgotten() {
        let book = HealthBook::new(HealthConfig { fail_after: 1 });
        let (a, b) = (ep(1), ep(2));
        book.observe(a.id, a.address, false);
        book.observe(b.id, b.address, false);
        book.retain(&HashSet::from([b.id]));
        assert_eq!(book.down_count(), 1);
        let masked = book.mask(Arc::new(vec![ep(1), ep(2), ep(3)]));
        let ready: Vec<bool> = masked.iter().map(|e| e.ready).collect();
        assert_eq!(ready, [true, false, true]);
    }
}
