//! Applying a discovered endpoint set to the routing state: the datastore, the index's node
//! links, and clean-up of everything held for endpoints that disappeared.

use std::collections::HashMap;
use std::sync::Mutex;

use kv_index::{Holder, KvIndex, NodeId};
use scheduler::{InflightTracker, LoadBook, Scheduler};

use super::datastore::{Datastore, EndpointKey};
use super::file::Parsed;

/// Stable ids for node names.
#[derive(Debug, Default)]
pub struct NodeIds {
    ids: Mutex<HashMap<String, NodeId>>,
}

impl NodeIds {
    /// The id of a node name (allocated on first sight).
    pub fn id(&self, name: &str) -> NodeId {
        let mut ids = self
            .ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Past 2^31 names (never, in practice) the last id is shared.
        let next = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        *ids.entry(name.to_owned())
            .or_insert_with(|| NodeId::saturating(next))
    }

    /// Every node name seen, with its id, by name.
    pub fn all(&self) -> Vec<(String, NodeId)> {
        let mut all: Vec<(String, NodeId)> = self
            .ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(name, id)| (name.clone(), *id))
            .collect();
        all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// The id of a node name seen before, without allocating one.
    pub fn get(&self, name: &str) -> Option<NodeId> {
        self.ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(name)
            .copied()
    }
}

/// The shared routing state a discovery update touches.
#[derive(Debug)]
pub struct Targets<'a> {
    /// Endpoints.
    pub datastore: &'a Datastore,
    /// The KV index.
    pub index: &'a KvIndex,
    /// In-flight accounting.
    pub inflight: &'a InflightTracker,
    /// Engine load samples.
    pub loads: &'a LoadBook,
    /// The scheduler (approximate-mode state).
    pub scheduler: &'a Scheduler,
    /// Node names → ids.
    pub nodes: &'a NodeIds,
}

/// Installs `parsed` as the endpoint set; returns (endpoints now, endpoints removed).
pub fn apply(t: &Targets<'_>, parsed: Vec<Parsed>) -> (usize, usize) {
    let endpoints: Vec<(EndpointKey, scheduler::Endpoint)> =
        super::file::to_endpoints(t.datastore, parsed, |name| t.nodes.id(name));
    for (_, e) in &endpoints {
        t.index.set_endpoint_node(e.id, e.node);
    }
    let change = t.datastore.replace(endpoints);
    for id in &change.removed {
        t.index.remove_source(Holder::Endpoint(*id));
        t.index.set_endpoint_node(*id, None);
        t.inflight.remove_endpoint(*id);
        t.loads.remove(*id);
        t.scheduler.remove_endpoint(*id);
    }
    (change.count, change.removed.len())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use kv_events::{BlockKey, KvEvent, Tier};
    use scheduler::SchedulerConfig;

    use super::*;

    #[test]
    fn endpoints_that_disappear_leave_the_index_and_the_books() {
        let datastore = Datastore::new();
        let index = KvIndex::new(kv_index::IndexConfig::default()).unwrap();
        let inflight = InflightTracker::new();
        let loads = LoadBook::new();
        let scheduler = Scheduler::new(SchedulerConfig::default(), 1).unwrap();
        let nodes = NodeIds::default();
        let t = Targets {
            datastore: &datastore,
            index: &index,
            inflight: &inflight,
            loads: &loads,
            scheduler: &scheduler,
            nodes: &nodes,
        };
        let two = "endpoints:\n  - {name: a, address: 10.0.0.1, ports: [8000], node: n}\n  - {name: b, address: 10.0.0.2, ports: [8000]}\n";
        assert_eq!(
            apply(&t, super::super::file::parse(Path::new("f"), two).unwrap()),
            (2, 0)
        );
        let b = datastore.id_for(&("b".to_owned(), 8000));
        let keys = vec![BlockKey(1), BlockKey(2)];
        index.apply(
            Holder::Endpoint(b),
            &[KvEvent::Stored {
                keys: keys.clone(),
                parent: None,
                tier: Tier::Gpu,
                lora: None,
                token_count: 32,
            }],
        );
        inflight.on_routed(b, 2, 0, 1);
        assert_eq!(index.find_matches(&keys, &[b])[0].reach(Tier::Gpu), 2);
        let one = "endpoints:\n  - {name: a, address: 10.0.0.1, ports: [8000], node: n}\n";
        assert_eq!(
            apply(&t, super::super::file::parse(Path::new("f"), one).unwrap()),
            (1, 1)
        );
        assert_eq!(index.find_matches(&keys, &[b])[0].reach(Tier::Gpu), 0);
        assert!(inflight.is_empty());
        assert_eq!(nodes.id("n"), nodes.id("n"));
        assert_eq!(nodes.get("n"), Some(nodes.id("n")));
        assert_eq!(nodes.get("never"), None);
        assert_ne!(nodes.id("n"), nodes.id("m"));
    }
}
