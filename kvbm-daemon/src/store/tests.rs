//! The store against a naive model (three LRU lists), and its events against a receiver.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::sketch::Sketch;
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

/// Three LRU lists (host, disk, remote), least recently used first, and the pins, written the
/// obvious way.
#[derive(Debug, Default)]
struct Model {
    host_cap: u64,
    /// Disk, then remote.
    lower_cap: [u64; 2],
    host: Vec<(BlockId, u64)>,
    lower: [Vec<(BlockId, u64)>; 2],
    /// The chain parent each tier recorded for a block when it stored it (0 host, 1 disk,
    /// 2 remote); entries of blocks no longer resident are ignored.
    parents: HashMap<(usize, BlockId), Option<BlockKey>>,
    /// Pinned blocks: (pins, latest deadline).
    pins: HashMap<BlockId, (u32, u64)>,
    max_pins: usize,
    now: u64,
    /// The disk's admission filter (the store's own sketch type: tested on its own) and
    /// write-through.
    uses: Option<Sketch>,
    min_uses: u8,
    write_through: bool,
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

fn has(list: &[(BlockId, u64)], id: BlockId) -> bool {
    list.iter().any(|(i, _)| *i == id)
}

/// What putting a block into a lower tier did.
#[derive(Debug, PartialEq)]
enum Put {
    Present,
    Stored,
    NoRoom,
}

impl Model {
    /// Makes room for `bytes` in `list` (capacity `cap`) by removing its oldest unpinned
    /// blocks, returning them; `None`, removing nothing, when pinned blocks leave too little.
    fn room(
        pins: &HashMap<BlockId, (u32, u64)>,
        list: &mut Vec<(BlockId, u64)>,
        cap: u64,
        bytes: u64,
    ) -> Option<Vec<(BlockId, u64)>> {
        let pinned: u64 = list
            .iter()
            .filter(|(i, _)| pins.contains_key(i))
            .map(|(_, b)| b)
            .sum();
        if cap < pinned + bytes {
            return None;
        }
        let mut out = Vec::new();
        while used(list) + bytes > cap {
            let p = list.iter().position(|(i, _)| !pins.contains_key(i))?;
            out.push(list.remove(p));
        }
        Some(out)
    }

    /// Touches or inserts (`NoRoom` when the tier cannot hold the block now, or the disk
    /// does not admit it yet).
    fn put_lower(&mut self, i: usize, id: BlockId, bytes: u64, parent: Option<BlockKey>) -> Put {
        if bytes > self.lower_cap[i] {
            return Put::NoRoom;
        }
        if bump(&mut self.lower[i], id) {
            return Put::Present;
        }
        if i == 0
            && let Some(uses) = &self.uses
            && uses.estimate(&id) < self.min_uses
        {
            return Put::NoRoom;
        }
        if Self::room(&self.pins, &mut self.lower[i], self.lower_cap[i], bytes).is_none() {
            return Put::NoRoom;
        }
        self.lower[i].push((id, bytes));
        self.parents.insert((i + 1, id), parent);
        Put::Stored
    }

    /// Inserts into host memory, demoting what it evicts; false when pinned blocks leave too
    /// little room.
    fn put_host(&mut self, id: BlockId, bytes: u64, parent: Option<BlockKey>) -> bool {
        let Some(victims) = Self::room(&self.pins, &mut self.host, self.host_cap, bytes) else {
            return false;
        };
        for (victim, b) in victims {
            let p = self.parents.get(&(0, victim)).copied().flatten();
            self.put_lower(0, victim, b, p);
            self.put_lower(1, victim, b, p);
        }
        self.host.push((id, bytes));
        self.parents.insert((0, id), parent);
        true
    }

    fn record(&mut self, id: BlockId) {
        if let Some(uses) = &mut self.uses {
            uses.record(&id);
        }
    }

    fn offload(&mut self, layout: u32, keys: &[u64], bytes: u64) -> Offloaded {
        for k in keys {
            self.record(id(layout, *k));
        }
        let mut out = Offloaded::default();
        let mut before = None;
        for k in keys {
            let id = id(layout, *k);
            let parent = before;
            before = Some(BlockKey(*k));
            if bytes <= self.host_cap {
                if bump(&mut self.host, id) {
                    out.present += 1;
                } else if !self.put_host(id, bytes, parent) {
                    // Pinned blocks fill host memory: the lower tiers take it (below).
                } else {
                    out.stored += 1;
                }
                if has(&self.host, id) {
                    if self.write_through {
                        self.put_lower(0, id, bytes, parent);
                    }
                    continue;
                }
            }
            let puts = [0, 1].map(|i| self.put_lower(i, id, bytes, parent));
            if puts.contains(&Put::Stored) {
                out.stored += 1;
            } else if puts.contains(&Put::Present) {
                out.present += 1;
            } else {
                out.skipped += 1;
            }
        }
        out
    }

    /// Pins the leading held keys until `until`; how many.
    fn pin(&mut self, layout: u32, keys: &[u64], until: u64) -> u32 {
        let mut n = 0;
        for k in keys {
            let id = id(layout, *k);
            if !has(&self.host, id) && !self.lower.iter().any(|l| has(l, id)) {
                break;
            }
            if let Some((count, t)) = self.pins.get_mut(&id) {
                *count += 1;
                *t = (*t).max(until);
            } else if self.pins.len() < self.max_pins {
                self.pins.insert(id, (1, until));
            } else {
                break;
            }
            // Pinning touches the block wherever it is.
            bump(&mut self.host, id);
            for l in &mut self.lower {
                bump(l, id);
            }
            n += 1;
        }
        n
    }

    /// Per block found: 0 host, 1 disk, 2 remote.
    fn onboard(&mut self, layout: u32, keys: &[u64]) -> Vec<usize> {
        let mut out = Vec::new();
        for k in keys {
            let id = id(layout, *k);
            if has(&self.host, id) || self.lower.iter().any(|l| has(l, id)) {
                self.record(id);
            }
            if bump(&mut self.host, id) {
                out.push(0);
            } else if bump(&mut self.lower[0], id) {
                out.push(1);
            } else if bump(&mut self.lower[1], id) {
                out.push(2);
            } else {
                break;
            }
        }
        out
    }

    fn promote(&mut self, id: BlockId, from: usize, bytes: u64) {
        if has(&self.lower[from], id) && !has(&self.host, id) && bytes <= self.host_cap {
            let p = self.parents.get(&(from + 1, id)).copied().flatten();
            let _ = self.put_host(id, bytes, p);
        }
    }
}

/// Applies the store's events and lower-tier effects, as the EPP, the disk and Redis would
/// see them.
#[derive(Debug, Default)]
struct Receiver {
    resident: HashSet<(BlockId, Tier)>,
    /// Each resident block's parent as the events chain it.
    parents: HashMap<(BlockId, Tier), Option<BlockKey>>,
    written: HashMap<(Tier, BlockId), Bytes>,
}

impl Receiver {
    fn apply(&mut self, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::Publish { layout, event } => match event {
                    KvEvent::Stored {
                        keys,
                        tier,
                        parent,
                        token_count,
                        ..
                    } => {
                        // Every test layout has 4 tokens per block.
                        assert_eq!(token_count as usize, 4 * keys.len());
                        let mut before = parent;
                        for k in keys {
                            let at = (BlockId { layout, key: k }, tier);
                            assert!(self.resident.insert(at), "stored twice: {k:?} {tier:?}");
                            self.parents.insert(at, before);
                            before = Some(k);
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
                Effect::Write { tier, id, data } => {
                    assert!(LOWER_TIERS.contains(&tier));
                    assert!(
                        self.written.insert((tier, id), data).is_none(),
                        "written twice: {tier:?} {id:?}"
                    );
                }
                Effect::Delete { tier, id } => {
                    assert!(
                        self.written.remove(&(tier, id)).is_some(),
                        "deleted but absent: {tier:?} {id:?}"
                    );
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Offload {
        layout: u32,
        keys: Vec<u64>,
    },
    Onboard {
        layout: u32,
        keys: Vec<u64>,
    },
    Lookup {
        layout: u32,
        keys: Vec<u64>,
    },
    Promote {
        layout: u32,
        key: u64,
        from: usize,
    },
    Lost {
        layout: u32,
        key: u64,
        from: usize,
    },
    Pin {
        layout: u32,
        keys: Vec<u64>,
        ttl: u64,
    },
    Unpin {
        layout: u32,
        keys: Vec<u64>,
    },
    Tick {
        ms: u64,
    },
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    let keys = || proptest::collection::vec(0u64..16, 1..7);
    prop_oneof![
        6 => (0u32..2, keys()).prop_map(|(layout, keys)| Op::Offload { layout, keys }),
        3 => (0u32..2, keys()).prop_map(|(layout, keys)| Op::Onboard { layout, keys }),
        2 => (0u32..2, keys()).prop_map(|(layout, keys)| Op::Lookup { layout, keys }),
        2 => (0u32..2, 0u64..16, 0usize..2)
            .prop_map(|(layout, key, from)| Op::Promote { layout, key, from }),
        1 => (0u32..2, 0u64..16, 0usize..2)
            .prop_map(|(layout, key, from)| Op::Lost { layout, key, from }),
        2 => (0u32..2, keys(), 1u64..50)
            .prop_map(|(layout, keys, ttl)| Op::Pin { layout, keys, ttl }),
        1 => (0u32..2, keys()).prop_map(|(layout, keys)| Op::Unpin { layout, keys }),
        2 => (0u64..40).prop_map(|ms| Op::Tick { ms }),
        1 => Just(Op::Clear),
    ]
}

/// A store with these budgets and pin limit, the disk's admission filter off and no
/// write-through.
fn plain_store(host_bytes: u64, disk_bytes: u64, remote_bytes: u64, max_pins: usize) -> BlockStore {
    BlockStore::new(StoreConfig {
        host_bytes,
        disk_bytes,
        remote_bytes,
        max_pins,
        disk_min_uses: 0,
        disk_write_through: false,
    })
}

/// Layout 0 has 8-byte blocks, layout 1 16-byte ones.
const BYTES: [u64; 2] = [8, 16];

/// The disk's policy in a run: (uses needed for admission, write-through).
type DiskPolicy = (u8, bool);

fn check(
    host_cap: u64,
    lower_cap: [u64; 2],
    max_pins: usize,
    (min_uses, write_through): DiskPolicy,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let mut store = BlockStore::new(StoreConfig {
        host_bytes: host_cap,
        disk_bytes: lower_cap[0],
        remote_bytes: lower_cap[1],
        max_pins,
        disk_min_uses: min_uses,
        disk_write_through: write_through,
    });
    let mut model = Model {
        host_cap,
        lower_cap,
        max_pins,
        uses: (min_uses > 0).then(|| Sketch::new(1 << 16)),
        min_uses,
        write_through,
        ..Model::default()
    };
    let mut rx = Receiver::default();
    let largest = host_cap.max(lower_cap[0]).max(lower_cap[1]);
    for (i, b) in BYTES.iter().enumerate() {
        let r = store.register(layout(i as u32, *b));
        if *b > largest {
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
                for ((found, tier), key) in got.iter().zip(&want).zip(&keys) {
                    match found {
                        Found::Host(d) => {
                            prop_assert_eq!(*tier, 0);
                            prop_assert_eq!(d, &data(*key, BYTES[layout as usize]));
                        }
                        Found::Disk | Found::Remote => {
                            let t = if matches!(found, Found::Disk) { 1 } else { 2 };
                            prop_assert_eq!(*tier, t);
                            // What the edge would read is there.
                            let at = (LOWER_TIERS[t - 1], id(layout, *key));
                            prop_assert_eq!(
                                rx.written.get(&at),
                                Some(&data(*key, BYTES[layout as usize]))
                            );
                        }
                    }
                }
            }
            Op::Lookup { layout, keys } => {
                let k: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
                let got = store.lookup(LayoutId(layout), &k).unwrap();
                let in_host = |k: &u64| has(&model.host, id(layout, *k));
                let in_any =
                    |k: &u64| in_host(k) || model.lower.iter().any(|l| has(l, id(layout, *k)));
                let want = Lookup {
                    host: keys.iter().take_while(|k| in_host(k)).count() as u32,
                    any: keys.iter().take_while(|k| in_any(k)).count() as u32,
                };
                prop_assert_eq!(got, want);
            }
            Op::Promote { layout, key, from } => {
                let b = BYTES[layout as usize];
                store
                    .promote(id(layout, key), LOWER_TIERS[from], data(key, b), &mut fx)
                    .unwrap();
                model.promote(id(layout, key), from, b);
            }
            Op::Lost { layout, key, from } => {
                store.lost(id(layout, key), LOWER_TIERS[from], &mut fx);
                model.lower[from].retain(|(i, _)| *i != id(layout, key));
                let block = id(layout, key);
                if !has(&model.host, block) && !model.lower.iter().any(|l| has(l, block)) {
                    model.pins.remove(&block);
                }
                // The tier lost it: the receiver's copy too.
                rx.written.remove(&(LOWER_TIERS[from], id(layout, key)));
            }
            Op::Pin { layout, keys, ttl } => {
                let k: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
                let until = model.now + ttl;
                let got = store.pin(LayoutId(layout), &k, until).unwrap();
                prop_assert_eq!(got, model.pin(layout, &keys, until));
            }
            Op::Unpin { layout, keys } => {
                let k: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
                let got = store.unpin(LayoutId(layout), &k).unwrap();
                let mut want = 0;
                for k in &keys {
                    let block = id(layout, *k);
                    if let Some((count, _)) = model.pins.get_mut(&block) {
                        want += 1;
                        *count -= 1;
                        if *count == 0 {
                            model.pins.remove(&block);
                        }
                    }
                }
                prop_assert_eq!(got as usize, want);
            }
            Op::Tick { ms } => {
                model.now += ms;
                store.expire_pins(model.now);
                let now = model.now;
                model.pins.retain(|_, (_, until)| *until > now);
            }
            Op::Clear => {
                store.clear(&mut fx);
                model.host.clear();
                model.lower = Default::default();
                model.pins.clear();
            }
        }
        rx.apply(fx);
        let host: Vec<BlockId> = model.host.iter().map(|(i, _)| *i).collect();
        prop_assert_eq!(store.host.ids().collect::<Vec<_>>(), host.clone());
        prop_assert!(store.host.used() <= host_cap);
        prop_assert_eq!(store.host.used(), used(&model.host));
        let mut want: HashSet<(BlockId, Tier)> = host.iter().map(|i| (*i, Tier::Host)).collect();
        let mut written = HashSet::new();
        for (i, tier) in LOWER_TIERS.into_iter().enumerate() {
            let ids: Vec<BlockId> = model.lower[i].iter().map(|(id, _)| *id).collect();
            prop_assert_eq!(store.lower[i].set.ids().collect::<Vec<_>>(), ids.clone());
            prop_assert!(store.lower[i].set.used() <= lower_cap[i]);
            prop_assert_eq!(store.usage(tier).bytes, used(&model.lower[i]));
            want.extend(ids.iter().map(|id| (*id, tier)));
            written.extend(ids.iter().map(|id| (tier, *id)));
        }
        // Events and lower-tier effects describe the residency exactly, chains included.
        prop_assert_eq!(&rx.resident, &want);
        for (id, tier) in &want {
            let t = match tier {
                Tier::Host => 0,
                Tier::Disk => 1,
                _ => 2,
            };
            prop_assert_eq!(
                rx.parents.get(&(*id, *tier)),
                model.parents.get(&(t, *id)),
                "parent of {:?} in {:?}",
                id,
                tier
            );
        }
        prop_assert_eq!(rx.written.keys().copied().collect::<HashSet<_>>(), written);
        prop_assert_eq!(store.pinned(), model.pins.len());
        let distinct: HashSet<BlockId> = want.iter().map(|(id, _)| *id).collect();
        prop_assert_eq!(store.distinct_blocks(), distinct.len() as u64);
        prop_assert_eq!(store.distinct_blocks_scanned(), distinct.len() as u64);
        for l in 0..2u32 {
            let n: usize = [Tier::Host, Tier::Disk, Tier::Remote]
                .into_iter()
                .map(|t| store.resident(LayoutId(l), t).len())
                .sum();
            prop_assert_eq!(
                n,
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
        disk_blocks in 0u64..6,
        remote_blocks in 0u64..10,
        max_pins in 0usize..6,
        min_uses in prop_oneof![Just(0u8), 1u8..4],
        write_through: bool,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let lower = [disk_blocks * 8, remote_blocks * 8];
        check(host_blocks * 8, lower, max_pins, (min_uses, write_through), ops)?;
    }
}

#[test]
fn an_offload_is_validated_before_anything_changes() {
    let mut store = plain_store(64, 0, 0, 64);
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
    assert_eq!(store.usage(Tier::Host).blocks, 0);
    assert_eq!(
        store.offload(LayoutId(9), None, &blocks[..1], &mut fx),
        Err(StoreError::UnknownLayout(9))
    );
}

#[test]
fn a_chain_is_one_stored_event_with_its_parent_and_tokens() {
    let mut store = plain_store(64, 0, 64, 64);
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
            present: 0,
            skipped: 0
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
    let mut store = plain_store(16, 0, 64, 64);
    let l = store.register(layout(0, 8)).unwrap();
    let mut fx = Vec::new();
    let blocks: Vec<_> = (1..=3).map(|k| (BlockKey(k), data(k, 8))).collect();
    store.offload(l, None, &blocks, &mut fx).unwrap();
    // Block 1 left host memory for the remote store, keeping its place in the chain.
    assert!(fx.contains(&Effect::Write {
        tier: Tier::Remote,
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
    store
        .promote(id(0, 1), Tier::Remote, data(1, 8), &mut fx)
        .unwrap();
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

#[test]
fn host_evictions_go_to_disk_and_remote_and_onboards_prefer_disk() {
    let mut store = plain_store(8, 16, 64, 64);
    let l = store.register(layout(0, 8)).unwrap();
    let mut fx = Vec::new();
    let blocks: Vec<_> = (1..=3).map(|k| (BlockKey(k), data(k, 8))).collect();
    store.offload(l, None, &blocks, &mut fx).unwrap();
    // Blocks 1 and 2 left host memory for both lower tiers.
    for tier in LOWER_TIERS {
        for k in [1, 2] {
            assert!(fx.contains(&Effect::Write {
                tier,
                id: id(0, k),
                data: data(k, 8)
            }));
        }
        assert_eq!(store.resident(l, tier), vec![BlockKey(1), BlockKey(2)]);
    }
    assert_eq!(store.counters().demoted, 2);
    let chain = [BlockKey(1), BlockKey(2), BlockKey(3)];
    assert_eq!(store.lookup(l, &chain), Ok(Lookup { host: 0, any: 3 }));
    assert_eq!(store.onboard(l, &chain[..1]).unwrap(), vec![Found::Disk]);
    // Block 3 is demoted next; the disk (two blocks) evicts 2, which it used least recently
    // since the onboard touched 1, and only deletes its own copy.
    fx.clear();
    store
        .offload(l, Some(BlockKey(3)), &[(BlockKey(4), data(4, 8))], &mut fx)
        .unwrap();
    assert!(fx.contains(&Effect::Delete {
        tier: Tier::Disk,
        id: id(0, 2)
    }));
    assert!(!fx.iter().any(|e| matches!(
        e,
        Effect::Delete {
            tier: Tier::Remote,
            ..
        }
    )));
    assert_eq!(
        store.onboard(l, &chain).unwrap(),
        vec![Found::Disk, Found::Remote, Found::Disk]
    );
    // Read back from disk, block 1 returns to host memory and block 4 is demoted (it is
    // touched in neither lower tier: both write it).
    fx.clear();
    store
        .promote(id(0, 1), Tier::Disk, data(1, 8), &mut fx)
        .unwrap();
    assert_eq!(store.resident(l, Tier::Host), vec![BlockKey(1)]);
    assert_eq!(store.counters().disk.onboarded, 1);
    assert_eq!(store.counters().disk.evicted, 2);
    // A file found gone is forgotten with a Removed for the disk only.
    fx.clear();
    store.lost(id(0, 3), Tier::Disk, &mut fx);
    assert_eq!(
        fx,
        vec![Effect::Publish {
            layout: l,
            event: KvEvent::Removed {
                keys: vec![BlockKey(3)],
                tier: Tier::Disk
            }
        }]
    );
    assert_eq!(store.counters().disk.lost, 1);
}

#[test]
fn without_host_memory_a_chain_goes_to_each_lower_tier_as_one_event() {
    let mut store = plain_store(0, 64, 64, 64);
    let l = store.register(layout(0, 8)).unwrap();
    let mut fx = Vec::new();
    let blocks: Vec<_> = (1..=2).map(|k| (BlockKey(k), data(k, 8))).collect();
    let done = store.offload(l, None, &blocks, &mut fx).unwrap();
    assert_eq!(
        done,
        Offloaded {
            stored: 2,
            present: 0,
            skipped: 0
        }
    );
    for tier in LOWER_TIERS {
        assert!(fx.contains(&Effect::Publish {
            layout: l,
            event: KvEvent::Stored {
                keys: vec![BlockKey(1), BlockKey(2)],
                parent: None,
                tier,
                lora: None,
                token_count: 8,
            }
        }));
    }
    fx.clear();
    let again = store.offload(l, None, &blocks, &mut fx).unwrap();
    assert_eq!(
        again,
        Offloaded {
            stored: 0,
            present: 2,
            skipped: 0
        }
    );
    assert!(fx.is_empty());
}

#[test]
fn pins_are_counted_per_block_and_go_with_the_block() {
    let mut store = plain_store(16, 0, 64, 8);
    let l = store.register(layout(0, 8)).unwrap();
    let mut fx = Vec::new();
    let blocks: Vec<_> = (1..=2).map(|k| (BlockKey(k), data(k, 8))).collect();
    store.offload(l, None, &blocks, &mut fx).unwrap();
    // Two requests pin block 1; the first one's unpin leaves the second's.
    assert_eq!(store.pin(l, &[BlockKey(1)], 100), Ok(1));
    assert_eq!(store.pin(l, &[BlockKey(1)], 50), Ok(1));
    assert_eq!(store.unpin(l, &[BlockKey(1)]), Ok(1));
    assert_eq!(store.pinned(), 1);
    // Block 1 stays in host memory while block 3 comes in (block 2 is evicted).
    store
        .offload(l, None, &[(BlockKey(3), data(3, 8))], &mut fx)
        .unwrap();
    assert_eq!(
        store.lookup(l, &[BlockKey(1), BlockKey(2)]),
        Ok(Lookup { host: 1, any: 2 })
    );
    // The pin keeps the later deadline.
    store.expire_pins(99);
    assert_eq!(store.pinned(), 1);
    store.expire_pins(100);
    assert_eq!(store.pinned(), 0);
    assert_eq!(store.counters().pins_expired, 1);
    // A pin on a block that leaves every tier goes with it.
    assert_eq!(store.pin(l, &[BlockKey(2)], 1000), Ok(1));
    store.lost(id(0, 2), Tier::Remote, &mut fx);
    assert_eq!(store.pinned(), 0);
}
