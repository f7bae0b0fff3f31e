//! Example-based tests of the index's documented behaviour.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{ConfigError, EndpointId, Holder, IndexConfig, KvIndex, Millis, NodeId};

fn keys(n: u64) -> Vec<BlockKey> {
    (0..n)
        .map(|i| BlockKey((i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
        .collect()
}

fn stored(keys: &[BlockKey], tier: Tier) -> KvEvent {
    KvEvent::Stored {
        keys: keys.to_vec(),
        parent: None,
        tier,
        lora: None,
        token_count: 0,
    }
}

fn ep(i: u32) -> EndpointId {
    EndpointId::new(i).unwrap()
}

#[test]
fn node_tiers_count_for_every_endpoint_on_the_node() {
    let idx = KvIndex::new(IndexConfig::default()).unwrap();
    let node = NodeId::new(7).unwrap();
    let k = keys(10);
    idx.set_endpoint_node(ep(0), Some(node));
    idx.set_endpoint_node(ep(1), Some(node));
    idx.apply(Holder::Endpoint(ep(0)), &[stored(&k[..3], Tier::Gpu)]);
    idx.apply(
        Holder::Node(node),
        &[stored(&k[..6], Tier::Host), stored(&k[..9], Tier::Disk)],
    );
    // A node's GPU entries (which a block manager should never send) are ignored.
    idx.apply(Holder::Node(node), &[stored(&k, Tier::Gpu)]);
    let got = idx.find_matches(&k, &[ep(0), ep(1), ep(2)]);
    assert_eq!(got[0].reaches(), [3, 6, 9, 9]);
    assert_eq!(
        (
            got[0].hits(Tier::Gpu),
            got[0].hits(Tier::Host),
            got[0].hits(Tier::Disk)
        ),
        (3, 3, 3)
    );
    assert_eq!(got[1].reaches(), [0, 6, 9, 9]);
    assert_eq!(got[2].reaches(), [0, 0, 0, 0], "endpoint 2 is on no node");
    idx.set_endpoint_node(ep(1), None);
    assert_eq!(idx.find_matches(&k, &[ep(1)])[0].reaches(), [0; 4]);
}

#[test]
fn matches_are_consecutive_from_key_zero() {
    let idx = KvIndex::new(IndexConfig::default()).unwrap();
    let k = keys(8);
    idx.apply(Holder::Endpoint(ep(0)), &[stored(&k[1..], Tier::Gpu)]);
    assert_eq!(
        idx.find_matches(&k, &[ep(0)])[0].reaches(),
        [0; 4],
        "a gap at key 0 means no match"
    );
    idx.apply(
        Holder::Endpoint(ep(0)),
        &[
            stored(&k[..1], Tier::Gpu),
            KvEvent::Removed {
                keys: vec![k[4]],
                tier: Tier::Gpu,
            },
        ],
    );
    assert_eq!(idx.find_matches(&k, &[ep(0)])[0].reaches(), [4; 4]);
    assert!(idx.find_matches(&[], &[ep(0)])[0].reaches() == [0; 4]);
    assert!(idx.find_matches(&k, &[]).is_empty());
}

#[test]
fn speculation_is_visible_until_confirmed_or_expired() {
    let idx = KvIndex::new(IndexConfig::default()).unwrap();
    let k = keys(6);
    idx.speculate(ep(1), &k, Millis(100), Millis(50));
    assert_eq!(idx.find_matches(&k, &[ep(1)])[0].reach(Tier::Gpu), 6);
    // The engine confirms the first four; the last two stay speculative.
    idx.apply(Holder::Endpoint(ep(1)), &[stored(&k[..4], Tier::Gpu)]);
    assert_eq!(idx.expire(Millis(149)), 0);
    assert_eq!(idx.expire(Millis(150)), 2);
    assert_eq!(idx.find_matches(&k, &[ep(1)])[0].reach(Tier::Gpu), 4);
    // Renewal: the later deadline wins.
    idx.speculate(ep(1), &k[4..], Millis(200), Millis(10));
    idx.speculate(ep(1), &k[4..], Millis(205), Millis(10));
    assert_eq!(idx.expire(Millis(210)), 0);
    assert_eq!(idx.expire(Millis(215)), 2);
    assert_eq!(idx.stats().residencies, 4);
}

#[test]
fn sources_can_be_replaced_and_removed() {
    let idx = KvIndex::new(IndexConfig {
        shards: 4,
        capacity: 1000,
    })
    .unwrap();
    let k = keys(10);
    let h = Holder::Endpoint(ep(2));
    idx.apply(h, &[stored(&k, Tier::Gpu)]);
    idx.apply(Holder::Endpoint(ep(3)), &[stored(&k[..2], Tier::Gpu)]);
    idx.replace_source(h, k[..5].iter().map(|&x| (x, Tier::Host)));
    assert_eq!(
        idx.find_matches(&k, &[ep(2), ep(3)])[0].reaches(),
        [0, 5, 5, 5]
    );
    idx.remove_source(h);
    let got = idx.find_matches(&k, &[ep(2), ep(3)]);
    assert_eq!((got[0].reaches(), got[1].reaches()), ([0; 4], [2; 4]));
    assert_eq!(idx.stats().residencies, 2);
    assert_eq!(idx.stats().blocks, 2);
}

#[test]
fn capacity_evicts_unreferenced_blocks_first() {
    let idx = KvIndex::new(IndexConfig {
        shards: 1,
        capacity: 100,
    })
    .unwrap();
    let hot = keys(50);
    idx.apply(Holder::Endpoint(ep(0)), &[stored(&hot, Tier::Gpu)]);
    // Cold blocks arrive; lookups keep the hot chain referenced.
    for round in 0..20u64 {
        let cold: Vec<BlockKey> = (0..10)
            .map(|i| BlockKey(0xC01D_0000 + round * 100 + i))
            .collect();
        idx.apply(Holder::Endpoint(ep(1)), &[stored(&cold, Tier::Gpu)]);
        assert_eq!(
            idx.find_matches(&hot, &[ep(0)])[0].reach(Tier::Gpu),
            50,
            "round {round}"
        );
    }
    let st = idx.stats();
    assert!(st.residencies <= 100);
    assert!(st.evicted_blocks >= 100);
}

#[test]
fn bad_configs_are_rejected() {
    assert_eq!(
        KvIndex::new(IndexConfig {
            shards: 3,
            capacity: 10
        })
        .unwrap_err(),
        ConfigError::Shards(3)
    );
    assert_eq!(
        KvIndex::new(IndexConfig {
            shards: 8,
            capacity: 4
        })
        .unwrap_err(),
        ConfigError::Capacity {
            capacity: 4,
            shards: 8
        }
    );
    assert_eq!(ConfigError::Shards(3).metric_label(), "shards");
}

#[test]
fn a_run_walk_sees_a_block_that_became_shared() {
    // The node stores a chain in three adjacent events (one run in its log, mixed tiers); an
    // endpoint on it then stores block 5 itself, faster than the node has it. A lookup that
    // walks the node's run must not take block 5 as the node's alone.
    let idx = KvIndex::new(IndexConfig::default()).unwrap();
    let node = NodeId::new(3).unwrap();
    idx.set_endpoint_node(ep(0), Some(node));
    let k = keys(10);
    let n = Holder::Node(node);
    idx.apply(
        n,
        &[
            stored(&k[..5], Tier::Host),
            stored(&k[5..6], Tier::Disk),
            stored(&k[6..], Tier::Host),
        ],
    );
    assert_eq!(idx.find_matches(&k, &[ep(0)])[0].reaches(), [0, 5, 10, 10]);
    idx.apply(Holder::Endpoint(ep(0)), &[stored(&k[5..6], Tier::Host)]);
    assert_eq!(idx.find_matches(&k, &[ep(0)])[0].reaches(), [0, 10, 10, 10]);
    // And back: the endpoint drops it; the node's entry stays exact (it only loses its
    // shortcut).
    idx.apply(
        Holder::Endpoint(ep(0)),
        &[KvEvent::Removed {
            keys: k[5..6].to_vec(),
            tier: Tier::Host,
        }],
    );
    assert_eq!(idx.find_matches(&k, &[ep(0)])[0].reaches(), [0, 5, 10, 10]);
}

/// Lookups on one thread share scratch state, and one with the same candidate list as the
/// last reuses its candidate map: answers must not depend on what the previous lookup saw,
/// whether the list is the same, reordered, repeated or a subset.
#[test]
fn consecutive_lookups_do_not_leak_candidate_state() {
    let idx = KvIndex::new(IndexConfig::default()).unwrap();
    let all = keys(40);
    let (x, y) = (&all[..20], &all[20..]);
    idx.apply(Holder::Endpoint(ep(1)), &[stored(x, Tier::Gpu)]);
    idx.apply(Holder::Endpoint(ep(2)), &[stored(&y[..5], Tier::Gpu)]);
    idx.apply(Holder::Endpoint(ep(3)), &[stored(&y[..9], Tier::Host)]);
    let reach = |k: &[BlockKey], c: &[EndpointId]| -> Vec<[u32; 4]> {
        idx.find_matches(k, c).iter().map(|o| o.reaches()).collect()
    };
    let c = [ep(1), ep(2), ep(3)];
    for _ in 0..2 {
        assert_eq!(reach(x, &c), [[20; 4], [0; 4], [0; 4]]);
        assert_eq!(reach(y, &c), [[0; 4], [5; 4], [0, 9, 9, 9]]);
        assert_eq!(reach(&x[..0], &c), [[0; 4]; 3]);
    }
    assert_eq!(
        reach(y, &[ep(3), ep(2), ep(1)]),
        [[0, 9, 9, 9], [5; 4], [0; 4]]
    );
    assert_eq!(
        reach(y, &[ep(2), ep(3), ep(2)]),
        [[5; 4], [0, 9, 9, 9], [5; 4]]
    );
    assert_eq!(reach(x, &[ep(2), ep(3), ep(2)]), [[0; 4]; 3]);
    assert_eq!(reach(x, &[ep(1), ep(1)]), [[20; 4]; 2]);
    assert_eq!(reach(y, &[ep(1), ep(1)]), [[0; 4]; 2]);
    assert_eq!(reach(y, &[ep(3)]), [[0, 9, 9, 9]]);
    assert_eq!(reach(x, &[ep(3)]), [[0; 4]]);
}
