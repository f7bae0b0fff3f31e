//! Approximate mode: for engines that publish no KV events, model each endpoint's cache from
//! the routing decisions themselves. A routed prompt's blocks are assumed cached for `ttl`
//! after their last use, and at most `capacity` blocks per endpoint (least recently used
//! first out). The tracker emits the `Stored`/`Removed` events the engine would have sent,
//! which the caller applies to the [`crate::KvIndex`] like any other source's.

use std::collections::VecDeque;

use kv_events::fasthash::U64Map;
use kv_events::{BlockKey, KvEvent, Tier};

use crate::id::EndpointId;
use crate::time::Millis;

#[derive(Debug, Default)]
struct EndpointCache {
    /// Key → (its current deadline = last use + ttl, the use's sequence number).
    deadline: U64Map<BlockKey, (u64, u64)>,
    /// (deadline, sequence number, key) in use order; entries since renewed are stale.
    order: VecDeque<(u64, u64, BlockKey)>,
    seq: u64,
}

impl EndpointCache {
    /// Pops the least recently used live key if `pred(deadline)` holds.
    fn pop_if(&mut self, pred: impl Fn(u64) -> bool) -> Option<BlockKey> {
        while let Some(&(d, seq, k)) = self.order.front() {
            if self.deadline.get(&k) != Some(&(d, seq)) {
                self.order.pop_front();
                continue;
            }
            if !pred(d) {
                return None;
            }
            self.order.pop_front();
            self.deadline.remove(&k);
            return Some(k);
        }
        None
    }

    /// Drops stale queue entries once they outnumber the live ones.
    fn compact(&mut self) {
        if self.order.len() > 2 * self.deadline.len() + 64 {
            let live = &self.deadline;
            self.order
                .retain(|&(d, seq, k)| live.get(&k) == Some(&(d, seq)));
        }
    }
}

/// Per-endpoint approximate caches built from routing decisions.
#[derive(Debug)]
pub struct ApproxTracker {
    ttl: Millis,
    capacity: usize,
    now: u64,
    endpoints: U64Map<u32, EndpointCache>,
}

fn stored(keys: Vec<BlockKey>) -> KvEvent {
    KvEvent::Stored {
        keys,
        parent: None,
        tier: Tier::Gpu,
        lora: None,
        token_count: 0,
    }
}

fn removed(keys: Vec<BlockKey>) -> KvEvent {
    KvEvent::Removed {
        keys,
        tier: Tier::Gpu,
    }
}

impl ApproxTracker {
    /// A tracker keeping blocks `ttl` after last use and at most `capacity` per endpoint.
    pub fn new(ttl: Millis, capacity: usize) -> Self {
        Self {
            ttl,
            capacity: capacity.max(1),
            now: 0,
            endpoints: U64Map::default(),
        }
    }

    /// Records that a request with `keys` was routed to `endpoint` at `now` (time never goes
    /// back: an earlier `now` counts as the latest seen). Returns the events to apply for the
    /// endpoint: a `Stored` of the keys it did not have, then a `Removed` of those evicted.
    pub fn record_route(
        &mut self,
        endpoint: EndpointId,
        keys: &[BlockKey],
        now: Millis,
    ) -> Vec<KvEvent> {
        self.now = self.now.max(now.0);
        let deadline = self.now.saturating_add(self.ttl.0);
        let cache = self.endpoints.entry(endpoint.get()).or_default();
        let mut new = Vec::new();
        for &k in keys {
            cache.seq += 1;
            if cache.deadline.insert(k, (deadline, cache.seq)).is_none() {
                new.push(k);
            }
            cache.order.push_back((deadline, cache.seq, k));
        }
        let mut evicted = Vec::new();
        while cache.deadline.len() > self.capacity {
            match cache.pop_if(|_| true) {
                Some(k) => evicted.push(k),
                None => break,
            }
        }
        cache.compact();
        // A key both new and evicted in one call nets out to absent: report both, in order.
        let mut events = Vec::new();
        if !new.is_empty() {
            events.push(stored(new));
        }
        if !evicted.is_empty() {
            events.push(removed(evicted));
        }
        events
    }

    /// Expires blocks unused since `now - ttl`; returns each affected endpoint's `Removed`.
    pub fn expire(&mut self, now: Millis) -> Vec<(EndpointId, KvEvent)> {
        self.now = self.now.max(now.0);
        let now = self.now;
        let mut out = Vec::new();
        for (&ep, cache) in &mut self.endpoints {
            let mut gone = Vec::new();
            while let Some(k) = cache.pop_if(|d| d <= now) {
                gone.push(k);
            }
            cache.compact();
            if let (false, Ok(ep)) = (gone.is_empty(), EndpointId::new(ep)) {
                out.push((ep, removed(gone)));
            }
        }
        out.sort_by_key(|(ep, _)| *ep);
        out
    }

    /// Forgets an endpoint (it left the pool).
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        self.endpoints.remove(&endpoint.get());
    }

    /// How many blocks the tracker believes `endpoint` holds.
    pub fn len(&self, endpoint: EndpointId) -> usize {
        self.endpoints
            .get(&endpoint.get())
            .map_or(0, |c| c.deadline.len())
    }

    /// Whether the tracker believes `endpoint` holds nothing.
    pub fn is_empty(&self, endpoint: EndpointId) -> bool {
        self.len(endpoint) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Holder, IndexConfig, KvIndex};

    fn keys(r: std::ops::Range<u64>) -> Vec<BlockKey> {
        r.map(|i| BlockKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect()
    }

    #[test]
    fn routed_blocks_become_visible_then_expire() {
        let idx = KvIndex::new(IndexConfig::default()).unwrap();
        let mut t = ApproxTracker::new(Millis(1000), 100);
        let ep = EndpointId::new(3).unwrap();
        let k = keys(0..10);
        for ev in t.record_route(ep, &k, Millis(0)) {
            idx.apply(Holder::Endpoint(ep), &[ev]);
        }
        assert_eq!(idx.find_matches(&k, &[ep])[0].reach(Tier::Gpu), 10);
        // Re-routing the first half renews it.
        assert!(t.record_route(ep, &k[..5], Millis(600)).is_empty());
        for (e, ev) in t.expire(Millis(1000)) {
            idx.apply(Holder::Endpoint(e), &[ev]);
        }
        assert_eq!(t.len(ep), 5);
        assert_eq!(idx.find_matches(&k, &[ep])[0].reach(Tier::Gpu), 5);
        for (e, ev) in t.expire(Millis(1600)) {
            idx.apply(Holder::Endpoint(e), &[ev]);
        }
        assert!(t.is_empty(ep));
        assert_eq!(idx.find_matches(&k, &[ep])[0].reach(Tier::Gpu), 0);
    }

    #[test]
    fn capacity_evicts_least_recently_routed() {
        let mut t = ApproxTracker::new(Millis(10_000), 8);
        let ep = EndpointId::new(0).unwrap();
        let a = keys(0..6);
        let b = keys(100..106);
        t.record_route(ep, &a, Millis(0));
        t.record_route(ep, &a[..2], Millis(1));
        let evs = t.record_route(ep, &b, Millis(2));
        assert_eq!(t.len(ep), 8);
        // a[2..6] were least recently used.
        assert_eq!(
            evs[1],
            KvEvent::Removed {
                keys: a[2..6].to_vec(),
                tier: Tier::Gpu
            }
        );
        for _ in 0..100 {
            t.record_route(ep, &b, Millis(3));
        }
        assert_eq!(t.len(ep), 8);
        let c = t.endpoints.get(&0).unwrap();
        assert!(
            c.order.len() <= 2 * 8 + 64 + b.len(),
            "stale queue entries are compacted"
        );
    }
}
