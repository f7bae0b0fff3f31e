//! The slots of one slab file: which are free, as runs, and where the next run goes. Pure (no
//! I/O); [`super::index::Index`] holds one per block size.
//!
//! The file only grows when no freed slot is left, so it spans at most the most slots that
//! were ever in use at once. A request for `n` slots takes the smallest free run that holds
//! them all (so blocks written together lie together and are read back in one call), else
//! the largest free runs until it has `n`, and only then slots past the end.

use std::collections::{BTreeMap, BTreeSet};

/// Consecutive slots: `start`, `start + 1`, …, `start + len - 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Run {
    /// The first slot.
    pub(super) start: u64,
    /// How many slots.
    pub(super) len: u64,
}

impl Run {
    /// One past the last slot.
    pub(super) const fn end(self) -> u64 {
        self.start + self.len
    }
}

/// The free slots of a file of `end` slots.
#[derive(Debug, Default)]
pub(super) struct Extents {
    /// Slots the file spans (every slot below is free or in use).
    end: u64,
    /// Free runs by start; adjacent runs are always merged.
    by_start: BTreeMap<u64, u64>,
    /// The same runs by (length, start), for the best fit.
    by_len: BTreeSet<(u64, u64)>,
    /// Free slots in all.
    free: u64,
}

impl Extents {
    /// Slots the file spans.
    pub(super) const fn end(&self) -> u64 {
        self.end
    }

    /// Slots in use.
    #[cfg(test)]
    pub(super) const fn used(&self) -> u64 {
        self.end - self.free
    }

    /// Takes `n` slots: runs in ascending order of start, `n` slots in all (none for 0).
    pub(super) fn take(&mut self, n: u64) -> Vec<Run> {
        if n == 0 {
            return Vec::new();
        }
        // The smallest free run that holds all n.
        if let Some(&(len, start)) = self.by_len.range((n, 0)..).next() {
            self.remove_free(start, len);
            if len > n {
                self.insert_free(start + n, len - n);
            }
            return vec![Run { start, len: n }];
        }
        // Else every free run (none holds n), largest first, then the end.
        let mut runs = Vec::new();
        let mut left = n;
        while left > 0 {
            let Some(&(len, start)) = self.by_len.iter().next_back() else {
                break;
            };
            self.remove_free(start, len);
            let take = len.min(left);
            if len > take {
                self.insert_free(start + take, len - take);
            }
            runs.push(Run { start, len: take });
            left -= take;
        }
        if left > 0 {
            runs.push(Run {
                start: self.end,
                len: left,
            });
            self.end += left;
        }
        runs.sort_unstable();
        runs
    }

    /// Frees a run taken before (merged with its free neighbours). A run that is not wholly
    /// in use (past the end, or overlapping a free run) is a caller's bug: it is ignored and
    /// false returned.
    pub(super) fn give_back(&mut self, run: Run) -> bool {
        if run.len == 0 || run.end() > self.end || self.overlaps_free(run) {
            return false;
        }
        let mut start = run.start;
        let mut len = run.len;
        if let Some((&s, &l)) = self.by_start.range(..start).next_back()
            && s + l == start
        {
            self.remove_free(s, l);
            start = s;
            len += l;
        }
        if let Some(&l) = self.by_start.get(&run.end()) {
            self.remove_free(run.end(), l);
            len += l;
        }
        self.insert_free(start, len);
        true
    }

    /// Whether any slot of `run` is free.
    fn overlaps_free(&self, run: Run) -> bool {
        let before = self
            .by_start
            .range(..=run.start)
            .next_back()
            .is_some_and(|(&s, &l)| s + l > run.start);
        before || self.by_start.range(run.start..run.end()).next().is_some()
    }

    fn insert_free(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.free += len;
    }

    fn remove_free(&mut self, start: u64, len: u64) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.free -= len;
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_fresh_file_grows_and_freed_runs_are_reused_best_fit_first() {
        let mut e = Extents::default();
        assert!(e.take(0).is_empty());
        assert_eq!(e.take(4), [Run { start: 0, len: 4 }]);
        assert_eq!(e.take(8), [Run { start: 4, len: 8 }]);
        assert_eq!(e.take(2), [Run { start: 12, len: 2 }]);
        assert_eq!(e.take(3), [Run { start: 14, len: 3 }]);
        assert_eq!((e.end(), e.used()), (17, 17));
        // Free 0..4 and 4..12: merged into one run of 12.
        assert!(e.give_back(Run { start: 0, len: 4 }));
        assert!(e.give_back(Run { start: 4, len: 8 }));
        assert_eq!(e.used(), 5);
        assert_eq!(e.take(3), [Run { start: 0, len: 3 }]);
        // Free 14..17: the smallest run that holds 2 is it, not 3..12.
        assert!(e.give_back(Run { start: 14, len: 3 }));
        assert_eq!(e.take(2), [Run { start: 14, len: 2 }]);
        // 10 asked, no free run holds them: the largest (3..12), then 16..17; the file
        // does not grow while a slot is free.
        assert_eq!(
            e.take(10),
            [Run { start: 3, len: 9 }, Run { start: 16, len: 1 }]
        );
        assert_eq!((e.end(), e.used()), (17, 17));
        assert_eq!(e.take(1), [Run { start: 17, len: 1 }]);
    }

    #[test]
    fn freeing_what_is_not_in_use_is_refused() {
        let mut e = Extents::default();
        e.take(4);
        assert!(!e.give_back(Run { start: 3, len: 2 }), "past the end");
        assert!(!e.give_back(Run { start: 0, len: 0 }));
        assert!(e.give_back(Run { start: 1, len: 2 }));
        assert!(!e.give_back(Run { start: 2, len: 1 }), "already free");
        assert!(
            !e.give_back(Run { start: 0, len: 2 }),
            "overlaps a free run"
        );
        assert_eq!(e.used(), 2);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Take(u64),
        /// Gives back the held run at this index (modulo), or a part of it.
        GiveBack {
            which: usize,
            part: bool,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..9).prop_map(Op::Take),
            (any::<usize>(), any::<bool>()).prop_map(|(which, part)| Op::GiveBack { which, part }),
        ]
    }

    proptest! {
        /// Against a naive model (a vector of in-use flags): runs taken are free slots, never
        /// overlap what is held, add up to what was asked, and the file grows only when no
        /// free slot is left; one run when a free run could hold the request.
        #[test]
        fn behaves_like_a_bitmap(ops in proptest::collection::vec(op(), 1..80)) {
            let mut e = Extents::default();
            let mut used: Vec<bool> = Vec::new();
            let mut held: Vec<Run> = Vec::new();
            let mut peak = 0u64;
            for op in ops {
                match op {
                    Op::Take(n) => {
                        let free_before = used.iter().filter(|u| !**u).count() as u64;
                        let longest = used
                            .split(|u| *u)
                            .map(|r| r.len() as u64)
                            .max()
                            .unwrap_or(0);
                        let runs = e.take(n);
                        prop_assert_eq!(runs.iter().map(|r| r.len).sum::<u64>(), n);
                        if n > 0 && longest >= n {
                            prop_assert_eq!(runs.len(), 1, "a free run holds {} slots", n);
                        }
                        let grown = e.end() - used.len() as u64;
                        prop_assert_eq!(grown, n.saturating_sub(free_before));
                        used.resize(e.end() as usize, false);
                        for r in &runs {
                            prop_assert!(r.len > 0);
                            for s in r.start..r.end() {
                                prop_assert!(!used[s as usize], "slot {} taken twice", s);
                                used[s as usize] = true;
                            }
                        }
                        held.extend(runs);
                    }
                    Op::GiveBack { which, part } => {
                        if held.is_empty() {
                            continue;
                        }
                        let i = which % held.len();
                        let run = held.swap_remove(i);
                        let back = if part && run.len > 1 {
                            // Give back the tail half; keep the head.
                            let keep = run.len / 2;
                            held.push(Run { start: run.start, len: keep });
                            Run { start: run.start + keep, len: run.len - keep }
                        } else {
                            run
                        };
                        prop_assert!(e.give_back(back));
                        for s in back.start..back.end() {
                            used[s as usize] = false;
                        }
                    }
                }
                let in_use = used.iter().filter(|u| **u).count() as u64;
                prop_assert_eq!(e.used(), in_use);
                peak = peak.max(in_use);
                prop_assert!(e.end() <= peak, "the file spans {} slots, at most {} were used", e.end(), peak);
            }
        }
    }
}
