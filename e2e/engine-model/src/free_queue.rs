//! The free-block queue in eviction order (vLLM's `FreeKVCacheBlockQueue`).
//!
//! Free blocks are taken from the front (the least recently freed first); freed blocks join
//! the back; a prefix-cache hit on a free block removes it from the middle. vLLM uses an
//! intrusive doubly linked list; here an ordered map keyed by a monotonically increasing
//! sequence number gives the same order with `O(log n)` operations and no unsafe or
//! index-juggling code.

use std::collections::BTreeMap;

use crate::BlockId;

#[derive(Debug, Default)]
pub(crate) struct FreeQueue {
    /// Sequence number → block, in eviction order.
    order: BTreeMap<u64, BlockId>,
    /// Block → its sequence number while it is queued.
    position: Vec<Option<u64>>,
    next_seq: u64,
}

impl FreeQueue {
    /// An empty queue for blocks `0..num_blocks`.
    pub(crate) fn new(num_blocks: usize) -> Self {
        Self {
            order: BTreeMap::new(),
            position: vec![None; num_blocks],
            next_seq: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    pub(crate) fn contains(&self, block: BlockId) -> bool {
        matches!(self.position.get(block as usize), Some(Some(_)))
    }

    /// Appends `block` at the back (the last to be evicted). A block already queued stays
    /// where it is.
    pub(crate) fn push_back(&mut self, block: BlockId) {
        let Some(slot) = self.position.get_mut(block as usize) else {
            return;
        };
        if slot.is_some() {
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        *slot = Some(seq);
        self.order.insert(seq, block);
    }

    /// Takes the block at the front (the next eviction candidate).
    pub(crate) fn pop_front(&mut self) -> Option<BlockId> {
        let (_, block) = self.order.pop_first()?;
        if let Some(slot) = self.position.get_mut(block as usize) {
            *slot = None;
        }
        Some(block)
    }

    /// Removes `block` wherever it is; returns whether it was queued.
    pub(crate) fn remove(&mut self, block: BlockId) -> bool {
        let Some(slot) = self.position.get_mut(block as usize) else {
            return false;
        };
        match slot.take() {
            Some(seq) => self.order.remove(&seq).is_some(),
            None => false,
        }
    }

    /// The queued blocks, front first.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.order.values().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_order_with_removal_from_the_middle() {
        let mut q = FreeQueue::new(5);
        for b in [3, 1, 4, 2] {
            q.push_back(b);
        }
        assert!(q.remove(1));
        assert!(!q.remove(1));
        assert!(!q.contains(1));
        q.push_back(1);
        q.push_back(3); // already queued: stays at the front
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![3, 4, 2, 1]);
        assert_eq!(q.pop_front(), Some(3));
        assert_eq!(q.len(), 3);
        assert!(!q.contains(3));
    }

    #[test]
    fn out_of_range_blocks_are_ignored() {
        let mut q = FreeQueue::new(1);
        q.push_back(9);
        assert_eq!(q.len(), 0);
        assert!(!q.remove(9));
        assert_eq!(q.pop_front(), None);
    }
}
