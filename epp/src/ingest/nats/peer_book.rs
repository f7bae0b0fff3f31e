//! Other EPP replicas' in-flight load, keyed by (replica, endpoint): a pure book fed with
//! decoded [`InflightMessage`]s and summed for the scheduler.
//!
//! Deltas add to the sender's entry; a full state replaces it; a goodbye or silence longer than
//! the expiry drops it, so a replica that crashed cannot leave phantom load behind. Counts are
//! kept signed (a delta may arrive before the full state it belongs after) and clamped at zero
//! when summed.

use std::collections::HashMap;

use kv_index::{EndpointId, Millis};
use scheduler::InflightLoad;

use super::inflight_wire::{InflightMessage, PeerEndpoint};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Signed {
    requests: i64,
    prefill: i64,
    decode: i64,
}

#[derive(Debug, Default)]
struct Peer {
    last_seen: Millis,
    next_seq: Option<u64>,
    loads: HashMap<EndpointId, Signed>,
}

/// What one message did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Applied {
    /// Deltas applied.
    pub deltas: usize,
    /// Whether the message was a full state.
    pub full: bool,
    /// Whether messages from this replica were missed before it.
    pub gap: bool,
    /// Whether it was this replica's own message (ignored).
    pub own: bool,
    /// Entries naming endpoints this replica does not know (skipped).
    pub unknown_endpoints: usize,
    /// Whether the sender was not known before.
    pub new_peer: bool,
}

/// Peers' in-flight load.
#[derive(Debug)]
pub struct PeerBook {
    own: u64,
    expiry: Millis,
    peers: HashMap<u64, Peer>,
}

impl PeerBook {
    /// A book for replica `own` (whose messages it ignores), forgetting peers silent longer
    /// than `expiry`.
    pub fn new(own: u64, expiry: Millis) -> Self {
        Self {
            own,
            expiry,
            peers: HashMap::new(),
        }
    }

    /// Peers known.
    pub fn replicas(&self) -> usize {
        self.peers.len()
    }

    /// Applies a message received at `now`; `resolve` maps an endpoint name to this replica's id.
    pub fn apply(
        &mut self,
        msg: &InflightMessage,
        now: Millis,
        resolve: impl Fn(&PeerEndpoint) -> Option<EndpointId>,
    ) -> Applied {
        let mut done = Applied::default();
        if msg.replica == self.own {
            done.own = true;
            return done;
        }
        if msg.bye {
            self.peers.remove(&msg.replica);
            return done;
        }
        done.new_peer = !self.peers.contains_key(&msg.replica);
        let peer = self.peers.entry(msg.replica).or_default();
        peer.last_seen = now;
        done.gap = peer.next_seq.is_some_and(|n| n != msg.seq);
        peer.next_seq = Some(msg.seq.wrapping_add(1));
        let ids: Vec<Option<EndpointId>> = msg.endpoints.iter().map(&resolve).collect();
        let id = |ep: u32| ids.get(ep as usize).copied().flatten();
        for d in &msg.deltas {
            let Some(e) = id(d.ep) else {
                done.unknown_endpoints += 1;
                continue;
            };
            let s = peer.loads.entry(e).or_default();
            s.requests = s.requests.saturating_add(d.requests);
            s.prefill = s.prefill.saturating_add(d.prefill);
            s.decode = s.decode.saturating_add(d.decode);
            done.deltas += 1;
        }
        if let Some(totals) = &msg.full {
            done.full = true;
            peer.loads.clear();
            for t in totals {
                let Some(e) = id(t.ep) else {
                    done.unknown_endpoints += 1;
                    continue;
                };
                let signed = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
                peer.loads.insert(
                    e,
                    Signed {
                        requests: signed(t.requests),
                        prefill: signed(t.prefill),
                        decode: signed(t.decode),
                    },
                );
            }
        }
        peer.loads.retain(|_, s| *s != Signed::default());
        done
    }

    /// Forgets peers silent since before `now - expiry`; returns how many.
    pub fn expire(&mut self, now: Millis) -> usize {
        let before = self.peers.len();
        let expiry = self.expiry;
        self.peers
            .retain(|_, p| now.0.saturating_sub(p.last_seen.0) <= expiry.0);
        before - self.peers.len()
    }

    /// Drops `endpoint` from every peer (it left the pool).
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        for p in self.peers.values_mut() {
            p.loads.remove(&endpoint);
        }
    }

    /// Forgets every peer.
    pub fn clear(&mut self) {
        self.peers.clear();
    }

    /// The peers' load per endpoint, summed, negative counts clamped to zero.
    pub fn totals(&self) -> HashMap<EndpointId, InflightLoad> {
        let mut sum: HashMap<EndpointId, InflightLoad> = HashMap::new();
        let clamp = |v: i64| u64::try_from(v).unwrap_or(0);
        for p in self.peers.values() {
            for (e, s) in &p.loads {
                let t = sum.entry(*e).or_default();
                t.requests = t.requests.saturating_add(clamp(s.requests));
                t.prefill_blocks = t.prefill_blocks.saturating_add(clamp(s.prefill));
                t.decode_blocks = t.decode_blocks.saturating_add(clamp(s.decode));
            }
        }
        sum.retain(|_, l| *l != InflightLoad::default());
        sum
    }
}

#[cfg(test)]
#[path = "peer_book_tests.rs"]
mod tests;
