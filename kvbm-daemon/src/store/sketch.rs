//! How often each block was used, approximately, in bounded memory: a count-min sketch of
//! four rows of small saturating counters, halved every so many records so that old use fades
//! (the frequency half of TinyLFU). The disk tier admits a demoted block only when its
//! estimate reaches a threshold, so blocks used once do not wear the disk.

use super::BlockId;

/// Rows of counters (each block is counted once per row, at a different place).
const ROWS: usize = 4;
/// Counters saturate here.
const MAX: u8 = 15;

/// The sketch. See the module documentation.
#[derive(Debug)]
pub(crate) struct Sketch {
    rows: [Vec<u8>; ROWS],
    mask: u64,
    records: u64,
    /// Records between two halvings.
    period: u64,
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of `x`.
const fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Sketch {
    /// A sketch of `width` counters per row (rounded up to a power of two, at least 64).
    pub(crate) fn new(width: usize) -> Self {
        let width = width.max(64).next_power_of_two();
        Self {
            rows: std::array::from_fn(|_| vec![0; width]),
            mask: width as u64 - 1,
            records: 0,
            period: 10 * width as u64,
        }
    }

    /// The counter indexes of `id`, one per row.
    fn slots(&self, id: &BlockId) -> [usize; ROWS] {
        let base = mix(id.key.0 ^ mix(u64::from(id.layout.0)));
        std::array::from_fn(|row| {
            let h = mix(base.wrapping_add((row as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
            // The mask keeps the index below the row's width, which fits a usize.
            usize::try_from(h & self.mask).unwrap_or(0)
        })
    }

    /// Counts one use of `id`; every `period` records, halves every counter.
    pub(crate) fn record(&mut self, id: &BlockId) {
        let slots = self.slots(id);
        for (row, slot) in self.rows.iter_mut().zip(slots) {
            if let Some(c) = row.get_mut(slot) {
                *c = (*c + 1).min(MAX);
            }
        }
        self.records += 1;
        if self.records >= self.period {
            self.records = 0;
            for row in &mut self.rows {
                for c in row.iter_mut() {
                    *c /= 2;
                }
            }
        }
    }

    /// How many times `id` was used (an overestimate when counters are shared; at most 15).
    pub(crate) fn estimate(&self, id: &BlockId) -> u8 {
        let slots = self.slots(id);
        self.rows
            .iter()
            .zip(slots)
            .map(|(row, slot)| row.get(slot).copied().unwrap_or(0))
            .min()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use kv_events::BlockKey;
    use proptest::prelude::*;

    use super::*;
    use crate::store::LayoutId;

    fn id(layout: u32, key: u64) -> BlockId {
        BlockId {
            layout: LayoutId(layout),
            key: BlockKey(key),
        }
    }

    proptest! {
        /// Before the first halving, an estimate is never below the true count (capped at
        /// 15), and with few distinct blocks in a wide sketch it is exact.
        #[test]
        fn estimates_bound_the_true_count(uses in proptest::collection::vec((0u32..2, 0u64..40), 0..400)) {
            let mut s = Sketch::new(4096);
            let mut truth: HashMap<BlockId, u8> = HashMap::new();
            for (l, k) in &uses {
                s.record(&id(*l, *k));
                let c = truth.entry(id(*l, *k)).or_default();
                *c = (*c + 1).min(MAX);
            }
            for (block, n) in &truth {
                prop_assert!(s.estimate(block) >= *n);
            }
            let over = truth.iter().filter(|(b, n)| s.estimate(b) != **n).count();
            prop_assert!(over <= 1, "{} of {} blocks overestimated", over, truth.len());
        }
    }

    #[test]
    fn counts_saturate_and_halve_every_period() {
        let mut s = Sketch::new(64);
        assert_eq!(s.period, 640);
        let hot = id(0, 7);
        for _ in 0..20 {
            s.record(&hot);
        }
        assert_eq!(s.estimate(&hot), MAX);
        assert_eq!(s.estimate(&id(1, 7)), 0, "layouts are counted apart");
        // 620 more records of other blocks reach the period: every counter halves.
        for k in 0..620u64 {
            s.record(&id(5, 1000 + k));
        }
        assert!(s.estimate(&hot) <= MAX / 2, "{}", s.estimate(&hot));
    }
}
