//! One shard of the index: a single-threaded map from block key to its holders, with CLOCK
//! eviction under a residency budget and the speculative entries' deadlines. Pure: the
//! concurrency layer ([`crate::KvIndex`]) wraps each shard in a lock.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use kv_events::BlockKey;
use kv_events::fasthash::{BuildU64Hasher, U64Map};

use crate::block::{Bits, Block, Residency, SPEC};
use crate::time::Millis;

/// A write to one block for one holder.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    /// Set confirmed bits (a store); a GPU store also confirms speculation.
    Set(BlockKey, Bits),
    /// Clear bits (a removal); removing GPU also drops speculation.
    Unset(BlockKey, Bits),
}

#[derive(Debug)]
pub(crate) struct Shard {
    map: U64Map<BlockKey, u32>,
    slots: Vec<Block>,
    free: Vec<u32>,
    hand: usize,
    residencies: usize,
    capacity: usize,
    evicted: u64,
    spec: HashMap<(BlockKey, u32), u64, BuildU64Hasher>,
    spec_heap: BinaryHeap<Reverse<(u64, BlockKey, u32)>>,
}

impl Shard {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            map: U64Map::default(),
            slots: Vec::new(),
            free: Vec::new(),
            hand: 0,
            residencies: 0,
            capacity: capacity.max(1),
            evicted: 0,
            spec: HashMap::default(),
            spec_heap: BinaryHeap::new(),
        }
    }

    /// The block for `key`, if any holder has it.
    pub(crate) fn get(&self, key: BlockKey) -> Option<&Block> {
        let slot = *self.map.get(&key)?;
        self.slots.get(slot as usize)
    }

    pub(crate) fn residencies(&self) -> usize {
        self.residencies
    }

    pub(crate) fn blocks(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Applies `f` to `holder`'s bits on `key`, creating and deleting the block as needed.
    fn update(&mut self, key: BlockKey, holder: u32, f: impl FnOnce(Bits) -> Bits) {
        match self.map.get(&key).copied() {
            Some(slot) => {
                let Some(block) = self.slots.get_mut(slot as usize) else {
                    return;
                };
                let delta = block.update(holder, f);
                block.touch();
                self.residencies = self.residencies.saturating_add_signed(delta);
                if block.is_vacant() {
                    self.vacate(slot);
                } else if delta > 0 {
                    self.evict_over_capacity();
                }
            }
            None => {
                let bits = f(0);
                if bits == 0 {
                    return;
                }
                let block = Block::new(key, Residency { holder, bits });
                let slot = match self.free.pop() {
                    Some(slot) => {
                        if let Some(b) = self.slots.get_mut(slot as usize) {
                            *b = block;
                        }
                        slot
                    }
                    None => {
                        self.slots.push(block);
                        u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX)
                    }
                };
                self.map.insert(key, slot);
                self.residencies += 1;
                self.evict_over_capacity();
            }
        }
    }

    fn vacate(&mut self, slot: u32) {
        if let Some(b) = self.slots.get_mut(slot as usize) {
            self.map.remove(&b.key);
            self.residencies -= b.len();
            *b = Block::vacant();
            self.free.push(slot);
        }
    }

    /// CLOCK: sweep, giving referenced blocks a second chance, until under budget.
    fn evict_over_capacity(&mut self) {
        let mut budget = 2 * self.slots.len() + 1;
        while self.residencies > self.capacity && budget > 0 && !self.slots.is_empty() {
            budget -= 1;
            self.hand = (self.hand + 1) % self.slots.len();
            let Some(b) = self.slots.get(self.hand) else {
                continue;
            };
            if b.is_vacant() || (b.take_reference() && budget > self.slots.len()) {
                continue;
            }
            let slot = u32::try_from(self.hand).unwrap_or(u32::MAX);
            self.vacate(slot);
            self.evicted += 1;
        }
    }

    pub(crate) fn apply(&mut self, holder: u32, op: Op) {
        match op {
            Op::Set(key, bits) => {
                let gpu = bits & 1 != 0;
                if gpu {
                    self.spec.remove(&(key, holder));
                }
                self.update(
                    key,
                    holder,
                    |b| if gpu { (b & !SPEC) | bits } else { b | bits },
                );
            }
            Op::Unset(key, bits) => {
                let gpu = bits & 1 != 0;
                if gpu {
                    self.spec.remove(&(key, holder));
                }
                self.update(
                    key,
                    holder,
                    |b| if gpu { b & !bits & !SPEC } else { b & !bits },
                );
            }
        }
    }

    /// Clears `bits` of `holder` on every block, and its speculation too when `drop_spec`.
    /// O(blocks in the shard).
    pub(crate) fn clear(&mut self, holder: u32, bits: Bits, drop_spec: bool) {
        let bits = if drop_spec { bits | SPEC } else { bits & !SPEC };
        if drop_spec {
            self.spec.retain(|&(_, h), _| h != holder);
        }
        for slot in 0..self.slots.len() {
            let Some(b) = self.slots.get_mut(slot) else {
                continue;
            };
            if b.is_vacant() || b.bits_of(holder) == 0 {
                continue;
            }
            let delta = b.update(holder, |x| x & !bits);
            self.residencies = self.residencies.saturating_add_signed(delta);
            if b.is_vacant() {
                self.vacate(u32::try_from(slot).unwrap_or(u32::MAX));
            }
        }
    }

    /// Records a speculative GPU residency until `deadline`. A no-op where the holder already
    /// has the block in GPU.
    pub(crate) fn speculate(&mut self, key: BlockKey, holder: u32, deadline: Millis) {
        if self.get(key).is_some_and(|b| b.bits_of(holder) & 1 != 0) {
            return;
        }
        self.spec.insert((key, holder), deadline.0);
        self.spec_heap.push(Reverse((deadline.0, key, holder)));
        self.update(key, holder, |b| b | SPEC);
    }

    /// Drops speculation whose deadline is at or before `now`; returns how many.
    pub(crate) fn expire(&mut self, now: Millis) -> usize {
        let mut n = 0;
        while let Some(&Reverse((deadline, key, holder))) = self.spec_heap.peek() {
            if deadline > now.0 {
                break;
            }
            self.spec_heap.pop();
            if self.spec.get(&(key, holder)) == Some(&deadline) {
                self.spec.remove(&(key, holder));
                self.update(key, holder, |b| b & !SPEC);
                n += 1;
            }
        }
        n
    }

    /// Bytes held by the shard's structures (tables at capacity, not allocator overhead).
    pub(crate) fn heap_bytes(&self) -> usize {
        let map = self.map.capacity() * (std::mem::size_of::<(BlockKey, u32)>() + 1);
        let slots = self.slots.capacity() * std::mem::size_of::<Block>();
        let more: usize = self.slots.iter().map(Block::heap_bytes).sum();
        let spec = self.spec.capacity() * (std::mem::size_of::<((BlockKey, u32), u64)>() + 1)
            + self.spec_heap.capacity() * std::mem::size_of::<(u64, BlockKey, u32)>();
        map + slots + more + self.free.capacity() * 4 + spec
    }
}
