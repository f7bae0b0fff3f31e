//! Where each block lies in the slab files: pure (no I/O), under the directory's mutex.
//!
//! Blocks of one size share a slab file (a *class*); a block is a slot of it. Every write
//! gets a new id, and a reader that looked a block up before reading its slot checks after
//! the read that the block still has that id: a slot is only given back when its block is
//! deleted or written again, so an unchanged id means the slot held the block for the whole
//! read.

use std::collections::HashMap;

use super::extents::{Extents, Run};

/// A block's identity in the tier: its layout's fingerprint and its key.
pub(super) type Name = (u64, u64);

/// Where a block lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    /// Its class (slab file).
    pub(super) class: usize,
    /// Its slot.
    pub(super) slot: u64,
    /// The write that put it there.
    pub(super) id: u64,
}

/// One block size's slab.
#[derive(Debug)]
struct Class {
    block_bytes: u64,
    slots: Extents,
}

/// The blocks of every class.
#[derive(Debug, Default)]
pub(super) struct Index {
    classes: Vec<Class>,
    by_size: HashMap<u64, usize>,
    blocks: HashMap<Name, Place>,
    next_id: u64,
}

impl Index {
    /// The class of blocks of `block_bytes`, made on first use.
    pub(super) fn class(&mut self, block_bytes: u64) -> usize {
        if let Some(&c) = self.by_size.get(&block_bytes) {
            return c;
        }
        let c = self.classes.len();
        self.classes.push(Class {
            block_bytes,
            slots: Extents::default(),
        });
        self.by_size.insert(block_bytes, c);
        c
    }

    /// The class of blocks of `block_bytes`, if there is one.
    pub(super) fn find_class(&self, block_bytes: u64) -> Option<usize> {
        self.by_size.get(&block_bytes).copied()
    }

    /// Takes `n` slots of `class` for a write (see [`Extents::take`]); none for an unknown
    /// class.
    pub(super) fn reserve(&mut self, class: usize, n: u64) -> Vec<Run> {
        self.classes
            .get_mut(class)
            .map_or_else(Vec::new, |c| c.slots.take(n))
    }

    /// Gives back slots reserved for a write that failed.
    pub(super) fn unreserve(&mut self, class: usize, run: Run) {
        if let Some(c) = self.classes.get_mut(class) {
            c.slots.give_back(run);
        }
    }

    /// A write of `name` into `slot` of `class` (reserved) finished: it is now where the
    /// block lies; the slot it had before is given back.
    pub(super) fn publish(&mut self, name: Name, class: usize, slot: u64) {
        let id = self.next_id;
        self.next_id += 1;
        if let Some(old) = self.blocks.insert(name, Place { class, slot, id }) {
            self.free(old);
        }
    }

    /// Forgets `name`, giving back its slot; false when it was not there.
    pub(super) fn remove(&mut self, name: Name) -> bool {
        match self.blocks.remove(&name) {
            Some(old) => {
                self.free(old);
                true
            }
            None => false,
        }
    }

    /// Where `name` lies.
    pub(super) fn get(&self, name: Name) -> Option<Place> {
        self.blocks.get(&name).copied()
    }

    /// Whether `name` still lies where the write `id` put it.
    pub(super) fn unchanged(&self, name: Name, id: u64) -> bool {
        self.blocks.get(&name).is_some_and(|p| p.id == id)
    }

    /// Blocks held.
    pub(super) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Bytes the slab files span (each class's slots × its block size).
    pub(super) fn file_bytes(&self) -> u64 {
        self.classes
            .iter()
            .map(|c| c.slots.end().saturating_mul(c.block_bytes))
            .sum()
    }

    fn free(&mut self, place: Place) {
        if let Some(c) = self.classes.get_mut(place.class) {
            c.slots.give_back(Run {
                start: place.slot,
                len: 1,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rewrite_moves_the_block_and_changes_its_id() {
        let mut ix = Index::default();
        assert_eq!(ix.find_class(4096), None);
        let c = ix.class(4096);
        assert_eq!(ix.class(4096), c);
        assert_eq!(ix.find_class(4096), Some(c));
        let run = ix.reserve(c, 2);
        assert_eq!(run, [Run { start: 0, len: 2 }]);
        ix.publish((1, 1), c, 0);
        ix.publish((1, 2), c, 1);
        let first = ix.get((1, 1)).unwrap();
        // Written again: a new slot (the old one is still in use until then), a new id.
        let again = ix.reserve(c, 1);
        assert_eq!(again, [Run { start: 2, len: 1 }]);
        ix.publish((1, 1), c, 2);
        let second = ix.get((1, 1)).unwrap();
        assert_eq!(second.slot, 2);
        assert!(!ix.unchanged((1, 1), first.id));
        assert!(ix.unchanged((1, 1), second.id));
        // Slot 0 was given back and is reused.
        assert_eq!(ix.reserve(c, 1), [Run { start: 0, len: 1 }]);
        ix.unreserve(c, Run { start: 0, len: 1 });
        assert!(ix.remove((1, 2)));
        assert!(!ix.remove((1, 2)));
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.file_bytes(), 3 * 4096);
        // Another size is another class.
        assert_eq!(ix.class(100), c + 1);
        assert!(ix.reserve(9, 1).is_empty());
    }
}
