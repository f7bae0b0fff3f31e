//! The directory against a naive model: per peer, the set of keys it holds; `best` is the
//! peer with the longest leading run. Streams lose envelopes (gaps), peers restart (new
//! epochs) and fall silent (expiry); snapshots are answered from the model.

use std::collections::{BTreeMap, BTreeSet};

use kv_events::envelope::ENVELOPE_VERSION;
use kv_events::snapshot::TierKeys;
use kv_events::{KvEvent, Source};
use proptest::prelude::*;

use super::*;

const MODEL: &str = "m";
const NODES: [&str; 3] = ["a", "b", "c"];

fn source(node: &str) -> Source {
    Source {
        namespace: "ns".into(),
        pool: None,
        pod: None,
        ip: None,
        port: None,
        dp_rank: 0,
        node: Some(node.into()),
        model: MODEL.into(),
        engine: EngineKind::Kvbm,
        block_size: 16,
    }
}

fn announce(node: &str, port: u16) -> Announce {
    Announce {
        node: node.into(),
        model: MODEL.into(),
        block_size: 16,
        addr: SocketAddr::from(([10, 0, 0, 1], port)),
    }
}

/// One peer as its own publisher sees it.
#[derive(Debug, Default)]
struct Publisher {
    epoch: u64,
    seq: u64,
    keys: BTreeSet<u64>,
}

impl Publisher {
    fn envelope(&mut self, node: &str, events: Vec<KvEvent>) -> Envelope {
        for e in &events {
            match e {
                KvEvent::Stored { keys, .. } => self.keys.extend(keys.iter().map(|k| k.0)),
                KvEvent::Removed { keys, .. } => {
                    for k in keys {
                        self.keys.remove(&k.0);
                    }
                }
                KvEvent::Cleared { .. } => self.keys.clear(),
                KvEvent::Unknown => {}
            }
        }
        let e = Envelope {
            v: ENVELOPE_VERSION,
            source: source(node),
            epoch: self.epoch,
            seq: self.seq,
            events,
        };
        self.seq += 1;
        e
    }

    fn snapshot(&self, node: &str) -> Snapshot {
        Snapshot {
            source: source(node),
            epoch: self.epoch,
            next_seq: self.seq,
            tiers: vec![TierKeys {
                tier: Tier::Host,
                keys: self.keys.iter().map(|k| BlockKey(*k)).collect(),
            }],
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Announce(usize),
    Store(usize, Vec<u64>),
    Remove(usize, Vec<u64>),
    Clear(usize),
    /// An envelope of this peer is lost on the way.
    Lose(usize, Vec<u64>),
    Restart(usize),
    Advance(u64),
    Best(Vec<u64>),
}

fn op() -> impl Strategy<Value = Op> {
    let peer = 0..NODES.len();
    let keys = proptest::collection::vec(0u64..12, 1..6);
    prop_oneof![
        2 => peer.clone().prop_map(Op::Announce),
        4 => (peer.clone(), keys.clone()).prop_map(|(p, k)| Op::Store(p, k)),
        2 => (peer.clone(), keys.clone()).prop_map(|(p, k)| Op::Remove(p, k)),
        1 => peer.clone().prop_map(Op::Clear),
        1 => (peer.clone(), keys.clone()).prop_map(|(p, k)| Op::Lose(p, k)),
        1 => peer.prop_map(Op::Restart),
        1 => (0u64..20_000).prop_map(Op::Advance),
        4 => proptest::collection::vec(0u64..12, 1..8).prop_map(Op::Best),
    ]
}

fn stored(keys: &[u64]) -> KvEvent {
    KvEvent::Stored {
        keys: keys.iter().map(|k| BlockKey(*k)).collect(),
        parent: None,
        tier: Tier::Host,
        lora: None,
        token_count: 16,
    }
}

/// Answers every pending fetch from the publishers' state (answering may reveal another gap
/// and ask again).
fn answer(
    dir: &mut Directory,
    pending: &mut Vec<Fetch>,
    publishers: &[Publisher],
    now: u64,
) -> Result<(), TestCaseError> {
    while let Some(f) = pending.pop() {
        let p = NODES.iter().position(|n| *n == f.node);
        prop_assert!(p.is_some());
        let p = p.unwrap_or_default();
        let snap = publishers[p].snapshot(NODES[p]);
        pending.extend(dir.snapshot_done(&f.node, f.id, Some(snap), Millis(now)));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn best_is_the_peer_with_the_longest_held_run(ops in proptest::collection::vec(op(), 1..80)) {
        let config = DirectoryConfig { ttl: Millis(30_000), ..DirectoryConfig::default() };
        let mut dir = Directory::new("me", MODEL, 16, config).unwrap();
        let mut publishers: Vec<Publisher> = (0..NODES.len())
            .map(|i| Publisher { epoch: i as u64 + 1, ..Publisher::default() })
            .collect();
        // Model: which peers the directory follows and when each last announced.
        let mut live: BTreeMap<usize, u64> = BTreeMap::new();
        let mut now = 0u64;
        let mut pending: Vec<Fetch> = Vec::new();
        for op in ops {
            match op {
                Op::Announce(p) => {
                    match dir.announced(&announce(NODES[p], 9000 + p as u16), Millis(now)) {
                        Announced::New(f) => {
                            prop_assert!(!live.contains_key(&p));
                            pending.push(f);
                        }
                        Announced::Renewed => prop_assert!(live.contains_key(&p)),
                        Announced::Ignored(why) => prop_assert!(false, "ignored: {why}"),
                    }
                    live.insert(p, now);
                }
                Op::Store(p, k) => {
                    let e = publishers[p].envelope(NODES[p], vec![stored(&k)]);
                    pending.extend(dir.envelope(e, Millis(now)));
                }
                Op::Remove(p, k) => {
                    let keys = k.iter().map(|k| BlockKey(*k)).collect();
                    let e = publishers[p].envelope(NODES[p], vec![KvEvent::Removed { keys, tier: Tier::Host }]);
                    pending.extend(dir.envelope(e, Millis(now)));
                }
                Op::Clear(p) => {
                    let e = publishers[p].envelope(NODES[p], vec![KvEvent::Cleared { tier: None }]);
                    pending.extend(dir.envelope(e, Millis(now)));
                }
                Op::Lose(p, k) => {
                    // Lost on the way; the next envelope shows the gap (a loss is only ever
                    // seen at the stream's next envelope).
                    let _lost = publishers[p].envelope(NODES[p], vec![stored(&k)]);
                    let e = publishers[p].envelope(NODES[p], Vec::new());
                    pending.extend(dir.envelope(e, Millis(now)));
                }
                Op::Restart(p) => {
                    let publisher = &mut publishers[p];
                    publisher.epoch += 10;
                    publisher.seq = 0;
                    publisher.keys.clear();
                    let e = publisher.envelope(NODES[p], vec![KvEvent::Cleared { tier: None }]);
                    pending.extend(dir.envelope(e, Millis(now)));
                }
                Op::Advance(ms) => {
                    // Snapshot replies come well within their timeout.
                    answer(&mut dir, &mut pending, &publishers, now)?;
                    now += ms;
                    let (fetches, expired) = dir.tick(Millis(now));
                    pending.extend(fetches);
                    for node in expired {
                        let p = NODES.iter().position(|n| *n == node).unwrap();
                        prop_assert!(now - live[&p] > 30_000);
                        live.remove(&p);
                    }
                    // The directory keeps exactly the peers announced within the TTL.
                    live.retain(|_, seen| now - *seen <= 30_000);
                    prop_assert_eq!(dir.peers(), live.len());
                }
                Op::Best(keys) => {
                    // Every fetch is answered before the question, as a live receiver would be
                    // by then.
                    answer(&mut dir, &mut pending, &publishers, now)?;
                    let keys: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
                    let want = live
                        .keys()
                        .map(|&p| {
                            let run = keys.iter().take_while(|k| publishers[p].keys.contains(&k.0)).count();
                            (run, p)
                        })
                        .filter(|(run, _)| *run > 0)
                        .max_by_key(|(run, _)| *run);
                    let got = dir.best(&keys);
                    match (want, got) {
                        (None, None) => {}
                        (Some((run, _)), Some(h)) => {
                            prop_assert_eq!(h.blocks as usize, run);
                            let p = NODES.iter().position(|n| *n == h.node).unwrap();
                            let held = keys.iter().take_while(|k| publishers[p].keys.contains(&k.0)).count();
                            prop_assert_eq!(held, run, "named a peer without the longest run");
                            prop_assert_eq!(h.addr.port(), 9000 + p as u16);
                        }
                        (want, got) => prop_assert!(false, "want {want:?}, got {got:?}"),
                    }
                    prop_assert_eq!(dir.stale(), 0);
                }
            }
        }
    }
}

#[test]
fn other_models_this_node_and_pods_are_not_peers() {
    let mut dir = Directory::new("me", MODEL, 16, DirectoryConfig::default()).unwrap();
    let mut other = announce("x", 1);
    other.model = "other".into();
    assert_eq!(
        dir.announced(&other, Millis(0)),
        Announced::Ignored("other model")
    );
    let mut size = announce("x", 1);
    size.block_size = 32;
    assert_eq!(
        dir.announced(&size, Millis(0)),
        Announced::Ignored("other model")
    );
    assert_eq!(
        dir.announced(&announce("me", 1), Millis(0)),
        Announced::Ignored("self")
    );
    assert!(matches!(
        dir.announced(&announce("a", 1), Millis(0)),
        Announced::New(_)
    ));
    // A pod source naming node a, and an unannounced node, are ignored.
    let mut pod = Publisher::default();
    let mut e = pod.envelope("a", vec![stored(&[1])]);
    e.source.pod = Some("p".into());
    assert!(dir.envelope(e, Millis(0)).is_empty());
    let e = Publisher::default().envelope("z", vec![stored(&[1])]);
    assert!(dir.envelope(e, Millis(0)).is_empty());
    assert_eq!(dir.stats().envelopes_ignored, 2);
    assert_eq!(dir.best(&[BlockKey(1)]), None);
}

#[test]
fn the_peer_limit_holds_and_a_forgotten_peer_frees_its_place() {
    let config = DirectoryConfig {
        max_peers: 1,
        ..DirectoryConfig::default()
    };
    let mut dir = Directory::new("me", MODEL, 16, config).unwrap();
    assert!(matches!(
        dir.announced(&announce("a", 1), Millis(0)),
        Announced::New(_)
    ));
    assert_eq!(
        dir.announced(&announce("b", 2), Millis(0)),
        Announced::Ignored("peer limit")
    );
    dir.forget("a");
    assert!(matches!(
        dir.announced(&announce("b", 2), Millis(0)),
        Announced::New(_)
    ));
}

#[test]
fn announces_round_trip_and_oversized_ones_are_refused() {
    let a = announce("node-1", 9094);
    assert_eq!(Announce::decode(&a.encode()).unwrap(), a);
    assert!(matches!(
        Announce::decode(&vec![0u8; MAX_ANNOUNCE_BYTES + 1]),
        Err(AnnounceError::TooLarge(_))
    ));
    assert!(Announce::decode(b"\xc1").is_err());
}
