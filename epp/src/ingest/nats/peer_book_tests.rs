#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::HashMap;

use proptest::prelude::*;
use scheduler::{InflightToken, InflightTracker};

use super::super::inflight_wire::{InflightMessage, Outbox};
use super::*;

fn ep(i: u32) -> EndpointId {
    EndpointId::new(i).unwrap()
}

/// The sender names endpoint `i` `pod-i`; the receiver knows `pod-i` as id `100 + i`.
fn name(id: EndpointId) -> Option<PeerEndpoint> {
    Some(PeerEndpoint {
        pod: format!("pod-{}", id.get()),
        port: 8000,
    })
}

fn resolve(p: &PeerEndpoint) -> Option<EndpointId> {
    let i: u32 = p.pod.strip_prefix("pod-")?.parse().ok()?;
    Some(ep(100 + i))
}

/// The sender's own load as the receiver should see it.
fn expected(t: &InflightTracker) -> HashMap<EndpointId, InflightLoad> {
    t.own_loads()
        .into_iter()
        .map(|(e, l)| (ep(100 + e.get()), l))
        .collect()
}

/// Encodes and decodes, as the wire would.
fn wire(m: InflightMessage) -> InflightMessage {
    InflightMessage::decode(&m.encode().unwrap()).unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    Route { ep: u32, prompt: u32, uncached: u32 },
    First { which: usize },
    Finish { which: usize },
    Flush { lost: bool },
    Heartbeat { lost: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..4, 0u32..20, 0u32..20)
            .prop_map(|(ep, prompt, uncached)| Op::Route { ep, prompt, uncached }),
        3 => (0usize..8).prop_map(|which| Op::First { which }),
        3 => (0usize..8).prop_map(|which| Op::Finish { which }),
        3 => prop::bool::weighted(0.15).prop_map(|lost| Op::Flush { lost }),
        1 => prop::bool::weighted(0.15).prop_map(|lost| Op::Heartbeat { lost }),
    ]
}

proptest! {
    #[test]
    fn a_peer_book_tracks_the_senders_own_load(ops in prop::collection::vec(op(), 0..80)) {
        let sender = InflightTracker::new();
        sender.enable_journal(1 << 16);
        let mut outbox = Outbox::new(7);
        let mut book = PeerBook::new(1, Millis(3_000));
        let mut open: Vec<InflightToken> = Vec::new();
        let mut in_step = true;
        let mut now = Millis(0);
        for op in ops {
            now = now.after(Millis(5));
            match op {
                Op::Route { ep: e, prompt, uncached } => {
                    open.push(sender.on_routed(ep(e), prompt, uncached, 2));
                }
                Op::First { which } => {
                    if let Some(t) = open.get(which) {
                        sender.on_first_token(*t);
                    }
                }
                Op::Finish { which } => {
                    if which < open.len() {
                        sender.on_finished(open.remove(which));
                    }
                }
                Op::Flush { lost } | Op::Heartbeat { lost } => {
                    let full = matches!(op, Op::Heartbeat { .. });
                    let mut changes = Vec::new();
                    let drain = sender.drain_journal(&mut changes);
                    if let Some(m) = outbox.build(&changes, &drain.own, full, name) {
                        if lost {
                            in_step = false;
                        } else {
                            let done = book.apply(&wire(m), now, resolve);
                            prop_assert!(!done.own);
                            in_step = (in_step && !done.gap) || done.full;
                        }
                    }
                    if in_step {
                        prop_assert_eq!(book.totals(), expected(&sender));
                    }
                }
            }
        }
        // A delivered heartbeat always brings the book in step.
        let mut changes = Vec::new();
        let drain = sender.drain_journal(&mut changes);
        let m = outbox.build(&changes, &drain.own, true, name).unwrap();
        book.apply(&wire(m), now, resolve);
        prop_assert_eq!(book.totals(), expected(&sender));
        // Silence past the expiry forgets the peer.
        prop_assert_eq!(book.expire(now.after(Millis(3_000))), 0);
        prop_assert_eq!(book.expire(now.after(Millis(3_001))), 1);
        prop_assert!(book.totals().is_empty());
    }
}

#[test]
fn own_messages_goodbyes_and_unknown_endpoints() {
    let sender = InflightTracker::new();
    sender.enable_journal(64);
    sender.on_routed(ep(1), 4, 4, 0);
    sender.on_routed(ep(9), 4, 4, 0);
    let mut outbox = Outbox::new(5);
    let mut changes = Vec::new();
    let drain = sender.drain_journal(&mut changes);
    let only_one = |p: &PeerEndpoint| (p.pod == "pod-1").then(|| ep(101));
    let msg = wire(outbox.build(&changes, &drain.own, false, name).unwrap());
    let mut mine = PeerBook::new(5, Millis(1_000));
    assert!(mine.apply(&msg, Millis(0), only_one).own);
    assert_eq!(mine.replicas(), 0);
    let mut book = PeerBook::new(6, Millis(1_000));
    let done = book.apply(&msg, Millis(0), only_one);
    assert_eq!((done.deltas, done.unknown_endpoints), (1, 1));
    assert!(done.new_peer);
    assert_eq!(book.totals()[&ep(101)].requests, 1);
    book.remove_endpoint(ep(101));
    assert!(book.totals().is_empty());
    book.apply(&wire(outbox.bye()), Millis(1), only_one);
    assert_eq!(book.replicas(), 0);
    // Nothing to say, nothing sent.
    assert!(outbox.build(&[], &[], false, name).is_none());
}

#[test]
fn decode_refuses_unknown_versions_and_junk() {
    let mut m = Outbox::new(1).bye();
    m.v = 9;
    assert_eq!(
        InflightMessage::decode(&m.encode().unwrap())
            .unwrap_err()
            .metric_label(),
        "version"
    );
    assert!(InflightMessage::decode(b"\xc1").is_err());
    let big = vec![0u8; super::super::inflight_wire::MAX_INFLIGHT_BYTES + 1];
    assert_eq!(
        InflightMessage::decode(&big).unwrap_err().metric_label(),
        "too_large"
    );
}
