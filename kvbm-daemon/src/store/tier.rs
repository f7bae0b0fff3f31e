//! One tier's residency: which blocks it holds, their sizes, their recency, and its byte budget.
//!
//! Least recently used first out. Recency is a logical clock (one tick per touch), so the
//! order is deterministic and tests can model it exactly.

use std::collections::{BTreeMap, HashMap};

use super::BlockId;

/// What a tier keeps per block besides the id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resident<T> {
    /// The block's size in bytes.
    pub(crate) bytes: u64,
    /// When it was last touched (the key of its place in the recency order).
    tick: u64,
    /// What the tier stores with it (the data in the host tier; nothing in the remote index).
    pub(crate) value: T,
}

/// A byte-budgeted LRU set of blocks.
#[derive(Debug)]
pub(crate) struct TierSet<T> {
    capacity: u64,
    used: u64,
    clock: u64,
    entries: HashMap<BlockId, Resident<T>>,
    order: BTreeMap<u64, BlockId>,
}

impl<T> TierSet<T> {
    pub(crate) fn new(capacity: u64) -> Self {
        Self {
            capacity,
            used: 0,
            clock: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    pub(crate) const fn capacity(&self) -> u64 {
        self.capacity
    }

    pub(crate) const fn used(&self) -> u64 {
        self.used
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn contains(&self, id: &BlockId) -> bool {
        self.entries.contains_key(id)
    }

    pub(crate) fn get(&self, id: &BlockId) -> Option<&Resident<T>> {
        self.entries.get(id)
    }

    /// Marks `id` most recently used; false when absent.
    pub(crate) fn touch(&mut self, id: &BlockId) -> bool {
        let Some(entry) = self.entries.get_mut(id) else {
            return false;
        };
        self.order.remove(&entry.tick);
        self.clock += 1;
        entry.tick = self.clock;
        self.order.insert(self.clock, *id);
        true
    }

    /// Whether a block of `bytes` could ever fit.
    pub(crate) const fn fits(&self, bytes: u64) -> bool {
        bytes <= self.capacity
    }

    /// The least recently used block, if any.
    #[cfg(test)]
    pub(crate) fn oldest(&self) -> Option<BlockId> {
        self.order.first_key_value().map(|(_, id)| *id)
    }

    /// Free bytes.
    pub(crate) const fn free(&self) -> u64 {
        self.capacity.saturating_sub(self.used)
    }

    /// The least recently used blocks, skipping those `pinned` says are pinned, whose
    /// removal leaves `bytes` free: empty when they already are, `None` when even every
    /// unpinned block would not free enough (then nothing should be evicted).
    pub(crate) fn victims(
        &self,
        bytes: u64,
        pinned: impl Fn(&BlockId) -> bool,
    ) -> Option<Vec<BlockId>> {
        let mut free = self.free();
        let mut out = Vec::new();
        for id in self.order.values() {
            if free >= bytes {
                break;
            }
            if pinned(id) {
                continue;
            }
            free += self.entries.get(id).map_or(0, |e| e.bytes);
            out.push(*id);
        }
        (free >= bytes).then_some(out)
    }

    /// Inserts `id` as most recently used. The caller made room first (`bytes ≤ free`) and
    /// checked that `id` is absent.
    pub(crate) fn insert(&mut self, id: BlockId, bytes: u64, value: T) {
        debug_assert!(bytes <= self.free() && !self.entries.contains_key(&id));
        self.clock += 1;
        self.order.insert(self.clock, id);
        self.used += bytes;
        self.entries.insert(
            id,
            Resident {
                bytes,
                tick: self.clock,
                value,
            },
        );
    }

    /// Removes `id`, returning what it held.
    pub(crate) fn remove(&mut self, id: &BlockId) -> Option<Resident<T>> {
        let entry = self.entries.remove(id)?;
        self.order.remove(&entry.tick);
        self.used -= entry.bytes;
        Some(entry)
    }

    /// Every resident id, least recently used first.
    pub(crate) fn ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.order.values().copied()
    }

    /// Drops everything.
    pub(crate) fn clear(&mut self) -> Vec<BlockId> {
        let ids: Vec<BlockId> = self.order.values().copied().collect();
        self.entries.clear();
        self.order.clear();
        self.used = 0;
        ids
    }
}

#[cfg(test)]
mod tests {
    use kv_events::BlockKey;

    use super::*;
    use crate::store::LayoutId;

    fn id(k: u64) -> BlockId {
        BlockId {
            layout: LayoutId(0),
            key: BlockKey(k),
        }
    }

    #[test]
    fn oldest_follows_touches_and_bytes_are_accounted() {
        let mut t = TierSet::new(10);
        t.insert(id(1), 4, ());
        t.insert(id(2), 4, ());
        assert_eq!((t.used(), t.free(), t.oldest()), (8, 2, Some(id(1))));
        assert!(t.touch(&id(1)));
        assert_eq!(t.oldest(), Some(id(2)));
        assert!(!t.touch(&id(3)));
        assert_eq!(t.remove(&id(2)).map(|r| r.bytes), Some(4));
        assert_eq!((t.used(), t.len(), t.oldest()), (4, 1, Some(id(1))));
        assert_eq!(t.clear(), vec![id(1)]);
        assert_eq!((t.used(), t.len(), t.oldest()), (0, 0, None));
        assert!(t.fits(10) && !t.fits(11));
    }

    #[test]
    fn victims_skip_pinned_blocks_and_refuse_when_they_cannot_free_enough() {
        let mut t = TierSet::new(12);
        for k in 1..=3 {
            t.insert(id(k), 4, ());
        }
        assert_eq!(t.victims(0, |_| false), Some(vec![]));
        assert_eq!(t.victims(4, |_| false), Some(vec![id(1)]));
        assert_eq!(t.victims(8, |i| *i == id(1)), Some(vec![id(2), id(3)]));
        assert_eq!(t.victims(12, |i| *i == id(2)), None);
        assert_eq!(t.len(), 3, "asking evicts nothing");
    }
}
