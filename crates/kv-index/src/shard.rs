//! One shard of the index: the block table, CLOCK eviction under a residency budget, the
//! speculative entries' deadlines, and each source's key list (so clearing or replacing a
//! source visits only its own keys, not the shard). Single-threaded: the concurrency
//! layer ([`crate::KvIndex`]) wraps each shard in a lock.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use kv_events::BlockKey;
use kv_events::fasthash::{BuildU64Hasher, U64Map};

use crate::table::{Bits, NO_POS, SPEC, Table};
use crate::time::Millis;

/// A write to one block for the batch's holder.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    /// Set confirmed bits (a store); a GPU store also confirms speculation.
    Set(BlockKey, Bits),
    /// Clear bits (a removal); removing GPU also drops speculation.
    Unset(BlockKey, Bits),
    /// Speculate GPU residency until the batch's deadline.
    Spec(BlockKey),
}

/// A removed key's place in a source's key list.
const TOMB: u64 = u64::MAX;
/// Dead entries a list tolerates before compacting (tiny in unit tests, to exercise it).
const COMPACT_MIN: usize = if cfg!(test) { 2 } else { 32 };

/// The keys a source holds in this shard; each of its residencies records its index here, so
/// a residency that goes marks its entry dead in O(1) without reading the list, and the list
/// is compacted (dead entries filled from its end) once half of it is dead.
#[derive(Debug, Default)]
struct SourceKeys {
    keys: Vec<u64>,
    dead: usize,
    /// Some residencies are unlisted (the list reached [`NO_POS`] entries, or the key is
    /// [`TOMB`] itself): clearing the source then also scans the shard.
    overflow: bool,
}

impl SourceKeys {
    /// The position a new residency on `key` will get.
    fn next_pos(&self, key: u64) -> u32 {
        u32::try_from(self.keys.len())
            .ok()
            .filter(|&p| p < NO_POS && key != TOMB)
            .unwrap_or(NO_POS)
    }

    /// Marks `key`'s entry (at `pos`) dead. (The position is trusted rather than checked:
    /// reading the entry would be a cache miss per removal.)
    fn unlist(&mut self, table: &mut Table, holder: u32, key: u64, pos: u32) {
        if let Some(e) = self.keys.get_mut(pos as usize) {
            debug_assert_eq!(*e, key);
            let _ = key;
            *e = TOMB;
            self.dead += 1;
            if self.dead >= COMPACT_MIN && 2 * self.dead >= self.keys.len() {
                self.compact(table, holder);
            }
        }
    }

    /// Fills dead entries with live ones from the end and truncates; moves at most `dead`
    /// keys, whose residencies then learn their new positions (probed in overlapping batches).
    fn compact(&mut self, table: &mut Table, holder: u32) {
        let keys = &mut self.keys;
        let mut moved = Vec::new();
        let (mut lo, mut hi) = (0, keys.len());
        loop {
            while lo < hi && keys.get(lo).is_some_and(|&k| k != TOMB) {
                lo += 1;
            }
            while hi > lo && keys.get(hi - 1) == Some(&TOMB) {
                hi -= 1;
            }
            if lo >= hi {
                break;
            }
            keys.swap(lo, hi - 1);
            moved.push(lo);
            lo += 1;
            hi -= 1;
        }
        // Everything from `hi` on is dead now.
        keys.truncate(hi);
        self.dead = 0;
        for batch in moved.chunks(32) {
            let sink = batch.iter().fold(0, |a, &p| {
                let k = keys.get(p).copied().unwrap_or(0);
                a ^ table.peek(table.home(k))
            });
            std::hint::black_box(sink);
            for &p in batch {
                if let (Some(&k), Ok(pos)) = (keys.get(p), u32::try_from(p)) {
                    table.set_pos(k, holder, pos);
                }
            }
        }
    }
}

/// The shard's state.
#[derive(Debug)]
struct Core {
    table: Table,
    hand: usize,
    residencies: usize,
    capacity: usize,
    evicted: u64,
    spec: HashMap<(u64, u32), u64, BuildU64Hasher>,
    spec_heap: BinaryHeap<Reverse<(u64, u64, u32)>>,
    /// Each source's key list, found through `list_of`.
    lists: Vec<SourceKeys>,
    list_of: U64Map<u32, usize>,
    victims: Vec<(u32, Bits, u32)>,
}

#[derive(Debug)]
pub(crate) struct Shard {
    core: Core,
}

impl Core {
    /// The index of `holder`'s key list, created empty if need be.
    fn list(&mut self, holder: u32) -> usize {
        let lists = &mut self.lists;
        *self.list_of.entry(holder).or_insert_with(|| {
            lists.push(SourceKeys::default());
            lists.len() - 1
        })
    }

    /// Applies `f` to `holder`'s bits on `key` (`li`: its key list), keeping the residency
    /// count, the speculation map and the key lists in step and evicting over capacity.
    /// Returns the bits before and after.
    fn write(
        &mut self,
        key: u64,
        holder: u32,
        f: impl FnOnce(Bits) -> Bits,
        li: usize,
    ) -> (Bits, Bits) {
        let next = self.lists.get(li).map_or(NO_POS, |l| l.next_pos(key));
        let (old, new, pos) = self.table.update(key, holder, f, next);
        if old & SPEC != 0 && new & SPEC == 0 {
            self.spec.remove(&(key, holder));
        }
        match (old == 0, new == 0) {
            (true, false) => {
                self.residencies += 1;
                if let Some(list) = self.lists.get_mut(li) {
                    if pos == NO_POS {
                        list.overflow = true;
                    } else {
                        list.keys.push(key);
                    }
                }
                self.evict_over_capacity();
            }
            (false, true) => {
                self.residencies -= 1;
                if let Some(list) = self.lists.get_mut(li) {
                    list.unlist(&mut self.table, holder, key, pos);
                }
            }
            _ => {}
        }
        (old, new)
    }

    fn op(&mut self, holder: u32, op: Op, deadline: Millis, li: usize) {
        match op {
            Op::Set(k, bits) => {
                let gpu = bits & 1 != 0;
                let f = |b| if gpu { (b & !SPEC) | bits } else { b | bits };
                self.write(k.0, holder, f, li);
            }
            Op::Unset(k, bits) => {
                let gpu = bits & 1 != 0;
                let f = |b| if gpu { b & !bits & !SPEC } else { b & !bits };
                self.write(k.0, holder, f, li);
            }
            Op::Spec(k) => {
                // Speculating a block the endpoint already has in GPU is a no-op.
                if self.table.get(k.0).bits_of(holder) & 1 == 0 {
                    self.spec.insert((k.0, holder), deadline.0);
                    self.spec_heap.push(Reverse((deadline.0, k.0, holder)));
                    self.write(k.0, holder, |b| b | SPEC, li);
                }
            }
        }
    }

    /// CLOCK: sweep, giving referenced blocks two more turns and new ones one, until under
    /// budget (after two full turns, whatever the hand meets goes).
    fn evict_over_capacity(&mut self) {
        let cap = self.table.capacity();
        let mut budget = 3 * cap + 1;
        while self.residencies > self.capacity && budget > 0 && cap > 0 {
            budget -= 1;
            self.hand = (self.hand + 1) & (cap - 1);
            match self.table.take_reference(self.hand) {
                None => continue,
                Some(true) if budget > cap => continue,
                _ => {}
            }
            let mut victims = std::mem::take(&mut self.victims);
            victims.clear();
            let gone = self
                .table
                .evict(self.hand, |h, bits, pos| victims.push((h, bits, pos)));
            if let Some((key, n)) = gone {
                for &(h, bits, pos) in &victims {
                    if bits & SPEC != 0 {
                        self.spec.remove(&(key, h));
                    }
                    let list = self.list_of.get(&h).and_then(|&li| self.lists.get_mut(li));
                    if let Some(list) = list {
                        list.unlist(&mut self.table, h, key, pos);
                    }
                }
                self.residencies -= n;
                self.evicted += 1;
                // A later block may have moved into this slot: look at it next.
                self.hand = self.hand.wrapping_sub(1) & (cap - 1);
            }
            self.victims = victims;
        }
    }
}

impl Shard {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            core: Core {
                table: Table::default(),
                hand: 0,
                residencies: 0,
                capacity: capacity.max(1),
                evicted: 0,
                spec: HashMap::default(),
                spec_heap: BinaryHeap::new(),
                lists: Vec::new(),
                list_of: U64Map::default(),
                victims: Vec::new(),
            },
        }
    }

    pub(crate) fn table(&self) -> &Table {
        &self.core.table
    }

    pub(crate) fn residencies(&self) -> usize {
        self.core.residencies
    }

    pub(crate) fn blocks(&self) -> usize {
        self.core.table.len()
    }

    pub(crate) fn evicted(&self) -> u64 {
        self.core.evicted
    }

    /// Applies `holder`'s ops in order (`deadline` is for [`Op::Spec`]).
    pub(crate) fn apply(&mut self, holder: u32, ops: &[Op], deadline: Millis) {
        // Touch every op's home bucket first, so the batch's cache misses overlap (chunks are
        // often a few ops: a fold costs nothing to set up).
        let t = &self.core.table;
        let sink = ops.iter().fold(0, |a, op| {
            let (Op::Set(k, _) | Op::Unset(k, _) | Op::Spec(k)) = *op;
            a ^ t.peek(t.home(k.0))
        });
        std::hint::black_box(sink);
        let li = self.core.list(holder);
        for &op in ops {
            self.core.op(holder, op, deadline, li);
        }
    }

    /// Clears `mask` of `holder` on up to `limit` keys of its list, walking down from
    /// `cursor` (start with `usize::MAX`); returns the cursor to continue from, 0 when done.
    /// Keys listed meanwhile (above the cursor) are left alone; a key moved below the cursor
    /// is cleared twice, which is harmless.
    pub(crate) fn clear_some(
        &mut self,
        holder: u32,
        mask: Bits,
        cursor: usize,
        limit: usize,
    ) -> usize {
        let core = &mut self.core;
        let li = core.list(holder);
        let len = core.lists.get(li).map_or(0, |l| l.keys.len());
        let mut i = cursor.min(len);
        let stop = i.saturating_sub(limit);
        while i > stop {
            i -= 1;
            if let Some(&k) = core.lists.get(li).and_then(|l| l.keys.get(i))
                && k != TOMB
            {
                core.write(k, holder, |b| b & !mask, li);
            }
            // A compaction may have shortened the list below the cursor.
            i = i.min(core.lists.get(li).map_or(0, |l| l.keys.len()));
        }
        if i == 0 && core.lists.get(li).is_some_and(|l| l.overflow) {
            for k in core.table.scan(holder) {
                core.write(k, holder, |b| b & !mask, li);
            }
            let left = core.table.scan(holder).len();
            if let Some(l) = core.lists.get_mut(li) {
                l.overflow = left > l.keys.len() - l.dead;
            }
        }
        i
    }

    /// Drops up to `limit` speculative entries whose deadline is at or before `now`; returns
    /// how many, and whether more may be due.
    pub(crate) fn expire(&mut self, now: Millis, limit: usize) -> (usize, bool) {
        let mut n = 0;
        let mut popped = 0;
        while let Some(&Reverse((deadline, key, holder))) = self.core.spec_heap.peek() {
            if deadline > now.0 {
                return (n, false);
            }
            if popped == limit {
                return (n, true);
            }
            popped += 1;
            self.core.spec_heap.pop();
            if self.core.spec.get(&(key, holder)) == Some(&deadline) {
                self.core.spec.remove(&(key, holder));
                let li = self.core.list(holder);
                self.core.write(key, holder, |b| b & !SPEC, li);
                n += 1;
            }
        }
        (n, false)
    }

    /// Bytes held by the shard's structures (capacities, not allocator overhead).
    pub(crate) fn heap_bytes(&self) -> usize {
        let c = &self.core;
        let spec = c.spec.capacity() * (std::mem::size_of::<((u64, u32), u64)>() + 1)
            + c.spec_heap.capacity() * std::mem::size_of::<(u64, u64, u32)>();
        let sources = c.list_of.capacity() * (std::mem::size_of::<(u32, usize)>() + 1)
            + c.lists.capacity() * std::mem::size_of::<SourceKeys>()
            + c.lists.iter().map(|s| s.keys.capacity() * 8).sum::<usize>();
        c.table.heap_bytes() + spec + sources
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::table::ALL_TIERS;

    /// Every residency is listed by its source at the position it records; lists hold no
    /// stale or repeated keys; the residency count is exact.
    fn check(s: &Shard) -> Result<(), TestCaseError> {
        let c = &s.core;
        let mut count = 0;
        for (&h, &li) in &c.list_of {
            let list = &c.lists[li];
            prop_assert!(!list.overflow);
            let dead = list.keys.iter().filter(|&&k| k == TOMB).count();
            prop_assert_eq!(dead, list.dead);
            prop_assert!(list.dead < COMPACT_MIN || 2 * list.dead < list.keys.len());
            for (p, &k) in list.keys.iter().enumerate() {
                if k == TOMB {
                    continue;
                }
                let i = c.table.find(k);
                prop_assert!(i.is_some(), "listed key {k} of {h} absent");
                let held = c.table.get(k).bits_of(h);
                prop_assert!(held != 0, "listed key {k} of {h} not held");
                prop_assert_eq!(c.table.position_of(k, h) as usize, p, "key {} of {}", k, h);
            }
            let mut live: Vec<u64> = list.keys.iter().copied().filter(|&k| k != TOMB).collect();
            live.sort_unstable();
            live.dedup();
            prop_assert_eq!(live.len(), list.keys.len() - dead);
            count += live.len();
        }
        prop_assert_eq!(count, c.residencies);
        Ok(())
    }

    #[derive(Debug, Clone)]
    enum Step {
        Set(u64, u32, Bits),
        Unset(u64, u32, Bits),
        Spec(u64, u32, u64),
        Clear(u32, Bits, usize),
        Expire(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        let key = 0..12u64;
        let holder = 0..4u32;
        prop_oneof![
            6 => (key.clone(), holder.clone(), 1..16u8).prop_map(|(k, h, b)| Step::Set(k, h, b)),
            4 => (key.clone(), holder.clone(), 1..16u8).prop_map(|(k, h, b)| Step::Unset(k, h, b)),
            2 => (key, holder.clone(), 0..20u64).prop_map(|(k, h, d)| Step::Spec(k, h, d)),
            1 => (holder, 1..32u8, 1..4usize).prop_map(|(h, b, n)| Step::Clear(h, b, n)),
            1 => (0..20u64).prop_map(Step::Expire),
        ]
    }

    proptest! {
        #[test]
        fn source_lists_track_every_residency(
            steps in prop::collection::vec(step(), 1..120),
            capacity in prop_oneof![Just(5usize), Just(1000)],
        ) {
            let mut s = Shard::new(capacity);
            for st in steps {
                match st {
                    Step::Set(k, h, b) => s.apply(h, &[Op::Set(BlockKey(k), b & ALL_TIERS)], Millis(0)),
                    Step::Unset(k, h, b) => s.apply(h, &[Op::Unset(BlockKey(k), b & ALL_TIERS)], Millis(0)),
                    Step::Spec(k, h, d) => s.apply(h, &[Op::Spec(BlockKey(k))], Millis(d)),
                    Step::Clear(h, b, n) => {
                        let mut cursor = usize::MAX;
                        while cursor > 0 {
                            cursor = s.clear_some(h, b & (ALL_TIERS | SPEC), cursor, n);
                        }
                    }
                    Step::Expire(now) => while s.expire(Millis(now), 2).1 {},
                }
                check(&s)?;
                prop_assert!(s.residencies() <= capacity);
            }
        }
    }
}
