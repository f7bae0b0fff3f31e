//! Tickets handed from a request's routing stream to its response observer's stream.
//!
//! With the response-observer layout, the gateway runs two ext_proc filters: the routing one
//! sees only the request (so the EPP is off the response path and a stream in flight survives
//! the EPP's loss), and a second one in observability mode sends the response without waiting
//! for replies. Each filter opens its own `Process` stream. The routing stream parks the
//! request's open ticket here under its `x-request-id` when it picks; the observer stream claims
//! it on the request headers it sees first and reports the response against it.
//!
//! A parked ticket nobody claims (the observer filter is missing, its stream went to another
//! EPP replica, or the request died before reaching it) is aborted by the second [`sweep`] after
//! it was parked; the server sweeps once a second. Dropping a ticket aborts it, so nothing is
//! ever left open. Pure: no clock, no I/O.
//!
//! With several EPP replicas, an observer stream that finds no ticket here relays its events to
//! the replica that routed the request (see [`super::relay`]); that replica moves the parked
//! ticket to its relayed table on the first event ([`Handoffs::relay_event`]) and aborts it when
//! its observer stops listing it or falls silent.
//!
//! [`sweep`]: Handoffs::sweep

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::relay::{Relay, RelayEvent, RelayTicket, id_hash};
use super::stream::Observer;

/// Sweeps (seconds) an observer replica may stay silent before the tickets it relays for are
/// aborted: its heartbeat comes every second while it observes anything.
pub const RELAY_SILENCE_SWEEPS: u64 = 5;

/// Parked tickets by request id.
#[derive(Debug)]
pub struct Handoffs {
    inner: Mutex<Inner>,
    capacity: usize,
    claimed: AtomicU64,
    unmatched: AtomicU64,
    expired: AtomicU64,
    overflowed: AtomicU64,
    replaced: AtomicU64,
    relayed_out: AtomicU64,
    relayed_in: AtomicU64,
    relay_lost: AtomicU64,
    relay_unmatched: AtomicU64,
    /// The observer side of relaying, when on.
    relay: Option<Arc<Relay>>,
}

#[derive(Debug, Default)]
struct Inner {
    parked: HashMap<String, Parked>,
    /// Tickets claimed by another replica's observer, by request id.
    relayed: HashMap<String, Relayed>,
    /// The sweep count when each observer replica was last heard from.
    observers: HashMap<u64, u64>,
    sweeps: u64,
}

#[derive(Debug)]
struct Relayed {
    observer: Observer,
    /// The observing replica.
    by: u64,
}

/// What an observer stream takes over for its request.
// Returned once per observer stream and unpacked at once: boxing would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(super) enum Claimed {
    /// The ticket this replica parked.
    Local(Observer),
    /// A relay towards the replica that routed the request.
    Relay(RelayTicket),
}

#[derive(Debug)]
struct Parked {
    observer: Observer,
    /// The sweep count when it was parked.
    sweeps: u64,
}

/// Counters of what happened to parked tickets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandoffStats {
    /// Tickets waiting for their observer now.
    pub parked: u64,
    /// Claimed by an observer stream.
    pub claimed: u64,
    /// Observer streams that found no ticket under their request id.
    pub unmatched: u64,
    /// Aborted unclaimed by a sweep.
    pub expired: u64,
    /// Aborted at once because the table was full.
    pub overflowed: u64,
    /// Aborted because another ticket was parked under the same request id.
    pub replaced: u64,
    /// Tickets held here for another replica's observer now.
    pub relayed: u64,
    /// Observer streams here that relay to the replica that routed their request.
    pub relayed_out: u64,
    /// Parked tickets claimed by another replica's observer.
    pub relayed_in: u64,
    /// Relayed tickets aborted because their observer stopped listing them or fell silent.
    pub relay_lost: u64,
    /// Relayed events naming no ticket here (it expired, or a client forged the header).
    pub relay_unmatched: u64,
}

impl Handoffs {
    /// A table holding at most `capacity` parked tickets.
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            capacity: capacity.max(1),
            claimed: AtomicU64::new(0),
            unmatched: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            overflowed: AtomicU64::new(0),
            replaced: AtomicU64::new(0),
            relayed_out: AtomicU64::new(0),
            relayed_in: AtomicU64::new(0),
            relay_lost: AtomicU64::new(0),
            relay_unmatched: AtomicU64::new(0),
            relay: None,
        }
    }

    /// The same table, relaying observed responses of other replicas' requests through `relay`.
    pub fn with_relay(self, relay: Arc<Relay>) -> Self {
        Self {
            relay: Some(relay),
            ..self
        }
    }

    /// The observer side of relaying, when on.
    pub fn relay(&self) -> Option<&Arc<Relay>> {
        self.relay.as_ref()
    }

    /// Parks `observer` under `request_id`. A full table (parked and relayed tickets count) aborts
    /// it at once; an id already parked aborts the older ticket (ids are meant to be unique).
    pub(super) fn park(&self, request_id: &str, observer: Observer) {
        let aborted = {
            let mut inner = self.lock();
            let held = inner.parked.len() + inner.relayed.len();
            if held >= self.capacity && !inner.parked.contains_key(request_id) {
                self.overflowed.fetch_add(1, Ordering::Relaxed);
                Some(observer)
            } else {
                let sweeps = inner.sweeps;
                let old = inner
                    .parked
                    .insert(request_id.to_owned(), Parked { observer, sweeps });
                if old.is_some() {
                    self.replaced.fetch_add(1, Ordering::Relaxed);
                }
                old.map(|p| p.observer)
            }
        };
        // Dropped outside the lock: aborting reports to the router.
        drop(aborted);
    }

    /// Takes the ticket parked under `request_id`, or, when it is not here and `owner` (the
    /// replica the request's headers name as its router) is another replica, opens a relay to it.
    pub(super) fn claim(&self, request_id: &str, owner: Option<u64>) -> Option<Claimed> {
        if let Some(p) = self.lock().parked.remove(request_id) {
            self.claimed.fetch_add(1, Ordering::Relaxed);
            return Some(Claimed::Local(p.observer));
        }
        let relayed = self
            .relay
            .as_ref()
            .zip(owner)
            .and_then(|(relay, owner)| relay.open(owner, request_id));
        let counter = if relayed.is_some() {
            &self.relayed_out
        } else {
            &self.unmatched
        };
        counter.fetch_add(1, Ordering::Relaxed);
        relayed.map(Claimed::Relay)
    }

    /// Applies an event another replica's observer relayed for `request_id`: the first one moves
    /// the parked ticket to the relayed table; a terminal one closes it.
    pub fn relay_event(&self, observer: u64, request_id: &str, event: RelayEvent) {
        let taken = {
            let mut inner = self.lock();
            let sweeps = inner.sweeps;
            inner.observers.insert(observer, sweeps);
            match inner.relayed.remove(request_id) {
                Some(r) if r.by == observer => Some(r),
                Some(r) => {
                    // Another observer holds it: a forged or replayed header.
                    inner.relayed.insert(request_id.to_owned(), r);
                    None
                }
                None => inner.parked.remove(request_id).map(|p| {
                    self.relayed_in.fetch_add(1, Ordering::Relaxed);
                    Relayed {
                        observer: p.observer,
                        by: observer,
                    }
                }),
            }
        };
        let Some(relayed) = taken else {
            self.relay_unmatched.fetch_add(1, Ordering::Relaxed);
            return;
        };
        // The router hears the event outside the lock.
        let keep = match event {
            RelayEvent::Claim => Some(relayed),
            RelayEvent::Report(e) if e.is_terminal() => {
                relayed.observer.close(e);
                None
            }
            RelayEvent::Report(e) => {
                relayed.observer.report(e);
                Some(relayed)
            }
        };
        if let Some(r) = keep {
            let old = self.lock().relayed.insert(request_id.to_owned(), r);
            // Never anything (one loop applies relayed events); dropped outside the lock anyway,
            // as aborting reports to the router.
            drop(old);
        }
    }

    /// An observer replica's heartbeat: the requests of this replica it still observes, as
    /// [`id_hash`]es. Claims for it the parked tickets it lists (their claim was lost), and
    /// aborts the tickets it relayed for and no longer lists (their end was lost); returns how
    /// many were aborted.
    pub fn relay_observing(&self, observer: u64, ids: &[u64]) -> usize {
        let listed: HashSet<u64> = ids.iter().copied().collect();
        let lost: Vec<Relayed> = {
            let mut inner = self.lock();
            let sweeps = inner.sweeps;
            inner.observers.insert(observer, sweeps);
            let gone: Vec<String> = inner
                .relayed
                .iter()
                .filter(|(id, r)| r.by == observer && !listed.contains(&id_hash(id)))
                .map(|(id, _)| id.clone())
                .collect();
            let lost = gone
                .iter()
                .filter_map(|id| inner.relayed.remove(id))
                .collect();
            let unclaimed: Vec<String> = inner
                .parked
                .keys()
                .filter(|id| listed.contains(&id_hash(id)) && !inner.relayed.contains_key(*id))
                .cloned()
                .collect();
            for id in unclaimed {
                if let Some(p) = inner.parked.remove(&id) {
                    self.relayed_in.fetch_add(1, Ordering::Relaxed);
                    let relayed = Relayed {
                        observer: p.observer,
                        by: observer,
                    };
                    inner.relayed.insert(id, relayed);
                }
            }
            lost
        };
        self.count_lost(lost)
    }

    fn count_lost(&self, lost: Vec<Relayed>) -> usize {
        let n = lost.len();
        if n > 0 {
            self.relay_lost.fetch_add(n as u64, Ordering::Relaxed);
            tracing::debug!(
                lost = n,
                "relayed tickets aborted: their observer replica no longer reports them"
            );
        }
        drop(lost);
        n
    }

    /// Aborts the tickets parked before the previous sweep, and the relayed tickets whose
    /// observer replica has been silent for [`RELAY_SILENCE_SWEEPS`]; returns how many parked
    /// tickets expired.
    pub fn sweep(&self) -> usize {
        let (expired, lost): (Vec<Parked>, Vec<Relayed>) = {
            let mut inner = self.lock();
            let cutoff = inner.sweeps;
            inner.sweeps += 1;
            let now = inner.sweeps;
            inner
                .observers
                .retain(|_, heard| now.saturating_sub(*heard) <= RELAY_SILENCE_SWEEPS);
            let silent: Vec<String> = inner
                .relayed
                .iter()
                .filter(|(_, r)| !inner.observers.contains_key(&r.by))
                .map(|(id, _)| id.clone())
                .collect();
            let lost = silent
                .iter()
                .filter_map(|id| inner.relayed.remove(id))
                .collect();
            let stale: Vec<String> = inner
                .parked
                .iter()
                .filter(|(_, p)| p.sweeps < cutoff)
                .map(|(id, _)| id.clone())
                .collect();
            let expired = stale
                .iter()
                .filter_map(|id| inner.parked.remove(id))
                .collect();
            (expired, lost)
        };
        self.count_lost(lost);
        let n = expired.len();
        if n > 0 {
            self.expired.fetch_add(n as u64, Ordering::Relaxed);
            tracing::debug!(
                expired = n,
                "parked tickets no response observer claimed were aborted"
            );
        }
        drop(expired);
        n
    }

    /// The counters now.
    pub fn stats(&self) -> HandoffStats {
        let (parked, relayed) = {
            let inner = self.lock();
            (inner.parked.len() as u64, inner.relayed.len() as u64)
        };
        HandoffStats {
            parked,
            relayed,
            relayed_out: self.relayed_out.load(Ordering::Relaxed),
            relayed_in: self.relayed_in.load(Ordering::Relaxed),
            relay_lost: self.relay_lost.load(Ordering::Relaxed),
            relay_unmatched: self.relay_unmatched.load(Ordering::Relaxed),
            claimed: self.claimed.load(Ordering::Relaxed),
            unmatched: self.unmatched.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
            overflowed: self.overflowed.load(Ordering::Relaxed),
            replaced: self.replaced.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
