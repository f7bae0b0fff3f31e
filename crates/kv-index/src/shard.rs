//! One shard of the index: the block table, CLOCK eviction under a residency budget, the
//! speculative entries' deadlines, each source's key list (so clearing or replacing a source
//! visits only its own keys, not the shard), and the upkeep of the holders' run logs
//! ([`crate::runs`]) that every residency change implies. Single-threaded: the concurrency
//! layer ([`crate::KvIndex`]) wraps each shard in a lock.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use kv_events::BlockKey;
use kv_events::fasthash::{BuildU64Hasher, U64Map};

use crate::runs::RunCtx;
use crate::table::{Bits, Grown, NO_POS, Retired, SPEC, Table, Update};
use crate::time::Millis;

/// A write to one block for the batch's holder. Writes that may create a residency carry the
/// run-log position it gets (reserved in chain order by the caller; [`NO_POS`]: none).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    /// Set confirmed bits (a store); a GPU store also confirms speculation.
    Set(BlockKey, Bits, u32),
    /// Clear bits (a removal); removing GPU also drops speculation.
    Unset(BlockKey, Bits),
    /// Speculate GPU residency until the batch's deadline.
    Spec(BlockKey, u32),
}

/// Dropped keys a list tolerates beyond its live ones before compacting (tiny in unit tests,
/// to exercise it).
const COMPACT_MIN: usize = if cfg!(test) { 2 } else { 32 };

/// The keys a source holds in this shard, lazily: a new residency appends its key; a vanished
/// one appends its key to `dropped` (a sequential write, where marking its list entry would be
/// a cache miss). Residencies of one (key, source) come and go in turn, so of a key listed
/// `n` times and dropped `g` times the first `g` entries are dead and any other is live. A
/// compaction (once `dropped` outgrows the live count) removes exactly those, keeping the
/// order, without reading the table. Every live residency's key is listed once.
#[derive(Debug, Default)]
struct SourceKeys {
    keys: Vec<u64>,
    dropped: Vec<u64>,
}

impl SourceKeys {
    /// Live entries.
    fn live(&self) -> usize {
        self.keys.len() - self.dropped.len()
    }

    /// A residency on `key` went (`scratch`: reusable space for a compaction).
    fn drop_key(&mut self, key: u64, scratch: &mut U64Map<u64, u32>) {
        self.dropped.push(key);
        if self.dropped.len() >= COMPACT_MIN + self.live() {
            self.compact(scratch);
        }
    }

    /// Removes the dead entries: for each key, as many of its first entries as it was dropped.
    fn compact(&mut self, gone: &mut U64Map<u64, u32>) {
        let g = self.dropped.len();
        if self.keys.get(..g) == Some(&self.dropped[..]) {
            // The oldest entries went, in order (first in, first out): by the rule above they
            // are exactly the dead ones.
            self.keys.drain(..g);
            self.dropped.clear();
            return;
        }
        gone.clear();
        gone.reserve(self.dropped.len());
        for &k in &self.dropped {
            *gone.entry(k).or_default() += 1;
        }
        self.keys.retain(|k| match gone.get_mut(k) {
            Some(n) if *n > 0 => {
                *n -= 1;
                false
            }
            _ => true,
        });
        self.dropped.clear();
        if gone.capacity() > 4 * COMPACT_MIN.max(self.keys.len()) {
            // One large compaction must not keep its space for ever.
            *gone = U64Map::default();
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
    /// Space for source-list compactions.
    scratch: U64Map<u64, u32>,
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
    /// count, the speculation map, the key lists and the run logs in step and evicting over
    /// capacity. Returns the bits before and after.
    fn write(
        &mut self,
        key: u64,
        holder: u32,
        f: impl FnOnce(Bits) -> Bits,
        li: usize,
        pos: u32,
        runs: &mut RunCtx<'_>,
    ) -> (Bits, Bits) {
        // A position is only recorded where the writer holds the log it points into.
        let pos = if runs.own(holder).is_some() {
            pos
        } else {
            NO_POS
        };
        let u = self.table.update(key, holder, f, pos);
        let Update { old, new, .. } = u;
        if old & SPEC != 0 && new & SPEC == 0 {
            self.spec.remove(&(key, holder));
        }
        Self::keep_runs(&u, key, holder, runs);
        match (old == 0, new == 0) {
            (true, false) => {
                self.residencies += 1;
                if let Some(list) = self.lists.get_mut(li) {
                    list.keys.push(key);
                }
                self.evict_over_capacity(runs);
            }
            (false, true) => {
                self.residencies -= 1;
                if let Some(list) = self.lists.get_mut(li) {
                    list.drop_key(key, &mut self.scratch);
                }
            }
            _ => {}
        }
        (old, new)
    }

    /// The run-log side of an update (see [`crate::runs`] for the invariant kept).
    fn keep_runs(u: &Update, key: u64, holder: u32, runs: &mut RunCtx<'_>) {
        if let Some((h, pos)) = u.displaced {
            runs.zero(h, pos);
        }
        if u.old == u.new {
            return;
        }
        let state = if u.sole { u.new } else { 0 };
        match runs.own(holder) {
            Some(l) if u.old == 0 => l.commit(u.pos, key, state),
            Some(l) if state != 0 => l.set(u.pos, key, state),
            _ => runs.zero(holder, u.pos),
        }
    }

    fn op(&mut self, holder: u32, op: Op, deadline: Millis, li: usize, runs: &mut RunCtx<'_>) {
        match op {
            Op::Set(k, bits, pos) => {
                let gpu = bits & 1 != 0;
                let f = |b| if gpu { (b & !SPEC) | bits } else { b | bits };
                self.write(k.0, holder, f, li, pos, runs);
            }
            Op::Unset(k, bits) => {
                let gpu = bits & 1 != 0;
                let f = |b| if gpu { b & !bits & !SPEC } else { b & !bits };
                self.write(k.0, holder, f, li, NO_POS, runs);
            }
            Op::Spec(k, pos) => {
                // Speculating a block the endpoint already has in GPU is a no-op.
                if self.table.get(k.0).bits_of(holder) & 1 == 0 {
                    self.spec.insert((k.0, holder), deadline.0);
                    self.spec_heap.push(Reverse((deadline.0, k.0, holder)));
                    self.write(k.0, holder, |b| b | SPEC, li, pos, runs);
                }
            }
        }
    }

    /// CLOCK: sweep, giving referenced blocks two more turns and new ones one, until under
    /// budget (after two full turns, whatever the hand meets goes).
    fn evict_over_capacity(&mut self, runs: &mut RunCtx<'_>) {
        let cap = self.table.capacity();
        let mut budget = 3 * cap + 1;
        while self.residencies > self.capacity && budget > 0 && cap > 0 {
            budget -= 1;
            self.hand = (self.hand + 1) & (cap - 1);
            let walked = |k, h, pos| runs.take_ref(h, pos, k);
            match self.table.take_reference(self.hand, walked) {
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
                    runs.zero(h, pos);
                    let list = self.list_of.get(&h).and_then(|&li| self.lists.get_mut(li));
                    if let Some(list) = list {
                        list.drop_key(key, &mut self.scratch);
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
                scratch: U64Map::default(),
            },
        }
    }

    pub(crate) fn table(&self) -> &Table {
        &self.core.table
    }

    pub(crate) fn residencies(&self) -> usize {
        self.core.residencies
    }

    /// `holder`'s residencies in this shard (its key list's live entries).
    pub(crate) fn residencies_of(&self, holder: u32) -> usize {
        self.core
            .list_of
            .get(&holder)
            .and_then(|&li| self.core.lists.get(li))
            .map_or(0, SourceKeys::live)
    }

    pub(crate) fn blocks(&self) -> usize {
        self.core.table.len()
    }

    pub(crate) fn evicted(&self) -> u64 {
        self.core.evicted
    }

    /// How many blocks `ops` may create (stores and speculation count, removals do not),
    /// when that many could take the table past [`Table::wants_room`]: pass it to
    /// [`Shard::grown`].
    pub(crate) fn wants_room(&self, ops: &[Op]) -> Option<usize> {
        let adding = ops.iter().filter(|op| !matches!(op, Op::Unset(..))).count();
        (adding > 0 && self.core.table.wants_room(adding)).then_some(adding)
    }

    /// The table's slots grown for `adding` more blocks ([`Table::grown`]), built under the
    /// shared lock.
    pub(crate) fn grown(&self, adding: usize) -> Grown {
        self.core.table.grown(adding)
    }

    /// Installs a grown copy if the table did not change since ([`Table::install`]); the
    /// replaced slots are the caller's to drop, after letting go of the lock.
    pub(crate) fn install(&mut self, grown: Grown) -> Option<Retired> {
        self.core.table.install(grown)
    }

    /// Table doublings done in place and grown copies installed.
    pub(crate) fn growths(&self) -> (u64, u64) {
        self.core.table.growths()
    }

    /// Applies `holder`'s ops in order (`deadline` is for [`Op::Spec`]).
    pub(crate) fn apply(
        &mut self,
        holder: u32,
        ops: &[Op],
        deadline: Millis,
        runs: &mut RunCtx<'_>,
    ) {
        std::hint::black_box(self.touch(holder, ops));
        self.apply_touched(holder, ops, deadline, runs);
    }

    /// Loads the lines `ops` will write (every op's home bucket, the tails of `holder`'s key
    /// list and dropped keys) and returns a value depending on them: a writer touches all its
    /// shards' lines first, so their cache misses overlap instead of stalling one by one.
    pub(crate) fn touch(&self, holder: u32, ops: &[Op]) -> u64 {
        let t = &self.core.table;
        let sink = ops.iter().fold(0, |a, op| {
            let (Op::Set(k, ..) | Op::Unset(k, _) | Op::Spec(k, _)) = *op;
            a ^ t.peek(t.home(k.0))
        });
        let list = self
            .core
            .list_of
            .get(&holder)
            .and_then(|&li| self.core.lists.get(li));
        list.map_or(sink, |l| {
            sink ^ l.keys.last().copied().unwrap_or(0) ^ l.dropped.last().copied().unwrap_or(0)
        })
    }

    /// [`Shard::apply`] once [`Shard::touch`] has loaded the lines.
    pub(crate) fn apply_touched(
        &mut self,
        holder: u32,
        ops: &[Op],
        deadline: Millis,
        runs: &mut RunCtx<'_>,
    ) {
        let li = self.core.list(holder);
        for &op in ops {
            self.core.op(holder, op, deadline, li, runs);
        }
    }

    /// Clears `mask` of `holder` on up to `limit` keys of its list, walking down from
    /// `cursor` (start with `usize::MAX`); returns the cursor to continue from, 0 when done.
    /// A compaction meanwhile only moves keys down (keeping their order), so every key below
    /// the cursor is still visited; one moved from above is cleared too, which is harmless.
    pub(crate) fn clear_some(
        &mut self,
        holder: u32,
        mask: Bits,
        cursor: usize,
        limit: usize,
        runs: &mut RunCtx<'_>,
    ) -> usize {
        let core = &mut self.core;
        let li = core.list(holder);
        let len = core.lists.get(li).map_or(0, |l| l.keys.len());
        let mut i = cursor.min(len);
        let stop = i.saturating_sub(limit);
        while i > stop {
            i -= 1;
            if let Some(&k) = core.lists.get(li).and_then(|l| l.keys.get(i)) {
                core.write(k, holder, |b| b & !mask, li, NO_POS, runs);
            }
            // A compaction may have shortened the list below the cursor.
            i = i.min(core.lists.get(li).map_or(0, |l| l.keys.len()));
        }
        i
    }

    /// Drops up to `limit` speculative entries whose deadline is at or before `now`; returns
    /// how many, and whether more may be due.
    pub(crate) fn expire(
        &mut self,
        now: Millis,
        limit: usize,
        runs: &mut RunCtx<'_>,
    ) -> (usize, bool) {
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
                self.core
                    .write(key, holder, |b| b & !SPEC, li, NO_POS, runs);
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
            + c.lists
                .iter()
                .map(|s| (s.keys.capacity() + s.dropped.capacity()) * 8)
                .sum::<usize>();
        c.table.heap_bytes() + spec + sources
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::runs::Runs;
    use crate::table::{ALL_TIERS, Holders};

    const KEYS: u64 = 12;

    /// Runs `f` on the shard as a writer holding `holder`'s log would, then does the deferred
    /// zeroings.
    fn with_log<R>(
        s: &mut Shard,
        runs: &Runs,
        holder: Option<u32>,
        f: impl FnOnce(&mut Shard, &mut RunCtx<'_>) -> R,
    ) -> R {
        let mut zeros = Vec::new();
        let r = match holder {
            Some(h) => runs.get_or_create(h).write(|log| {
                let mut ctx = RunCtx {
                    holder: h,
                    own: Some(log),
                    runs: Some(runs),
                    zeros: &mut zeros,
                };
                f(s, &mut ctx)
            }),
            None => f(s, &mut RunCtx::deferred(runs, &mut zeros)),
        };
        runs.apply_zeros(&mut zeros);
        r
    }

    /// Every residency is listed by its source (lists stay within twice their live count
    /// plus slack); every run-log entry claiming a state is its key's only residency with
    /// exactly those bits; the residency count is exact.
    fn check(s: &Shard, runs: &Runs) -> Result<(), TestCaseError> {
        let c = &s.core;
        let mut count = 0;
        for k in 0..KEYS {
            c.table.get(k).for_each(|h, _| {
                count += 1;
                let listed = c
                    .list_of
                    .get(&h)
                    .is_some_and(|&li| c.lists[li].keys.contains(&k));
                assert!(listed, "residency ({k}, {h}) unlisted");
            });
        }
        prop_assert_eq!(count, c.residencies);
        for (&h, &li) in &c.list_of {
            let list = &c.lists[li];
            let held = (0..KEYS).filter(|&k| c.table.holds(k, h)).count();
            prop_assert_eq!(list.live(), held, "holder {}", h);
            prop_assert!(list.dropped.len() < COMPACT_MIN + list.live());
            // Exactly the live keys survive a compaction, each once.
            let mut copy = SourceKeys {
                keys: list.keys.clone(),
                dropped: list.dropped.clone(),
            };
            copy.compact(&mut U64Map::default());
            let mut live = copy.keys.clone();
            live.sort_unstable();
            let mut want: Vec<u64> = (0..KEYS).filter(|&k| c.table.holds(k, h)).collect();
            want.sort_unstable();
            prop_assert_eq!(live, want, "holder {}", h);
            if let Some(log) = runs.get(h) {
                prop_assert_eq!(log.queued(), 0);
                for (k, state) in log.try_read().unwrap().known() {
                    prop_assert_eq!(
                        c.table.get(k),
                        Holders::One(crate::table::entry(h, state)),
                        "run entry ({}, {}) of {}",
                        k,
                        state,
                        h
                    );
                }
            }
        }
        Ok(())
    }

    #[derive(Debug, Clone)]
    enum Step {
        Set(u64, u32, u64, Bits),
        Unset(u64, u32, Bits),
        Spec(u64, u32, u64),
        /// Speculation while the holder's log is held exclusively (by its writer).
        SpecBusy(u64, u32, u64),
        Clear(u32, Bits, usize),
        Expire(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        let key = 0..KEYS;
        let holder = 0..4u32;
        prop_oneof![
            6 => (key.clone(), holder.clone(), 1..5u64, 1..16u8).prop_map(|(k, h, n, b)| Step::Set(k, h, n, b)),
            4 => (key.clone(), holder.clone(), 1..16u8).prop_map(|(k, h, b)| Step::Unset(k, h, b)),
            2 => (key.clone(), holder.clone(), 0..20u64).prop_map(|(k, h, d)| Step::Spec(k, h, d)),
            2 => (key, holder.clone(), 0..20u64).prop_map(|(k, h, d)| Step::SpecBusy(k, h, d)),
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
            let runs = Runs::default();
            for st in steps {
                match st {
                    Step::Set(k, h, n, b) => with_log(&mut s, &runs, Some(h), |s, r| {
                        // A run of `n` consecutive keys, as one event stores them.
                        let base = r.own.as_deref_mut().unwrap().reserve_run(n as usize);
                        let ops: Vec<Op> = (0..n)
                            .map(|j| Op::Set(BlockKey((k + j) % KEYS), b & ALL_TIERS, base + j as u32))
                            .collect();
                        s.apply(h, &ops, Millis(0), r);
                    }),
                    Step::Unset(k, h, b) => with_log(&mut s, &runs, Some(h), |s, r| {
                        s.apply(h, &[Op::Unset(BlockKey(k), b & ALL_TIERS)], Millis(0), r);
                    }),
                    Step::Spec(k, h, d) => with_log(&mut s, &runs, Some(h), |s, r| {
                        let pos = r.own.as_deref_mut().unwrap().reserve_run(1);
                        s.apply(h, &[Op::Spec(BlockKey(k), pos)], Millis(d), r);
                    }),
                    Step::SpecBusy(k, h, d) => runs.get_or_create(h).write(|_| {
                        // As `KvIndex::speculate` does when the log is busy: no position,
                        // every zeroing deferred (here: queued for the holder of the log).
                        with_log(&mut s, &runs, None, |s, r| {
                            s.apply(h, &[Op::Spec(BlockKey(k), NO_POS)], Millis(d), r);
                        });
                    }),
                    Step::Clear(h, b, n) => {
                        let mut cursor = usize::MAX;
                        while cursor > 0 {
                            cursor = with_log(&mut s, &runs, None, |s, r| {
                                s.clear_some(h, b & (ALL_TIERS | SPEC), cursor, n, r)
                            });
                        }
                    }
                    Step::Expire(now) => {
                        while with_log(&mut s, &runs, None, |s, r| s.expire(Millis(now), 2, r)).1 {}
                    }
                }
                check(&s, &runs)?;
                prop_assert!(s.residencies() <= capacity);
            }
        }
    }
}
