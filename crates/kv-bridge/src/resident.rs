//! The resident set a receiver of a source's envelopes holds: per tier, the keys stored and not
//! since removed or cleared. The sidecar keeps it from the events it seals, so a snapshot is
//! exactly the effect of the envelopes before it.

use std::collections::HashSet;

use kv_events::fasthash::BuildU64Hasher;
use kv_events::snapshot::TierKeys;
use kv_events::{BlockKey, KvEvent, Tier};

type KeySet = HashSet<BlockKey, BuildU64Hasher>;

/// Resident keys per tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResidentSet {
    tiers: [KeySet; Tier::ALL.len()],
}

impl ResidentSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event as a receiver does.
    pub fn apply(&mut self, event: &KvEvent) {
        match event {
            KvEvent::Stored { keys, tier, .. } => {
                if let Some(set) = self.tiers.get_mut(tier.index()) {
                    set.extend(keys.iter().copied());
                }
            }
            KvEvent::Removed { keys, tier } => {
                if let Some(set) = self.tiers.get_mut(tier.index()) {
                    for k in keys {
                        set.remove(k);
                    }
                    shrink_if_sparse(set);
                }
            }
            KvEvent::Cleared { tier: None } => self.tiers = Default::default(),
            KvEvent::Cleared { tier: Some(t) } => {
                if let Some(set) = self.tiers.get_mut(t.index()) {
                    *set = KeySet::default();
                }
            }
            KvEvent::Unknown => {}
        }
    }

    /// Whether `key` is resident in `tier`.
    pub fn contains(&self, key: BlockKey, tier: Tier) -> bool {
        self.tiers
            .get(tier.index())
            .is_some_and(|s| s.contains(&key))
    }

    /// (key, tier) pairs held.
    pub fn len(&self) -> usize {
        self.tiers.iter().map(HashSet::len).sum()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The set as snapshot tiers (non-empty tiers only).
    pub fn to_tier_keys(&self) -> Vec<TierKeys> {
        Tier::ALL
            .into_iter()
            .zip(&self.tiers)
            .filter(|(_, set)| !set.is_empty())
            .map(|(tier, set)| TierKeys {
                tier,
                keys: set.iter().copied().collect(),
            })
            .collect()
    }
}

/// Gives memory back once a set is less than a quarter full.
fn shrink_if_sparse(set: &mut KeySet) {
    let cap = set.capacity();
    if cap > 1024 && set.len() * 4 < cap {
        set.shrink_to(set.len() * 2);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn stored(keys: &[u64], tier: Tier) -> KvEvent {
        KvEvent::Stored {
            keys: keys.iter().copied().map(BlockKey).collect(),
            parent: None,
            tier,
            lora: None,
            token_count: 0,
        }
    }

    #[test]
    fn follows_stores_removals_and_clears_per_tier() {
        let mut s = ResidentSet::new();
        s.apply(&stored(&[1, 2, 3], Tier::Gpu));
        s.apply(&stored(&[2], Tier::Host));
        s.apply(&KvEvent::Removed {
            keys: vec![BlockKey(1), BlockKey(9)],
            tier: Tier::Gpu,
        });
        assert!(s.contains(BlockKey(2), Tier::Gpu) && s.contains(BlockKey(2), Tier::Host));
        assert!(!s.contains(BlockKey(1), Tier::Gpu));
        assert_eq!(s.len(), 3);
        s.apply(&KvEvent::Cleared {
            tier: Some(Tier::Gpu),
        });
        assert_eq!(s.len(), 1);
        let tk = s.to_tier_keys();
        assert_eq!(tk.len(), 1);
        assert_eq!(tk[0].tier, Tier::Host);
        s.apply(&KvEvent::Unknown);
        s.apply(&KvEvent::Cleared { tier: None });
        assert!(s.is_empty());
    }
}
