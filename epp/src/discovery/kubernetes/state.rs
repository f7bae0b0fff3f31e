//! The synchronous discovery state of one pool: the InferencePool as each API version shows it,
//! and the pods its selector watches. Fed watcher events; yields the endpoint [`Snapshot`].
//! No runtime, no client: tests feed it objects.

use api::pool::PoolView;

use super::convert::{PodView, endpoints};
use super::relist::{Relist, StoreEvent};
use crate::discovery::file::Parsed;

/// The InferencePool API a pool object came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolVersion {
    /// `inference.networking.k8s.io/v1`.
    V1,
    /// `inference.networking.x-k8s.io/v1alpha2`.
    V1Alpha2,
}

/// What discovery publishes: the endpoints and whether the EPP may report ready.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Every selected pod × target port (ready or not).
    pub endpoints: Vec<Parsed>,
    /// The pool is known and the pods have been listed.
    pub ready: bool,
}

/// The state.
#[derive(Debug)]
pub struct PoolState {
    pool_name: String,
    v1: Relist<PoolView>,
    v1alpha2: Relist<PoolView>,
    pods: Relist<PodView>,
}

impl PoolState {
    /// Empty state for the pool named `pool_name`.
    pub fn new(pool_name: impl Into<String>) -> Self {
        Self {
            pool_name: pool_name.into(),
            v1: Relist::default(),
            v1alpha2: Relist::default(),
            pods: Relist::default(),
        }
    }

    /// Applies an InferencePool event of one version. Objects of other names are ignored.
    pub fn pool_event(&mut self, version: PoolVersion, event: StoreEvent<PoolView>) {
        let event = match event {
            StoreEvent::Apply(n, _) | StoreEvent::InitApply(n, _) if n != self.pool_name => return,
            e => e,
        };
        let store = match version {
            PoolVersion::V1 => &mut self.v1,
            PoolVersion::V1Alpha2 => &mut self.v1alpha2,
        };
        store.apply(event);
        if self.pool().is_none() {
            // No pool, no pods: a later pool may select other ones.
            self.pods.reset();
        }
    }

    /// Applies a Pod event (from the watch on the current selector).
    pub fn pod_event(&mut self, event: StoreEvent<PodView>) {
        if self.pool().is_some() {
            self.pods.apply(event);
        }
    }

    /// The pool in force: v1 when both versions show it.
    pub fn pool(&self) -> Option<&PoolView> {
        self.v1
            .get(&self.pool_name)
            .or_else(|| self.v1alpha2.get(&self.pool_name))
    }

    /// The label selector pods are watched with; `None` when there is no pool or it selects
    /// nothing.
    pub fn pod_selector(&self) -> Option<String> {
        self.pool().and_then(PoolView::label_selector)
    }

    /// The endpoints and readiness now.
    pub fn snapshot(&self) -> Snapshot {
        match self.pool() {
            None => Snapshot::default(),
            Some(pool) => Snapshot {
                endpoints: endpoints(pool, self.pods.live().values()),
                ready: self.pods.synced(),
            },
        }
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
    use std::collections::BTreeMap;

    use scheduler::Role;

    use super::*;

    fn pool(app: &str, ports: &[i32]) -> Option<PoolView> {
        Some(PoolView {
            selector: [("app".to_owned(), app.to_owned())].into(),
            target_ports: ports.to_vec(),
        })
    }

    fn pod(name: &str, app: &str, ready: bool) -> Option<PodView> {
        Some(PodView {
            name: name.to_owned(),
            labels: BTreeMap::from([("app".to_owned(), app.to_owned())]),
            ip: "10.1.0.1".parse().unwrap(),
            ready,
            node: None,
            role: Role::Both,
            events_port: None,
            replay_port: None,
        })
    }

    fn listed(state: &mut PoolState, items: Vec<(&str, Option<PodView>)>) {
        state.pod_event(StoreEvent::Init);
        for (n, o) in items {
            state.pod_event(StoreEvent::InitApply(n.to_owned(), o));
        }
        state.pod_event(StoreEvent::InitDone);
    }

    fn pool_listed(state: &mut PoolState, version: PoolVersion, p: Option<PoolView>) {
        state.pool_event(version, StoreEvent::Init);
        if let Some(p) = p {
            state.pool_event(version, StoreEvent::InitApply("pool".into(), Some(p)));
        }
        state.pool_event(version, StoreEvent::InitDone);
    }

    #[test]
    fn ready_once_the_pool_is_seen_and_pods_listed() {
        let mut s = PoolState::new("pool");
        assert_eq!(s.snapshot(), Snapshot::default());
        listed(&mut s, vec![("a", pod("a", "m", true))]);
        assert!(!s.snapshot().ready, "pods without a pool are ignored");
        pool_listed(&mut s, PoolVersion::V1, pool("m", &[8000, 8001]));
        assert_eq!(s.pod_selector().as_deref(), Some("app=m"));
        assert!(!s.snapshot().ready);
        listed(
            &mut s,
            vec![("a", pod("a", "m", true)), ("b", pod("b", "x", true))],
        );
        let snap = s.snapshot();
        assert!(snap.ready);
        assert_eq!(snap.endpoints.len(), 2, "a × two ports; b is not selected");
    }

    #[test]
    fn readiness_flips_and_deletions_show() {
        let mut s = PoolState::new("pool");
        pool_listed(&mut s, PoolVersion::V1, pool("m", &[8000]));
        listed(
            &mut s,
            vec![("a", pod("a", "m", true)), ("b", pod("b", "m", true))],
        );
        s.pod_event(StoreEvent::Apply("a".into(), pod("a", "m", false)));
        let snap = s.snapshot();
        assert_eq!(
            snap.endpoints.iter().map(|e| e.ready).collect::<Vec<_>>(),
            vec![false, true]
        );
        s.pod_event(StoreEvent::Delete("b".into()));
        s.pod_event(StoreEvent::Apply("a".into(), None));
        assert!(s.snapshot().endpoints.is_empty());
        assert!(s.snapshot().ready, "an empty synced pool is ready");
    }

    #[test]
    fn v1_wins_and_other_pools_are_ignored() {
        let mut s = PoolState::new("pool");
        pool_listed(&mut s, PoolVersion::V1Alpha2, pool("old", &[8000]));
        assert_eq!(s.pod_selector().as_deref(), Some("app=old"));
        s.pool_event(
            PoolVersion::V1,
            StoreEvent::Apply("other".into(), pool("x", &[1])),
        );
        assert_eq!(s.pod_selector().as_deref(), Some("app=old"));
        s.pool_event(
            PoolVersion::V1,
            StoreEvent::Apply("pool".into(), pool("new", &[8000])),
        );
        assert_eq!(s.pod_selector().as_deref(), Some("app=new"));
        s.pool_event(PoolVersion::V1, StoreEvent::Delete("pool".into()));
        assert_eq!(s.pod_selector().as_deref(), Some("app=old"));
    }

    #[test]
    fn losing_the_pool_clears_pods_and_readiness() {
        let mut s = PoolState::new("pool");
        pool_listed(&mut s, PoolVersion::V1, pool("m", &[8000]));
        listed(&mut s, vec![("a", pod("a", "m", true))]);
        assert_eq!(s.snapshot().endpoints.len(), 1);
        s.pool_event(PoolVersion::V1, StoreEvent::Delete("pool".into()));
        assert_eq!(s.snapshot(), Snapshot::default());
        s.pool_event(
            PoolVersion::V1,
            StoreEvent::Apply("pool".into(), pool("m", &[8000])),
        );
        assert!(!s.snapshot().ready, "pods must be listed again");
        assert!(s.snapshot().endpoints.is_empty());
    }

    #[test]
    fn a_selector_change_filters_at_once_and_keeps_matching_pods() {
        let mut s = PoolState::new("pool");
        pool_listed(&mut s, PoolVersion::V1, pool("m", &[8000]));
        listed(&mut s, vec![("a", pod("a", "m", true))]);
        s.pool_event(
            PoolVersion::V1,
            StoreEvent::Apply("pool".into(), pool("n", &[8000])),
        );
        assert!(s.snapshot().endpoints.is_empty(), "a no longer matches");
        assert!(s.snapshot().ready, "readiness survives a selector change");
        listed(&mut s, vec![("c", pod("c", "n", true))]);
        assert_eq!(s.snapshot().endpoints[0].key.0, "c");
    }
}
