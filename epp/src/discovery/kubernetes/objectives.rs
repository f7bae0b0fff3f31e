//! InferenceObjectives of this pool: name → priority, from both API groups. The picker reads a
//! request's objective name from its headers (`routing::picker::OBJECTIVE_HEADERS`) and asks
//! this store through the `routing::picker::Objectives` trait.
//!
//! An objective of the same name in both groups takes the `llm-d.ai` one. Objectives of other pools are not kept. An unknown or absent name gives no
//! priority; callers treat that as 0, as upstream does.

use std::sync::Mutex;

use api::objective::ObjectiveView;

use super::relist::{Relist, StoreEvent};

/// The InferenceObjective API group an object came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectiveGroup {
    /// `llm-d.ai/v1alpha2`.
    LlmD,
    /// `inference.networking.x-k8s.io/v1alpha2`.
    XK8s,
}

impl crate::routing::picker::Objectives for Objectives {
    fn priority(&self, name: &str) -> Option<i32> {
        Objectives::priority(self, name)
    }
}

/// The objectives of one pool, shared between the watchers and request handling.
#[derive(Debug)]
pub struct Objectives {
    pool: String,
    stores: Mutex<(Relist<i32>, Relist<i32>)>,
}

impl Objectives {
    /// No objectives yet, for the pool named `pool`.
    pub fn new(pool: impl Into<String>) -> Self {
        Self {
            pool: pool.into(),
            stores: Mutex::new((Relist::default(), Relist::default())),
        }
    }

    /// Applies a watcher event; objectives of other pools count as absent.
    pub fn apply(&self, group: ObjectiveGroup, event: StoreEvent<ObjectiveView>) {
        let mine = |o: Option<ObjectiveView>| {
            o.filter(|o| o.pool.refers_to_pool(&self.pool))
                .map(|o| o.priority)
        };
        let event = match event {
            StoreEvent::Apply(n, o) => StoreEvent::Apply(n, mine(o)),
            StoreEvent::InitApply(n, o) => StoreEvent::InitApply(n, mine(o)),
            StoreEvent::Delete(n) => StoreEvent::Delete(n),
            StoreEvent::Init => StoreEvent::Init,
            StoreEvent::InitDone => StoreEvent::InitDone,
        };
        let mut stores = self
            .stores
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match group {
            ObjectiveGroup::LlmD => stores.0.apply(event),
            ObjectiveGroup::XK8s => stores.1.apply(event),
        };
    }

    /// The priority of the objective `name`.
    pub fn priority(&self, name: &str) -> Option<i32> {
        let stores = self
            .stores
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        stores.0.get(name).or_else(|| stores.1.get(name)).copied()
    }

    /// How many objectives of this pool are known.
    pub fn len(&self) -> usize {
        let stores = self
            .stores
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut names: Vec<&String> = stores
            .0
            .live()
            .keys()
            .chain(stores.1.live().keys())
            .collect();
        names.sort();
        names.dedup();
        names.len()
    }

    /// Whether no objective of this pool is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
    use api::objective::PoolObjectReference;

    use super::*;

    fn obj(pool: &str, priority: i32) -> Option<ObjectiveView> {
        Some(ObjectiveView {
            pool: PoolObjectReference {
                group: None,
                kind: None,
                name: pool.to_owned(),
            },
            priority,
        })
    }

    #[test]
    fn priorities_by_name() {
        let o = Objectives::new("pool");
        o.apply(
            ObjectiveGroup::XK8s,
            StoreEvent::Apply("critical".into(), obj("pool", 5)),
        );
        o.apply(
            ObjectiveGroup::XK8s,
            StoreEvent::Apply("batch".into(), obj("pool", -1)),
        );
        o.apply(
            ObjectiveGroup::XK8s,
            StoreEvent::Apply("foreign".into(), obj("other", 9)),
        );
        assert_eq!(o.priority("critical"), Some(5));
        assert_eq!(
            o.priority("foreign"),
            None,
            "other pools' objectives are not kept"
        );
        assert_eq!(o.len(), 2);
        o.apply(
            ObjectiveGroup::LlmD,
            StoreEvent::Apply("critical".into(), obj("pool", 7)),
        );
        assert_eq!(o.priority("critical"), Some(7), "llm-d.ai wins");
        assert_eq!(o.len(), 2);
        o.apply(ObjectiveGroup::LlmD, StoreEvent::Delete("critical".into()));
        assert_eq!(o.priority("critical"), Some(5));
        o.apply(
            ObjectiveGroup::XK8s,
            StoreEvent::Apply("critical".into(), obj("moved", 5)),
        );
        assert_eq!(
            o.priority("critical"),
            None,
            "an objective moved to another pool leaves"
        );
    }

    #[test]
    fn relists_replace_each_group() {
        let o = Objectives::new("pool");
        o.apply(
            ObjectiveGroup::LlmD,
            StoreEvent::Apply("a".into(), obj("pool", 1)),
        );
        o.apply(ObjectiveGroup::LlmD, StoreEvent::Init);
        o.apply(
            ObjectiveGroup::LlmD,
            StoreEvent::InitApply("b".into(), obj("pool", 2)),
        );
        assert_eq!(o.priority("a"), Some(1));
        o.apply(ObjectiveGroup::LlmD, StoreEvent::InitDone);
        assert_eq!((o.priority("a"), o.priority("b")), (None, Some(2)));
        assert!(!o.is_empty());
    }
}
