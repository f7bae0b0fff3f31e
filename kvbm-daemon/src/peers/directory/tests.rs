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
        interval_ms: 0,
        layouts: Vec::new(),
    }
}

/// One peer as its own publisher sees it: (key, tier) pairs.
#[derive(Debug, Default)]
struct Publisher {
    epoch: u64,
    seq: u64,
    keys: BTreeSet<(u64, u8)>,
}

fn tier_of(t: u8) -> Tier {
    match t {
        0 => Tier::Host,
        1 => Tier::Disk,
        _ => Tier::Remote,
    }
}

fn tier_no(t: Tier) -> u8 {
    match t {
        Tier::Host | Tier::Gpu => 0,
        Tier::Disk => 1,
        Tier::Remote => 2,
    }
}

impl Publisher {
    fn envelope(&mut self, node: &str, events: Vec<KvEvent>) -> Envelope {
        for e in &events {
            match e {
                KvEvent::Stored { keys, tier, .. } => {
                    self.keys.extend(keys.iter().map(|k| (k.0, tier_no(*tier))));
                }
                KvEvent::Removed { keys, tier } => {
                    for k in keys {
                        self.keys.remove(&(k.0, tier_no(*tier)));
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
            tiers: (0..3)
                .map(|t| TierKeys {
                    tier: tier_of(t),
                    keys: self
                        .keys
                        .iter()
                        .filter(|(_, kt)| *kt == t)
                        .map(|(k, _)| BlockKey(*k))
                        .collect(),
                })
                .collect(),
        }
    }

    /// Whether `key` is in host memory or on disk (what a pull may take).
    fn pullable(&self, key: u64) -> bool {
        self.keys.contains(&(key, 0)) || self.keys.contains(&(key, 1))
    }
}

/// What the test knows of a peer the directory should follow.
#[derive(Debug, Clone)]
struct Known {
    seen: u64,
    port: u16,
    layouts: Vec<u64>,
    down_until: u64,
}

#[derive(Debug, Clone)]
enum Op {
    /// Peer, port variant, layouts variant.
    Announce(usize, u16, u8),
    Store(usize, Vec<u64>, u8),
    Remove(usize, Vec<u64>, u8),
    Clear(usize),
    /// An envelope of this peer is lost on the way.
    Lose(usize, Vec<u64>),
    Restart(usize),
    PullFailed(usize),
    /// Every snapshot request in flight fails (the peer's answer lost or refused).
    FailFetches,
    Advance(u64),
    /// Keys, and the layout asked for.
    Best(Vec<u64>, u64),
}

fn op() -> impl Strategy<Value = Op> {
    let peer = 0..NODES.len();
    let keys = proptest::collection::vec(0u64..12, 1..6);
    let tier = 0u8..3;
    prop_oneof![
        2 => (peer.clone(), 0u16..2, 0u8..3).prop_map(|(p, v, l)| Op::Announce(p, v, l)),
        4 => (peer.clone(), keys.clone(), tier.clone()).prop_map(|(p, k, t)| Op::Store(p, k, t)),
        2 => (peer.clone(), keys.clone(), tier).prop_map(|(p, k, t)| Op::Remove(p, k, t)),
        1 => peer.clone().prop_map(Op::Clear),
        1 => (peer.clone(), keys.clone()).prop_map(|(p, k)| Op::Lose(p, k)),
        1 => peer.clone().prop_map(Op::Restart),
        1 => peer.prop_map(Op::PullFailed),
        1 => Just(Op::FailFetches),
        1 => (0u64..20_000).prop_map(Op::Advance),
        4 => (proptest::collection::vec(0u64..12, 1..8), 1u64..3).prop_map(|(k, l)| Op::Best(k, l)),
    ]
}

fn stored(keys: &[u64], tier: Tier) -> KvEvent {
    KvEvent::Stored {
        keys: keys.iter().map(|k| BlockKey(*k)).collect(),
        parent: None,
        tier,
        lora: None,
        token_count: 16,
    }
}

/// The layouts announce variant `l` names: none said (older daemons: every layout), the
/// layout 1, or the layout 2.
fn layouts(l: u8) -> Vec<u64> {
    match l {
        0 => Vec::new(),
        n => vec![u64::from(n)],
    }
}

/// Runs `f` on the directory and applies the index writes it queued, as the edge does.
fn change<T>(dir: &mut Directory, f: impl FnOnce(&mut Directory) -> T) -> T {
    let out = f(dir);
    dir.take_writes().apply();
    out
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
        let more = change(dir, |d| d.snapshot_done(&f, Some(snap), Millis(now)));
        pending.extend(more);
    }
    Ok(())
}

/// Answers every fetch, and retries every failed one (backoff is zero here), until the
/// directory asks for nothing more.
fn settle(
    dir: &mut Directory,
    pending: &mut Vec<Fetch>,
    publishers: &[Publisher],
    now: u64,
) -> Result<(), TestCaseError> {
    loop {
        answer(dir, pending, publishers, now)?;
        let (retries, expired) = change(dir, |d| d.tick(Millis(now)));
        prop_assert!(expired.is_empty(), "time did not move");
        if retries.is_empty() {
            return Ok(());
        }
        pending.extend(retries);
    }
}

const TTL: u64 = 30_000;
const BACKOFF: u64 = 5_000;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn best_is_the_peer_with_the_longest_pullable_run(ops in proptest::collection::vec(op(), 1..80)) {
        let config = DirectoryConfig {
            ttl: Millis(TTL),
            backoff: Millis(BACKOFF),
            // A failed snapshot is asked again at the next tick.
            sync: kv_sync::SyncConfig {
                retry_initial: Millis(0),
                retry_max: Millis(0),
                ..kv_sync::SyncConfig::default()
            },
            ..DirectoryConfig::default()
        };
        let mut dir = Directory::new("me", MODEL, 16, config).unwrap();
        let mut publishers: Vec<Publisher> = (0..NODES.len())
            .map(|i| Publisher { epoch: i as u64 + 1, ..Publisher::default() })
            .collect();
        // Model: the peers the directory follows.
        let mut live: BTreeMap<usize, Known> = BTreeMap::new();
        let mut now = 0u64;
        let mut pending: Vec<Fetch> = Vec::new();
        for op in ops {
            match op {
                Op::Announce(p, v, l) => {
                    let mut a = announce(NODES[p], 9000 + 10 * p as u16 + v);
                    a.layouts = layouts(l);
                    match change(&mut dir, |d| d.announced(&a, Millis(now))) {
                        Announced::New(f) => {
                            prop_assert!(!live.contains_key(&p));
                            pending.push(f);
                        }
                        Announced::Renewed => prop_assert!(live.contains_key(&p)),
                        Announced::Ignored(why) => prop_assert!(false, "ignored: {why}"),
                    }
                    let down_until = match live.get(&p) {
                        Some(k) if k.port == a.addr.port() => k.down_until,
                        _ => 0,
                    };
                    live.insert(p, Known { seen: now, port: a.addr.port(), layouts: a.layouts, down_until });
                }
                Op::Store(p, k, t) => {
                    let e = publishers[p].envelope(NODES[p], vec![stored(&k, tier_of(t))]);
                    pending.extend(change(&mut dir, |d| d.envelope(e, Millis(now))));
                }
                Op::Remove(p, k, t) => {
                    let keys = k.iter().map(|k| BlockKey(*k)).collect();
                    let e = publishers[p].envelope(NODES[p], vec![KvEvent::Removed { keys, tier: tier_of(t) }]);
                    pending.extend(change(&mut dir, |d| d.envelope(e, Millis(now))));
                }
                Op::Clear(p) => {
                    let e = publishers[p].envelope(NODES[p], vec![KvEvent::Cleared { tier: None }]);
                    pending.extend(change(&mut dir, |d| d.envelope(e, Millis(now))));
                }
                Op::Lose(p, k) => {
                    // Lost on the way; the next envelope shows the gap (a loss is only ever
                    // seen at the stream's next envelope).
                    let _lost = publishers[p].envelope(NODES[p], vec![stored(&k, Tier::Host)]);
                    let e = publishers[p].envelope(NODES[p], Vec::new());
                    pending.extend(change(&mut dir, |d| d.envelope(e, Millis(now))));
                }
                Op::Restart(p) => {
                    let publisher = &mut publishers[p];
                    publisher.epoch += 10;
                    publisher.seq = 0;
                    publisher.keys.clear();
                    let e = publisher.envelope(NODES[p], vec![KvEvent::Cleared { tier: None }]);
                    pending.extend(change(&mut dir, |d| d.envelope(e, Millis(now))));
                }
                Op::PullFailed(p) => {
                    change(&mut dir, |d| d.failed(NODES[p], Millis(now)));
                    if let Some(k) = live.get_mut(&p) {
                        k.down_until = now + BACKOFF;
                    }
                }
                Op::FailFetches => {
                    for f in std::mem::take(&mut pending) {
                        let more = change(&mut dir, |d| d.snapshot_done(&f, None, Millis(now)));
                        pending.extend(more);
                    }
                }
                Op::Advance(ms) => {
                    // Snapshot replies (or retries) come well within their timeout.
                    settle(&mut dir, &mut pending, &publishers, now)?;
                    now += ms;
                    let (fetches, expired) = change(&mut dir, |d| d.tick(Millis(now)));
                    pending.extend(fetches);
                    for node in expired {
                        let p = NODES.iter().position(|n| *n == node).unwrap();
                        prop_assert!(now - live[&p].seen > TTL);
                        live.remove(&p);
                    }
                    // The directory keeps exactly the peers announced within the TTL.
                    live.retain(|_, k| now - k.seen <= TTL);
                    prop_assert_eq!(dir.peers(), live.len());
                }
                Op::Best(keys, layout) => {
                    // Every fetch is answered (failed ones after their retry) before the
                    // question, as a live receiver would be by then.
                    settle(&mut dir, &mut pending, &publishers, now)?;
                    let keys: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
                    let run = |p: usize| keys.iter().take_while(|k| publishers[p].pullable(k.0)).count();
                    let eligible = |k: &Known| {
                        k.down_until <= now && (k.layouts.is_empty() || k.layouts.contains(&layout))
                    };
                    let want = live
                        .iter()
                        .filter(|(_, k)| eligible(k))
                        .map(|(&p, _)| run(p))
                        .filter(|run| *run > 0)
                        .max();
                    let got = dir.best(&keys, layout, Millis(now));
                    match (want, got) {
                        (None, None) => {}
                        (Some(want), Some(h)) => {
                            prop_assert_eq!(h.blocks as usize, want);
                            let p = NODES.iter().position(|n| *n == h.node).unwrap();
                            prop_assert_eq!(run(p), want, "named a peer without the longest run");
                            prop_assert!(eligible(&live[&p]), "named a peer it should pass over");
                            prop_assert_eq!(h.addr.port(), live[&p].port);
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
    let mut e = pod.envelope("a", vec![stored(&[1], Tier::Host)]);
    e.source.pod = Some("p".into());
    assert!(dir.envelope(e, Millis(0)).is_empty());
    let e = Publisher::default().envelope("z", vec![stored(&[1], Tier::Host)]);
    assert!(dir.envelope(e, Millis(0)).is_empty());
    assert_eq!(dir.stats().envelopes_ignored, 2);
    assert_eq!(dir.best(&[BlockKey(1)], 1, Millis(0)), None);
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

#[test]
fn a_peer_is_kept_for_three_of_its_own_intervals() {
    let mut dir = Directory::new("me", MODEL, 16, DirectoryConfig::default()).unwrap();
    let mut a = announce("a", 1);
    a.interval_ms = 2_000;
    assert!(matches!(dir.announced(&a, Millis(0)), Announced::New(_)));
    assert!(dir.tick(Millis(6_000)).1.is_empty());
    assert_eq!(dir.tick(Millis(6_001)).1, vec!["a".to_owned()]);
    assert_eq!(dir.peers(), 0);
}

#[test]
fn a_reply_for_a_forgotten_incarnation_is_dropped() {
    let mut dir = Directory::new("me", MODEL, 16, DirectoryConfig::default()).unwrap();
    let Announced::New(old) = dir.announced(&announce("a", 1), Millis(0)) else {
        panic!("new peer");
    };
    dir.forget("a");
    let Announced::New(new) = dir.announced(&announce("a", 1), Millis(0)) else {
        panic!("new again");
    };
    assert_ne!(old.peer, new.peer, "ids are not reused");
    let mut p = Publisher::default();
    let _ = p.envelope("a", vec![stored(&[7], Tier::Host)]);
    // The old incarnation's reply, with the same request id, changes nothing.
    assert_eq!(old.id, new.id);
    let _ = dir.snapshot_done(&old, Some(p.snapshot("a")), Millis(1));
    dir.take_writes().apply();
    assert_eq!(dir.stale(), 1);
    assert_eq!(dir.best(&[BlockKey(7)], 1, Millis(1)), None);
    let _ = dir.snapshot_done(&new, Some(p.snapshot("a")), Millis(1));
    dir.take_writes().apply();
    assert_eq!(dir.stale(), 0);
    assert_eq!(
        dir.best(&[BlockKey(7)], 1, Millis(1)).map(|h| h.blocks),
        Some(1)
    );
}
