//! Property test for the chain-local layout: long chains (up to 160 blocks, sharing prefixes
//! of different lengths) stored whole or in slices of mixed tiers, split by removals,
//! re-stored, shared and speculated by several holders (endpoints and a node two of them run
//! on), with logs small enough to wrap many times: every lookup must agree with the naive model
//! exactly. (A run-log entry that wrongly claims its holder alone is only visible through a
//! candidate alive by its node's tiers, hence the node and the mixed tiers.)

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
use support::Model;

const CHAINS: u64 = 4;
const LEN: u64 = 160;
const ENDPOINTS: u32 = 4;
/// Blocks chain `c` shares with chain 0.
const SHARED: [u64; CHAINS as usize] = [0, 40, 64, 150];

fn key(c: u64, pos: u64) -> BlockKey {
    let c = if pos < SHARED[c as usize] { 0 } else { c };
    BlockKey((c * 1000 + pos + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn slice(c: u64, start: u64, len: u64) -> Vec<BlockKey> {
    (start..(start + len).min(LEN)).map(|p| key(c, p)).collect()
}

fn ep(i: u32) -> EndpointId {
    EndpointId::new(i).unwrap()
}

#[derive(Debug, Clone)]
enum Action {
    /// A holder stores (or removes) a slice of a chain in one event.
    Store(Holder, u64, u64, u64, Tier),
    Remove(Holder, u64, u64, u64, Tier),
    /// Several short events covering a slice, in order, each in its own tier (adjacent in
    /// the holder's log: one run of mixed tiers).
    StorePieces(Holder, u64, u64, u64, Vec<Tier>),
    Speculate(u32, u64, u64, u64),
    Replace(Holder, u64, u64),
    RemoveSource(Holder),
    Advance(u64),
}

fn holder() -> impl Strategy<Value = Holder> {
    prop_oneof![
        3 => (0..ENDPOINTS).prop_map(|e| Holder::Endpoint(ep(e))),
        2 => Just(Holder::Node(NodeId::new(0).unwrap())),
    ]
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![4 => Just(Tier::Gpu), 2 => Just(Tier::Host), 2 => Just(Tier::Disk)]
}

fn action() -> impl Strategy<Value = Action> {
    let c = 0..CHAINS;
    let start = prop_oneof![2 => Just(0u64), 3 => 0..LEN];
    let len = 1..=LEN;
    prop_oneof![
        8 => (holder(), c.clone(), start.clone(), len.clone(), tier())
            .prop_map(|(h, c, s, l, t)| Action::Store(h, c, s, l, t)),
        4 => (holder(), c.clone(), start.clone(), 1..20u64, tier())
            .prop_map(|(h, c, s, l, t)| Action::Remove(h, c, s, l, t)),
        3 => (holder(), c.clone(), start.clone(), len.clone(), prop::collection::vec(tier(), 1..8))
            .prop_map(|(h, c, s, l, t)| Action::StorePieces(h, c, s, l, t)),
        2 => (0..ENDPOINTS, c.clone(), len, 1..30u64)
            .prop_map(|(e, c, l, ttl)| Action::Speculate(e, c, l, ttl)),
        1 => (holder(), c, start).prop_map(|(h, c, s)| Action::Replace(h, c, s)),
        1 => holder().prop_map(Action::RemoveSource),
        1 => (0..40u64).prop_map(Action::Advance),
    ]
}

fn stored(keys: Vec<BlockKey>, tier: Tier) -> KvEvent {
    KvEvent::Stored {
        keys,
        parent: None,
        tier,
        lora: None,
        token_count: 0,
    }
}

fn check(idx: &KvIndex, model: &Model, cands: &[EndpointId]) -> Result<(), TestCaseError> {
    for c in 0..CHAINS {
        for len in [LEN, SHARED[c as usize] + 1, 70] {
            let keys = slice(c, 0, len);
            for (o, &e) in idx.find_matches(&keys, cands).iter().zip(cands) {
                prop_assert_eq!(
                    o.reaches(),
                    model.find(&keys, e),
                    "chain {} len {} {:?}",
                    c,
                    len,
                    e
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn long_chains_match_naive_model(actions in prop::collection::vec(action(), 1..40)) {
        let idx = KvIndex::new(IndexConfig { shards: 4, capacity: 1 << 20 }).unwrap();
        let mut model = Model::default();
        let node = NodeId::new(0).unwrap();
        for e in 0..2 {
            idx.set_endpoint_node(ep(e), Some(node));
            model.node_of.insert(ep(e), node);
        }
        let all: Vec<EndpointId> = (0..ENDPOINTS).map(ep).collect();
        let one = [ep(1)];
        let mut now = 0;
        for a in actions {
            match a {
                Action::Store(h, c, s, l, t) => {
                    let ev = [stored(slice(c, s, l), t)];
                    idx.apply(h, &ev);
                    model.apply(h, &ev);
                }
                Action::Remove(h, c, s, l, t) => {
                    let ev = [KvEvent::Removed { keys: slice(c, s, l), tier: t }];
                    idx.apply(h, &ev);
                    model.apply(h, &ev);
                }
                Action::StorePieces(h, c, s, l, tiers) => {
                    let keys = slice(c, s, l);
                    let evs: Vec<KvEvent> = keys
                        .chunks(keys.len().div_ceil(tiers.len()).max(1))
                        .zip(tiers.iter().cycle())
                        .map(|(k, &t)| stored(k.to_vec(), t))
                        .collect();
                    idx.apply(h, &evs);
                    model.apply(h, &evs);
                }
                Action::Speculate(e, c, l, ttl) => {
                    let keys = slice(c, 0, l);
                    idx.speculate(ep(e), &keys, Millis(now), Millis(ttl));
                    model.speculate(ep(e), &keys, Millis(now), Millis(ttl));
                }
                Action::Replace(h, c, s) => {
                    let snap: Vec<(BlockKey, Tier)> =
                        slice(c, s, 50).into_iter().map(|k| (k, Tier::Gpu)).collect();
                    idx.replace_source(h, snap.iter().copied());
                    model.replace_source(h, &snap);
                }
                Action::RemoveSource(h) => {
                    idx.remove_source(h);
                    model.remove_source(h);
                }
                Action::Advance(dt) => {
                    now += dt;
                    prop_assert_eq!(idx.expire(Millis(now)), model.expire(Millis(now)));
                }
            }
            check(&idx, &model, &all)?;
            check(&idx, &model, &one)?;
            prop_assert_eq!(idx.stats().residencies, model.residencies());
        }
    }
}
