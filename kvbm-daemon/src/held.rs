//! The pins one connector connection holds, so that its `unpin` releases only its own pins,
//! and its disconnect (a connector that crashed, an engine restart) releases whatever it
//! still held instead of leaving the blocks pinned until their deadline.
//!
//! The store counts pins per block and ends them all at the latest deadline; it does not know
//! who holds them. A connection forwards the release of a pin only while its own deadline has
//! not passed: after it, the store may already have ended that pin, and a release would end
//! another connection's.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A pin counts as live until this long before its deadline (the store keeps its clock in
/// whole milliseconds).
const MARGIN: Duration = Duration::from_millis(2);

/// One connection's pins: per key, how many it holds and its latest deadline.
#[derive(Debug, Default)]
pub(crate) struct HeldPins {
    held: HashMap<u64, (u32, Instant)>,
}

impl HeldPins {
    /// Records one more pin of each key, lasting until `until`.
    pub(crate) fn add(&mut self, keys: &[u64], until: Instant) {
        for key in keys {
            let e = self.held.entry(*key).or_insert((0, until));
            e.0 = e.0.saturating_add(1);
            e.1 = e.1.max(until);
        }
    }

    /// Gives up one pin of each of `keys` this connection holds; returns those whose release
    /// the store should see (the ones not past their deadline at `now`).
    pub(crate) fn take(&mut self, keys: &[u64], now: Instant) -> Vec<u64> {
        let mut out = Vec::new();
        for key in keys {
            let Some((count, until)) = self.held.get_mut(key) else {
                continue;
            };
            if now + MARGIN < *until {
                out.push(*key);
            }
            *count -= 1;
            if *count == 0 {
                self.held.remove(key);
            }
        }
        out
    }

    /// Gives up every pin; returns each live one's key once per pin held.
    pub(crate) fn drain(&mut self, now: Instant) -> Vec<u64> {
        let mut out = Vec::new();
        for (key, (count, until)) in self.held.drain() {
            if now + MARGIN < until {
                out.extend(std::iter::repeat_n(key, count as usize));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_held_and_live_pins_are_released() {
        let t0 = Instant::now();
        let mut h = HeldPins::default();
        h.add(&[1, 2], t0 + Duration::from_secs(10));
        h.add(&[1], t0 + Duration::from_secs(20));
        // A key this connection never pinned is not released; 1 is held twice.
        assert_eq!(h.take(&[1, 3], t0), vec![1]);
        assert_eq!(
            h.take(&[1, 1], t0),
            vec![1],
            "held twice, released twice at most"
        );
        // Past its deadline, a pin is forgotten without a release.
        h.add(&[4], t0 + Duration::from_secs(1));
        assert_eq!(h.take(&[4], t0 + Duration::from_secs(2)), Vec::<u64>::new());
        h.add(&[5, 5], t0 + Duration::from_secs(30));
        let mut left = h.drain(t0 + Duration::from_secs(15));
        left.sort_unstable();
        assert_eq!(left, vec![5, 5], "2 is past its deadline; 5 is held twice");
        assert!(h.drain(t0).is_empty());
    }
}
