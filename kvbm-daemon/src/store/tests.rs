//! The store against a naive model (two LRU lists), and its events against a receiver.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;

fn layout(shard: u32, block_bytes: u64) -> Layout {
    Layout {
        model: "m".into(),
        dtype: "fp8".into(),
        layers: 2,
        block_size: 4,
        block_bytes,
        shard,
        shards: 2,
    }
}

/// A block's bytes: its key repeated, so onboarded data can be checked.
fn data(key: u64, bytes: u64) -> Bytes {
    Bytes::from(
        (0..bytes)
            .map(|i| (key.wrapping_mul(31).wrapping_add(i)) as u8)
            .collect::<Vec<u8>>(),
    )
}

fn id(layout: u32, key: u64) -> BlockId {
    BlockId {
        layout: LayoutId(layout),
        key: BlockKey(key),
    }
}

/// Two LRU lists, least recently used first, written the obvious way.
#[derive(Debug, Default)]
struct Model {
    host_cap: u64,
    remote_cap: u64,
    host: Vec<(BlockId, u64)>,
    remote: Vec<(BlockId, u64)>,
}

fn used(list: &[(BlockId, u64)]) -> u64 {
    list.iter().map(|(_, b)| b).sum()
}

fn bump(list: &mut Vec<(BlockId, u64)>, id: BlockId) -> bool {
    match list.iter().position(|(i, _)| *i == id) {
        Some(p) => {
            let e = list.remove(p);
            list.push(e);
            true
        }
        None => false,
    }
}

impl Model {
    fn put_remote(&mut self, id: BlockId, bytes: u64) {
        if bump(&mut self.remote, id) || bytes > self.remote_cap {
            return;
        }
        while used(&self.remote) + bytes > self.remote_cap {
            self.remote.remove(0);
        }
        self.remote.push((id, bytes));
    }

    fn put_host(&mut self, id: BlockId, bytes: u64) {
        while used(&self.host) + bytes > self.host_cap {
            let (victim, b) = self.host.remove(0);
            self.put_remote(victim, b);
        }
        self.host.push((id, bytes));
    }

    fn offload(&mut self, layout: u32, keys: &[u64], bytes: u64) -> Offloaded {
        let mut out = Offloaded::default();
        for k in keys {
            let id = id(layout, *k);
            let to_host = bytes <= self.host_cap;
            let present = if to_host {
                bump(&mut self.host, id)
            } else {
                bump(&mut self.remote, id)
            };
            if present {
                out.present += 1;
                continue;
            }
            out.stored += 1;
            if to_host {
                self.put_host(id, bytes);
            } else {
                self.put_remote(id, bytes);
            }
        }
        out
    }

    fn onboard(&mut self, layout: u32, keys: &[u64]) -> Vec<bool> {
        let mut out = Vec::new();
        for k in keys {
            let id = id(layout, *k);
            if bump(&mut self.host, id) {
                out.push(true);
            } else if bump(&mut self.remote, id) {
                out.push(false);
            } else {
                break;
            }
        }
        out
    }

    fn promote(&mut self, id: BlockId, bytes: u64) {
        let in_remote = self.remote.iter().any(|(i, _)| *i == id);
        let in_host = self.host.iter().any(|(i, _)| *i == id);
        if in_remote && !in_host && bytes <= self.host_cap {
            self.put_host(id, bytes);
        }
    }
}

/// Applies the store's events and remote effects, as the EPP and Redis would see them.
#[derive(Debug, Default)]
struct Receiver {
    resident: HashSet<(BlockId, Tier)>,
    redis: HashMap<BlockId, Bytes>,
}

impl Receiver {
    fn apply(&mut self, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::Publish { layout, event } => match event {
                    KvEvent::Stored { keys, tier, .. } => {
                        for k in keys {
                            assert!(
                                self.resident.insert((BlockId { layout, key: k }, tier)),
                                "stored twice: {k:?} {tier:?}"
                            );
                        }
                    }
                    KvEvent::Removed { keys, tier } => {
                        for k in keys {
                            assert!(
                                self.resident.remove(&(BlockId { layout, key: k }, tier)),
                                "removed but absent: {k:?} {tier:?}"
                            );
                        }
                    }
                    KvEvent::Cleared { tier: None } => {
                        self.resident.retain(|(id, _)| id.layout != layout)
                    }
                    other => panic!("unexpected event {other:?}"),
                },
                Effect::RemotePut { id, data } => {
                    assert!(self.redis.insert(id, data).is_none(), "put twice: {id:?}");
                }
                Effect::RemoteDelete { id } => {
                    assert!(self.redis.remove(&id).is_some(), "deleted but absent");
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Offload { layout: u32, keys: Vec<u64> },
    Onboard { layout: u32, keys: Vec<u64> },
    Lookup { layout: u32, keys: Vec<u64> },
    Promote { layout: u32, key: u64 },
    Lost { layout: u32, key: u64 },
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    let keys = || proptest::collection::vec(0u64..16, 1..7);
    prop_oneof![
        6 => (0u32..2, keys()).prop_map(|(layout, keys)| Op::Offload { layout, keys }),
        3 => (0u32..2, keys()).prop_map(|(layout, keys)| Op::Onboard { layout, keys }),
        2 => (0u32..2, keys()).prop_map(|(layout, keys)| Op::Lookup { layout, keys }),
        2 => (0u32..2, 0u64..16).prop_map(|(layout, key)| Op::Promote { layout, key }),
        1 => (0u32..2, 0u64..16).prop_map(|(layout, key)| Op::Lost { layout, key }),
        1 => Just(Op::Clear),
    ]
}

/// Layout 0 has 8-byte blocks, layout 1 16-byte ones.
const BYTES: [u64; 2] = [8, 16];

fn check(host_cap: u64, remote_cap: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut store = BlockStore::new(StoreConfig {
        host_bytes: host_cap,
        remote_bytes: remote_cap,
    });
    let mut model = Model {
        host_cap,
        remote_cap,
        ..Model::default()
    };
    let mut rx = Receiver::default();
    for (i, b) in BYTES.iter().enumerate() {
        let r = store.register(layout(i as u32, *b));
        if *b > host_cap.max(remote_cap) {
            let too_large = matches!(r, Err(StoreError::Layout(LayoutError::TooLarge { .. })));
            prop_assert!(too_large);
            return Ok(());
        }
        prop_assert_eq!(r, Ok(LayoutId(i as u32)));
    }
    for op in ops {
        let mut fx = Vec::new();
        match op {
            Op::Offload { layout, keys } => {
                let b = BYTES[layout as usize];
                let blocks: Vec<(BlockKey, Bytes)> =
                    keys.iter().map(|k| (BlockKey(*k), data(*k, b))).collect();
                let got = store
                    .offload(LayoutId(layout), None, &blocks, &mut fx)
                    .unwrap();
                prop_assert_eq!(got, model.offload(layout, &keys, b));
            }
            Op::Onboard { layout, keys } => {
                let k: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
                let got = store.onboard(LayoutId(layout), &k).unwrap();
                let want = model.onboard(layout, &keys);
                prop_assert_eq!(got.len(), want.len());
                for ((found, in_host), key) in got.iter().zip(&want).zip(&keys) {
                    match found {
                        Found::Host(d) => {
                            prop_assert!(*in_host);
                            prop_assert_eq!(d, &data(*key, BYTES[layout as usize]));
                        }
                        Found::Remote => {
                            prop_assert!(!*in_host);
                            // What the edge would fetch is there.
                            prop_assert!(rx.redis.contains_key(&id(layout, *key)));
                        }
                    }
                }
            }
            Op::Lookup { layout, keys } => {
                let k: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
                let got = store.lookup(LayoutId(layout), &k).unwrap();
                let in_host = |k: &u64| model.host.iter().any(|(i, _)| *i == id(layout, *k));
                let in_any =
                    |k: &u64| in_host(k) || model.remote.iter().any(|(i, _)| *i == id(layout, *k));
                let want = Lookup {
                    host: keys.iter().take_while(|k| in_host(k)).count() as u32,
                    any: keys.iter().take_while(|k| in_any(k)).count() as u32,
                };
                prop_assert_eq!(got, want);
            }
            Op::Promote { layout, key } => {
                let b = BYTES[layout as usize];
                store
                    .promote(id(layout, key), data(key, b), &mut fx)
                    .unwrap();
                model.promote(id(layout, key), b);
            }
            Op::Lost { layout, key } => {
                store.remote_lost(id(layout, key), &mut fx);
                model.remote.retain(|(i, _)| *i != id(layout, key));
                // The remote store lost it: the receiver's Redis too.
                rx.redis.remove(&id(layout, key));
            }
            Op::Clear => {
                store.clear(&mut fx);
                model.host.clear();
                model.remote.clear();
            }
        }
        rx.apply(fx);
        let host: Vec<BlockId> = model.host.iter().map(|(i, _)| *i).collect();
        let remote: Vec<BlockId> = model.remote.iter().map(|(i, _)| *i).collect();
        prop_assert_eq!(store.host.ids().collect::<Vec<_>>(), host.clone());
        prop_assert_eq!(store.remote.ids().collect::<Vec<_>>(), remote.clone());
        prop_assert!(store.host.used() <= host_cap && store.remote.used() <= remote_cap);
        prop_assert_eq!(store.host.used(), used(&model.host));
        // Events and remote effects describe the residency exactly.
        let mut want: HashSet<(BlockId, Tier)> = host.iter().map(|i| (*i, Tier::Host)).collect();
        want.extend(remote.iter().map(|i| (*i, Tier::Remote)));
        prop_assert_eq!(&rx.resident, &want);
        let in_redis: HashSet<BlockId> = rx.redis.keys().copied().collect();
        prop_assert_eq!(in_redis, remote.iter().copied().collect::<HashSet<_>>());
        for l in 0..2u32 {
            let mut r = store.resident(LayoutId(l), Tier::Host);
            r.extend(store.resident(LayoutId(l), Tier::Remote));
            prop_assert_eq!(
                r.len(),
                want.iter().filter(|(i, _)| i.layout == LayoutId(l)).count()
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_the_model_and_its_events(
        host_blocks in 0u64..8,
        remote_blocks in 0u64..10,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        check(host_blocks * 8, remote_blocks * 8, ops)?;
    }
}

#[test]
fn an_offload_is_validated_before_anything_changes() {
    let mut store = BlockStore::new(StoreConfig {
        host_bytes: 64,
        remote_bytes: 0,
    });
    let l = store.register(layout(0, 8)).unwrap();
    let mut fx = Vec::new();
    let blocks = [(BlockKey(1), data(1, 8)), (BlockKey(2), data(2, 7))];
    assert_eq!(
        store.offload(l, None, &blocks, &mut fx),
        Err(StoreError::BlockSize {
            index: 1,
            got: 7,
            want: 8
        })
    );
    assert!(fx.is_empty());
    assert_eq!(store.host_usage().blocks, 0);
    assert_eq!(
        store.offload(LayoutId(9), None, &blocks[..1], &mut fx),
        Err(StoreError::UnknownLayout(9))
    );
}

#[test]
fn a_chain_is_one_stored_event_with_its_parent_and_tokens() {
    let mut store = BlockStore::new(StoreConfig {
        host_bytes: 64,
        remote_bytes: 64,
    });
    let l = store.register(layout(0, 8)).unwrap();
    let mut fx = Vec::new();
    let blocks: Vec<_> = (1..=3).map(|k| (BlockKey(k), data(k, 8))).collect();
    let got = store
        .offload(l, Some(BlockKey(9)), &blocks, &mut fx)
        .unwrap();
    assert_eq!(
        got,
        Offloaded {
            stored: 3,
            present: 0
        }
    );
    assert_eq!(
        fx,
        vec![Effect::Publish {
            layout: l,
            event: KvEvent::Stored {
                keys: vec![BlockKey(1), BlockKey(2), BlockKey(3)],
                parent: Some(BlockKey(9)),
                tier: Tier::Host,
                lora: None,
                token_count: 12,
            }
        }]
    );
}

#[test]
fn host_eviction_demotes_to_remote_with_the_blocks_parent() {
    let mut store = BlockStore::new(StoreConfig {
        host_bytes: 16,
        remote_bytes: 64,
    });
    let l = store.register(layout(0, 8)).unwrap();
    let mut fx = Vec::new();
    let blocks: Vec<_> = (1..=3).map(|k| (BlockKey(k), data(k, 8))).collect();
    store.offload(l, None, &blocks, &mut fx).unwrap();
    // Block 1 left host memory for the remote store, keeping its place in the chain.
    assert!(fx.contains(&Effect::RemotePut {
        id: id(0, 1),
        data: data(1, 8)
    }));
    assert!(fx.contains(&Effect::Publish {
        layout: l,
        event: KvEvent::Stored {
            keys: vec![BlockKey(1)],
            parent: None,
            tier: Tier::Remote,
            lora: None,
            token_count: 4,
        }
    }));
    assert_eq!(
        store.lookup(l, &[BlockKey(1), BlockKey(2), BlockKey(3)]),
        Ok(Lookup { host: 0, any: 3 })
    );
    assert_eq!(store.counters().demoted, 1);
    // Fetched back, it is promoted and evicts block 3 (the least recently used once 2 was
    // onboarded), which is demoted in turn.
    let found = store.onboard(l, &[BlockKey(1), BlockKey(2)]).unwrap();
    assert_eq!(found, vec![Found::Remote, Found::Host(data(2, 8))]);
    fx.clear();
    store.promote(id(0, 1), data(1, 8), &mut fx).unwrap();
    assert_eq!(
        store.lookup(l, &[BlockKey(1)]),
        Ok(Lookup { host: 1, any: 1 })
    );
    assert_eq!(
        store.resident(l, Tier::Host),
        vec![BlockKey(2), BlockKey(1)]
    );
    assert_eq!(store.counters().demoted, 2);
}
