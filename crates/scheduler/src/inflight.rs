//! The EPP's own in-flight accounting: per endpoint, the requests it routed there that have
//! not finished, the blocks still to prefill and the blocks held by decoding requests.
//!
//! Lifecycle of one request: [`InflightTracker::on_routed`] (its uncached blocks are pending
//! prefill) → [`InflightTracker::on_first_token`] (prefill done: those blocks leave the prefill
//! count and the request's whole footprint, prompt plus expected output, counts as decoding)
//! → [`InflightTracker::on_finished`] (everything it held is freed). Both later calls are
//! idempotent, and finishing without a first token (an error, a client that went away) frees
//! the prefill blocks. Every count returns to zero and every entry is dropped once all
//! requests finished: the tracker cannot leak.
//!
//! Active-active replicas: each EPP replica shares its own changes (the optional *journal*,
//! drained by the sharing adapter) and installs the sum of its peers' loads with
//! [`InflightTracker::set_peer_loads`]. [`InflightTracker::load`] and
//! [`InflightTracker::loads_into`] — what the scheduler reads — return own plus peers';
//! [`InflightTracker::len`], [`InflightTracker::is_empty`] and [`InflightTracker::own_loads`]
//! count this replica's requests only.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use kv_index::EndpointId;

/// One endpoint's in-flight load as the EPP accounts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct InflightLoad {
    /// Requests routed and not finished.
    pub requests: u64,
    /// Uncached prompt blocks of requests still waiting for their first token.
    pub prefill_blocks: u64,
    /// Blocks (prompt + expected output) of requests past their first token.
    pub decode_blocks: u64,
}

/// A routed request's handle in the tracker. Copyable: later calls with a token already
/// finished, or one the tracker never issued, do nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InflightToken {
    id: u64,
    endpoint: EndpointId,
}

impl InflightToken {
    /// The endpoint the request was routed to.
    pub const fn endpoint(&self) -> EndpointId {
        self.endpoint
    }

    /// The token's number, unique within its tracker.
    pub const fn id(&self) -> u64 {
        self.id
    }
}

/// Which lifecycle step a journalled change was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChangeKind {
    /// A request was routed.
    Routed,
    /// A request produced its first token.
    FirstToken,
    /// A request ended.
    Finished,
}

/// One change to this replica's in-flight load, as the journal records it: signed differences
/// that, summed over a replica's changes, give its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InflightChange {
    /// The endpoint whose load changed.
    pub endpoint: EndpointId,
    /// The step.
    pub kind: ChangeKind,
    /// Change in requests.
    pub requests: i64,
    /// Change in prefill blocks.
    pub prefill_blocks: i64,
    /// Change in decode blocks.
    pub decode_blocks: i64,
}

#[derive(Debug, Default)]
struct Journal {
    changes: Vec<InflightChange>,
    cap: usize,
    overflowed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Prefill,
    Decode,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    endpoint: EndpointId,
    phase: Phase,
    /// Blocks counted in `prefill_blocks` while in [`Phase::Prefill`].
    uncached: u64,
    /// Blocks counted in `decode_blocks` once in [`Phase::Decode`].
    footprint: u64,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    requests: HashMap<u64, Entry>,
    endpoints: HashMap<EndpointId, InflightLoad>,
    peers: HashMap<EndpointId, InflightLoad>,
    journal: Option<Journal>,
}

fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Inner {
    fn record(&mut self, change: InflightChange) {
        if let Some(j) = &mut self.journal {
            if j.changes.len() < j.cap {
                j.changes.push(change);
            } else {
                j.overflowed = true;
            }
        }
    }

    fn total(&self, endpoint: &EndpointId) -> InflightLoad {
        let own = self.endpoints.get(endpoint).copied().unwrap_or_default();
        match self.peers.get(endpoint) {
            None => own,
            Some(p) => InflightLoad {
                requests: own.requests.saturating_add(p.requests),
                prefill_blocks: own.prefill_blocks.saturating_add(p.prefill_blocks),
                decode_blocks: own.decode_blocks.saturating_add(p.decode_blocks),
            },
        }
    }

    fn load_mut(&mut self, endpoint: EndpointId) -> &mut InflightLoad {
        self.endpoints.entry(endpoint).or_default()
    }

    /// Removes `entry`'s contribution from its endpoint's counts.
    fn release(&mut self, entry: Entry) {
        let (prefill, decode) = match entry.phase {
            Phase::Prefill => (entry.uncached, 0),
            Phase::Decode => (0, entry.footprint),
        };
        self.record(InflightChange {
            endpoint: entry.endpoint,
            kind: ChangeKind::Finished,
            requests: -1,
            prefill_blocks: -signed(prefill),
            decode_blocks: -signed(decode),
        });
        let load = self.load_mut(entry.endpoint);
        load.requests = load.requests.saturating_sub(1);
        match entry.phase {
            Phase::Prefill => {
                load.prefill_blocks = load.prefill_blocks.saturating_sub(entry.uncached)
            }
            Phase::Decode => {
                load.decode_blocks = load.decode_blocks.saturating_sub(entry.footprint)
            }
        }
        if load.requests == 0 {
            self.endpoints.remove(&entry.endpoint);
        }
    }
}

/// What [`InflightTracker::drain_journal`] reports besides the changes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct JournalDrain {
    /// Changes were dropped because the journal was full.
    pub overflowed: bool,
    /// Own load per endpoint after the drained changes.
    pub own: Vec<(EndpointId, InflightLoad)>,
}

/// Per-endpoint in-flight accounting, shared by every request stream (`&self` everywhere; one
/// short mutex hold per call, one per scheduling decision for all candidates).
#[derive(Debug, Default)]
pub struct InflightTracker {
    inner: Mutex<Inner>,
}

impl InflightTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every critical section leaves the state consistent, so a poisoned lock is usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a request routed to `endpoint` with a prompt of `prompt_blocks` blocks of which
    /// `uncached_blocks` must be computed (clamped to the prompt), expecting to generate about
    /// `expected_decode_blocks` blocks.
    pub fn on_routed(
        &self,
        endpoint: EndpointId,
        prompt_blocks: u32,
        uncached_blocks: u32,
        expected_decode_blocks: u32,
    ) -> InflightToken {
        let uncached = u64::from(uncached_blocks.min(prompt_blocks));
        let footprint = u64::from(prompt_blocks) + u64::from(expected_decode_blocks);
        let mut inner = self.lock();
        let id = inner.next_id;
        inner.next_id += 1;
        inner.requests.insert(
            id,
            Entry {
                endpoint,
                phase: Phase::Prefill,
                uncached,
                footprint,
            },
        );
        let load = inner.load_mut(endpoint);
        load.requests += 1;
        load.prefill_blocks += uncached;
        inner.record(InflightChange {
            endpoint,
            kind: ChangeKind::Routed,
            requests: 1,
            prefill_blocks: signed(uncached),
            decode_blocks: 0,
        });
        InflightToken { id, endpoint }
    }

    /// The request produced its first token: its prefill is done. Returns whether this call
    /// changed anything (false when repeated, after finish, or for an unknown token).
    pub fn on_first_token(&self, token: InflightToken) -> bool {
        let mut inner = self.lock();
        let Some(entry) = inner.requests.get_mut(&token.id) else {
            return false;
        };
        if entry.phase == Phase::Decode {
            return false;
        }
        entry.phase = Phase::Decode;
        let (endpoint, uncached, footprint) = (entry.endpoint, entry.uncached, entry.footprint);
        let load = inner.load_mut(endpoint);
        load.prefill_blocks = load.prefill_blocks.saturating_sub(uncached);
        load.decode_blocks += footprint;
        inner.record(InflightChange {
            endpoint,
            kind: ChangeKind::FirstToken,
            requests: 0,
            prefill_blocks: -signed(uncached),
            decode_blocks: signed(footprint),
        });
        true
    }

    /// The request ended (end of stream, error or disconnect): frees what it held. Returns
    /// whether this call changed anything.
    pub fn on_finished(&self, token: InflightToken) -> bool {
        let mut inner = self.lock();
        match inner.requests.remove(&token.id) {
            Some(entry) => {
                inner.release(entry);
                true
            }
            None => false,
        }
    }

    /// Forgets every request routed to `endpoint` (it left the pool); their tokens become
    /// no-ops. Returns how many were dropped. O(requests in flight).
    pub fn remove_endpoint(&self, endpoint: EndpointId) -> usize {
        let mut inner = self.lock();
        let before = inner.requests.len();
        inner.requests.retain(|_, e| e.endpoint != endpoint);
        inner.endpoints.remove(&endpoint);
        inner.peers.remove(&endpoint);
        before - inner.requests.len()
    }

    /// `endpoint`'s current load: this replica's plus its peers'.
    pub fn load(&self, endpoint: EndpointId) -> InflightLoad {
        self.lock().total(&endpoint)
    }

    /// Appends the load (own plus peers') of each of `endpoints` (in order) to `out`, under
    /// one lock hold.
    pub fn loads_into(&self, endpoints: &[EndpointId], out: &mut Vec<InflightLoad>) {
        let inner = self.lock();
        out.extend(endpoints.iter().map(|e| inner.total(e)));
    }

    /// Replaces the load other replicas routed (summed over them) with `peers`.
    pub fn set_peer_loads(&self, peers: HashMap<EndpointId, InflightLoad>) {
        self.lock().peers = peers;
    }

    /// This replica's own load per endpoint (endpoints with nothing in flight are left out).
    pub fn own_loads(&self) -> Vec<(EndpointId, InflightLoad)> {
        self.lock()
            .endpoints
            .iter()
            .map(|(e, l)| (*e, *l))
            .collect()
    }

    /// Starts recording own changes (at most `cap` between drains) for sharing with peers.
    pub fn enable_journal(&self, cap: usize) {
        self.lock().journal = Some(Journal {
            changes: Vec::new(),
            cap,
            overflowed: false,
        });
    }

    /// Moves the journalled changes to `out` and returns the own loads they lead to, taken
    /// under the same lock hold so the two agree. `overflowed` is set when changes were lost
    /// since the last drain (the caller should then send full state).
    pub fn drain_journal(&self, out: &mut Vec<InflightChange>) -> JournalDrain {
        let mut inner = self.lock();
        let overflowed = match &mut inner.journal {
            Some(j) => {
                out.append(&mut j.changes);
                std::mem::take(&mut j.overflowed)
            }
            None => false,
        };
        JournalDrain {
            overflowed,
            own: inner.endpoints.iter().map(|(e, l)| (*e, *l)).collect(),
        }
    }

    /// Requests in flight, over all endpoints.
    pub fn len(&self) -> usize {
        self.lock().requests.len()
    }

    /// Whether nothing is in flight and no per-endpoint state is kept.
    pub fn is_empty(&self) -> bool {
        let inner = self.lock();
        inner.requests.is_empty() && inner.endpoints.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(i: u32) -> EndpointId {
        EndpointId::new(i).unwrap()
    }

    fn load(requests: u64, prefill_blocks: u64, decode_blocks: u64) -> InflightLoad {
        InflightLoad {
            requests,
            prefill_blocks,
            decode_blocks,
        }
    }

    #[test]
    fn a_request_moves_from_prefill_to_decode_then_frees() {
        let t = InflightTracker::new();
        let tok = t.on_routed(ep(1), 10, 4, 2);
        assert_eq!(tok.endpoint(), ep(1));
        assert_eq!(t.load(ep(1)), load(1, 4, 0));
        assert!(t.on_first_token(tok));
        assert_eq!(t.load(ep(1)), load(1, 0, 12));
        assert!(t.on_finished(tok));
        assert_eq!(t.load(ep(1)), InflightLoad::default());
        assert!(t.is_empty());
    }

    #[test]
    fn repeated_and_late_calls_are_no_ops() {
        let t = InflightTracker::new();
        let a = t.on_routed(ep(0), 8, 8, 1);
        let b = t.on_routed(ep(0), 8, 2, 1);
        assert!(t.on_first_token(a));
        assert!(!t.on_first_token(a));
        assert_eq!(t.load(ep(0)), load(2, 2, 9));
        assert!(t.on_finished(a));
        assert!(!t.on_finished(a));
        assert!(!t.on_first_token(a));
        assert_eq!(t.load(ep(0)), load(1, 2, 0));
        // Finishing before the first token frees the prefill blocks.
        assert!(t.on_finished(b));
        assert!(t.is_empty());
        assert_ne!(a.id(), b.id());
    }

    #[test]
    fn uncached_is_clamped_to_the_prompt() {
        let t = InflightTracker::new();
        let tok = t.on_routed(ep(2), 3, 9, 0);
        assert_eq!(t.load(ep(2)).prefill_blocks, 3);
        t.on_finished(tok);
        assert!(t.is_empty());
    }

    #[test]
    fn the_journal_sums_to_the_own_load_and_peers_add_to_reads() {
        let t = InflightTracker::new();
        t.enable_journal(100);
        let a = t.on_routed(ep(1), 10, 4, 2);
        let b = t.on_routed(ep(1), 6, 6, 0);
        t.on_first_token(a);
        t.on_finished(b);
        let mut changes = Vec::new();
        let drain = t.drain_journal(&mut changes);
        assert!(!drain.overflowed);
        let kinds: Vec<_> = changes.iter().map(|c| c.kind).collect();
        use ChangeKind::*;
        assert_eq!(kinds, vec![Routed, Routed, FirstToken, Finished]);
        let sum = |f: fn(&InflightChange) -> i64| changes.iter().map(f).sum::<i64>();
        let own = t.load(ep(1));
        assert_eq!(drain.own, vec![(ep(1), own)]);
        assert_eq!(sum(|c| c.requests), own.requests as i64);
        assert_eq!(sum(|c| c.prefill_blocks), own.prefill_blocks as i64);
        assert_eq!(sum(|c| c.decode_blocks), own.decode_blocks as i64);
        t.set_peer_loads([(ep(1), load(2, 3, 4)), (ep(2), load(1, 1, 1))].into());
        assert_eq!(t.load(ep(1)), load(3, 3, 16));
        let mut out = Vec::new();
        t.loads_into(&[ep(2)], &mut out);
        assert_eq!(out, vec![load(1, 1, 1)]);
        assert_eq!(t.own_loads(), vec![(ep(1), own)]);
        t.on_finished(a);
        assert!(t.is_empty(), "peers' load is not this replica's state");
        t.remove_endpoint(ep(2));
        assert_eq!(t.load(ep(2)), InflightLoad::default());
        // A full journal drops changes and says so once.
        let t = InflightTracker::new();
        t.enable_journal(1);
        t.on_routed(ep(0), 1, 1, 0);
        t.on_routed(ep(0), 1, 1, 0);
        let mut changes = Vec::new();
        assert!(t.drain_journal(&mut changes).overflowed);
        assert_eq!(changes.len(), 1);
        assert!(!t.drain_journal(&mut changes).overflowed);
    }

    #[test]
    fn removing_an_endpoint_drops_its_requests() {
        let t = InflightTracker::new();
        let a = t.on_routed(ep(0), 4, 4, 0);
        let _b = t.on_routed(ep(0), 4, 4, 0);
        let c = t.on_routed(ep(1), 4, 1, 0);
        assert_eq!(t.remove_endpoint(ep(0)), 2);
        assert_eq!(t.load(ep(0)), InflightLoad::default());
        assert!(!t.on_finished(a));
        let mut out = Vec::new();
        t.loads_into(&[ep(0), ep(1)], &mut out);
        assert_eq!(out, vec![InflightLoad::default(), load(1, 1, 0)]);
        assert_eq!(t.len(), 1);
        t.on_finished(c);
        assert!(t.is_empty());
    }
}
