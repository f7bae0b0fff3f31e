//! A shard's block table: open addressing (linear probing, backward-shift deletion, no
//! tombstones) whose 16-byte slots hold a block's key and, inline, its only holder; a block
//! with two or more holders keeps them, sorted by holder, in a per-shard arena of
//! power-of-two chunks. A lookup of a resident block with one holder is one cache line.
//!
//! Slot word layout (`u64`):
//!
//! | bits | one holder | several holders |
//! |---|---|---|
//! | 0..32 | packed holder | arena offset |
//! | 32..37 | its tier bits ([`Bits`]) | 0 |
//! | 37 | CLOCK: new (one turn of grace) | the same |
//! | 38 | 0 | `MULTI` |
//! | 39 | CLOCK: referenced (two turns) | the same |
//! | 40..64 | its position in its holder's run log | holder count |
//!
//! A word of 0 is a vacant slot. Arena entries are `holder << 32 | position << 8 | bits`, so
//! a chunk sorted as integers is sorted by holder (endpoints before nodes). The position is
//! the residency's entry in its holder's [`crate::runs::RunLog`] ([`NO_POS`]: none).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kv_events::Tier;

/// Bit `t` (0..4) means "resident in tier `t`"; [`SPEC`] means "speculatively in GPU".
pub(crate) type Bits = u8;

/// Speculative GPU residency: recorded when a request is routed, dropped when confirmed or
/// expired.
pub(crate) const SPEC: Bits = 1 << 4;

/// All confirmed tiers.
pub(crate) const ALL_TIERS: Bits = 0b1111;

/// The confirmed-tier bit for `tier`.
pub(crate) const fn tier_bit(tier: Tier) -> Bits {
    1 << tier.index()
}

/// The tier mask a residency contributes to a lookup (speculation counts as GPU).
pub(crate) const fn effective(bits: Bits) -> Bits {
    (bits & ALL_TIERS) | ((bits & SPEC) >> 4)
}

const BITS_SHIFT: u32 = 32;
const BITS_MASK: u64 = 0x1F;
const NEW: u64 = 1 << 37;
const MULTI: u64 = 1 << 38;
const REF: u64 = 1 << 39;
const LEN_SHIFT: u32 = 40;
/// The most holders one block records (24 bits); further holders of that block are ignored.
pub(crate) const MAX_HOLDERS: usize = (1 << 24) - 1;
/// "No run-log entry".
pub(crate) const NO_POS: u32 = (1 << 24) - 1;
const POS_SHIFT: u32 = 40;
/// An arena entry without its run-log position: what lookups compare.
pub(crate) const ENTRY_MASK: u64 = !(0xFF_FFFF << 8);
const MIN_CAP: usize = 16;

/// An arena entry or a one-holder word's residency: holder and bits (position 0).
pub(crate) const fn entry(holder: u32, bits: Bits) -> u64 {
    ((holder as u64) << 32) | bits as u64
}

const fn entry_at(holder: u32, bits: Bits, pos: u32) -> u64 {
    entry(holder, bits) | ((pos as u64 & 0xFF_FFFF) << 8)
}

const fn entry_pos(e: u64) -> u32 {
    ((e >> 8) & 0xFF_FFFF) as u32
}

/// The holder of an arena entry.
pub(crate) const fn entry_holder(e: u64) -> u32 {
    (e >> 32) as u32
}

/// The bits of an arena entry.
pub(crate) const fn entry_bits(e: u64) -> Bits {
    (e & 0xFF) as Bits
}

/// A one-holder slot word as [`Table::touch`] returns it: equal words, equal residencies.
pub(crate) const fn one_word(holder: u32, bits: Bits) -> u64 {
    single_word(holder, bits, 0)
}

const fn single_word(holder: u32, bits: Bits, pos: u32) -> u64 {
    holder as u64 | ((bits as u64) << BITS_SHIFT) | ((pos as u64 & 0xFF_FFFF) << POS_SHIFT)
}

/// A one-holder word's residency as an arena entry (with its position).
const fn single_entry(w: u64) -> u64 {
    entry_at(
        w as u32,
        ((w >> BITS_SHIFT) & BITS_MASK) as Bits,
        (w >> POS_SHIFT) as u32,
    )
}

/// The chunk class (log2 of its capacity) for `len ≥ 2` holders.
const fn class_of(len: usize) -> u32 {
    len.next_power_of_two().trailing_zeros()
}

/// Spreads a key over the table (the shard was chosen by the key's top bits).
const fn mix(key: u64) -> u64 {
    (key ^ (key >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[derive(Debug, Default)]
struct Slot {
    key: u64,
    /// Readers set the reference bit under a shared lock; everything else changes under the
    /// exclusive lock.
    word: AtomicU64,
}

/// Where writers grow a table off the exclusive lock ([`Table::wants_room`]): 11/16 full.
const GROW_EARLY: (usize, usize) = (11, 16);

/// A table's slots rebuilt larger from a shared view ([`Table::grown`]), waiting to be
/// installed.
pub(crate) struct Grown {
    buckets: Box<[Bucket]>,
    shift: u32,
    edits: u64,
}

impl std::fmt::Debug for Grown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grown")
            .field("buckets", &self.buckets.len())
            .finish_non_exhaustive()
    }
}

/// A table's slots replaced by a [`Grown`] copy: dropped by whoever installed it, after
/// letting go of the shard's lock.
pub(crate) struct Retired(#[allow(dead_code)] Box<[Bucket]>);

impl std::fmt::Debug for Retired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Retired").field(&self.0.len()).finish()
    }
}

/// Puts `(key, w)` in the first vacant slot of its probe run in `buckets` (`shift`: as
/// [`Table`]'s for that many buckets).
fn place(buckets: &mut [Bucket], shift: u32, key: u64, w: u64) {
    if buckets.is_empty() {
        return;
    }
    let mask = buckets.len() * 4 - 1;
    let mut i = ((mix(key) >> shift) as usize) << 2;
    while let Some(s) = buckets.get_mut(i >> 2).and_then(|b| b.0.get_mut(i & 3)) {
        let sw = s.word.get_mut();
        if *sw == 0 {
            *sw = w;
            s.key = key;
            return;
        }
        i = (i + 1) & mask;
    }
}

/// Four slots in one cache line: a key's probe starts at its bucket's first slot, so a
/// resident block is almost always found in the one line its bucket occupies.
#[derive(Debug, Default)]
#[repr(C, align(64))]
struct Bucket([Slot; 4]);

/// A block's holders as a lookup sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holders<'a> {
    /// Nobody holds the block.
    None,
    /// One holder: `entry(holder, bits)`.
    One(u64),
    /// Two or more, sorted by holder: `entry(holder, bits)` each, plus run-log positions (mask
    /// with [`ENTRY_MASK`] to compare).
    Many(&'a [u64]),
}

impl Holders<'_> {
    /// Calls `f(holder, bits)` for each residency.
    pub(crate) fn for_each(self, mut f: impl FnMut(u32, Bits)) {
        match self {
            Holders::None => {}
            Holders::One(e) => f(entry_holder(e), entry_bits(e)),
            Holders::Many(list) => list.iter().for_each(|&e| f(entry_holder(e), entry_bits(e))),
        }
    }

    /// The bits of `holder`, zero if absent.
    pub(crate) fn bits_of(self, holder: u32) -> Bits {
        match self {
            Holders::None => 0,
            Holders::One(e) => {
                if entry_holder(e) == holder {
                    entry_bits(e)
                } else {
                    0
                }
            }
            Holders::Many(list) => list
                .binary_search_by_key(&holder, |&e| entry_holder(e))
                .ok()
                .and_then(|p| list.get(p))
                .map_or(0, |&e| entry_bits(e)),
        }
    }
}

/// What [`Table::update`] did to a residency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Update {
    /// The holder's bits before.
    pub(crate) old: Bits,
    /// The holder's bits after (0: the residency is gone).
    pub(crate) new: Bits,
    /// The residency's run-log position (the new one's when it was created here).
    pub(crate) pos: u32,
    /// The holder is now the block's only holder.
    pub(crate) sole: bool,
    /// The block's former only holder and its position, when this update made it shared.
    pub(crate) displaced: Option<(u32, u32)>,
}

impl Update {
    const fn none(new_pos: u32) -> Self {
        Self {
            old: 0,
            new: 0,
            pos: new_pos,
            sole: false,
            displaced: None,
        }
    }
}

/// The block table of one shard.
#[derive(Default)]
pub(crate) struct Table {
    buckets: Box<[Bucket]>,
    /// `64 - log2(buckets)`: a key's home bucket is the top bits of its mix.
    shift: u32,
    /// Occupied slots (= blocks).
    len: usize,
    /// Mutable slot accesses so far: a [`Grown`] copy is installed only if none happened
    /// since it was taken.
    edits: u64,
    /// Doublings done in place, under the exclusive lock (lookups of the shard waited).
    growths_blocking: u64,
    /// Grown copies installed (built under the shared lock while lookups went on).
    growths_shared: u64,
    arena: Vec<u64>,
    /// Free arena chunks by class.
    free: Vec<Vec<u32>>,
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table")
            .field("capacity", &self.capacity())
            .field("blocks", &self.len)
            .field("arena", &self.arena.len())
            .finish()
    }
}

impl Table {
    /// Blocks in the table.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots (a power of two, or zero before the first insert).
    pub(crate) fn capacity(&self) -> usize {
        self.buckets.len() * 4
    }

    fn mask(&self) -> usize {
        self.capacity().wrapping_sub(1)
    }

    fn slot(&self, i: usize) -> Option<&Slot> {
        self.buckets.get(i >> 2)?.0.get(i & 3)
    }

    fn slot_mut(&mut self, i: usize) -> Option<&mut Slot> {
        self.edits = self.edits.wrapping_add(1);
        self.buckets.get_mut(i >> 2)?.0.get_mut(i & 3)
    }

    /// The slot a key's probe starts at (the first of its bucket).
    pub(crate) fn home(&self, key: u64) -> usize {
        if self.buckets.is_empty() {
            return 0;
        }
        ((mix(key) >> self.shift) as usize) << 2
    }

    /// Loads the key stored in slot `i` (a lookup touches its batch's home buckets first, so
    /// their cache misses overlap).
    pub(crate) fn peek(&self, i: usize) -> u64 {
        self.slot(i).map_or(0, |s| s.key)
    }

    /// `key`'s home slot and a reference to the key stored there: a lookup batch computes
    /// these first, then loads them all in a tight loop so the cache misses overlap.
    pub(crate) fn home_ref(&self, key: u64) -> (usize, Option<&u64>) {
        let h = self.home(key);
        (h, self.slot(h).map(|s| &s.key))
    }

    /// Calls `f` with a reference into each cache line of slot `i`'s holder list, when it has
    /// one in the arena (the batch's second round of overlapping misses).
    pub(crate) fn holder_lines<'a>(&'a self, i: usize, mut f: impl FnMut(&'a u64)) {
        let w = self.word(i);
        if w & MULTI == 0 {
            return;
        }
        let off = w as u32 as usize;
        let len = (w >> LEN_SHIFT) as usize;
        if let Some(list) = self.arena.get(off..off + len) {
            list.iter().step_by(8).for_each(&mut f);
            if let Some(last) = list.last() {
                f(last);
            }
        }
    }

    /// The slot holding `key`.
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
        self.find_from(key, self.home(key))
    }

    /// The slot holding `key`, probing from its home slot `home` (as [`Table::home`] gave).
    pub(crate) fn find_from(&self, key: u64, home: usize) -> Option<usize> {
        // The home bucket first, all four keys compared without branching (where in its
        // bucket a key sits is unpredictable). Vacant slots hold key 0.
        let b = self.buckets.get(home >> 2)?;
        let [a, c, d, e] = &b.0;
        let hits = u32::from(a.key == key)
            | (u32::from(c.key == key) << 1)
            | (u32::from(d.key == key) << 2)
            | (u32::from(e.key == key) << 3);
        if hits != 0 && key != 0 {
            return Some((home & !3) + hits.trailing_zeros() as usize);
        }
        let full = [a, c, d, e].iter().all(|s| s.word.load(Relaxed) != 0);
        if !full && key != 0 {
            // A probe run never skips a vacant slot, so the key is nowhere.
            return None;
        }
        let mask = self.mask();
        let mut i = home;
        loop {
            let s = self.slot(i)?;
            if s.word.load(Relaxed) == 0 {
                return None;
            }
            if s.key == key {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    fn word(&self, i: usize) -> u64 {
        self.slot(i).map_or(0, |s| s.word.load(Relaxed))
    }

    fn set_word(&mut self, i: usize, w: u64) {
        if let Some(s) = self.slot_mut(i) {
            *s.word.get_mut() = w;
        }
    }

    /// The holders of the block in slot `i`.
    pub(crate) fn holders(&self, i: usize) -> Holders<'_> {
        let w = self.word(i);
        if w == 0 {
            Holders::None
        } else if w & MULTI == 0 {
            Holders::One(entry(w as u32, ((w >> BITS_SHIFT) & BITS_MASK) as Bits))
        } else {
            let off = w as u32 as usize;
            let len = (w >> LEN_SHIFT) as usize;
            self.arena
                .get(off..off + len)
                .map_or(Holders::None, Holders::Many)
        }
    }

    /// The holders of `key`.
    pub(crate) fn get(&self, key: u64) -> Holders<'_> {
        self.find(key).map_or(Holders::None, |i| self.holders(i))
    }

    /// The only holder of the block in slot `i`: (holder, bits, run-log position).
    pub(crate) fn sole(&self, i: usize) -> Option<(u32, Bits, u32)> {
        let w = self.word(i);
        if w == 0 || w & MULTI != 0 {
            return None;
        }
        let e = single_entry(w);
        Some((entry_holder(e), entry_bits(e), entry_pos(e)))
    }

    /// Where a lookup can continue from the block in slot `i` in some holder's run log:
    /// (holder, position) of its only holder, or of `prefer` among several (else the first
    /// with a position).
    pub(crate) fn cursor(&self, i: usize, prefer: u32) -> Option<(u32, u32)> {
        let logged = |e: u64| (entry_pos(e) != NO_POS).then(|| (entry_holder(e), entry_pos(e)));
        let w = self.word(i);
        if w == 0 {
            return None;
        }
        if w & MULTI == 0 {
            return logged(single_entry(w));
        }
        let list = self.chunk(w as u32, (w >> LEN_SHIFT) as usize);
        list.binary_search_by_key(&prefer, |&e| entry_holder(e))
            .ok()
            .and_then(|p| list.get(p))
            .and_then(|&e| logged(e))
            .or_else(|| list.iter().find_map(|&e| logged(e)))
    }

    /// Whether `holder` has a residency on `key`.
    #[cfg(test)]
    pub(crate) fn holds(&self, key: u64, holder: u32) -> bool {
        self.get(key).bits_of(holder) != 0
    }

    /// Sets slot `i`'s CLOCK reference bit (readers call this under the shared lock; a
    /// relaxed store is enough for a hint, and no writer runs meanwhile). Returns the slot's
    /// word without its CLOCK bits and run-log position: equal one-holder words mean equal
    /// residencies.
    pub(crate) fn touch(&self, i: usize) -> u64 {
        let Some(s) = self.slot(i) else {
            return 0;
        };
        let w = s.word.load(Relaxed);
        if w != 0 && w & REF == 0 {
            s.word.store(w | REF, Relaxed);
        }
        if w & MULTI == 0 {
            w & !(REF | NEW) & !(0xFF_FFFF << POS_SHIFT)
        } else {
            w & !(REF | NEW)
        }
    }

    /// The CLOCK hand passes slot `i`: a referenced block drops to new, a new one to
    /// unreferenced. `None` when the slot is vacant, else whether the block had a chance left.
    /// A block with one holder whose lookups walked its run-log entry instead of probing it
    /// counts as referenced when `walked(key, holder, position)` says so.
    pub(crate) fn take_reference(
        &mut self,
        i: usize,
        walked: impl FnOnce(u64, u32, u32) -> bool,
    ) -> Option<bool> {
        let key = self.peek(i);
        let s = self.slot_mut(i)?;
        let w = s.word.get_mut();
        if *w == 0 {
            return None;
        }
        if *w & REF != 0 {
            *w = (*w & !REF) | NEW;
            Some(true)
        } else if *w & NEW != 0 {
            *w &= !NEW;
            Some(true)
        } else if *w & MULTI == 0 && walked(key, *w as u32, (*w >> POS_SHIFT) as u32) {
            *w |= NEW;
            Some(true)
        } else {
            Some(false)
        }
    }

    /// Applies `f` to `holder`'s bits on `key` (zero when absent), storing the result and
    /// dropping the residency (and the block with its last one) when it is zero. A residency
    /// created here records `new_pos` as its run-log position.
    pub(crate) fn update(
        &mut self,
        key: u64,
        holder: u32,
        f: impl FnOnce(Bits) -> Bits,
        new_pos: u32,
    ) -> Update {
        let Some(i) = self.find(key) else {
            let new = f(0);
            if new != 0 {
                // New blocks get one turn of the CLOCK hand; looked-up ones two.
                self.insert_new(key, single_word(holder, new, new_pos) | NEW);
            }
            return Update {
                new,
                sole: new != 0,
                ..Update::none(new_pos)
            };
        };
        let w = self.word(i);
        if w & MULTI == 0 {
            let e = single_entry(w);
            let (h, old, pos) = (entry_holder(e), entry_bits(e), entry_pos(e));
            if h == holder {
                let new = f(old);
                if new == 0 {
                    self.remove_at(i);
                } else {
                    self.set_word(i, single_word(h, new, pos) | REF);
                }
                return Update {
                    old,
                    new,
                    pos,
                    sole: new != 0,
                    displaced: None,
                };
            }
            let new = f(0);
            if new == 0 {
                return Update::none(NO_POS);
            }
            let Some(off) = self.alloc(1) else {
                return Update::none(NO_POS);
            };
            let b = entry_at(holder, new, new_pos);
            if let Some(chunk) = self.arena.get_mut(off as usize..off as usize + 2) {
                chunk.copy_from_slice(&[e.min(b), e.max(b)]);
            }
            self.set_word(i, multi_word(off, 2) | REF);
            return Update {
                new,
                displaced: Some((h, pos)),
                ..Update::none(new_pos)
            };
        }
        let off = w as u32;
        let len = (w >> LEN_SHIFT) as usize;
        let found = self
            .chunk(off, len)
            .binary_search_by_key(&holder, |&e| entry_holder(e));
        match found {
            Ok(p) => {
                let e = self.chunk(off, len).get(p).copied().unwrap_or(0);
                let (old, pos) = (entry_bits(e), entry_pos(e));
                let new = f(old);
                let done = Update {
                    old,
                    new,
                    pos,
                    sole: false,
                    displaced: None,
                };
                if new != 0 {
                    if let Some(slot) = self.chunk_mut(off, len).get_mut(p) {
                        *slot = entry_at(holder, new, pos);
                    }
                    self.set_word(i, w | REF);
                    return done;
                }
                if let Some(tail) = self.chunk_mut(off, len).get_mut(p..) {
                    tail.rotate_left(1);
                }
                let len = len - 1;
                if len == 1 {
                    let e = self.chunk(off, 1).first().copied().unwrap_or(0);
                    self.release(off, class_of(2));
                    let word = single_word(entry_holder(e), entry_bits(e), entry_pos(e));
                    self.set_word(i, word | REF);
                } else {
                    // A failed move keeps the larger chunk, which is safe to reuse as smaller.
                    let off = self.resize_chunk(off, len + 1, len).unwrap_or(off);
                    self.set_word(i, multi_word(off, len) | REF);
                }
                done
            }
            Err(p) => {
                let new = f(0);
                if new == 0 || len >= MAX_HOLDERS {
                    return Update::none(NO_POS);
                }
                let Some(off) = self.resize_chunk(off, len, len + 1) else {
                    return Update::none(NO_POS);
                };
                if let Some(tail) = self.chunk_mut(off, len + 1).get_mut(p..) {
                    tail.rotate_right(1);
                    if let Some(e) = tail.first_mut() {
                        *e = entry_at(holder, new, new_pos);
                    }
                }
                self.set_word(i, multi_word(off, len + 1) | REF);
                Update {
                    new,
                    ..Update::none(new_pos)
                }
            }
        }
    }

    /// `holder`'s run-log position on `key` ([`NO_POS`] when it has no residency there).
    #[cfg(test)]
    pub(crate) fn position_of(&self, key: u64, holder: u32) -> u32 {
        let Some(i) = self.find(key) else {
            return NO_POS;
        };
        let w = self.word(i);
        if w & MULTI == 0 {
            return if w as u32 == holder {
                entry_pos(single_entry(w))
            } else {
                NO_POS
            };
        }
        let (off, len) = (w as u32, (w >> LEN_SHIFT) as usize);
        let chunk = self.chunk(off, len);
        chunk
            .binary_search_by_key(&holder, |&e| entry_holder(e))
            .ok()
            .and_then(|p| chunk.get(p))
            .map_or(NO_POS, |&e| entry_pos(e))
    }

    /// Removes the block in slot `i`, calling `f(holder, bits, run-log position)` for each of its
    /// residencies; returns its key and holder count (`None` when vacant). A later block may
    /// move into slot `i`.
    pub(crate) fn evict(
        &mut self,
        i: usize,
        mut f: impl FnMut(u32, Bits, u32),
    ) -> Option<(u64, usize)> {
        let w = self.word(i);
        if w == 0 {
            return None;
        }
        let key = self.peek(i);
        let n = if w & MULTI == 0 {
            let e = single_entry(w);
            f(entry_holder(e), entry_bits(e), entry_pos(e));
            1
        } else {
            let (off, len) = (w as u32, (w >> LEN_SHIFT) as usize);
            self.chunk(off, len)
                .iter()
                .for_each(|&e| f(entry_holder(e), entry_bits(e), entry_pos(e)));
            self.release(off, class_of(len));
            len
        };
        self.remove_at(i);
        Some((key, n))
    }

    fn chunk(&self, off: u32, len: usize) -> &[u64] {
        let off = off as usize;
        self.arena.get(off..off + len).unwrap_or_default()
    }

    fn chunk_mut(&mut self, off: u32, len: usize) -> &mut [u64] {
        let off = off as usize;
        self.arena.get_mut(off..off + len).unwrap_or_default()
    }

    /// Moves a chunk holding `from` entries to the class fitting `to` entries (both ≥ 2)
    /// when the class changes, keeping the first `min(from, to)` entries. Returns the offset,
    /// `None` when the arena is full.
    fn resize_chunk(&mut self, off: u32, from: usize, to: usize) -> Option<u32> {
        let (old, new) = (class_of(from), class_of(to));
        if old == new {
            return Some(off);
        }
        let dst = self.alloc(new)?;
        let n = from.min(to);
        let (src, dst_u) = (off as usize, dst as usize);
        self.arena.copy_within(src..src + n, dst_u);
        self.release(off, old);
        Some(dst)
    }

    fn alloc(&mut self, class: u32) -> Option<u32> {
        if let Some(off) = self.free.get_mut(class as usize).and_then(Vec::pop) {
            return Some(off);
        }
        let off = u32::try_from(self.arena.len()).ok()?;
        let size = 1usize << class;
        u32::try_from(self.arena.len() + size).ok()?;
        self.arena.resize(self.arena.len() + size, 0);
        Some(off)
    }

    fn release(&mut self, off: u32, class: u32) {
        let c = class as usize;
        if self.free.len() <= c {
            self.free.resize_with(c + 1, Vec::new);
        }
        if let Some(list) = self.free.get_mut(c) {
            list.push(off);
        }
    }

    fn insert_new(&mut self, key: u64, w: u64) {
        if (self.len + 1) * 4 > self.capacity() * 3 {
            self.grow();
        }
        self.edits = self.edits.wrapping_add(1);
        place(&mut self.buckets, self.shift, key, w);
        self.len += 1;
    }

    /// Doubles the table in place (under the exclusive lock: every lookup of the shard waits
    /// for the whole copy). Writers avoid it by installing a [`Table::grown`] copy first.
    fn grow(&mut self) {
        // At 3/4 load, twice the slots leave room below `GROW_EARLY`: one doubling.
        let g = self.grown(0);
        self.buckets = g.buckets;
        self.shift = g.shift;
        self.edits = self.edits.wrapping_add(1);
        self.growths_blocking += 1;
    }

    /// Whether `additional` new blocks would take the table past [`GROW_EARLY`] of its
    /// slots: the point where a writer builds a grown copy, below the in-place threshold (3/4)
    /// so that writes that do not grow early (speculation) rarely reach the in-place one.
    pub(crate) fn wants_room(&self, additional: usize) -> bool {
        let (num, den) = GROW_EARLY;
        (self.len + additional) * den > self.capacity() * num
    }

    /// A copy of the slots in a table at least twice as large and with room for `additional`
    /// more blocks below [`GROW_EARLY`], built from `&self`: under the shared lock, so lookups
    /// go on meanwhile (they may set reference bits the copy misses; those are CLOCK hints).
    /// The arena is shared, not copied: slot words keep their offsets.
    pub(crate) fn grown(&self, additional: usize) -> Grown {
        let (num, den) = GROW_EARLY;
        let mut n = (self.buckets.len() * 2).max(MIN_CAP / 4);
        while (self.len + additional) * den > n * 4 * num {
            n *= 2;
        }
        let mut buckets: Box<[Bucket]> = (0..n).map(|_| Bucket::default()).collect();
        let shift = 64 - n.trailing_zeros();
        for b in &self.buckets {
            for s in &b.0 {
                let w = s.word.load(Relaxed);
                if w != 0 {
                    place(&mut buckets, shift, s.key, w);
                }
            }
        }
        Grown {
            buckets,
            shift,
            edits: self.edits,
        }
    }

    /// Installs `g` (under the exclusive lock, O(1)) if no slot was edited since it was taken,
    /// and returns the replaced slots, for the caller to drop once it has let go of the lock
    /// (freeing tens of megabytes is not O(1)). `None`: not installed, the copy was dropped
    /// (the table grows in place when full).
    pub(crate) fn install(&mut self, g: Grown) -> Option<Retired> {
        if g.edits != self.edits {
            return None;
        }
        let old = std::mem::replace(&mut self.buckets, g.buckets);
        self.shift = g.shift;
        self.edits = self.edits.wrapping_add(1);
        self.growths_shared += 1;
        Some(Retired(old))
    }

    /// Doublings done in place (lookups waited) and grown copies installed.
    pub(crate) fn growths(&self) -> (u64, u64) {
        (self.growths_blocking, self.growths_shared)
    }

    /// Vacates slot `i`, shifting later entries of its probe run back (no tombstones).
    fn remove_at(&mut self, mut i: usize) {
        let mask = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let w = self.word(j);
            if w == 0 {
                break;
            }
            let key = self.peek(j);
            let h = self.home(key);
            // The entry at j may move to i when i lies on its probe path [h, j].
            if j.wrapping_sub(h) & mask >= j.wrapping_sub(i) & mask {
                if let Some(s) = self.slot_mut(i) {
                    s.key = key;
                    *s.word.get_mut() = w;
                }
                i = j;
            }
        }
        if let Some(s) = self.slot_mut(i) {
            s.key = 0;
            *s.word.get_mut() = 0;
        }
        self.len -= 1;
    }

    /// Bytes owned: slots, arena and its free lists (capacities).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.buckets.len() * std::mem::size_of::<Bucket>()
            + self.arena.capacity() * 8
            + self.free.iter().map(|f| f.capacity() * 4).sum::<usize>()
    }
}

const fn multi_word(off: u32, len: usize) -> u64 {
    off as u64 | MULTI | ((len as u64) << LEN_SHIFT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(t: &Table, key: u64, h: u32) -> Bits {
        t.get(key).bits_of(h)
    }

    trait Upd {
        fn upd(&mut self, key: u64, h: u32, f: impl FnOnce(Bits) -> Bits) -> (Bits, Bits);
    }

    impl Upd for Table {
        fn upd(&mut self, key: u64, h: u32, f: impl FnOnce(Bits) -> Bits) -> (Bits, Bits) {
            let u = self.update(key, h, f, h + 100);
            (u.old, u.new)
        }
    }

    /// Every (key, holder, bits) the table answers for `keys` × holders 1..=3.
    fn contents(t: &Table, keys: impl Iterator<Item = u64>) -> Vec<(u64, u32, Bits)> {
        keys.flat_map(|k| (1..=3).map(move |h| (k, h)))
            .map(|(k, h)| (k, h, bits(t, k, h)))
            .filter(|&(.., b)| b != 0)
            .collect()
    }

    #[test]
    fn a_grown_copy_installed_answers_like_the_table_it_replaces() {
        let mut t = Table::default();
        // Blocks with one holder and with several (arena chunks), some removed again.
        for k in 1..=500u64 {
            t.upd(k, 1, |b| b | 1);
            if k % 3 == 0 {
                t.upd(k, 2, |b| b | 2);
            }
            if k % 7 == 0 {
                t.upd(k, 3, |b| b | 4);
            }
        }
        for k in (1..=500u64).step_by(11) {
            t.upd(k, 1, |_| 0);
        }
        let before = contents(&t, 1..=500);
        let (len, cap) = (t.len(), t.capacity());
        assert!(t.wants_room(cap));
        let copy = t.grown(cap);
        assert!(
            t.install(copy).is_some(),
            "nothing was edited since the copy"
        );
        assert_eq!(t.len(), len);
        assert!(t.capacity() >= 2 * cap);
        assert!(!t.wants_room(cap), "room for what the copy was sized for");
        assert_eq!(contents(&t, 1..=500), before);
        assert_eq!(t.growths().1, 1);
        // Writes go on in the installed table; removals keep every probe run reachable.
        let blocking = t.growths().0;
        for k in 501..=800u64 {
            t.upd(k, 2, |b| b | 1);
        }
        for k in (1..=800u64).step_by(5) {
            t.upd(k, 2, |_| 0);
        }
        for k in 1..=800u64 {
            let expect = if k % 5 == 1 {
                0
            } else if k > 500 || k % 3 == 0 {
                1u8 << u8::from(k <= 500)
            } else {
                0
            };
            assert_eq!(bits(&t, k, 2), expect, "key {k}");
        }
        assert_eq!(
            t.growths().0,
            blocking,
            "sized for 800 blocks: no growth in place"
        );
    }

    #[test]
    fn a_copy_taken_before_an_edit_is_not_installed() {
        let mut t = Table::default();
        for k in 1..=40u64 {
            t.upd(k, 1, |b| b | 1);
        }
        let copy = t.grown(10);
        t.upd(41, 1, |b| b | 1);
        let cap = t.capacity();
        assert!(t.install(copy).is_none(), "the copy lacks key 41");
        assert_eq!(t.capacity(), cap);
        assert_eq!(bits(&t, 41, 1), 1);
        assert_eq!(t.growths().1, 0);
        // A bits-only change is an edit too: the copy would carry the old word.
        let copy = t.grown(10);
        t.upd(5, 1, |b| b | 2);
        assert!(t.install(copy).is_none());
        assert_eq!(bits(&t, 5, 1), 3);
    }

    #[test]
    fn residencies_grow_into_sorted_chunks_and_shrink_back() {
        let mut t = Table::default();
        assert_eq!(std::mem::size_of::<Slot>(), 16);
        assert_eq!(std::mem::size_of::<Bucket>(), 64);
        assert_eq!(t.upd(9, 5, |b| b | 1), (0, 1));
        assert!(matches!(t.get(9), Holders::One(_)));
        for h in [3u32, 7, 1, 9, 2] {
            assert_eq!(t.upd(9, h, |b| b | 2), (0, 2));
        }
        for h in [1u32, 2, 3, 5, 7, 9] {
            assert_eq!(
                t.update(9, h, |b| b, 0).pos,
                h + 100,
                "holder {h}'s position"
            );
        }
        let Holders::Many(list) = t.get(9) else {
            panic!("several holders")
        };
        let hs: Vec<u32> = list.iter().map(|&e| entry_holder(e)).collect();
        assert_eq!(hs, [1, 2, 3, 5, 7, 9]);
        assert_eq!(bits(&t, 9, 5), 1);
        assert_eq!(t.upd(9, 5, |b| b | 4), (1, 5));
        for h in [1u32, 9, 2, 5, 7] {
            let old = bits(&t, 9, h);
            assert_eq!(t.upd(9, h, |_| 0), (old, 0));
            assert_eq!(bits(&t, 9, h), 0);
        }
        assert_eq!(t.get(9), Holders::One(entry(3, 2)));
        // Positions follow their residencies through chunk moves and back inline.
        assert_eq!(t.update(9, 3, |b| b, 0).pos, 103);
        assert_eq!(t.position_of(9, 3), 103);
        assert_eq!(t.sole(t.find(9).unwrap()), Some((3, 2, 103)));
        assert_eq!(t.upd(9, 4, |_| 0), (0, 0), "removing an absent holder");
        assert_eq!(t.upd(9, 3, |_| 0), (2, 0));
        assert_eq!(t.len(), 0);
        assert_eq!(t.get(9), Holders::None);
        // Freed chunks are reused.
        let arena = t.arena.len();
        t.upd(1, 1, |_| 1);
        t.upd(1, 2, |_| 1);
        t.upd(1, 3, |_| 1);
        assert_eq!(t.arena.len(), arena);
    }

    #[test]
    fn updates_report_sole_holders_and_displacements() {
        let mut t = Table::default();
        let u = t.update(7, 1, |_| 1, 10);
        assert_eq!((u.sole, u.displaced, u.pos), (true, None, 10));
        let u = t.update(7, 1, |b| b | 2, 11);
        assert_eq!((u.old, u.new, u.sole, u.pos), (1, 3, true, 10));
        let u = t.update(7, 2, |_| 1, 20);
        assert_eq!((u.sole, u.displaced, u.pos), (false, Some((1, 10)), 20));
        assert_eq!(t.sole(t.find(7).unwrap()), None);
        let u = t.update(7, 3, |_| 1, 30);
        assert_eq!((u.sole, u.displaced), (false, None));
        let u = t.update(7, 2, |_| 0, 99);
        assert_eq!((u.old, u.new, u.pos, u.sole), (1, 0, 20, false));
        t.update(7, 3, |_| 0, 99);
        // Back to one holder: it keeps its position; the CLOCK asks about its entry.
        let i = t.find(7).unwrap();
        assert_eq!(t.sole(i), Some((1, 3, 10)));
        assert_eq!(
            t.take_reference(i, |_, _, _| false),
            Some(true),
            "rewritten"
        );
        assert_eq!(t.take_reference(i, |_, _, _| false), Some(true), "new");
        assert_eq!(
            t.take_reference(i, |k, h, p| (k, h, p) == (7, 1, 10)),
            Some(true)
        );
        assert_eq!(t.take_reference(i, |_, _, _| true), Some(true));
        assert_eq!(t.take_reference(i, |_, _, _| false), Some(false));
        assert!(t.holds(7, 1) && !t.holds(7, 2));
    }

    #[test]
    fn deletion_keeps_every_probe_run_reachable() {
        let mut t = Table::default();
        // Keys that collide on few home slots, inserted and deleted in a scrambled order.
        let keys: Vec<u64> = (0..2000u64)
            .map(|i| i.wrapping_mul(0x1_0000_0001))
            .collect();
        for &k in &keys {
            t.upd(k, 1, |_| 1);
        }
        for (n, &k) in keys.iter().enumerate() {
            if n % 3 != 0 {
                t.upd(k, 1, |_| 0);
            }
        }
        for (n, &k) in keys.iter().enumerate() {
            assert_eq!(bits(&t, k, 1), u8::from(n % 3 == 0), "key {n}");
        }
        assert_eq!(t.len(), keys.len().div_ceil(3));
        let mut seen = 0;
        for i in 0..t.capacity() {
            if t.evict(i, |_, _, _| {}).is_some() {
                seen += 1;
                // A later entry may have moved into i: evict until vacant.
                while t.evict(i, |_, _, _| {}).is_some() {
                    seen += 1;
                }
            }
        }
        assert_eq!(seen, keys.len().div_ceil(3));
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn speculation_counts_as_gpu() {
        assert_eq!(effective(SPEC), tier_bit(Tier::Gpu));
        assert_eq!(effective(SPEC | tier_bit(Tier::Disk)), 0b101);
    }
}
