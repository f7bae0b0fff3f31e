#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::{BTreeSet, HashMap};

use kv_events::envelope::{EngineKind, Source};
use kv_events::snapshot::{Snapshot, TierKeys};
use kv_events::{BlockKey, KvEvent, Tier};
use proptest::prelude::*;

use super::*;

const TIERS: [Tier; 3] = [Tier::Gpu, Tier::Host, Tier::Disk];

fn source() -> Source {
    Source {
        namespace: "ns".into(),
        pool: Some("p".into()),
        pod: Some("pod-0".into()),
        ip: Some("10.0.0.1".into()),
        port: Some(8000),
        dp_rank: 0,
        node: None,
        model: "m".into(),
        engine: EngineKind::Sim,
        block_size: 16,
    }
}

type Set = BTreeSet<(u64, Tier)>;

fn apply_events(set: &mut Set, events: &[KvEvent]) {
    for ev in events {
        match ev {
            KvEvent::Stored { keys, tier, .. } => {
                set.extend(keys.iter().map(|k| (k.0, *tier)));
            }
            KvEvent::Removed { keys, tier } => {
                for k in keys {
                    set.remove(&(k.0, *tier));
                }
            }
            KvEvent::Cleared { tier } => set.retain(|(_, t)| tier.is_some_and(|c| c != *t)),
            KvEvent::Unknown => {}
        }
    }
}

fn snapshot_of(set: &Set, epoch: u64, next_seq: u64) -> Snapshot {
    Snapshot {
        source: source(),
        epoch,
        next_seq,
        tiers: TIERS
            .iter()
            .map(|&tier| TierKeys {
                tier,
                keys: set
                    .iter()
                    .filter(|(_, t)| *t == tier)
                    .map(|(k, _)| BlockKey(*k))
                    .collect(),
            })
            .collect(),
    }
}

/// The receiver side: the machine plus a naive index of the one source.
struct Receiver {
    sync: SourceSync,
    index: Set,
    requests: Vec<u64>,
    now: Millis,
}

impl Receiver {
    fn new(config: SyncConfig) -> Self {
        let mut out = Vec::new();
        let sync = SourceSync::new(config, Millis(0), &mut out);
        let mut r = Self {
            sync,
            index: Set::new(),
            requests: Vec::new(),
            now: Millis(0),
        };
        r.act(out);
        r
    }

    fn act(&mut self, out: Vec<Effect>) {
        for e in out {
            match e {
                Effect::Apply(events) => apply_events(&mut self.index, &events),
                Effect::Replace(snap) => {
                    self.index = snap.entries().map(|(k, t)| (k.0, t)).collect();
                }
                Effect::Request { id } => self.requests.push(id),
                Effect::Gap | Effect::NewEpoch | Effect::Failed(_) | Effect::LateReply => {}
            }
        }
    }

    fn envelope(&mut self, epoch: u64, seq: u64, events: Vec<KvEvent>) {
        let mut out = Vec::new();
        self.sync
            .on_envelope(epoch, seq, events, self.now, &mut out);
        self.act(out);
    }

    fn snapshot(&mut self, id: u64, snap: Snapshot) {
        let mut out = Vec::new();
        self.sync.on_snapshot(id, snap, self.now, &mut out);
        self.act(out);
    }

    fn advance(&mut self, ms: u64) {
        self.now = self.now.after(Millis(ms));
        let mut out = Vec::new();
        self.sync.tick(self.now, &mut out);
        self.act(out);
    }
}

/// The publisher: its resident set, epoch and seq, and the state after every prefix.
struct Publisher {
    set: Set,
    epoch: u64,
    seq: u64,
    history: HashMap<(u64, u64), Set>,
}

impl Publisher {
    fn new(epoch: u64) -> Self {
        let mut history = HashMap::new();
        history.insert((epoch, 0), Set::new());
        Self {
            set: Set::new(),
            epoch,
            seq: 0,
            history,
        }
    }

    fn publish(&mut self, events: Vec<KvEvent>) -> (u64, u64, Vec<KvEvent>) {
        apply_events(&mut self.set, &events);
        let seq = self.seq;
        self.seq += 1;
        self.history
            .insert((self.epoch, self.seq), self.set.clone());
        (self.epoch, seq, events)
    }

    fn restart(&mut self, epoch: u64, keep_cache: bool) {
        if !keep_cache {
            self.set.clear();
        }
        self.epoch = epoch;
        self.seq = 0;
        self.history.insert((epoch, 0), self.set.clone());
    }

    fn snapshot(&self) -> Snapshot {
        snapshot_of(&self.set, self.epoch, self.seq)
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Publish an event; deliver it 0 (dropped), 1 or 2 (duplicated) times.
    Publish { event: KvEvent, copies: u8 },
    /// Restart the publisher with a new epoch.
    Restart { keep_cache: bool },
    /// Take a snapshot for one of the requests made so far (by index from the end); hold it.
    TakeSnapshot { which: usize },
    /// Deliver a held snapshot.
    DeliverSnapshot,
    /// The adapter reports the latest request failed.
    Fail,
    /// Time passes.
    Advance { ms: u64 },
    /// A reconnect.
    Reconnect,
}

fn event() -> impl Strategy<Value = KvEvent> {
    let tier = prop::sample::select(TIERS.to_vec());
    let keys = prop::collection::vec((0u64..12).prop_map(BlockKey), 1..4);
    prop_oneof![
        6 => (keys.clone(), tier.clone()).prop_map(|(keys, tier)| KvEvent::Stored {
            keys,
            parent: None,
            tier,
            lora: None,
            token_count: 16,
        }),
        3 => (keys, tier.clone()).prop_map(|(keys, tier)| KvEvent::Removed { keys, tier }),
        1 => prop::option::of(tier).prop_map(|tier| KvEvent::Cleared { tier }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (event(), prop_oneof![1 => Just(0u8), 8 => Just(1u8), 1 => Just(2u8)])
            .prop_map(|(event, copies)| Op::Publish { event, copies }),
        1 => any::<bool>().prop_map(|keep_cache| Op::Restart { keep_cache }),
        3 => (0usize..3).prop_map(|which| Op::TakeSnapshot { which }),
        3 => Just(Op::DeliverSnapshot),
        1 => Just(Op::Fail),
        2 => (0u64..3_000).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Reconnect),
    ]
}

fn small_config() -> SyncConfig {
    SyncConfig {
        max_buffered: 6,
        snapshot_timeout: Millis(1_000),
        retry_initial: Millis(50),
        retry_max: Millis(800),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn converges_to_the_publishers_resident_set(ops in prop::collection::vec(op(), 0..120)) {
        let mut publisher = Publisher::new(1);
        let mut next_epoch = 2;
        let mut rx = Receiver::new(small_config());
        let mut held: Vec<(u64, Snapshot)> = Vec::new();
        for op in ops {
            match op {
                Op::Publish { event, copies } => {
                    let (epoch, seq, events) = publisher.publish(vec![event]);
                    for _ in 0..copies {
                        rx.envelope(epoch, seq, events.clone());
                    }
                }
                Op::Restart { keep_cache } => {
                    publisher.restart(next_epoch, keep_cache);
                    next_epoch += 1;
                }
                Op::TakeSnapshot { which } => {
                    if let Some(&id) = rx.requests.iter().rev().nth(which) {
                        held.push((id, publisher.snapshot()));
                    }
                }
                Op::DeliverSnapshot => {
                    if !held.is_empty() {
                        let (id, snap) = held.remove(0);
                        rx.snapshot(id, snap);
                    }
                }
                Op::Fail => {
                    if let Some(&id) = rx.requests.last() {
                        let mut out = Vec::new();
                        rx.sync.on_snapshot_failed(id, rx.now, &mut out);
                        rx.act(out);
                    }
                }
                Op::Advance { ms } => rx.advance(ms),
                Op::Reconnect => {
                    let mut out = Vec::new();
                    rx.sync.resync(rx.now, &mut out);
                    rx.act(out);
                }
            }
            // While live, the index is exactly the publisher's state at the position.
            if rx.sync.phase() == Phase::Live {
                let pos = rx.sync.position().unwrap();
                prop_assert_eq!(Some(&rx.index), publisher.history.get(&pos));
            }
            prop_assert!(rx.sync.buffered() <= small_config().max_buffered);
        }
        // A final envelope arrives (a loss is only visible from the next envelope), then
        // every request is answered promptly until the source is live.
        let (epoch, seq, events) = publisher.publish(Vec::new());
        rx.envelope(epoch, seq, events);
        for _ in 0..64 {
            if rx.sync.phase() == Phase::Live {
                break;
            }
            match rx.sync.phase() {
                Phase::Awaiting { id, .. } => rx.snapshot(id, publisher.snapshot()),
                Phase::Backoff { .. } => rx.advance(1_000),
                Phase::Live => {}
            }
        }
        prop_assert_eq!(rx.sync.phase(), Phase::Live);
        prop_assert_eq!(&rx.index, &publisher.set);
        prop_assert_eq!(rx.sync.position(), Some((publisher.epoch, publisher.seq)));
    }
}

fn stored(k: u64) -> Vec<KvEvent> {
    vec![KvEvent::Stored {
        keys: vec![BlockKey(k)],
        parent: None,
        tier: Tier::Gpu,
        lora: None,
        token_count: 16,
    }]
}

#[test]
fn first_sight_asks_then_goes_live_and_applies_in_order() {
    let mut rx = Receiver::new(SyncConfig::default());
    assert_eq!(rx.requests, vec![0]);
    assert!(rx.sync.is_stale());
    rx.envelope(9, 5, stored(5));
    assert_eq!(rx.sync.buffered(), 1);
    rx.snapshot(0, snapshot_of(&[(1, Tier::Gpu)].into(), 9, 5));
    assert_eq!(rx.sync.phase(), Phase::Live);
    assert_eq!(rx.index, [(1, Tier::Gpu), (5, Tier::Gpu)].into());
    rx.envelope(9, 6, stored(6));
    rx.envelope(9, 6, stored(6));
    assert_eq!(rx.sync.position(), Some((9, 7)));
}

#[test]
fn a_gap_keeps_the_cache_and_asks_for_a_snapshot() {
    let mut rx = Receiver::new(SyncConfig::default());
    rx.snapshot(0, snapshot_of(&Set::new(), 3, 0));
    rx.envelope(3, 0, stored(1));
    rx.envelope(3, 2, stored(2));
    assert!(rx.sync.is_stale());
    assert_eq!(rx.index, [(1, Tier::Gpu)].into(), "stale is not a wipe");
    assert_eq!(rx.requests, vec![0, 1]);
    // A late reply to the first request is refused.
    let mut out = Vec::new();
    rx.sync
        .on_snapshot(0, snapshot_of(&Set::new(), 3, 0), rx.now, &mut out);
    assert_eq!(out, vec![Effect::LateReply]);
}

#[test]
fn timeouts_back_off_and_double_up_to_the_ceiling() {
    let config = SyncConfig {
        snapshot_timeout: Millis(100),
        retry_initial: Millis(10),
        retry_max: Millis(30),
        ..SyncConfig::default()
    };
    let mut rx = Receiver::new(config);
    rx.advance(100);
    assert_eq!(rx.sync.phase(), Phase::Backoff { at: Millis(110) });
    rx.advance(10);
    assert_eq!(rx.requests.len(), 2);
    rx.advance(100);
    assert_eq!(rx.sync.phase(), Phase::Backoff { at: Millis(230) });
    rx.advance(20);
    rx.advance(100);
    assert_eq!(rx.sync.phase(), Phase::Backoff { at: Millis(360) });
}

#[test]
fn a_reconnect_with_nothing_lost_goes_live_without_the_snapshot() {
    let mut rx = Receiver::new(SyncConfig::default());
    rx.snapshot(0, snapshot_of(&Set::new(), 3, 4));
    let mut out = Vec::new();
    rx.sync.resync(rx.now, &mut out);
    rx.act(out);
    assert!(rx.sync.is_stale());
    rx.envelope(3, 4, stored(4));
    assert_eq!(rx.sync.phase(), Phase::Live);
    assert_eq!(rx.index, [(4, Tier::Gpu)].into());
}

#[test]
fn overflow_drops_the_buffer_and_backs_off() {
    let config = SyncConfig {
        max_buffered: 2,
        ..SyncConfig::default()
    };
    let mut rx = Receiver::new(config);
    let mut out = Vec::new();
    for seq in 0..3 {
        rx.sync.on_envelope(1, seq, stored(seq), rx.now, &mut out);
    }
    assert!(out.contains(&Effect::Failed(Failure::Overflow)));
    assert_eq!(rx.sync.buffered(), 0);
    assert!(matches!(rx.sync.phase(), Phase::Backoff { .. }));
}
