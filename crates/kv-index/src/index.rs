//! The concurrent index: shards by key hash, each behind a `std::sync::RwLock`.
//!
//! Writers (one per source stream) bucket an event batch by shard and take each shard's write
//! lock once per batch; readers take each shard's read lock at most once per lookup and hold
//! it until the walk ends. Writers never hold two locks, so readers collecting several read
//! locks cannot deadlock with them.

use std::cell::RefCell;
use std::sync::{PoisonError, RwLock, RwLockReadGuard};

use kv_events::{BlockKey, KvEvent, Tier};

use crate::block::{ALL_TIERS, Block, SPEC, tier_bit};
use crate::config::{ConfigError, IndexConfig};
use crate::id::{EndpointId, Holder, NodeId};
use crate::matcher::Matcher;
use crate::overlap::Overlap;
use crate::shard::{Op, Shard};
use crate::time::Millis;

const NO_NODE: u32 = u32::MAX;

/// Keys probed together in a lookup.
const BATCH: usize = 8;

/// Counters describing the index's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Distinct blocks held by anyone.
    pub blocks: usize,
    /// (block, holder) residencies.
    pub residencies: usize,
    /// Blocks evicted to stay within capacity, since creation.
    pub evicted_blocks: u64,
    /// Bytes in the index's tables (capacity-based; excludes allocator overhead).
    pub heap_bytes: usize,
}

/// The global prefix index: block keys → the endpoints and nodes holding them, per tier.
#[derive(Debug)]
pub struct KvIndex {
    shards: Box<[RwLock<Shard>]>,
    shift: u32,
    /// Indexed by endpoint id: its node's raw id, or `NO_NODE`.
    nodes: RwLock<Vec<u32>>,
}

thread_local! {
    static MATCHER: RefCell<Matcher> = RefCell::new(Matcher::default());
    static OPS: RefCell<Vec<Vec<Op>>> = const { RefCell::new(Vec::new()) };
}

fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

impl KvIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let per_shard = config.capacity / config.shards;
        Ok(Self {
            shards: (0..config.shards)
                .map(|_| RwLock::new(Shard::new(per_shard)))
                .collect(),
            shift: 64 - config.shards.trailing_zeros(),
            nodes: RwLock::new(Vec::new()),
        })
    }

    fn shard_of(&self, key: BlockKey) -> usize {
        // The top bits: the shard's own table indexes by the (multiplied) low bits.
        key.0.checked_shr(self.shift).unwrap_or(0) as usize
    }

    fn with_shard<R>(&self, i: usize, f: impl FnOnce(&mut Shard) -> R) -> Option<R> {
        let lock = self.shards.get(i)?;
        let mut guard = lock.write().unwrap_or_else(PoisonError::into_inner);
        Some(f(&mut guard))
    }

    /// Says which node an endpoint runs on (`None`: unknown), so lookups credit the node's
    /// host/disk/remote tiers to it.
    pub fn set_endpoint_node(&self, endpoint: EndpointId, node: Option<NodeId>) {
        let mut nodes = self.nodes.write().unwrap_or_else(PoisonError::into_inner);
        let i = endpoint.get() as usize;
        if nodes.len() <= i {
            nodes.resize(i + 1, NO_NODE);
        }
        if let Some(slot) = nodes.get_mut(i) {
            *slot = node.map_or(NO_NODE, NodeId::get);
        }
    }

    /// Applies one source's events in order. `Stored`'s parent, LoRA and token count are not
    /// needed (keys already chain); `Unknown` is skipped.
    pub fn apply(&self, source: Holder, events: &[KvEvent]) {
        let holder = source.pack();
        OPS.with_borrow_mut(|ops| {
            ops.resize_with(self.shards.len(), Vec::new);
            for ev in events {
                match ev {
                    KvEvent::Stored { keys, tier, .. } => {
                        self.bucket(ops, keys, |k| Op::Set(k, tier_bit(*tier)));
                    }
                    KvEvent::Removed { keys, tier } => {
                        self.bucket(ops, keys, |k| Op::Unset(k, tier_bit(*tier)));
                    }
                    KvEvent::Cleared { tier } => {
                        self.flush(holder, ops);
                        let bits = tier.map_or(ALL_TIERS, tier_bit);
                        for i in 0..self.shards.len() {
                            self.with_shard(i, |s| s.clear(holder, bits, bits & 1 != 0));
                        }
                    }
                    KvEvent::Unknown => {}
                }
            }
            self.flush(holder, ops);
        });
    }

    /// Runs each shard's pending ops under one write lock, then empties them.
    fn run(&self, ops: &mut [Vec<Op>], f: impl Fn(&mut Shard, Op)) {
        for (i, v) in ops.iter_mut().enumerate() {
            if v.is_empty() {
                continue;
            }
            self.with_shard(i, |s| v.iter().for_each(|&op| f(s, op)));
            v.clear();
        }
    }

    fn bucket(&self, ops: &mut [Vec<Op>], keys: &[BlockKey], op: impl Fn(BlockKey) -> Op) {
        for &k in keys {
            if let Some(v) = ops.get_mut(self.shard_of(k)) {
                v.push(op(k));
            }
        }
    }

    fn flush(&self, holder: u32, ops: &mut [Vec<Op>]) {
        self.run(ops, |s, op| s.apply(holder, op));
    }

    /// Replaces everything `source` holds (its confirmed tiers; speculation is kept) with a
    /// snapshot of (key, tier) residencies, shard by shard. For resynchronising after a gap or
    /// a new epoch. O(index size): each shard is scanned once.
    pub fn replace_source(
        &self,
        source: Holder,
        snapshot: impl IntoIterator<Item = (BlockKey, Tier)>,
    ) {
        let holder = source.pack();
        let mut ops: Vec<Vec<Op>> = vec![Vec::new(); self.shards.len()];
        for (k, tier) in snapshot {
            if let Some(v) = ops.get_mut(self.shard_of(k)) {
                v.push(Op::Set(k, tier_bit(tier)));
            }
        }
        for (i, v) in ops.iter().enumerate() {
            self.with_shard(i, |s| {
                s.clear(holder, ALL_TIERS, false);
                v.iter().for_each(|&op| s.apply(holder, op));
            });
        }
    }

    /// Forgets `source` entirely (its residencies and speculation). O(index size).
    pub fn remove_source(&self, source: Holder) {
        let holder = source.pack();
        for i in 0..self.shards.len() {
            self.with_shard(i, |s| s.clear(holder, ALL_TIERS | SPEC, true));
        }
    }

    /// Records that a request routed to `endpoint` will put `keys` in its GPU cache: they count
    /// as GPU residency until a store or removal from the endpoint confirms them, or until
    /// [`KvIndex::expire`] runs at or after `now + ttl`.
    pub fn speculate(&self, endpoint: EndpointId, keys: &[BlockKey], now: Millis, ttl: Millis) {
        let holder = Holder::Endpoint(endpoint).pack();
        let deadline = now.after(ttl);
        OPS.with_borrow_mut(|ops| {
            ops.resize_with(self.shards.len(), Vec::new);
            self.bucket(ops, keys, |k| Op::Set(k, 0));
            self.run(ops, |s, op| {
                if let Op::Set(k, _) = op {
                    s.speculate(k, holder, deadline);
                }
            });
        });
    }

    /// Drops speculative entries whose deadline is at or before `now`; returns how many.
    pub fn expire(&self, now: Millis) -> usize {
        (0..self.shards.len())
            .filter_map(|i| self.with_shard(i, |s| s.expire(now)))
            .sum()
    }

    /// For each candidate (in order), the prefix of `keys` it can serve per tier. Stops reading
    /// as soon as no candidate can extend its match.
    pub fn find_matches(&self, keys: &[BlockKey], candidates: &[EndpointId]) -> Vec<Overlap> {
        let mut out = Vec::with_capacity(candidates.len());
        self.find_matches_into(keys, candidates, &mut out);
        out
    }

    /// [`KvIndex::find_matches`], appending to `out`.
    pub fn find_matches_into(
        &self,
        keys: &[BlockKey],
        candidates: &[EndpointId],
        out: &mut Vec<Overlap>,
    ) {
        MATCHER.with_borrow_mut(|m| {
            {
                let nodes = read(&self.nodes);
                m.begin(candidates, |ep| {
                    nodes
                        .get(ep.get() as usize)
                        .copied()
                        .filter(|&n| n != NO_NODE)
                });
            }
            let mut guards: Vec<Option<RwLockReadGuard<'_, Shard>>> = Vec::new();
            guards.resize_with(self.shards.len(), || None);
            let mut n = 0u32;
            // Keys go in batches: the batch's table probes are independent loads, so their
            // cache misses overlap instead of queueing one after another.
            for batch in keys.chunks(BATCH) {
                if !m.any_alive() {
                    break;
                }
                for &key in batch {
                    let i = self.shard_of(key);
                    if let (Some(slot @ None), Some(lock)) = (guards.get_mut(i), self.shards.get(i))
                    {
                        *slot = Some(read(lock));
                    }
                }
                let mut found: [Option<&Block>; BATCH] = [None; BATCH];
                for (f, &key) in found.iter_mut().zip(batch) {
                    *f = guards
                        .get(self.shard_of(key))
                        .and_then(Option::as_ref)
                        .and_then(|s| s.get(key));
                }
                for b in found.iter().flatten() {
                    b.touch();
                }
                for f in found.iter().take(batch.len()) {
                    let alive = match f {
                        Some(block) => m.key(n, block.residencies()),
                        None => m.key(n, std::iter::empty()),
                    };
                    n += 1;
                    if !alive {
                        break;
                    }
                }
            }
            m.finish(n, out);
        });
    }

    /// Counts of blocks, residencies and evictions, and the tables' size.
    pub fn stats(&self) -> IndexStats {
        let mut st = IndexStats::default();
        for lock in self.shards.iter() {
            let s = read(lock);
            st.blocks += s.blocks();
            st.residencies += s.residencies();
            st.evicted_blocks += s.evicted();
            st.heap_bytes += s.heap_bytes();
        }
        st
    }
}
