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
//! [`sweep`]: Handoffs::sweep

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::stream::Observer;

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
}

#[derive(Debug, Default)]
struct Inner {
    parked: HashMap<String, Parked>,
    sweeps: u64,
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
        }
    }

    /// Parks `observer` under `request_id`. A full table aborts it at once; an id already
    /// parked aborts the older ticket (ids are meant to be unique).
    pub(super) fn park(&self, request_id: &str, observer: Observer) {
        let aborted = {
            let mut inner = self.lock();
            if inner.parked.len() >= self.capacity && !inner.parked.contains_key(request_id) {
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

    /// Takes the ticket parked under `request_id`.
    pub(super) fn claim(&self, request_id: &str) -> Option<Observer> {
        let found = self.lock().parked.remove(request_id).map(|p| p.observer);
        let counter = if found.is_some() {
            &self.claimed
        } else {
            &self.unmatched
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// Aborts the tickets parked before the previous sweep; returns how many.
    pub fn sweep(&self) -> usize {
        let expired: Vec<Parked> = {
            let mut inner = self.lock();
            let cutoff = inner.sweeps;
            inner.sweeps += 1;
            let stale: Vec<String> = inner
                .parked
                .iter()
                .filter(|(_, p)| p.sweeps < cutoff)
                .map(|(id, _)| id.clone())
                .collect();
            stale
                .iter()
                .filter_map(|id| inner.parked.remove(id))
                .collect()
        };
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
        HandoffStats {
            parked: self.lock().parked.len() as u64,
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
