//! Run logs: the chain-local layout that lets a lookup read a chain's consecutive blocks
//! sequentially instead of probing the table once per key.
//!
//! Each holder has a [`RunLog`]: the keys of its residencies in the order they were created
//! (a `Stored` event's consecutive keys land next to each other: a *run*), each with a
//! *state*. A residency records its log position in the table (the slot word or arena
//! entry), so its entry is found in O(1).
//!
//! **Invariant** (between writes): an entry `(key, state)` whose state has tier bits is exact:
//! the holder is the block's *only* holder and `state` is its bits. State 0 means "unknown:
//! probe the table". So a lookup that found key `i` held by `h` alone at position `p` compares
//! the query's keys `i+1, i+2, …` with `h`'s entries `p+1, p+2, …` and takes every equal,
//! non-zero entry as that key's holders; where the log diverges or says 0 it probes again.
//! Exactness rests on each entry alone (key equality and its state), never on the run.
//!
//! Writers keep it: a new residency appends its entry (state = its bits when it is the
//! block's only holder, else 0); a change of the holder's bits on a block it holds alone
//! rewrites the entry; anything else that touches the residency (its removal, eviction, a
//! second holder arriving, a write by another thread) zeroes it. A rewrite to a non-zero
//! state checks the key at the position first, so a position reused since (the log wraps) is
//! left alone; a zeroing needs no check (zero is always safe: a reused entry only loses its
//! shortcut), so it touches only the 1-byte state. The
//! log grows by a quarter while more than half its entries are live, else wraps, so it stays
//! under 2.5 times its holder's accelerated residencies when it last grew (9 bytes per entry).
//!
//! Concurrency: a log sits behind its own `RwLock` in a [`LogCell`]. Appends and rewrites take
//! it exclusively (the holder's writer, for the whole of one `apply`); zeroing and lookups take
//! it shared (states are atomic). Nobody waits for a log held exclusively except its holder's
//! next writer: a lookup only *tries* the lock and falls back to probing; a zeroing that finds
//! the log held queues its position in the cell, and the thread holding the log zeroes the
//! queue before it lets go (so the entry is exact again by the time anyone can read the log);
//! and speculation *tries* the lock and, when the log is busy, records its residencies without
//! a log position. Writers zero other holders' entries only after releasing their shard locks,
//! so no thread waits for a log while holding what another waits for.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, TryLockError};

use kv_events::fasthash::U64Map;

use crate::table::{ALL_TIERS, Bits, NO_POS, SPEC};

/// The bits of a state that describe the residency.
const STATE: u8 = ALL_TIERS | SPEC;
/// The smallest log.
const MIN_LEN: usize = 64;
/// The largest log: positions must stay below [`NO_POS`].
const MAX_LEN: usize = 1 << 23;

/// The reference bits a walk sets, gathered one word at a time ([`RunLog::mark`]).
struct Marks<'a> {
    log: &'a RunLog,
    word: usize,
    mask: u64,
}

impl Marks<'_> {
    /// Adds `bits` (from position `p` up; they must fit in `p`'s word).
    fn add(&mut self, p: usize, bits: u64) {
        if p / 64 != self.word {
            self.flush();
            self.word = p / 64;
        }
        self.mask |= bits << (p % 64);
    }

    fn flush(&mut self) {
        self.log.mark(self.word, self.mask);
        self.mask = 0;
    }
}

/// One holder's log of runs.
#[derive(Debug, Default)]
pub(crate) struct RunLog {
    keys: Vec<u64>,
    states: Vec<AtomicU8>,
    /// One bit per entry: a lookup walked it since the CLOCK hand last asked (the reference
    /// bit of blocks a lookup read from here and never probed). Apart from the states so that
    /// a lookup marks a run with a plain load and store per 64 entries ([`RunLog::mark`]):
    /// a locked read-modify-write per entry, as a bit in the state byte needed (zeroings
    /// race with lookups there), cost a third of a cold lookup, because each one stops the
    /// loads behind it from overlapping their misses.
    refs: Vec<AtomicU64>,
    /// Where the next entry goes.
    next: usize,
}

/// An entry to zero once the writer has let go of its shard: (holder, position).
pub(crate) type Zero = (u32, u32);

impl RunLog {
    /// Reserves `n` consecutive positions for the keys of one event, in order, and returns
    /// the first ([`NO_POS`] when `n` is 0 or too large); [`RunLog::commit`] fills those that
    /// become new residencies. Grows the log while more
    /// than half of it is live, else wraps to the start.
    pub(crate) fn reserve_run(&mut self, n: usize) -> u32 {
        if n == 0 || n > MAX_LEN / 2 {
            return NO_POS;
        }
        let len = self.keys.len();
        if self.next + n > len {
            let live = self
                .states
                .iter()
                .filter(|s| s.load(Relaxed) & STATE != 0)
                .count();
            // Grow by a quarter (or what the run needs) while more than half is live.
            let mut to = len;
            if len < MIN_LEN || 2 * live > len {
                to = (len + (len / 4).max(self.next + n - len)).max(MIN_LEN);
            }
            if to == len || to > MAX_LEN {
                self.next = 0;
                to = len.max(n).max(MIN_LEN);
            }
            if to > len {
                self.keys.reserve_exact(to - len);
                self.keys.resize(to, 0);
                self.states.reserve_exact(to - len);
                self.states.resize_with(to, AtomicU8::default);
                self.refs.resize_with(to.div_ceil(64), AtomicU64::default);
            }
        }
        // The range keeps its old entries until commits overwrite them: each is still exact
        // (its residency zeroes it when it changes).
        let base = self.next;
        self.next = base + n;
        u32::try_from(base).unwrap_or(NO_POS)
    }

    /// Fills the reserved position `pos` with `key` in `state` (0: not its block's only
    /// holder).
    pub(crate) fn commit(&mut self, pos: u32, key: u64, state: Bits) {
        let p = pos as usize;
        if let (Some(k), Some(s)) = (self.keys.get_mut(p), self.states.get(p)) {
            *k = key;
            s.store(state & STATE, Relaxed);
            if let Some(w) = self.refs.get_mut(p / 64) {
                *w.get_mut() &= !(1 << (p % 64));
            }
        }
    }

    /// Sets the state at `pos` if it still holds `key`.
    pub(crate) fn set(&self, pos: u32, key: u64, state: Bits) {
        if let Some(s) = self.state_of(pos, key) {
            s.store(state & STATE, Relaxed);
        }
    }

    /// Zeroes the state at `pos` without reading its key: zero is always safe (an entry
    /// since reused by another residency only loses its acceleration), and the 1-byte states
    /// are a ninth of the log's lines.
    pub(crate) fn zero(&self, pos: u32) {
        if let Some(s) = self.states.get(pos as usize) {
            s.store(0, Relaxed);
        }
    }

    /// Zeroes (and removes from `zeros`) the entries of `holder`, whose log this is (stores
    /// only: their misses overlap).
    pub(crate) fn zero_own(&self, holder: u32, zeros: &mut Vec<Zero>) {
        zeros.retain(|&(h, pos)| {
            if h == holder {
                self.zero(pos);
            }
            h != holder
        });
    }

    /// Whether a lookup walked the entry since the last call (and clears the mark).
    pub(crate) fn take_ref(&self, pos: u32, key: u64) -> bool {
        let p = pos as usize;
        let bit = 1 << (p % 64);
        self.state_of(pos, key).is_some()
            && self
                .refs
                .get(p / 64)
                .is_some_and(|w| w.fetch_and(!bit, Relaxed) & bit != 0)
    }

    /// Sets the reference bits `mask` of word `word` unless all are set: a plain load and
    /// store, not a locked `fetch_or`. A concurrent lookup's or the hand's update of the same
    /// word may be lost or undone that way; either only costs or gives a block one turn of
    /// the CLOCK hand (the marks are a recency hint, never part of an answer).
    fn mark(&self, word: usize, mask: u64) {
        if let Some(w) = self.refs.get(word) {
            let v = w.load(Relaxed);
            if v & mask != mask {
                w.store(v | mask, Relaxed);
            }
        }
    }

    fn state_of(&self, pos: u32, key: u64) -> Option<&AtomicU8> {
        let p = pos as usize;
        (self.keys.get(p) == Some(&key))
            .then(|| self.states.get(p))
            .flatten()
    }

    /// Walks the run after position `pos`: calls `f(j, bits)` for `keys[j]` while the entry at
    /// `pos + 1 + j` is `keys[j]` with a known state, stopping when `f` says so. Returns how
    /// many keys it covered.
    pub(crate) fn walk(
        &self,
        pos: u32,
        keys: &[kv_events::BlockKey],
        f: impl FnMut(usize, Bits) -> bool,
    ) -> usize {
        self.walk_run::<false>(pos, keys, f)
    }

    /// [`RunLog::walk`], calling `f(j, bits)` only for the first key and for each key whose
    /// state differs from the previous key's (a lookup skips a key whose holders equal the
    /// previous key's anyway, and a run's blocks mostly share one state).
    pub(crate) fn walk_changes(
        &self,
        pos: u32,
        keys: &[kv_events::BlockKey],
        f: impl FnMut(usize, Bits) -> bool,
    ) -> usize {
        self.walk_run::<true>(pos, keys, f)
    }

    /// The walk of [`RunLog::walk`] and [`RunLog::walk_changes`]: with `CHANGES`, `f` sees only
    /// state changes. Every covered entry gets its lookup mark.
    fn walk_run<const CHANGES: bool>(
        &self,
        pos: u32,
        keys: &[kv_events::BlockKey],
        mut f: impl FnMut(usize, Bits) -> bool,
    ) -> usize {
        let start = pos as usize + 1;
        let (Some(log), Some(states)) = (self.keys.get(start..), self.states.get(start..)) else {
            return 0;
        };
        let len = log.len().min(states.len()).min(keys.len());
        let mut n = 0;
        let mut prev = 0;
        let mut marks = Marks {
            log: self,
            word: start / 64,
            mask: 0,
        };
        while n < len {
            // Past the first key, eight entries whose keys match and whose states all equal
            // the last one change only the count and the marks: compared at once (without
            // early exits, so it vectorises), when their marks fall in one word.
            if CHANGES
                && prev != 0
                && (start + n) % 64 <= 56
                && let (Some(lk), Some(qk), Some(st)) =
                    (log.get(n..n + 8), keys.get(n..n + 8), states.get(n..n + 8))
            {
                let keys_differ = lk.iter().zip(qk).fold(0, |d, (&a, b)| d | (a ^ b.0));
                let states_differ = st
                    .iter()
                    .fold(0, |d, s| d | ((s.load(Relaxed) & STATE) ^ prev));
                if keys_differ == 0 && states_differ == 0 {
                    marks.add(start + n, 0xFF);
                    n += 8;
                    continue;
                }
            }
            let (Some(&k), Some(s), Some(q)) = (log.get(n), states.get(n), keys.get(n)) else {
                break;
            };
            let st = s.load(Relaxed) & STATE;
            if k != q.0 || st == 0 {
                break;
            }
            marks.add(start + n, 1);
            n += 1;
            if !CHANGES || st != prev {
                prev = st;
                if !f(n - 1, prev) {
                    break;
                }
            }
        }
        marks.flush();
        n
    }

    /// How many of `keys` (from the first, whose entry would be at `pos`) a lookup should
    /// probe next, as this log names them: entries equal to the keys but without a known state
    /// (blocks shared with other holders) up to the first entry with one (the next run to
    /// walk, not probed); at a divergence the diverging key is counted too. 0 when the log
    /// names none of them. At most `limit`.
    pub(crate) fn plan(&self, pos: u32, keys: &[kv_events::BlockKey], limit: usize) -> usize {
        let start = pos as usize;
        let (Some(log), Some(states)) = (self.keys.get(start..), self.states.get(start..)) else {
            return 0;
        };
        let mut n = 0;
        for ((&k, s), q) in log.iter().zip(states).zip(keys).take(limit) {
            if k != q.0 {
                return if n == 0 { 0 } else { n + 1 };
            }
            if s.load(Relaxed) & STATE != 0 {
                return n;
            }
            n += 1;
        }
        if n < keys.len() && n > 0 { n + 1 } else { n }.min(limit)
    }

    /// Bytes owned.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.keys.capacity() * 8 + self.states.capacity() + self.refs.capacity() * 8
    }

    /// Entries claiming a state: (key, state).
    #[cfg(test)]
    pub(crate) fn known(&self) -> Vec<(u64, Bits)> {
        self.keys
            .iter()
            .zip(&self.states)
            .map(|(&k, s)| (k, s.load(Relaxed) & STATE))
            .filter(|&(_, s)| s != 0)
            .collect()
    }
}

/// A holder's log behind its lock, with the zeroings that found it held exclusively.
///
/// Protocol: a zeroing takes `pending`, then *tries* the log shared: it zeroes at once, or (the
/// log is held exclusively, or about to be) queues the positions. A thread holding the log
/// exclusively takes `pending` before letting go, zeroes the queue through its own access,
/// and releases the log before `pending`. So a queued position is zeroed before the log is
/// next readable, and nobody waits for the log's lock: only, briefly, for `pending`, which is
/// never held while waiting for anything.
#[derive(Debug, Default)]
pub(crate) struct LogCell {
    log: RwLock<RunLog>,
    pending: Mutex<Vec<u32>>,
}

impl LogCell {
    /// The log, shared, unless someone holds (or waits for) it exclusively.
    pub(crate) fn try_read(&self) -> Option<RwLockReadGuard<'_, RunLog>> {
        match self.log.try_read() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Runs `f` holding the log exclusively (waiting for it), then zeroes what was queued.
    pub(crate) fn write<R>(&self, f: impl FnOnce(&mut RunLog) -> R) -> R {
        let mut g = self.log.write().unwrap_or_else(PoisonError::into_inner);
        let r = f(&mut g);
        self.release(g);
        r
    }

    /// [`LogCell::write`] if the log is free now, else `None` (nothing run).
    pub(crate) fn try_write<R>(&self, f: impl FnOnce(&mut RunLog) -> R) -> Option<R> {
        let mut g = match self.log.try_write() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        let r = f(&mut g);
        self.release(g);
        Some(r)
    }

    /// Zeroes the queued positions, then lets go of the log, then of the queue.
    fn release(&self, g: std::sync::RwLockWriteGuard<'_, RunLog>) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        for &pos in pending.iter() {
            g.zero(pos);
        }
        pending.clear();
        drop(g);
        drop(pending);
    }

    /// Zeroes the entries at `positions`, or queues them for the thread holding the log.
    /// Never waits for the log.
    pub(crate) fn zero_all(&self, positions: impl Iterator<Item = u32>) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        match self.try_read() {
            Some(l) => positions.for_each(|pos| l.zero(pos)),
            None => pending.extend(positions),
        }
    }

    /// Positions queued for zeroing (the log is held exclusively meanwhile).
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// Every holder's log.
#[derive(Debug, Default)]
pub(crate) struct Runs {
    logs: RwLock<U64Map<u32, Arc<LogCell>>>,
}

impl Runs {
    /// `holder`'s log, if it has one.
    pub(crate) fn get(&self, holder: u32) -> Option<Arc<LogCell>> {
        self.logs
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&holder)
            .cloned()
    }

    /// `holder`'s log, created empty if need be.
    pub(crate) fn get_or_create(&self, holder: u32) -> Arc<LogCell> {
        if let Some(l) = self.get(holder) {
            return l;
        }
        let mut logs = self.logs.write().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(logs.entry(holder).or_default())
    }

    /// Drops `holder`'s log (it holds nothing any more).
    pub(crate) fn remove(&self, holder: u32) {
        self.logs
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&holder);
    }

    /// Applies deferred zeroings (the caller holds no shard lock and no log), then empties
    /// `zeros`. A log held exclusively gets them queued (see [`LogCell`]): this never waits
    /// for a log.
    pub(crate) fn apply_zeros(&self, zeros: &mut Vec<Zero>) {
        zeros.sort_unstable_by_key(|z| z.0);
        for group in zeros.chunk_by(|a, b| a.0 == b.0) {
            if let Some(cell) = group.first().and_then(|&(h, _)| self.get(h)) {
                cell.zero_all(group.iter().map(|&(_, pos)| pos));
            }
        }
        zeros.clear();
    }

    /// Whether a lookup walked `holder`'s entry at `pos` since last asked (clearing the
    /// mark); false when its log is busy (never waits: the caller holds a shard lock).
    pub(crate) fn try_take_ref(&self, holder: u32, pos: u32, key: u64) -> bool {
        let Ok(logs) = self.logs.try_read() else {
            return false;
        };
        let Some(l) = logs.get(&holder) else {
            return false;
        };
        l.try_read().is_some_and(|l| l.take_ref(pos, key))
    }

    /// Bytes owned by the logs (those not busy).
    pub(crate) fn heap_bytes(&self) -> usize {
        let logs = self.logs.read().unwrap_or_else(PoisonError::into_inner);
        logs.values()
            .filter_map(|l| l.try_read().map(|l| l.heap_bytes()))
            .sum::<usize>()
            + logs.capacity() * 24
    }
}

/// What a shard write needs of the logs: the written holder's log when the writer holds it,
/// the zeroings to do after the shard lock is released, and (for CLOCK) the others' marks.
pub(crate) struct RunCtx<'a> {
    /// The holder whose log `own` is.
    pub(crate) holder: u32,
    pub(crate) own: Option<&'a mut RunLog>,
    pub(crate) runs: Option<&'a Runs>,
    pub(crate) zeros: &'a mut Vec<Zero>,
}

impl<'a> RunCtx<'a> {
    /// A context holding no log: every zeroing waits for the shard lock's release.
    pub(crate) fn deferred(runs: &'a Runs, zeros: &'a mut Vec<Zero>) -> Self {
        Self {
            holder: u32::MAX,
            own: None,
            runs: Some(runs),
            zeros,
        }
    }

    /// The log of `holder`, when the writer holds it.
    pub(crate) fn own(&mut self, holder: u32) -> Option<&mut RunLog> {
        if holder == self.holder {
            self.own.as_deref_mut()
        } else {
            None
        }
    }

    /// Zeroes `holder`'s entry once the shard lock is released: the writer's own entries
    /// before it lets go of its log, all at once so their cache misses overlap
    /// ([`RunLog::zero_own`]); the others' after ([`Runs::apply_zeros`]).
    pub(crate) fn zero(&mut self, holder: u32, pos: u32) {
        if pos != NO_POS {
            self.zeros.push((holder, pos));
        }
    }

    /// Whether a lookup walked `holder`'s entry since the CLOCK hand last asked.
    pub(crate) fn take_ref(&mut self, holder: u32, pos: u32, key: u64) -> bool {
        if pos == NO_POS {
            return false;
        }
        if let Some(l) = self.own(holder) {
            return l.take_ref(pos, key);
        }
        self.runs.is_some_and(|r| r.try_take_ref(holder, pos, key))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use kv_events::BlockKey;

    use super::*;

    /// Long runs are compared eight entries at a time: a state change or a divergence
    /// inside a group of eight is still found at its exact key, and every walked entry
    /// (across reference words) is marked.
    #[test]
    fn long_walks_stop_at_the_exact_change() {
        let mut l = RunLog::default();
        let base = l.reserve_run(200);
        for p in 0..200u32 {
            l.commit(base + p, 1000 + u64::from(p), if p < 77 { 1 } else { 2 });
        }
        let mut q: Vec<BlockKey> = (1..200).map(|p| BlockKey(1000 + p)).collect();
        let mut seen = Vec::new();
        assert_eq!(
            l.walk_changes(base, &q, |j, b| {
                seen.push((j, b));
                true
            }),
            199
        );
        assert_eq!(seen, [(0, 1), (76, 2)]);
        assert!((1..200).all(|p| l.take_ref(base + p, 1000 + u64::from(p))));
        q[141] = BlockKey(7);
        assert_eq!(l.walk_changes(base, &q, |_, _| true), 141);
        for p in 1..200 {
            let walked = p <= 141;
            assert_eq!(
                l.take_ref(base + p, 1000 + u64::from(p)),
                walked,
                "entry {p}"
            );
        }
        l.zero(base + 100);
        assert_eq!(l.walk_changes(base, &q, |_, _| true), 99);
    }

    #[test]
    fn entries_are_exact_per_key_and_wrap_when_mostly_dead() {
        let mut l = RunLog::default();
        let base = l.reserve_run(10);
        assert_eq!(base, 0);
        for k in 1..=10u64 {
            l.commit(base + k as u32 - 1, k, if k == 5 { 0 } else { 1 });
        }
        let q: Vec<BlockKey> = (2..=10).map(BlockKey).collect();
        let mut seen = Vec::new();
        // Key 5 is shared (state 0): the walk stops there.
        assert_eq!(
            l.walk(0, &q, |j, b| {
                seen.push((j, b));
                true
            }),
            3
        );
        assert_eq!(seen, [(0, 1), (1, 1), (2, 1)]);
        l.set(5, 6, 2);
        l.set(7, 99, 2); // wrong key: left alone
        let q: Vec<BlockKey> = (7..=10).map(BlockKey).collect();
        assert_eq!(l.walk(5, &q, |_, _| true), 4);
        assert!(l.take_ref(7, 8) && !l.take_ref(7, 8));
        // The walk stops when told to.
        assert_eq!(l.walk(5, &q, |j, _| j < 1), 2);
        // Walking for changes only: keys 7..=10 have states 1, 1, 2, 1 (the third rewritten).
        l.set(8, 9, 2);
        let mut seen = Vec::new();
        let n = l.walk_changes(5, &q, |j, b| {
            seen.push((j, b));
            true
        });
        assert_eq!((n, seen), (4, vec![(0, 1), (2, 2), (3, 1)]));
        assert_eq!(l.walk_changes(5, &q, |j, _| j < 2), 3);
        l.set(8, 9, 1);
        // Planning probes: from key 5 (shared) on, the log names key 5 then a known run.
        let q: Vec<BlockKey> = (5..=10).map(BlockKey).collect();
        assert_eq!(l.plan(4, &q, 64), 1);
        assert_eq!(l.plan(4, &q, 0), 0);
        l.set(5, 6, 0);
        assert_eq!(l.plan(4, &q, 64), 2);
        // A divergence right away names nothing; later, the diverging key is included.
        assert_eq!(l.plan(4, &[BlockKey(77)], 64), 0);
        assert_eq!(l.plan(4, &[BlockKey(5), BlockKey(77)], 64), 2);
        l.set(5, 6, 2);
        // A reserved position not committed keeps what it had (here: nothing).
        let p = l.reserve_run(2);
        l.commit(p + 1, 50, 1);
        assert_eq!(l.walk(p - 1, &[BlockKey(0), BlockKey(50)], |_, _| true), 0);
        assert_eq!(l.walk(p, &[BlockKey(50)], |_, _| true), 1);
        l.zero(0);
        assert_eq!(l.known().len(), 9);
        // 9 of 64 live: a run that does not fit wraps to the start; entries stay exact until
        // overwritten.
        assert_eq!(l.reserve_run(60), 0);
        assert_eq!(l.keys.len(), 64);
        assert_eq!(l.known().len(), 9);
        for p in 0..60 {
            l.commit(p, 100 + u64::from(p), 1);
        }
        // Position 8 was walked (marked) before the wrap; its new entry starts unmarked.
        assert!(!l.take_ref(8, 108));
        assert_eq!(l.walk(7, &[BlockKey(108)], |_, _| true), 1);
        assert!(l.take_ref(8, 108));
        // 60 of 64 live: grows by a quarter (the run continues where it was).
        assert_eq!(l.reserve_run(10), 60);
        assert_eq!(l.keys.len(), 80);
        // A run longer than a quarter grows the log by what it needs.
        assert_eq!(l.reserve_run(100), 70);
        assert_eq!(l.keys.len(), 170);
        assert_eq!(l.reserve_run(0), NO_POS);
    }
}
