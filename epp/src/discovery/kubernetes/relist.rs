//! A reflector store as an explicit state machine: objects by name, fed the watcher's events.
//!
//! A (re)list arrives as `Init`, `InitApply`…, `InitDone`; the listed objects are buffered and
//! replace the live set atomically at `InitDone`, so readers never see a half-listed set.
//! `Apply` and `Delete` change the live set directly.

use std::collections::BTreeMap;

/// One watcher event, reduced to what the store needs (the object already converted; `None`
/// for an object that converts to nothing, which then counts as absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreEvent<T> {
    /// Added or modified.
    Apply(String, Option<T>),
    /// Deleted.
    Delete(String),
    /// A list starts.
    Init,
    /// An object of the list.
    InitApply(String, Option<T>),
    /// The list is complete.
    InitDone,
}

/// The store.
#[derive(Debug, Clone)]
pub struct Relist<T> {
    live: BTreeMap<String, T>,
    listing: Option<BTreeMap<String, T>>,
    synced: bool,
}

impl<T> Default for Relist<T> {
    fn default() -> Self {
        Self {
            live: BTreeMap::new(),
            listing: None,
            synced: false,
        }
    }
}

impl<T> Relist<T> {
    /// Applies one event; returns whether the live set (or the synced flag) may have changed.
    pub fn apply(&mut self, event: StoreEvent<T>) -> bool {
        match event {
            StoreEvent::Apply(name, Some(obj)) => {
                self.live.insert(name, obj);
                true
            }
            StoreEvent::Apply(name, None) | StoreEvent::Delete(name) => {
                self.live.remove(&name).is_some()
            }
            StoreEvent::Init => {
                self.listing = Some(BTreeMap::new());
                false
            }
            StoreEvent::InitApply(name, obj) => {
                let listing = self.listing.get_or_insert_with(BTreeMap::new);
                match obj {
                    Some(obj) => listing.insert(name, obj),
                    None => listing.remove(&name),
                };
                false
            }
            StoreEvent::InitDone => {
                self.live = self.listing.take().unwrap_or_default();
                self.synced = true;
                true
            }
        }
    }

    /// Forgets everything (a watch on other objects is about to start).
    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// Whether a list has completed since the last reset.
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// The live objects by name.
    pub fn live(&self) -> &BTreeMap<String, T> {
        &self.live
    }

    /// One live object.
    pub fn get(&self, name: &str) -> Option<&T> {
        self.live.get(name)
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
    use proptest::prelude::*;

    use super::*;

    fn event() -> impl Strategy<Value = StoreEvent<u8>> {
        let name = prop::sample::select(vec!["a", "b", "c", "d"]).prop_map(str::to_owned);
        let obj = prop::option::weighted(0.8, 0u8..4);
        prop_oneof![
            3 => (name.clone(), obj.clone()).prop_map(|(n, o)| StoreEvent::Apply(n, o)),
            2 => name.clone().prop_map(StoreEvent::Delete),
            1 => Just(StoreEvent::Init),
            3 => (name, obj).prop_map(|(n, o)| StoreEvent::InitApply(n, o)),
            1 => Just(StoreEvent::InitDone),
        ]
    }

    /// The naive model: replays the whole history. The live set is what the last completed list
    /// held (its last `InitApply` per name after the `Init` or `InitDone` before it), then every `Apply`/`Delete`
    /// after that list in order.
    fn model(history: &[StoreEvent<u8>]) -> (BTreeMap<String, u8>, bool) {
        let done = history.iter().rposition(|e| *e == StoreEvent::InitDone);
        let mut live = BTreeMap::new();
        let start = match done {
            Some(d) => {
                let init = history[..d]
                    .iter()
                    .rposition(|e| matches!(e, StoreEvent::Init | StoreEvent::InitDone))
                    .map_or(0, |i| i + 1);
                for e in &history[init..d] {
                    if let StoreEvent::InitApply(n, o) = e {
                        match o {
                            Some(o) => live.insert(n.clone(), *o),
                            None => live.remove(n),
                        };
                    }
                }
                d + 1
            }
            None => 0,
        };
        for e in &history[start..] {
            match e {
                StoreEvent::Apply(n, Some(o)) => {
                    live.insert(n.clone(), *o);
                }
                StoreEvent::Apply(n, None) | StoreEvent::Delete(n) => {
                    live.remove(n);
                }
                _ => {}
            }
        }
        (live, done.is_some())
    }

    proptest! {
        #[test]
        fn matches_the_replay_model(history in prop::collection::vec(event(), 0..40)) {
            let mut store = Relist::default();
            for (i, e) in history.iter().enumerate() {
                store.apply(e.clone());
                let (live, synced) = model(&history[..=i]);
                prop_assert_eq!(store.live(), &live);
                prop_assert_eq!(store.synced(), synced);
            }
        }
    }

    #[test]
    fn a_relist_replaces_the_set_only_when_done() {
        let mut s = Relist::default();
        s.apply(StoreEvent::Apply("a".into(), Some(1)));
        s.apply(StoreEvent::Init);
        s.apply(StoreEvent::InitApply("b".into(), Some(2)));
        assert_eq!(s.live().len(), 1);
        assert!(s.get("a").is_some(), "the old set stays until InitDone");
        assert!(s.apply(StoreEvent::InitDone));
        assert_eq!(s.live().keys().collect::<Vec<_>>(), vec!["b"]);
        s.reset();
        assert!(!s.synced() && s.live().is_empty());
    }
}
