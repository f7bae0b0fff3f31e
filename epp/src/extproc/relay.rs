//! Relaying a response observer's events to the EPP replica that routed the request.
//!
//! In the response-observer layout each request opens two ext_proc streams, and with several
//! EPP replicas behind one gateway they can reach different replicas. The routing replica then
//! holds the request's ticket (its in-flight accounting) while another replica sees the
//! response. The routing stream names its replica in [`REPLICA_HEADER`] (and a rewritten
//! model's names in [`RESPONSE_MODEL_HEADER`]); an observer stream that finds no local ticket
//! opens a [`RelayTicket`] towards that replica, whose events go out through a [`RelaySink`]
//! (the NATS side publishes them to the owner, which applies them to the ticket it parked, see
//! [`super::Handoffs::relay_event`]).
//!
//! Liveness: [`Relay::heartbeat`] lists, per owner, the requests this replica still observes.
//! The owner aborts a relayed ticket that a heartbeat of its observer no longer lists (its end
//! was lost) or whose observer fell silent (it died). Every item for an owner — claims, events,
//! heartbeats — is queued under one lock, so the owner sees a heartbeat after the claim of
//! every request it lists and after the end of every request it omits.
//!
//! Pure: no clock, no I/O.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::router::{ResponseEvent, ResponseModel};

/// Request header naming the EPP replica that routed the request (16 hex digits). Set by the
/// routing stream in the response-observer layout; a client's value is replaced.
pub const REPLICA_HEADER: &str = "x-kvgate-epp-replica";
/// Request header carrying a rewritten request's model names (`["served","client"]`, JSON with
/// non-ASCII escaped), so an observer on another replica can swap them back in the response.
pub const RESPONSE_MODEL_HEADER: &str = "x-kvgate-response-model";
/// Longest request id relayed (longer ones are observed without a ticket).
pub const MAX_RELAYED_ID_BYTES: usize = 256;
/// Longest [`RESPONSE_MODEL_HEADER`] value written or read.
pub(super) const MAX_MODEL_HEADER_BYTES: usize = 2048;

/// What an observer tells a ticket's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayEvent {
    /// The observer has taken the request over (sent first).
    Claim,
    /// A response event, as the local ticket would have reported it.
    Report(ResponseEvent),
}

/// One queued item for an owner replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outgoing {
    /// An event for one request.
    Event {
        /// The replica holding the ticket.
        owner: u64,
        /// The request id the ticket is parked under.
        request_id: Arc<str>,
        /// What happened.
        event: RelayEvent,
    },
    /// The requests of `owner` this replica still observes (a heartbeat).
    Observing {
        /// The replica holding the tickets.
        owner: u64,
        /// Their request ids, hashed ([`id_hash`]) to keep the heartbeat small.
        ids: Vec<u64>,
    },
}

impl Outgoing {
    /// The replica this item is for.
    pub fn owner(&self) -> u64 {
        match self {
            Self::Event { owner, .. } | Self::Observing { owner, .. } => *owner,
        }
    }
}

/// Where relayed items go; never blocks.
pub trait RelaySink: Send + Sync + 'static {
    /// Queues `item`; false when it was dropped (the queue is full or closed).
    fn send(&self, item: Outgoing) -> bool;
}

/// Counters of the observer side.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Relayed tickets open now.
    pub open: u64,
    /// Items queued for publishing.
    pub queued: u64,
    /// Items dropped because the queue was full or closed.
    pub dropped: u64,
    /// Observer streams that could not relay (the table was full).
    pub refused: u64,
}

/// The observer side of relaying: this replica's id, the queue, and the relayed tickets open.
pub struct Relay {
    replica: u64,
    /// `replica` as [`REPLICA_HEADER`] carries it.
    header: String,
    sink: Arc<dyn RelaySink>,
    capacity: usize,
    /// Open relayed tickets by owner. Items are queued under this lock.
    open: Mutex<HashMap<u64, HashSet<Arc<str>>>>,
    queued: AtomicU64,
    dropped: AtomicU64,
    refused: AtomicU64,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("replica", &format_args!("{:016x}", self.replica))
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// Relaying for replica `replica` through `sink`, with at most `capacity` tickets open.
    pub fn new(replica: u64, sink: Arc<dyn RelaySink>, capacity: usize) -> Self {
        Self {
            replica,
            header: replica_header_value(replica),
            sink,
            capacity: capacity.max(1),
            open: Mutex::new(HashMap::new()),
            queued: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// This replica's id.
    pub fn replica(&self) -> u64 {
        self.replica
    }

    /// This replica's id as [`REPLICA_HEADER`] carries it (formatted once: every routed
    /// request sends it).
    pub fn header_value(&self) -> &str {
        &self.header
    }

    /// Opens a relayed ticket for `request_id`, routed by `owner`: queues its claim. `None` when
    /// `owner` is this replica, the id is too long, or the table is full.
    pub(super) fn open(self: &Arc<Self>, owner: u64, request_id: &str) -> Option<RelayTicket> {
        if owner == self.replica || request_id.len() > MAX_RELAYED_ID_BYTES {
            return None;
        }
        let request_id: Arc<str> = Arc::from(request_id);
        {
            let mut open = self.lock();
            let total: usize = open.values().map(HashSet::len).sum();
            if total >= self.capacity {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            open.entry(owner)
                .or_default()
                .insert(Arc::clone(&request_id));
            self.queue(Outgoing::Event {
                owner,
                request_id: Arc::clone(&request_id),
                event: RelayEvent::Claim,
            });
        }
        Some(RelayTicket {
            relay: Arc::clone(self),
            owner,
            request_id,
            open: true,
        })
    }

    /// Queues, for every owner with tickets open, the list of their request ids.
    pub fn heartbeat(&self) {
        let open = self.lock();
        for (owner, ids) in open.iter().filter(|(_, ids)| !ids.is_empty()) {
            self.queue(Outgoing::Observing {
                owner: *owner,
                ids: ids.iter().map(|id| id_hash(id)).collect(),
            });
        }
    }

    /// The counters now.
    pub fn stats(&self) -> RelayStats {
        RelayStats {
            open: self.lock().values().map(HashSet::len).sum::<usize>() as u64,
            queued: self.queued.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }

    fn report(&self, owner: u64, request_id: &Arc<str>, event: ResponseEvent) {
        let _open = self.lock();
        self.queue(Outgoing::Event {
            owner,
            request_id: Arc::clone(request_id),
            event: RelayEvent::Report(event),
        });
    }

    /// Queues the terminal event and forgets the ticket, under one lock.
    fn close(&self, owner: u64, request_id: &Arc<str>, event: ResponseEvent) {
        let mut open = self.lock();
        self.queue(Outgoing::Event {
            owner,
            request_id: Arc::clone(request_id),
            event: RelayEvent::Report(event),
        });
        if let Some(ids) = open.get_mut(&owner) {
            ids.remove(request_id);
            if ids.is_empty() {
                open.remove(&owner);
            }
        }
    }

    /// Call with the lock held.
    fn queue(&self, item: Outgoing) {
        let counter = if self.sink.send(item) {
            &self.queued
        } else {
            &self.dropped
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, HashSet<Arc<str>>>> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A ticket held by another replica, reported to through the relay. Exactly one terminal event
/// is queued: the one given to [`RelayTicket::close`], or `Aborted` when dropped open.
pub(super) struct RelayTicket {
    relay: Arc<Relay>,
    owner: u64,
    request_id: Arc<str>,
    open: bool,
}

impl std::fmt::Debug for RelayTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayTicket")
            .field("owner", &format_args!("{:016x}", self.owner))
            .field("request_id", &self.request_id)
            .field("open", &self.open)
            .finish()
    }
}

impl RelayTicket {
    pub(super) fn report(&self, event: ResponseEvent) {
        debug_assert!(!event.is_terminal());
        if self.open {
            self.relay.report(self.owner, &self.request_id, event);
        }
    }

    pub(super) fn close(mut self, event: ResponseEvent) {
        debug_assert!(event.is_terminal());
        self.finish(event);
    }

    fn finish(&mut self, event: ResponseEvent) {
        if std::mem::take(&mut self.open) {
            self.relay.close(self.owner, &self.request_id, event);
        }
    }
}

impl Drop for RelayTicket {
    fn drop(&mut self) {
        self.finish(ResponseEvent::Aborted);
    }
}

/// A request id as heartbeats carry it.
pub fn id_hash(request_id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(request_id.as_bytes())
}

/// `replica` as [`REPLICA_HEADER`] carries it.
pub fn replica_header_value(replica: u64) -> String {
    format!("{replica:016x}")
}

/// A [`REPLICA_HEADER`] value: 1 to 16 hex digits.
pub fn parse_replica(value: &str) -> Option<u64> {
    let v = value.trim();
    if v.is_empty() || v.len() > 16 || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(v, 16).ok()
}

/// A [`RESPONSE_MODEL_HEADER`] value: `["served","client"]` as JSON, everything but printable
/// ASCII escaped, so it is a valid header value whatever the names; `None` when longer than a
/// receiver reads.
pub(super) fn encode_response_model(m: &ResponseModel) -> Option<String> {
    let json = serde_json::to_string(&[&m.served, &m.client]).ok()?;
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if (' '..='~').contains(&c) {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    (out.len() <= MAX_MODEL_HEADER_BYTES).then_some(out)
}

/// Reads a [`RESPONSE_MODEL_HEADER`] value; `None` when malformed or too long.
pub(super) fn decode_response_model(value: &str) -> Option<ResponseModel> {
    if value.len() > MAX_MODEL_HEADER_BYTES {
        return None;
    }
    let (served, client): (String, String) = serde_json::from_str(value).ok()?;
    Some(ResponseModel { served, client })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    pub(crate) struct Collect {
        pub(crate) items: Mutex<Vec<Outgoing>>,
        pub(crate) full: std::sync::atomic::AtomicBool,
    }

    impl RelaySink for Collect {
        fn send(&self, item: Outgoing) -> bool {
            if self.full.load(Ordering::Relaxed) {
                return false;
            }
            self.items.lock().unwrap().push(item);
            true
        }
    }

    fn relay(capacity: usize) -> (Arc<Relay>, Arc<Collect>) {
        let sink = Arc::new(Collect::default());
        (
            Arc::new(Relay::new(1, Arc::clone(&sink) as _, capacity)),
            sink,
        )
    }

    fn event(owner: u64, id: &str, event: RelayEvent) -> Outgoing {
        Outgoing::Event {
            owner,
            request_id: Arc::from(id),
            event,
        }
    }

    #[test]
    fn a_ticket_queues_its_claim_its_events_and_one_end() {
        let (relay, sink) = relay(8);
        let t = relay.open(7, "r1").expect("opens");
        t.report(ResponseEvent::FirstByte);
        relay.heartbeat();
        t.close(ResponseEvent::End);
        relay.heartbeat();
        let items = sink.items.lock().unwrap().clone();
        assert_eq!(
            items,
            vec![
                event(7, "r1", RelayEvent::Claim),
                event(7, "r1", RelayEvent::Report(ResponseEvent::FirstByte)),
                Outgoing::Observing {
                    owner: 7,
                    ids: vec![id_hash("r1")]
                },
                event(7, "r1", RelayEvent::Report(ResponseEvent::End)),
            ],
            "no heartbeat once nothing is open"
        );
        assert_eq!(relay.stats().open, 0);
        assert_eq!(relay.stats().queued, 4);
    }

    #[test]
    fn a_dropped_ticket_aborts_once() {
        let (relay, sink) = relay(8);
        drop(relay.open(7, "r1"));
        let items = sink.items.lock().unwrap().clone();
        assert_eq!(
            items.last(),
            Some(&event(7, "r1", RelayEvent::Report(ResponseEvent::Aborted)))
        );
        assert_eq!(items.len(), 2);
    }

    #[test]
    fn own_replica_long_ids_and_a_full_table_are_not_relayed() {
        let (relay, sink) = relay(1);
        assert!(relay.open(1, "r").is_none(), "this replica's own ticket");
        assert!(
            relay
                .open(7, &"x".repeat(MAX_RELAYED_ID_BYTES + 1))
                .is_none()
        );
        let held = relay.open(7, "a").expect("room for one");
        assert!(relay.open(8, "b").is_none(), "the table is full");
        assert_eq!(relay.stats().refused, 1);
        drop(held);
        assert!(relay.open(8, "b").is_some(), "room again");
        assert!(sink.items.lock().unwrap().len() >= 3);
    }

    #[test]
    fn a_full_queue_counts_drops_and_still_forgets_the_ticket() {
        let (relay, sink) = relay(8);
        let t = relay.open(7, "r1").expect("opens");
        sink.full.store(true, Ordering::Relaxed);
        t.close(ResponseEvent::End);
        let s = relay.stats();
        assert_eq!((s.open, s.queued, s.dropped), (0, 1, 1));
    }

    #[test]
    fn replica_ids_round_trip_and_junk_is_refused() {
        for id in [0, 1, u64::MAX, 0x0123_4567_89ab_cdef] {
            assert_eq!(parse_replica(&replica_header_value(id)), Some(id));
        }
        for bad in ["", "g", "0x12", "11111111111111111", " - "] {
            assert_eq!(parse_replica(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn model_names_survive_the_header_in_ascii() {
        let m = ResponseModel {
            served: "llama-3.1-8b\"x\\\u{7f}".into(),
            client: "modèle 🚀\n".into(),
        };
        let v = encode_response_model(&m).expect("short enough");
        assert!(v.bytes().all(|b| (0x20..0x7f).contains(&b)), "{v}");
        assert_eq!(decode_response_model(&v), Some(m));
        assert_eq!(decode_response_model("[\"one\"]"), None);
        assert_eq!(decode_response_model(&"a".repeat(4096)), None);
        let long = ResponseModel {
            served: "s".repeat(MAX_MODEL_HEADER_BYTES),
            client: "c".into(),
        };
        assert_eq!(
            encode_response_model(&long),
            None,
            "never longer than a receiver reads"
        );
    }
}
