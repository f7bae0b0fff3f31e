//! Property tests: the index agrees with the naive model over random interleavings of stores,
//! removes, clears, snapshots, speculation and expiry across many sources.
//!
//! Chains share prefixes (chain 1 its first 3 blocks with chain 0, chain 2 its first 5) and
//! events store, remove and speculate arbitrary slices of them, so the index's run logs see
//! chains stored in one event or in pieces, split by removals, re-stored, overlapping between
//! holders and diverging after a shared prefix.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{EndpointId, Holder, IndexConfig, KvIndex, Millis, NodeId};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use support::Model;

const CHAINS: u64 = 3;
const CHAIN_LEN: u64 = 8;
const ENDPOINTS: u32 = 6;
const NODES: u32 = 2;

/// How many leading blocks chain `c` shares with chain 0 (a shared system prompt, then a
/// diverging suffix): the index's run logs then hold overlapping runs.
const SHARED: [u64; CHAINS as usize] = [0, 3, 5];

/// Position `pos` of chain `c`, spread over all shards.
fn key(c: u64, pos: u64) -> BlockKey {
    let c = if pos < SHARED[c as usize] { 0 } else { c };
    BlockKey((c * 64 + pos + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn chain(c: u64, start: u64, len: u64) -> Vec<BlockKey> {
    (start..(start + len).min(CHAIN_LEN))
        .map(|p| key(c, p))
        .collect()
}

thread_local! {
    /// Spread endpoint ids over the whole id space (the index's scratch must not be sized by
    /// the largest id).
    static SPARSE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn ep(i: u32) -> EndpointId {
    let raw = if SPARSE.get() {
        (u64::from(i) * 0x1555_5555 + 7) as u32 & kv_index::MAX_ID
    } else {
        i
    };
    EndpointId::new(raw).unwrap()
}

fn node_of(e: u32) -> Option<NodeId> {
    (e % 3 != 2).then(|| NodeId::new(e % NODES).unwrap())
}

#[derive(Debug, Clone)]
enum Ev {
    Stored(u64, u64, u64, Tier),
    Removed(u64, u64, u64, Tier),
    Cleared(Option<Tier>),
    Unknown,
}

#[derive(Debug, Clone)]
enum Action {
    Apply(Holder, Vec<Ev>),
    Replace(Holder, Vec<(u64, u64, Tier)>),
    RemoveSource(Holder),
    Speculate(u32, u64, u64, u64),
    Advance(u64),
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![4 => Just(Tier::Gpu), 2 => Just(Tier::Host), 1 => Just(Tier::Disk), 1 => Just(Tier::Remote)]
}

fn holder() -> impl Strategy<Value = Holder> {
    prop_oneof![
        3 => (0..ENDPOINTS).prop_map(|e| Holder::Endpoint(EndpointId::new(e).unwrap())),
        1 => (0..NODES).prop_map(|n| Holder::Node(NodeId::new(n).unwrap())),
    ]
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        8 => (0..CHAINS, 0..CHAIN_LEN, 1..=CHAIN_LEN, tier()).prop_map(|(c, s, l, t)| Ev::Stored(c, s, l, t)),
        4 => (0..CHAINS, 0..CHAIN_LEN, 1..=CHAIN_LEN, tier()).prop_map(|(c, s, l, t)| Ev::Removed(c, s, l, t)),
        1 => proptest::option::of(tier()).prop_map(Ev::Cleared),
        1 => Just(Ev::Unknown),
    ]
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        10 => (holder(), prop::collection::vec(ev(), 1..4)).prop_map(|(h, e)| Action::Apply(h, e)),
        1 => (holder(), prop::collection::vec((0..CHAINS, 0..CHAIN_LEN, tier()), 0..12)).prop_map(|(h, s)| Action::Replace(h, s)),
        1 => holder().prop_map(Action::RemoveSource),
        3 => (0..ENDPOINTS, 0..CHAINS, 1..=CHAIN_LEN, 1..50u64).prop_map(|(e, c, l, ttl)| Action::Speculate(e, c, l, ttl)),
        2 => (0..40u64).prop_map(Action::Advance),
    ]
}

/// A generated holder (endpoint index `i`) as the run's id for endpoint `i`.
fn remap(h: Holder) -> Holder {
    match h {
        Holder::Endpoint(e) => Holder::Endpoint(ep(e.get())),
        n @ Holder::Node(_) => n,
    }
}

fn to_event(e: &Ev) -> KvEvent {
    match *e {
        Ev::Stored(c, s, l, tier) => KvEvent::Stored {
            keys: chain(c, s, l),
            parent: None,
            tier,
            lora: None,
            token_count: 0,
        },
        Ev::Removed(c, s, l, tier) => KvEvent::Removed {
            keys: chain(c, s, l),
            tier,
        },
        Ev::Cleared(tier) => KvEvent::Cleared { tier },
        Ev::Unknown => KvEvent::Unknown,
    }
}

fn check_all(idx: &KvIndex, model: &Model, candidates: &[EndpointId]) -> Result<(), TestCaseError> {
    for c in 0..CHAINS {
        for len in [CHAIN_LEN, 3] {
            let keys = chain(c, 0, len);
            let got = idx.find_matches(&keys, candidates);
            prop_assert_eq!(got.len(), candidates.len());
            for (o, &e) in got.iter().zip(candidates) {
                prop_assert_eq!(o.endpoint, e);
                prop_assert_eq!(
                    o.reaches(),
                    model.find(&keys, e),
                    "chain {} len {} endpoint {:?}",
                    c,
                    len,
                    e
                );
            }
        }
    }
    Ok(())
}

fn run(actions: Vec<Action>, shards: usize) -> Result<(), TestCaseError> {
    let idx = KvIndex::new(IndexConfig {
        shards,
        capacity: 1 << 20,
    })
    .unwrap();
    let mut model = Model::default();
    for e in 0..ENDPOINTS {
        idx.set_endpoint_node(ep(e), node_of(e));
        if let Some(n) = node_of(e) {
            model.node_of.insert(ep(e), n);
        }
    }
    // All endpoints, plus a repeated and a partial candidate list.
    let all: Vec<EndpointId> = (0..ENDPOINTS).map(ep).collect();
    let some = vec![ep(4), ep(1), ep(4)];
    let mut now = 0u64;
    for a in actions {
        match a {
            Action::Apply(h, evs) => {
                let h = remap(h);
                let evs: Vec<KvEvent> = evs.iter().map(to_event).collect();
                idx.apply(h, &evs);
                model.apply(h, &evs);
            }
            Action::Replace(h, snap) => {
                let h = remap(h);
                let snap: Vec<(BlockKey, Tier)> =
                    snap.iter().map(|&(c, p, t)| (key(c, p), t)).collect();
                idx.replace_source(h, snap.iter().copied());
                model.replace_source(h, &snap);
            }
            Action::RemoveSource(h) => {
                let h = remap(h);
                idx.remove_source(h);
                model.remove_source(h);
            }
            Action::Speculate(e, c, l, ttl) => {
                let keys = chain(c, 0, l);
                idx.speculate(ep(e), &keys, Millis(now), Millis(ttl));
                model.speculate(ep(e), &keys, Millis(now), Millis(ttl));
            }
            Action::Advance(dt) => {
                now += dt;
                prop_assert_eq!(idx.expire(Millis(now)), model.expire(Millis(now)));
            }
        }
        check_all(&idx, &model, &all)?;
        check_all(&idx, &model, &some)?;
        prop_assert_eq!(idx.stats().residencies, model.residencies());
        let holders = (0..ENDPOINTS)
            .map(|e| Holder::Endpoint(ep(e)))
            .chain((0..NODES).map(|n| Holder::Node(NodeId::new(n).unwrap())));
        for h in holders {
            prop_assert_eq!(idx.residencies_of(h), model.residencies_of(h), "{:?}", h);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn index_matches_naive_model(actions in prop::collection::vec(action(), 1..60)) {
        run(actions, 4)?;
    }

    #[test]
    fn single_shard_matches_naive_model(actions in prop::collection::vec(action(), 1..40)) {
        run(actions, 1)?;
    }

    #[test]
    fn sparse_endpoint_ids_match_naive_model(actions in prop::collection::vec(action(), 1..40)) {
        SPARSE.set(true);
        let r = run(actions, 2);
        SPARSE.set(false);
        r?;
    }

    /// Under a tight capacity the index forgets, but never claims more than the model. (The
    /// model records every speculation: one on a block the index evicted is not a no-op.)
    #[test]
    fn bounded_index_never_overclaims(actions in prop::collection::vec(action(), 1..60)) {
        let idx = KvIndex::new(IndexConfig { shards: 2, capacity: 6 }).unwrap();
        let mut model = Model::default();
        model.spec_always = true;
        let all: Vec<EndpointId> = (0..ENDPOINTS).map(ep).collect();
        let mut now = 0;
        for a in actions {
            match a {
                Action::Apply(h, evs) => {
                    let evs: Vec<KvEvent> = evs.iter().map(to_event).collect();
                    idx.apply(h, &evs);
                    model.apply(h, &evs);
                }
                Action::Replace(h, snap) => {
                    let snap: Vec<(BlockKey, Tier)> = snap.iter().map(|&(c, p, t)| (key(c, p), t)).collect();
                    idx.replace_source(h, snap.iter().copied());
                    model.replace_source(h, &snap);
                }
                Action::RemoveSource(h) => {
                    idx.remove_source(h);
                    model.remove_source(h);
                }
                Action::Speculate(e, c, l, ttl) => {
                    let keys = chain(c, 0, l);
                    idx.speculate(ep(e), &keys, Millis(now), Millis(ttl));
                    model.speculate(ep(e), &keys, Millis(now), Millis(ttl));
                }
                Action::Advance(dt) => {
                    now += dt;
                    idx.expire(Millis(now));
                    model.expire(Millis(now));
                }
            }
            prop_assert!(idx.stats().residencies <= 6);
            for c in 0..CHAINS {
                let keys = chain(c, 0, CHAIN_LEN);
                for (o, &e) in idx.find_matches(&keys, &all).iter().zip(&all) {
                    let want = model.find(&keys, e);
                    for t in 0..4 {
                        prop_assert!(o.reaches()[t] <= want[t], "{:?} {:?} {:?}", e, o.reaches(), want);
                    }
                }
            }
        }
    }
}
