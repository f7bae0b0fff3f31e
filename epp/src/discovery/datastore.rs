//! The synchronous endpoint datastore: discovery writes whole snapshots, every request reads the
//! current one without waiting (an `Arc` swap under a short lock).
//!
//! Endpoint ids are stable per (pod name, port) for the life of the process, so the KV index's
//! entries survive a reload. Endpoints that disappear are reported so their index entries, load
//! samples and in-flight state can be dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use kv_index::EndpointId;
use scheduler::Endpoint;

/// Identity of an endpoint across snapshots: the pod and the target port.
pub type EndpointKey = (String, u16);

/// The endpoints discovery found, with ids assigned.
#[derive(Debug, Default)]
pub struct Datastore {
    current: RwLock<Arc<Vec<Endpoint>>>,
    ids: Mutex<Ids>,
}

#[derive(Debug, Default)]
struct Ids {
    by_key: HashMap<EndpointKey, EndpointId>,
    live: HashMap<EndpointId, EndpointKey>,
    next: u32,
}

/// What a [`Datastore::replace`] changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// Endpoints that were present and are not any more.
    pub removed: Vec<EndpointId>,
    /// Endpoints now present.
    pub count: usize,
}

impl Datastore {
    /// An empty datastore.
    pub fn new() -> Self {
        Self::default()
    }

    /// The id for an endpoint key (allocated on first sight).
    pub fn id_for(&self, key: &EndpointKey) -> EndpointId {
        let mut ids = self
            .ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(id) = ids.by_key.get(key) {
            return *id;
        }
        // 2^31 distinct (pod, port) pairs in one process's life is out of reach; saturate rather
        // than fail if it ever happened.
        let id =
            EndpointId::new(ids.next.min(kv_index::MAX_ID)).unwrap_or_else(|e| unreachable_id(e.0));
        ids.next = ids.next.saturating_add(1);
        ids.by_key.insert(key.clone(), id);
        id
    }

    /// The id of a live endpoint (present in the current set); `None` for unknown or departed
    /// ones. Never allocates.
    pub fn live_id(&self, key: &EndpointKey) -> Option<EndpointId> {
        let ids = self
            .ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        ids.by_key
            .get(key)
            .copied()
            .filter(|id| ids.live.contains_key(id))
    }

    /// The key of a live endpoint.
    pub fn key_of(&self, id: EndpointId) -> Option<EndpointKey> {
        self.ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .live
            .get(&id)
            .cloned()
    }

    /// Replaces the endpoint set; `endpoints` carry ids from [`id_for`](Self::id_for).
    pub fn replace(&self, endpoints: Vec<(EndpointKey, Endpoint)>) -> Change {
        let mut ids = self
            .ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now: HashMap<EndpointId, EndpointKey> =
            endpoints.iter().map(|(k, e)| (e.id, k.clone())).collect();
        let removed: Vec<EndpointId> = ids
            .live
            .keys()
            .filter(|id| !now.contains_key(id))
            .copied()
            .collect();
        ids.live = now;
        let list: Vec<Endpoint> = endpoints.into_iter().map(|(_, e)| e).collect();
        let count = list.len();
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(list);
        Change { removed, count }
    }

    /// The current endpoints.
    pub fn snapshot(&self) -> Arc<Vec<Endpoint>> {
        Arc::clone(
            &self
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

fn unreachable_id(raw: u32) -> EndpointId {
    tracing::error!(raw, "endpoint ids exhausted");
    EndpointId::new(0).unwrap_or_else(|_| unreachable_id(raw))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(ds: &Datastore, name: &str, port: u16) -> (EndpointKey, Endpoint) {
        let key = (name.to_owned(), port);
        let id = ds.id_for(&key);
        let addr = format!("10.0.0.1:{port}").parse().unwrap();
        (key, Endpoint::new(id, addr))
    }

    #[test]
    fn ids_are_stable_and_removals_reported() {
        let ds = Datastore::new();
        let a = ep(&ds, "a", 8000);
        let b = ep(&ds, "b", 8000);
        let (ida, idb) = (a.1.id, b.1.id);
        assert_ne!(ida, idb);
        assert_eq!(ds.replace(vec![a, b]).removed, vec![]);
        let a2 = ep(&ds, "a", 8000);
        assert_eq!(a2.1.id, ida);
        assert_eq!(ds.live_id(&("b".to_owned(), 8000)), Some(idb));
        let change = ds.replace(vec![a2]);
        assert_eq!(change.removed, vec![idb]);
        assert_eq!(ds.live_id(&("b".to_owned(), 8000)), None);
        assert_eq!(ds.key_of(ida), Some(("a".to_owned(), 8000)));
        assert_eq!(ds.key_of(idb), None);
        assert_eq!(ds.snapshot().len(), 1);
    }
}
