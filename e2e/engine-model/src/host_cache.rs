//! The host (CPU) tier of a KV offloading connector: vLLM's native CPU offloading
//! (`--kv-offloading-size`) and Dynamo KVBM's G2 pool work alike here.
//!
//! - **Write-through**: every block the GPU caches is copied to host memory as it is cached
//!   (the copy runs beside the model, so it costs no step time here).
//! - **LRU**: a copy, or a lookup that finds a block, makes it the most recent; over capacity the
//!   least recent block is dropped.
//! - **Loads**: a request whose prompt goes on past its GPU prefix hit with blocks held here
//!   loads them (host → device) before it is scheduled, and computes only what follows.
//! - One entry per hash (unlike the GPU cache, which keeps duplicates).
//!
//! Every change is reported as a [`CacheEvent::HostStored`] or [`CacheEvent::HostRemoved`],
//! which the engine publishes with the `CPU` medium.

use std::collections::{BTreeMap, HashMap};

use crate::CacheEvent;
use crate::offload::{Lookup, LookupRequest, Offload, OffloadTier, Sources};

/// The host tier's blocks in least-recently-used order.
#[derive(Debug, Default)]
pub(crate) struct HostCache {
    capacity: usize,
    /// Hash → its recency stamp.
    stamp: HashMap<u64, u64>,
    /// Recency stamp → hash, least recent first.
    order: BTreeMap<u64, u64>,
    next: u64,
}

impl HostCache {
    /// A tier of `capacity` blocks (0: offloading off).
    pub(crate) fn new(capacity: u32) -> Self {
        Self {
            capacity: capacity as usize,
            ..Self::default()
        }
    }

    /// Whether `hash` is held (does not change recency).
    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.stamp.contains_key(&hash)
    }

    /// How many of `hashes`, from the first, are held (at most `max`).
    pub(crate) fn leading(&self, hashes: &[u64], max: usize) -> usize {
        hashes
            .iter()
            .take(max)
            .take_while(|&&h| self.contains(h))
            .count()
    }

    /// Makes `hash` the most recent, if held.
    pub(crate) fn touch(&mut self, hash: u64) {
        if let Some(s) = self.stamp.get_mut(&hash) {
            self.order.remove(s);
            *s = self.next;
            self.order.insert(self.next, hash);
            self.next += 1;
        }
    }

    /// Copies `hashes` in (write-through), dropping the least recent blocks over capacity, and
    /// reports the changes: one `HostStored` for the blocks new here, then one `HostRemoved`
    /// per dropped block.
    pub(crate) fn store(&mut self, hashes: &[u64], events: &mut Vec<CacheEvent>) {
        if self.capacity == 0 {
            return;
        }
        let mut added = Vec::new();
        for &h in hashes {
            if self.contains(h) {
                self.touch(h);
                continue;
            }
            self.stamp.insert(h, self.next);
            self.order.insert(self.next, h);
            self.next += 1;
            added.push(h);
        }
        if added.is_empty() {
            return;
        }
        events.push(CacheEvent::HostStored { hashes: added });
        while self.stamp.len() > self.capacity {
            let Some((_, victim)) = self.order.pop_first() else {
                break;
            };
            self.stamp.remove(&victim);
            events.push(CacheEvent::HostRemoved {
                hashes: vec![victim],
            });
        }
    }
}

impl OffloadTier for HostCache {
    fn offload(&mut self, blocks: Offload<'_>, events: &mut Vec<CacheEvent>) {
        self.store(blocks.hashes, events);
    }

    fn lookup(&mut self, request: LookupRequest<'_>) -> Lookup {
        Lookup::Found(Sources {
            host: self.leading(request.hashes, request.hashes.len()),
            ..Sources::default()
        })
    }

    /// A load is a use: the loaded blocks become the most recent.
    fn load_started(&mut self, request: LookupRequest<'_>, sources: Sources) {
        for &h in request.hashes.iter().take(sources.blocks()) {
            self.touch(h);
        }
    }

    /// Drops everything (no event: the caller reports one `Cleared` for every tier).
    fn clear(&mut self) {
        self.stamp.clear();
        self.order.clear();
    }

    fn len(&self) -> usize {
        self.stamp.len()
    }

    fn hashes(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self.stamp.keys().copied().collect();
        out.sort_unstable();
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn off_stores_nothing() {
        let mut h = HostCache::new(0);
        let mut ev = Vec::new();
        h.store(&[1, 2], &mut ev);
        assert!(ev.is_empty());
        assert_eq!(h.len(), 0);
        assert_eq!(h.leading(&[1], 1), 0);
    }

    #[test]
    fn least_recent_goes_first_and_every_change_is_reported() {
        let mut h = HostCache::new(3);
        let mut ev = Vec::new();
        h.store(&[1, 2, 3], &mut ev);
        assert_eq!(
            ev,
            [CacheEvent::HostStored {
                hashes: vec![1, 2, 3]
            }]
        );
        ev.clear();
        // 1 is touched, so 2 is now the least recent; re-storing 3 reports nothing new.
        h.touch(1);
        h.store(&[3, 4], &mut ev);
        assert_eq!(
            ev,
            [
                CacheEvent::HostStored { hashes: vec![4] },
                CacheEvent::HostRemoved { hashes: vec![2] },
            ]
        );
        assert_eq!(h.hashes(), [1, 3, 4]);
        assert_eq!(h.leading(&[1, 3, 2, 4], 4), 2);
        assert_eq!(h.leading(&[1, 3, 4], 2), 2);
        h.clear();
        assert_eq!(h.len(), 0);
    }

    #[test]
    fn a_batch_larger_than_the_tier_keeps_its_last_blocks() {
        let mut h = HostCache::new(2);
        let mut ev = Vec::new();
        h.store(&[1, 2, 3, 4], &mut ev);
        assert_eq!(h.hashes(), [3, 4]);
        assert_eq!(
            ev,
            [
                CacheEvent::HostStored {
                    hashes: vec![1, 2, 3, 4]
                },
                CacheEvent::HostRemoved { hashes: vec![1] },
                CacheEvent::HostRemoved { hashes: vec![2] },
            ]
        );
    }
}
