//! Whether the EPP's view of Kubernetes is current, watch by watch: what to log when a watch
//! fails or recovers (one warning per outage, not one per retry), and what the metrics show
//! (`kvgate_epp_kube_watch_up`, `kvgate_epp_kube_stale_seconds`, failures and relists).
//!
//! While the API server is away the EPP keeps routing on its last view and stays ready (as
//! GIE's EPP does): refusing every request because the control plane is briefly down would
//! turn an API outage into a data-plane outage. The staleness is visible instead, and the
//! watches list again from scratch as soon as the server answers. Pure: callers pass the time.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One of discovery's watches (a bounded metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchKind {
    /// InferencePool `inference.networking.k8s.io/v1`.
    PoolV1,
    /// InferencePool `inference.networking.x-k8s.io/v1alpha2`.
    PoolV1Alpha2,
    /// The pool's pods.
    Pods,
    /// InferenceObjective `llm-d.ai`.
    ObjectivesLlmD,
    /// InferenceObjective `inference.networking.x-k8s.io`.
    ObjectivesXK8s,
}

impl WatchKind {
    /// Every watch.
    pub const ALL: [WatchKind; 5] = [
        WatchKind::PoolV1,
        WatchKind::PoolV1Alpha2,
        WatchKind::Pods,
        WatchKind::ObjectivesLlmD,
        WatchKind::ObjectivesXK8s,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            WatchKind::PoolV1 => "inferencepools.inference.networking.k8s.io",
            WatchKind::PoolV1Alpha2 => "inferencepools.inference.networking.x-k8s.io",
            WatchKind::Pods => "pods",
            WatchKind::ObjectivesLlmD => "inferenceobjectives.llm-d.ai",
            WatchKind::ObjectivesXK8s => "inferenceobjectives.inference.networking.x-k8s.io",
        }
    }

    fn index(self) -> usize {
        match self {
            WatchKind::PoolV1 => 0,
            WatchKind::PoolV1Alpha2 => 1,
            WatchKind::Pods => 2,
            WatchKind::ObjectivesLlmD => 3,
            WatchKind::ObjectivesXK8s => 4,
        }
    }
}

/// Why a watch failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The resource is not served (its CRD is not installed): normal for the InferencePool
    /// version or objective group a cluster does not use. Not staleness.
    Absent,
    /// The API refused the EPP (403): its RBAC does not grant the watch.
    Forbidden,
    /// The API server is unreachable or failing.
    Unavailable,
}

impl Failure {
    fn stale(self) -> bool {
        !matches!(self, Failure::Absent)
    }
}

/// What to log about a transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Note {
    /// The first failure of an outage: warn once.
    OutageStarted,
    /// A resource is not installed (the first time for this watch): say so once.
    Absent,
    /// The API refused this watch (the first time for it): warn with the RBAC hint.
    Forbidden,
    /// Nothing new (a retry of a known failure, or a watch already healthy): debug at most.
    Repeat,
    /// The last failing watch listed again: the outage is over.
    Recovered {
        /// How long the view was stale.
        after: Duration,
    },
}

/// The watches' states.
#[derive(Debug, Clone, Default)]
pub struct Health {
    failing: [Option<Failure>; 5],
    told: [Option<Failure>; 5],
    stale_since: Option<Instant>,
}

impl Health {
    /// A watch failed at `now`.
    pub fn failed(&mut self, watch: WatchKind, failure: Failure, now: Instant) -> Note {
        let i = watch.index();
        let was_stale = self.stale_since.is_some();
        if let Some(slot) = self.failing.get_mut(i) {
            *slot = Some(failure);
        }
        if failure.stale() && !was_stale {
            self.stale_since = Some(now);
            return Note::OutageStarted;
        }
        if let Some(recovered) = self.end_outage(now) {
            return recovered;
        }
        let told = self.told.get_mut(i);
        match (failure, told) {
            (Failure::Absent | Failure::Forbidden, Some(told)) if *told != Some(failure) => {
                *told = Some(failure);
                if failure == Failure::Absent {
                    Note::Absent
                } else {
                    Note::Forbidden
                }
            }
            _ => Note::Repeat,
        }
    }

    /// A watch completed a list at `now`.
    pub fn listed(&mut self, watch: WatchKind, now: Instant) -> Note {
        let i = watch.index();
        if let Some(slot) = self.failing.get_mut(i) {
            *slot = None;
        }
        if let Some(told) = self.told.get_mut(i) {
            *told = None;
        }
        self.end_outage(now).unwrap_or(Note::Repeat)
    }

    /// Ends the outage when no watch is stale any more (a watch listed, or its failure turned
    /// out to be a resource that is simply not installed).
    fn end_outage(&mut self, now: Instant) -> Option<Note> {
        let since = self.stale_since?;
        if self.failing.iter().flatten().any(|f| f.stale()) {
            return None;
        }
        self.stale_since = None;
        Some(Note::Recovered {
            after: now.saturating_duration_since(since),
        })
    }

    /// Whether a watch works (listing, or its resource is simply not installed).
    pub fn up(&self, watch: WatchKind) -> bool {
        self.failing
            .get(watch.index())
            .copied()
            .flatten()
            .is_none_or(|f| !f.stale())
    }

    /// Since when the view has been stale (some watch unavailable or forbidden).
    pub fn stale_since(&self) -> Option<Instant> {
        self.stale_since
    }
}

/// Why a watch listed again from scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relist {
    /// After a failure (never resumed from a possibly unknown resourceVersion).
    Error,
    /// The periodic relist (`--kube-relist-seconds`).
    Periodic,
}

/// The counters and states the metrics endpoint reads.
#[derive(Debug, Default)]
pub struct KubeStats {
    health: Mutex<Health>,
    failures: [AtomicU64; 5],
    relists_error: [AtomicU64; 5],
    relists_periodic: [AtomicU64; 5],
}

impl KubeStats {
    /// Records a failure; returns what to log.
    pub fn failed(&self, watch: WatchKind, failure: Failure, now: Instant) -> Note {
        if let Some(c) = self.failures.get(watch.index()) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        self.lock().failed(watch, failure, now)
    }

    /// Records a completed list; returns what to log.
    pub fn listed(&self, watch: WatchKind, now: Instant) -> Note {
        self.lock().listed(watch, now)
    }

    /// Counts a relist.
    pub fn relisted(&self, watch: WatchKind, why: Relist) {
        let counters = match why {
            Relist::Error => &self.relists_error,
            Relist::Periodic => &self.relists_periodic,
        };
        if let Some(c) = counters.get(watch.index()) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Per watch: (label, up, failures, relists after errors, periodic relists).
    pub fn watches(&self) -> Vec<(&'static str, bool, u64, u64, u64)> {
        let health = self.lock().clone();
        WatchKind::ALL
            .iter()
            .map(|w| {
                let i = w.index();
                let get = |a: &[AtomicU64; 5]| a.get(i).map_or(0, |c| c.load(Ordering::Relaxed));
                (
                    w.label(),
                    health.up(*w),
                    get(&self.failures),
                    get(&self.relists_error),
                    get(&self.relists_periodic),
                )
            })
            .collect()
    }

    /// How long the view has been stale at `now` (zero when current).
    pub fn stale_for(&self, now: Instant) -> Duration {
        self.lock()
            .stale_since()
            .map_or(Duration::ZERO, |s| now.saturating_duration_since(s))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn an_outage_warns_once_and_recovers_when_every_watch_lists() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut h = Health::default();
        assert_eq!(
            h.failed(WatchKind::Pods, Failure::Unavailable, at(0)),
            Note::OutageStarted
        );
        assert_eq!(
            h.failed(WatchKind::PoolV1, Failure::Unavailable, at(10)),
            Note::Repeat
        );
        assert_eq!(
            h.failed(WatchKind::Pods, Failure::Unavailable, at(500)),
            Note::Repeat
        );
        assert!(!h.up(WatchKind::Pods));
        assert_eq!(h.listed(WatchKind::Pods, at(900)), Note::Repeat);
        assert_eq!(
            h.listed(WatchKind::PoolV1, at(1000)),
            Note::Recovered {
                after: Duration::from_secs(1)
            }
        );
        assert!(h.stale_since().is_none() && h.up(WatchKind::Pods));
    }

    #[test]
    fn an_absent_resource_is_said_once_and_is_not_staleness() {
        let now = Instant::now();
        let mut h = Health::default();
        assert_eq!(
            h.failed(WatchKind::PoolV1Alpha2, Failure::Absent, now),
            Note::Absent
        );
        assert_eq!(
            h.failed(WatchKind::PoolV1Alpha2, Failure::Absent, now),
            Note::Repeat
        );
        assert!(h.up(WatchKind::PoolV1Alpha2));
        assert!(h.stale_since().is_none());
        // Forbidden is staleness (the view cannot be refreshed) and says why once.
        assert_eq!(
            h.failed(WatchKind::ObjectivesLlmD, Failure::Forbidden, now),
            Note::OutageStarted
        );
        assert_eq!(
            h.failed(WatchKind::ObjectivesXK8s, Failure::Forbidden, now),
            Note::Forbidden
        );
        assert_eq!(
            h.failed(WatchKind::ObjectivesXK8s, Failure::Forbidden, now),
            Note::Repeat
        );
    }

    fn watch() -> impl Strategy<Value = WatchKind> {
        prop::sample::select(WatchKind::ALL.to_vec())
    }

    fn failure() -> impl Strategy<Value = Failure> {
        prop::sample::select(vec![
            Failure::Absent,
            Failure::Forbidden,
            Failure::Unavailable,
        ])
    }

    proptest! {
        /// Against the naive model (the last event of each watch): the view is stale exactly
        /// while some watch's last event is an unavailable or forbidden failure, since the
        /// first such failure after a fresh view; an outage starts with exactly one warning.
        #[test]
        fn staleness_matches_the_last_events(
            events in prop::collection::vec((watch(), prop::option::of(failure())), 0..60),
        ) {
            let t0 = Instant::now();
            let mut h = Health::default();
            let mut last: [Option<Failure>; 5] = [None; 5];
            let mut since: Option<Instant> = None;
            for (i, (w, f)) in events.iter().enumerate() {
                let now = t0 + Duration::from_millis(i as u64);
                let was_stale = last.iter().flatten().any(|f| *f != Failure::Absent);
                let note = match f {
                    Some(f) => h.failed(*w, *f, now),
                    None => h.listed(*w, now),
                };
                last[w.index()] = *f;
                let stale = last.iter().flatten().any(|f| *f != Failure::Absent);
                if stale && !was_stale {
                    since = Some(now);
                    prop_assert_eq!(note, Note::OutageStarted);
                }
                if !stale {
                    if was_stale {
                        prop_assert!(matches!(note, Note::Recovered { .. }), "recovery: {:?}", note);
                    }
                    since = None;
                }
                prop_assert_eq!(h.stale_since(), since);
                for w in WatchKind::ALL {
                    prop_assert_eq!(
                        h.up(w),
                        last[w.index()].is_none_or(|f| f == Failure::Absent)
                    );
                }
            }
        }
    }
}
