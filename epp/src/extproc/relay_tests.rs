//! The response relay between two replicas: a routing stream on one, the observer stream on
//! the other, the relay's queue delivered by hand (what the NATS loop does).

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::extproc::RELAY_SILENCE_SWEEPS;
use crate::extproc::relay::{Outgoing, Relay, RelayEvent, RelaySink, id_hash};

/// A relay queue the test delivers by hand; `drop_next` loses the next items.
#[derive(Default)]
struct Queue {
    items: Mutex<Vec<Outgoing>>,
    drop_next: AtomicU64,
}

impl RelaySink for Queue {
    fn send(&self, item: Outgoing) -> bool {
        if self.drop_next.load(Ordering::Relaxed) > 0 {
            self.drop_next.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        self.items.lock().unwrap().push(item);
        true
    }
}

/// One EPP replica: its router, handoff table and relay queue.
struct Replica {
    id: u64,
    router: Arc<FakeRouter>,
    handoffs: Arc<Handoffs>,
    queue: Arc<Queue>,
}

impl Replica {
    fn new(id: u64, router: Arc<FakeRouter>) -> Self {
        let queue = Arc::new(Queue::default());
        let relay = Relay::new(id, Arc::clone(&queue) as Arc<dyn RelaySink>, 64);
        Self {
            id,
            router,
            handoffs: Arc::new(Handoffs::new(64).with_relay(Arc::new(relay))),
            queue,
        }
    }

    fn stream(&self) -> ExtProcStream {
        stream(&self.router).with_handoffs(Arc::clone(&self.handoffs))
    }

    /// Delivers what this replica queued to `to` (the only peer), in order.
    fn deliver(&self, to: &Replica) -> usize {
        let items = std::mem::take(&mut *self.queue.items.lock().unwrap());
        let n = items.len();
        for item in items {
            assert_eq!(item.owner(), to.id);
            match item {
                Outgoing::Event {
                    request_id, event, ..
                } => to.handoffs.relay_event(self.id, &request_id, event),
                Outgoing::Observing { ids, .. } => {
                    to.handoffs.relay_observing(self.id, &ids);
                }
            }
        }
        n
    }
}

/// Routes `request_id` on `replica`'s routing stream; returns the headers its pick set (what
/// the next filter, the observer, sees).
fn route(replica: &Replica, request_id: &str, body: &[u8]) -> Vec<(String, String)> {
    let mut routing = replica.stream();
    routing
        .on_message(ProcessingRequest {
            protocol_config: routing_only(),
            ..req_headers(
                &[
                    (":method", "POST"),
                    (":path", "/v1/completions"),
                    ("x-request-id", request_id),
                    // A client's own value is replaced.
                    (REPLICA_HEADER, "ffff"),
                ],
                false,
            )
        })
        .unwrap();
    let out = routing.on_message(req_body(body, true)).unwrap();
    routing.finish();
    let mut headers: Vec<(String, String)> = set_headers(&out[0]).into_iter().collect();
    headers.push(("x-request-id".into(), request_id.into()));
    headers
}

/// The observer stream (the filter proper, answering every message) for those headers.
fn observe(replica: &Replica, headers: &[(String, String)]) -> (ExtProcStream, ProcessingResponse) {
    let mut observer = replica.stream().observing_responses();
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let out = observer
        .on_message(ProcessingRequest {
            protocol_config: observer_modes(),
            ..req_headers(&pairs, false)
        })
        .unwrap();
    assert_eq!(out.len(), 1);
    (observer, out.into_iter().next().unwrap())
}

fn event_kinds(router: &FakeRouter) -> Vec<ResponseEvent> {
    router.events().into_iter().map(|(_, e)| e).collect()
}

#[test]
fn an_observer_on_another_replica_relays_the_response_to_the_router() {
    let a = Replica::new(0xa, FakeRouter::picking(&["10.0.0.1:8000"]));
    let b = Replica::new(0xb, FakeRouter::picking(&["10.0.0.2:8000"]));
    let headers = route(&a, "req-1", b"{}");
    assert!(
        headers.contains(&(REPLICA_HEADER.into(), "000000000000000a".into())),
        "{headers:?}"
    );
    assert_eq!(a.handoffs.stats().parked, 1);

    let (mut observer, reply) = observe(&b, &headers);
    assert!(observer.has_open_ticket(), "a relayed ticket");
    assert_eq!(
        removed_headers(&reply),
        [REPLICA_HEADER],
        "the engine does not see the relay's header"
    );
    assert_eq!(b.deliver(&a), 1, "the claim");
    let stats = a.handoffs.stats();
    assert_eq!((stats.parked, stats.relayed, stats.relayed_in), (0, 1, 1));
    assert_eq!(b.handoffs.stats().relayed_out, 1);

    observer
        .on_message(resp_headers("200", "text/event-stream", false, None))
        .unwrap();
    for (i, chunk) in SSE.iter().enumerate() {
        observer
            .on_message(resp_body(chunk.as_bytes(), i + 1 == SSE.len()))
            .unwrap();
    }
    observer.finish();
    b.deliver(&a);
    let events = event_kinds(&a.router);
    assert_eq!(events.len(), 4, "{events:?}");
    assert!(matches!(
        events[0],
        ResponseEvent::Headers { status: 200, .. }
    ));
    assert_eq!(events[1], ResponseEvent::FirstByte);
    assert!(matches!(
        events[2],
        ResponseEvent::Usage {
            completion_tokens: 2,
            ..
        }
    ));
    assert_eq!(events[3], ResponseEvent::End);
    assert!(
        b.router.events().is_empty(),
        "the observer's router hears nothing"
    );
    assert_eq!(a.handoffs.stats().relayed, 0);
    // Nothing open any more: no heartbeat.
    b.handoffs.relay().unwrap().heartbeat();
    assert_eq!(b.deliver(&a), 0);
}

#[test]
fn a_relayed_observer_swaps_a_rewritten_model_back() {
    let router = FakeRouter::new(|_| {
        Ok(Decision {
            endpoints: vec!["10.0.0.1:8000".into()],
            body: Some(b"{\"model\":\"served\"}".to_vec()),
            add_headers: Vec::new(),
            ticket: 0,
            response_model: Some(ResponseModel {
                served: "served".into(),
                client: "alias".into(),
            }),
        })
    });
    let a = Replica::new(1, router);
    let b = Replica::new(2, FakeRouter::picking(&["10.0.0.2:8000"]));
    let headers = route(&a, "req-1", b"{\"model\":\"alias\"}");
    let (mut observer, reply) = observe(&b, &headers);
    let mut removed = removed_headers(&reply);
    removed.sort();
    assert_eq!(removed, [REPLICA_HEADER, RESPONSE_MODEL_HEADER]);
    let out = observer
        .on_message(resp_headers("200", "application/json", false, None))
        .unwrap();
    assert_eq!(removed_headers(&out[0]), ["content-length"]);
    let out = observer
        .on_message(resp_body(b"{\"model\":\"served\"}", true))
        .unwrap();
    match common(&out[0])
        .body_mutation
        .as_ref()
        .and_then(|m| m.mutation.as_ref())
    {
        Some(Mutation::Body(b)) => assert_eq!(b, b"{\"model\":\"alias\"}"),
        other => panic!("expected the chunk replaced, got {other:?}"),
    }
    observer.finish();
    b.deliver(&a);
    assert_eq!(event_kinds(&a.router).last(), Some(&ResponseEvent::End));
}

#[test]
fn a_lost_end_is_repaired_by_the_next_heartbeat() {
    let a = Replica::new(1, FakeRouter::picking(&["10.0.0.1:8000"]));
    let b = Replica::new(2, FakeRouter::picking(&["10.0.0.2:8000"]));
    let keep = route(&a, "keep", b"{}");
    let lose = route(&a, "lose", b"{}");
    let (mut kept, _) = observe(&b, &keep);
    let (mut lost, _) = observe(&b, &lose);
    b.deliver(&a);
    assert_eq!(a.handoffs.stats().relayed, 2);
    // The response's headers and end are lost.
    b.queue.drop_next.store(2, Ordering::Relaxed);
    lost.on_message(resp_headers("200", "application/json", true, None))
        .unwrap();
    lost.finish();
    b.deliver(&a);
    assert_eq!(a.handoffs.stats().relayed, 2, "the end never arrived");
    b.handoffs.relay().unwrap().heartbeat();
    b.deliver(&a);
    let stats = a.handoffs.stats();
    assert_eq!((stats.relayed, stats.relay_lost), (1, 1));
    assert_eq!(a.router.events(), [(2, ResponseEvent::Aborted)]);
    kept.on_message(resp_headers("200", "application/json", true, None))
        .unwrap();
    kept.finish();
    b.deliver(&a);
    assert_eq!(
        event_kinds(&a.router)[1..],
        [
            ResponseEvent::Headers {
                status: 200,
                served: None
            },
            ResponseEvent::End
        ]
    );
}

#[test]
fn a_silent_observer_replica_has_its_tickets_aborted() {
    let a = Replica::new(1, FakeRouter::picking(&["10.0.0.1:8000"]));
    let b = Replica::new(2, FakeRouter::picking(&["10.0.0.2:8000"]));
    let headers = route(&a, "req-1", b"{}");
    let (observer, _) = observe(&b, &headers);
    b.deliver(&a);
    for _ in 0..RELAY_SILENCE_SWEEPS {
        a.handoffs.sweep();
        // The observer lives: its heartbeat keeps the ticket.
        b.handoffs.relay().unwrap().heartbeat();
        b.deliver(&a);
    }
    assert_eq!(a.handoffs.stats().relayed, 1);
    // Replica b dies: nothing it queues is delivered any more.
    drop(observer);
    for _ in 0..RELAY_SILENCE_SWEEPS {
        a.handoffs.sweep();
        assert!(a.router.events().is_empty());
    }
    a.handoffs.sweep();
    assert_eq!(a.router.events(), [(1, ResponseEvent::Aborted)]);
    assert_eq!(a.handoffs.stats().relay_lost, 1);
}

#[test]
fn without_a_relay_or_with_its_own_id_an_observer_stays_unmatched() {
    // The header names this very replica (its ticket expired): nothing to relay.
    let a = Replica::new(1, FakeRouter::picking(&["10.0.0.1:8000"]));
    let headers = vec![
        ("x-request-id".to_owned(), "gone".to_owned()),
        (REPLICA_HEADER.to_owned(), "0000000000000001".to_owned()),
    ];
    let (observer, _) = observe(&a, &headers);
    assert!(!observer.has_open_ticket());
    assert_eq!(a.handoffs.stats().unmatched, 1);
    // A table without a relay (no NATS) never relays.
    let plain = Arc::new(Handoffs::new(4));
    let mut observer = stream(&a.router)
        .with_handoffs(Arc::clone(&plain))
        .observing_responses();
    observer
        .on_message(req_headers(
            &[("x-request-id", "r"), (REPLICA_HEADER, "0000000000000002")],
            false,
        ))
        .unwrap();
    assert!(!observer.has_open_ticket());
    assert_eq!(plain.stats().unmatched, 1);
}

#[test]
fn a_routing_stream_without_a_relay_strips_a_client_replica_header() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let plain = Arc::new(Handoffs::new(4));
    let mut routing = stream(&router).with_handoffs(plain);
    let out = routing
        .on_message(ProcessingRequest {
            protocol_config: routing_only(),
            ..req_headers(
                &[
                    (":method", "GET"),
                    ("x-request-id", "r"),
                    (REPLICA_HEADER, "0000000000000002"),
                ],
                true,
            )
        })
        .unwrap();
    assert!(!set_headers(&out[0]).contains_key(REPLICA_HEADER));
    assert_eq!(removed_headers(&out[0]), [REPLICA_HEADER]);
}

/// One step of the owner's relayed table.
#[derive(Debug, Clone)]
enum RelayOp {
    Park(u8),
    /// An observer (0 or 1) relays an event for a request.
    Event(u8, u8, u8),
    /// An observer's heartbeat lists these requests.
    Heartbeat(u8, Vec<u8>),
    Sweep,
}

fn relay_op() -> impl Strategy<Value = RelayOp> {
    prop_oneof![
        (0u8..5).prop_map(RelayOp::Park),
        (0u8..2, 0u8..5, 0u8..4).prop_map(|(o, id, e)| RelayOp::Event(o, id, e)),
        (0u8..2, proptest::collection::vec(0u8..5, 0..5))
            .prop_map(|(o, ids)| RelayOp::Heartbeat(o, ids)),
        Just(RelayOp::Sweep),
    ]
}

/// What the naive model holds for one request id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Parked { ticket: u64, sweep: u64 },
    Relayed { ticket: u64, by: u8 },
}

proptest! {
    /// The owner's table against a naive model: a relayed event claims a parked ticket for its
    /// observer, a terminal one closes it, another observer's events are refused, a heartbeat
    /// aborts the observer's tickets it omits and claims the parked ones it lists, a silent
    /// observer's tickets are aborted after
    /// `RELAY_SILENCE_SWEEPS`, and every ticket ends exactly once.
    #[test]
    fn the_relayed_table_matches_a_naive_model(ops in proptest::collection::vec(relay_op(), 1..80)) {
        const CAPACITY: usize = 4;
        let router = FakeRouter::picking(&["10.0.0.1:8000"]);
        let handoffs = Arc::new(Handoffs::new(CAPACITY));
        let mut model: BTreeMap<u8, Held> = BTreeMap::new();
        let mut heard: BTreeMap<u8, u64> = BTreeMap::new();
        let mut ended: BTreeMap<u64, ResponseEvent> = BTreeMap::new();
        let (mut sweeps, mut tickets) = (0u64, 0u64);
        for op in ops {
            match op {
                RelayOp::Park(id) => {
                    tickets += 1;
                    let mut routing = stream(&router).with_handoffs(Arc::clone(&handoffs));
                    routing.on_message(ProcessingRequest {
                        protocol_config: routing_only(),
                        ..req_headers(&[(":method", "GET"), ("x-request-id", &format!("r{id}"))], true)
                    }).unwrap();
                    routing.finish();
                    let parked = Held::Parked { ticket: tickets, sweep: sweeps };
                    match model.get(&id).copied() {
                        Some(Held::Parked { ticket, .. }) => {
                            ended.insert(ticket, ResponseEvent::Aborted);
                            model.insert(id, parked);
                        }
                        _ if model.len() >= CAPACITY => {
                            ended.insert(tickets, ResponseEvent::Aborted);
                        }
                        // A relayed ticket under the same id stays; the new one is parked.
                        _ => {
                            if matches!(model.get(&id), Some(Held::Relayed { .. })) {
                                // The model keys by id: keep both by parking under a shadow key.
                                let relayed = model.remove(&id).unwrap();
                                model.insert(id + 100, relayed);
                            }
                            model.insert(id, parked);
                        }
                    }
                }
                RelayOp::Event(observer, id, kind) => {
                    let event = match kind {
                        0 => RelayEvent::Claim,
                        1 => RelayEvent::Report(ResponseEvent::FirstByte),
                        2 => RelayEvent::Report(ResponseEvent::End),
                        _ => RelayEvent::Report(ResponseEvent::Aborted),
                    };
                    handoffs.relay_event(u64::from(observer), &format!("r{id}"), event.clone());
                    heard.insert(observer, sweeps);
                    let key = [id + 100, id]
                        .into_iter()
                        .find(|k| matches!(model.get(k), Some(Held::Relayed { .. })))
                        .unwrap_or(id);
                    let ticket = match model.get(&key).copied() {
                        Some(Held::Relayed { ticket, by }) if by == observer => Some(ticket),
                        Some(Held::Relayed { .. }) | None => None,
                        Some(Held::Parked { ticket, .. }) => Some(ticket),
                    };
                    if let Some(ticket) = ticket {
                        match event {
                            RelayEvent::Report(e) if e.is_terminal() => {
                                model.remove(&key);
                                ended.insert(ticket, e);
                            }
                            _ => {
                                model.insert(key, Held::Relayed { ticket, by: observer });
                            }
                        }
                    }
                }
                RelayOp::Heartbeat(observer, ids) => {
                    let hashes: Vec<u64> = ids.iter().map(|i| id_hash(&format!("r{i}"))).collect();
                    handoffs.relay_observing(u64::from(observer), &hashes);
                    heard.insert(observer, sweeps);
                    let omitted: Vec<u8> = model
                        .iter()
                        .filter(|(k, h)| matches!(h, Held::Relayed { by, .. } if *by == observer)
                            && !ids.contains(&(*k % 100)))
                        .map(|(k, _)| *k)
                        .collect();
                    for k in omitted {
                        if let Some(Held::Relayed { ticket, .. }) = model.remove(&k) {
                            ended.insert(ticket, ResponseEvent::Aborted);
                        }
                    }
                    // A listed request still parked is claimed (its claim was lost).
                    for id in ids.iter().copied().collect::<BTreeSet<u8>>() {
                        let shadowed = matches!(model.get(&(id + 100)), Some(Held::Relayed { .. }));
                        if let Some(Held::Parked { ticket, .. }) = model.get(&id).copied()
                            && !shadowed
                        {
                            model.insert(id, Held::Relayed { ticket, by: observer });
                        }
                    }
                }
                RelayOp::Sweep => {
                    let cutoff = sweeps;
                    sweeps += 1;
                    heard.retain(|_, h| sweeps - *h <= RELAY_SILENCE_SWEEPS);
                    let gone: Vec<u8> = model
                        .iter()
                        .filter(|(_, h)| match h {
                            Held::Parked { sweep, .. } => *sweep < cutoff,
                            Held::Relayed { by, .. } => !heard.contains_key(by),
                        })
                        .map(|(k, _)| *k)
                        .collect();
                    let expired = gone
                        .iter()
                        .filter(|k| matches!(model.get(k), Some(Held::Parked { .. })))
                        .count();
                    prop_assert_eq!(handoffs.sweep(), expired);
                    for k in gone {
                        let Some(Held::Parked { ticket, .. } | Held::Relayed { ticket, .. }) = model.remove(&k) else {
                            unreachable!()
                        };
                        ended.insert(ticket, ResponseEvent::Aborted);
                    }
                }
            }
            let stats = handoffs.stats();
            let relayed = model.values().filter(|h| matches!(h, Held::Relayed { .. })).count();
            prop_assert_eq!(stats.relayed, relayed as u64);
            prop_assert_eq!(stats.parked, (model.len() - relayed) as u64);
        }
        let events = router.events();
        let terminal: Vec<(u64, ResponseEvent)> =
            events.iter().filter(|(_, e)| e.is_terminal()).cloned().collect();
        let once: BTreeSet<u64> = terminal.iter().map(|(t, _)| *t).collect();
        prop_assert_eq!(terminal.len(), once.len(), "a ticket ended twice");
        let got: BTreeMap<u64, ResponseEvent> = terminal.into_iter().collect();
        prop_assert_eq!(got, ended);
        prop_assert_eq!(once.len() + model.len(), tickets as usize);
    }
}
