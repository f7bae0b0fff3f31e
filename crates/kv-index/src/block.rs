//! One block's record: its key and the holders that have it, with their tier bits.

use std::sync::atomic::{AtomicBool, Ordering};

use kv_events::{BlockKey, Tier};

/// Bit `t` (0..4) means "resident in tier `t`"; [`SPEC`] means "speculatively in GPU".
pub(crate) type Bits = u8;

/// Speculative GPU residency: recorded when a request is routed, dropped when confirmed or
/// expired.
pub(crate) const SPEC: Bits = 1 << 4;

/// The confirmed-tier bit for `tier`.
pub(crate) const fn tier_bit(tier: Tier) -> Bits {
    1 << tier.index()
}

/// All confirmed tiers.
pub(crate) const ALL_TIERS: Bits = 0b1111;

/// The tier mask a residency contributes to a lookup (speculation counts as GPU).
pub(crate) const fn effective(bits: Bits) -> Bits {
    (bits & ALL_TIERS) | ((bits & SPEC) >> 4)
}

/// One (block, holder) residency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Residency {
    pub(crate) holder: u32,
    pub(crate) bits: Bits,
}

/// A block and its holders: the first inline (most blocks have one), the rest in a boxed
/// slice that is empty (and unallocated) until a second holder arrives. 32 bytes.
#[derive(Debug)]
pub(crate) struct Block {
    pub(crate) key: BlockKey,
    more: Box<[Residency]>,
    first_holder: u32,
    /// Zero marks a vacant slot: a live block always has a first residency with some bit.
    first_bits: Bits,
    /// The CLOCK reference bit, set by readers under a shared lock and by writes to an existing
    /// block. New blocks start unreferenced in the slot the hand just passed, so they survive
    /// at least until the hand comes round again.
    referenced: AtomicBool,
}

impl Block {
    pub(crate) fn new(key: BlockKey, r: Residency) -> Self {
        Self {
            key,
            more: Box::default(),
            first_holder: r.holder,
            first_bits: r.bits,
            referenced: AtomicBool::new(false),
        }
    }

    pub(crate) fn vacant() -> Self {
        Self::new(BlockKey(0), Residency { holder: 0, bits: 0 })
    }

    pub(crate) fn is_vacant(&self) -> bool {
        self.first_bits == 0
    }

    /// How many holders the block has.
    pub(crate) fn len(&self) -> usize {
        if self.is_vacant() {
            0
        } else {
            1 + self.more.len()
        }
    }

    /// Every residency.
    pub(crate) fn residencies(&self) -> impl Iterator<Item = Residency> + '_ {
        let first = Residency {
            holder: self.first_holder,
            bits: self.first_bits,
        };
        (!self.is_vacant())
            .then_some(first)
            .into_iter()
            .chain(self.more.iter().copied())
    }

    /// Marks the block used (readers call this; relaxed is enough for a CLOCK hint).
    pub(crate) fn touch(&self) {
        if !self.referenced.load(Ordering::Relaxed) {
            self.referenced.store(true, Ordering::Relaxed);
        }
    }

    /// Clears the reference bit; returns whether it was set.
    pub(crate) fn take_reference(&self) -> bool {
        self.referenced.swap(false, Ordering::Relaxed)
    }

    /// The bits of `holder`, zero if absent.
    pub(crate) fn bits_of(&self, holder: u32) -> Bits {
        self.residencies()
            .find(|r| r.holder == holder)
            .map_or(0, |r| r.bits)
    }

    /// Applies `f` to `holder`'s bits (starting from zero when absent) and stores the result,
    /// dropping the residency when it becomes zero. Returns the change in residency count.
    pub(crate) fn update(&mut self, holder: u32, f: impl FnOnce(Bits) -> Bits) -> isize {
        if self.first_holder == holder && !self.is_vacant() {
            let bits = f(self.first_bits);
            if bits != 0 {
                self.first_bits = bits;
                return 0;
            }
            // Promote the last of `more` into the inline slot.
            let mut rest = std::mem::take(&mut self.more).into_vec();
            match rest.pop() {
                Some(r) => {
                    self.first_holder = r.holder;
                    self.first_bits = r.bits;
                }
                None => self.first_bits = 0,
            }
            self.more = rest.into_boxed_slice();
            return -1;
        }
        if let Some(pos) = self.more.iter().position(|r| r.holder == holder) {
            let Some(r) = self.more.get_mut(pos) else {
                return 0;
            };
            let bits = f(r.bits);
            if bits != 0 {
                r.bits = bits;
                return 0;
            }
            let mut rest = std::mem::take(&mut self.more).into_vec();
            rest.swap_remove(pos);
            self.more = rest.into_boxed_slice();
            return -1;
        }
        let bits = f(0);
        if bits == 0 {
            return 0;
        }
        if self.is_vacant() {
            self.first_holder = holder;
            self.first_bits = bits;
        } else {
            let mut rest = std::mem::take(&mut self.more).into_vec();
            rest.push(Residency { holder, bits });
            self.more = rest.into_boxed_slice();
        }
        1
    }

    /// Heap bytes owned beyond the 32-byte record.
    pub(crate) fn heap_bytes(&self) -> usize {
        std::mem::size_of_val::<[Residency]>(&self.more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_adds_changes_and_drops_residencies() {
        let mut b = Block::new(BlockKey(9), Residency { holder: 1, bits: 1 });
        assert_eq!(std::mem::size_of::<Block>(), 32);
        assert_eq!(b.update(2, |x| x | 2), 1);
        assert_eq!(b.update(3, |x| x | 4), 1);
        assert_eq!(b.update(2, |x| x | 1), 0);
        assert_eq!(b.bits_of(2), 3);
        assert_eq!(b.len(), 3);
        assert_eq!(b.update(1, |_| 0), -1);
        assert_eq!(b.len(), 2);
        assert_eq!(b.bits_of(1), 0);
        assert_eq!(b.bits_of(3), 4);
        assert_eq!(
            b.update(9, |_| 0),
            0,
            "removing an absent holder is a no-op"
        );
        assert_eq!(b.update(3, |_| 0), -1);
        assert_eq!(b.update(2, |_| 0), -1);
        assert!(b.is_vacant());
        assert_eq!(b.residencies().count(), 0);
    }

    #[test]
    fn speculation_counts_as_gpu() {
        assert_eq!(effective(SPEC), tier_bit(Tier::Gpu));
        assert_eq!(effective(SPEC | tier_bit(Tier::Disk)), 0b101);
    }
}
