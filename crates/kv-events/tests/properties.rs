//! Property tests: codecs round-trip, the normaliser agrees with a naive model, and no input
//! makes the decoders panic.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::{BTreeMap, BTreeSet};

use kv_events::engine::{
    BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, RawValue, WireFormat,
    decode_batch, encode_batch,
};
use kv_events::envelope::{EngineKind, Envelope, EnvelopeLimits, Source};
use kv_events::msgpack::Writer;
use kv_events::normalize::NormalizeError;
use kv_events::tier::Medium;
use kv_events::{BlockKey, KvEvent, Normalizer, NormalizerConfig, Tier};
use proptest::prelude::*;
use proptest::sample::select;
use xxhash_rust::xxh3::xxh3_64;

fn tier() -> impl Strategy<Value = Tier> {
    select(Tier::ALL.to_vec())
}

fn medium() -> impl Strategy<Value = Option<Medium>> {
    proptest::option::of(select(vec![
        Medium::Gpu,
        Medium::Cpu,
        Medium::CpuPinned,
        Medium::Storage,
        Medium::Disk,
        Medium::External,
    ]))
}

fn keys() -> impl Strategy<Value = Vec<BlockKey>> {
    proptest::collection::vec(any::<u64>().prop_map(BlockKey), 0..20)
}

fn kv_event() -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        (
            keys(),
            proptest::option::of(any::<u64>()),
            tier(),
            proptest::option::of("[a-z]{1,8}"),
            any::<u32>()
        )
            .prop_map(|(keys, parent, tier, lora, token_count)| KvEvent::Stored {
                keys,
                parent: parent.map(BlockKey),
                tier,
                lora,
                token_count,
            }),
        (keys(), tier()).prop_map(|(keys, tier)| KvEvent::Removed { keys, tier }),
        proptest::option::of(tier()).prop_map(|tier| KvEvent::Cleared { tier }),
    ]
}

fn envelope() -> impl Strategy<Value = Envelope> {
    let source = (
        "[a-z-]{1,12}",
        proptest::option::of("[a-z.-]{1,12}"),
        proptest::option::of("[a-z0-9-]{1,12}"),
        proptest::option::of("10\\.[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}"),
        proptest::option::of(any::<u16>()),
        any::<u32>(),
        proptest::option::of("[a-z0-9-]{1,12}"),
        ".{0,20}",
        select(vec![
            EngineKind::Vllm,
            EngineKind::Sglang,
            EngineKind::TrtLlm,
            EngineKind::Sim,
            EngineKind::Kvbm,
        ]),
        1u32..1024,
    )
        .prop_map(
            |(namespace, pool, pod, ip, port, dp_rank, node, model, engine, block_size)| Source {
                namespace,
                pool,
                pod,
                ip,
                port,
                dp_rank,
                node,
                model,
                engine,
                block_size,
            },
        );
    (
        source,
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec(kv_event(), 0..10),
    )
        .prop_map(|(source, epoch, seq, events)| Envelope {
            v: 1,
            source,
            epoch,
            seq,
            events,
        })
}

fn raw_value() -> impl Strategy<Value = RawValue> {
    prop_oneof![
        ".{0,40}".prop_map(|s| {
            let mut w = Writer::new();
            w.str(&s);
            RawValue(w.into_inner())
        }),
        any::<i64>().prop_map(|i| {
            let mut w = Writer::new();
            w.array(1);
            w.int(i);
            RawValue(w.into_inner())
        }),
    ]
}

fn stored() -> impl Strategy<Value = BlockStored> {
    (
        proptest::collection::vec(any::<u64>().prop_map(EngineHash), 0..6),
        proptest::option::of(any::<u64>().prop_map(EngineHash)),
        proptest::collection::vec(any::<u32>(), 0..70),
        any::<u32>(),
        proptest::option::of(any::<i64>()),
        medium(),
        proptest::option::of(".{0,10}"),
        proptest::option::of(proptest::collection::vec(
            proptest::option::of(raw_value()),
            0..4,
        )),
        (
            proptest::option::of(any::<i64>()),
            proptest::option::of("[a-z_]{0,20}"),
            proptest::option::of(any::<i64>()),
        ),
    )
        .prop_map(
            |(
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                (group_idx, kind, window),
            )| {
                BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys,
                    group_idx,
                    kv_cache_spec_kind: kind,
                    kv_cache_spec_sliding_window: window,
                    cache_salt: None,
                }
            },
        )
}

fn engine_event() -> impl Strategy<Value = EngineEvent> {
    prop_oneof![
        4 => stored().prop_map(EngineEvent::BlockStored),
        3 => (proptest::collection::vec(any::<u64>().prop_map(EngineHash), 0..6), medium(), proptest::option::of(any::<i64>()))
            .prop_map(|(block_hashes, medium, group_idx)| EngineEvent::BlockRemoved(BlockRemoved { block_hashes, medium, group_idx })),
        1 => Just(EngineEvent::AllBlocksCleared),
        1 => "[A-Z][a-z]{0,10}Updated".prop_map(|type_name| EngineEvent::Unknown { type_name }),
    ]
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (
        any::<f64>().prop_filter("finite", |f| f.is_finite()),
        proptest::collection::vec(engine_event(), 0..8),
        proptest::option::of(any::<i64>()),
    )
        .prop_map(|(ts, events, dp_rank)| EventBatch {
            ts,
            events,
            dp_rank,
        })
}

/// What survives a trip through a format that lacks some fields.
fn as_carried_by(mut batch: EventBatch, format: WireFormat) -> EventBatch {
    for e in &mut batch.events {
        match (format, e) {
            (WireFormat::Sglang, EngineEvent::BlockStored(s)) => {
                s.extra_keys = None;
                s.group_idx = None;
                s.kv_cache_spec_kind = None;
                s.kv_cache_spec_sliding_window = None;
            }
            (WireFormat::Sglang, EngineEvent::BlockRemoved(r)) => r.group_idx = None,
            (WireFormat::VllmArray | WireFormat::VllmMap, EngineEvent::BlockStored(s)) => {
                s.cache_salt = None;
            }
            _ => {}
        }
    }
    batch
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn envelope_round_trips(env in envelope()) {
        let bytes = env.encode().unwrap();
        prop_assert_eq!(Envelope::decode(&bytes, &EnvelopeLimits::default()).unwrap(), env);
    }

    #[test]
    fn engine_batches_round_trip_in_every_format(batch in batch(), salt in proptest::option::of("[a-z]{1,8}")) {
        for format in [WireFormat::VllmArray, WireFormat::VllmMap, WireFormat::Sglang] {
            let mut b = batch.clone();
            if format == WireFormat::Sglang {
                for e in &mut b.events {
                    if let EngineEvent::BlockStored(s) = e { s.cache_salt.clone_from(&salt); }
                }
            }
            let want = as_carried_by(b.clone(), format);
            let bytes = encode_batch(&b, format);
            prop_assert_eq!(decode_batch(&bytes).unwrap(), want, "{:?}", format);
        }
    }

    #[test]
    fn mutated_payloads_never_panic(batch in batch(), cuts in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), truncate in any::<usize>()) {
        for format in [WireFormat::VllmArray, WireFormat::VllmMap, WireFormat::Sglang] {
            let mut bytes = encode_batch(&batch, format);
            for (at, b) in &cuts {
                if !bytes.is_empty() {
                    let i = at % bytes.len();
                    bytes[i] = *b;
                }
            }
            let _ = decode_batch(&bytes);
            bytes.truncate(truncate % (bytes.len() + 1));
            let _ = decode_batch(&bytes);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
        let _ = Envelope::decode(&bytes, &EnvelopeLimits::default());
    }
}

// --- The normaliser against a naive model -------------------------------------------------

const BS: u32 = 2;
const MODEL: &str = "m";
const CAPACITY: usize = 12;

/// A deliberately simple model of the normaliser: a list of (hash, key, copies per tier) and
/// keys computed by concatenating bytes exactly as DESIGN.md states. GPU copies are counted
/// (vLLM caches duplicates, each stored and removed on its own); a lower tier holds one.
#[derive(Default)]
struct Model {
    resident: Vec<(EngineHash, BlockKey, BTreeMap<Tier, u32>)>,
}

fn add_copy(tiers: &mut BTreeMap<Tier, u32>, tier: Tier) {
    let c = tiers.entry(tier).or_insert(0);
    *c = if tier == Tier::Gpu { *c + 1 } else { 1 };
}

fn tier_of(m: Option<Medium>) -> Tier {
    match m {
        None | Some(Medium::Gpu) => Tier::Gpu,
        Some(Medium::Cpu | Medium::CpuPinned) => Tier::Host,
        Some(Medium::Storage | Medium::Disk) => Tier::Disk,
        Some(Medium::External) => Tier::Remote,
    }
}

fn naive_key(prev: u64, tokens: &[u32], extra: Option<&[u8]>) -> BlockKey {
    let mut bytes = prev.to_le_bytes().to_vec();
    for t in tokens {
        bytes.extend(t.to_le_bytes());
    }
    bytes.extend(extra.unwrap_or_default());
    BlockKey(xxh3_64(&bytes))
}

fn naive_seed(name: &str, salt: Option<&str>) -> u64 {
    xxh3_64(format!("{name}\0{}", salt.unwrap_or("")).as_bytes())
}

impl Model {
    fn find(&self, h: EngineHash) -> Option<usize> {
        self.resident.iter().position(|(x, _, _)| *x == h)
    }

    fn apply(&mut self, e: &EngineEvent, out: &mut Vec<KvEvent>) -> Result<(), &'static str> {
        match e {
            EngineEvent::BlockStored(s) if s.token_ids.is_empty() => {
                let tier = tier_of(s.medium);
                let mut keys = Vec::new();
                for h in &s.block_hashes {
                    if let Some(i) = self.find(*h) {
                        add_copy(&mut self.resident[i].2, tier);
                        keys.push(self.resident[i].1);
                    }
                }
                if !keys.is_empty() {
                    let parent = s
                        .parent_block_hash
                        .and_then(|p| self.find(p))
                        .map(|i| self.resident[i].1);
                    out.push(KvEvent::Stored {
                        keys,
                        parent,
                        tier,
                        lora: s.lora_name.clone(),
                        token_count: 0,
                    });
                }
                Ok(())
            }
            EngineEvent::BlockStored(s) => {
                if s.block_size != BS {
                    return Err("block_size_mismatch");
                }
                if s.token_ids.len() != s.block_hashes.len() * BS as usize {
                    return Err("token_count_mismatch");
                }
                if s.extra_keys
                    .as_ref()
                    .is_some_and(|e| e.len() != s.block_hashes.len())
                {
                    return Err("extra_keys_mismatch");
                }
                let parent = match s.parent_block_hash {
                    None => None,
                    Some(p) => Some(
                        self.find(p)
                            .map(|i| self.resident[i].1)
                            .ok_or("unknown_parent")?,
                    ),
                };
                // The real normaliser counts repeated new hashes in one event more than once.
                let new = s
                    .block_hashes
                    .iter()
                    .filter(|h| self.find(**h).is_none())
                    .count();
                if self.resident.len() + new > CAPACITY {
                    return Err("capacity_exceeded");
                }
                let name = s.lora_name.as_deref().unwrap_or(MODEL);
                let mut prev = parent.map_or(naive_seed(name, s.cache_salt.as_deref()), |k| k.0);
                let tier = tier_of(s.medium);
                let mut keys = Vec::new();
                for (i, h) in s.block_hashes.iter().enumerate() {
                    let tokens = &s.token_ids[i * BS as usize..(i + 1) * BS as usize];
                    let extra = s
                        .extra_keys
                        .as_ref()
                        .and_then(|e| e[i].as_ref())
                        .map(|r| r.0.as_slice());
                    let key = naive_key(prev, tokens, extra);
                    prev = key.0;
                    keys.push(key);
                    match self.find(*h) {
                        Some(j) if self.resident[j].1 == key => {
                            add_copy(&mut self.resident[j].2, tier);
                        }
                        Some(j) => {
                            for t in self.resident[j].2.keys() {
                                out.push(KvEvent::Removed {
                                    keys: vec![self.resident[j].1],
                                    tier: *t,
                                });
                            }
                            self.resident[j] = (*h, key, BTreeMap::from([(tier, 1)]));
                        }
                        None => self.resident.push((*h, key, BTreeMap::from([(tier, 1)]))),
                    }
                }
                out.push(KvEvent::Stored {
                    keys,
                    parent,
                    tier,
                    lora: s.lora_name.clone(),
                    token_count: s.token_ids.len() as u32,
                });
                Ok(())
            }
            EngineEvent::BlockRemoved(r) => {
                let tier = tier_of(r.medium);
                let mut keys = Vec::new();
                for h in &r.block_hashes {
                    if let Some(i) = self.find(*h)
                        && let Some(c) = self.resident[i].2.get_mut(&tier)
                    {
                        *c -= 1;
                        if *c > 0 {
                            continue;
                        }
                        self.resident[i].2.remove(&tier);
                        keys.push(self.resident[i].1);
                        if self.resident[i].2.is_empty() {
                            self.resident.remove(i);
                        }
                    }
                }
                if !keys.is_empty() {
                    out.push(KvEvent::Removed { keys, tier });
                }
                Ok(())
            }
            EngineEvent::AllBlocksCleared => {
                self.resident.clear();
                out.push(KvEvent::Cleared { tier: None });
                Ok(())
            }
            EngineEvent::Unknown { .. } => Ok(()),
        }
    }

    fn resident_pairs(&self) -> BTreeSet<(BlockKey, Tier)> {
        self.resident
            .iter()
            .flat_map(|(_, k, ts)| ts.keys().map(move |t| (*k, *t)))
            .collect()
    }
}

/// Events over a small universe so that parents, re-keying, removals and capacity all occur.
fn small_event() -> impl Strategy<Value = EngineEvent> {
    let hash = (0u64..16).prop_map(EngineHash);
    let small_medium = proptest::option::of(select(vec![
        Medium::Gpu,
        Medium::Cpu,
        Medium::Disk,
        Medium::External,
    ]));
    let stored = (
        proptest::collection::vec(hash.clone(), 1..4),
        proptest::option::of(hash.clone()),
        any::<bool>(),
        proptest::collection::vec(0u32..3, 8),
        small_medium.clone(),
        proptest::option::of(select(vec!["lora-a".to_owned(), "lora-b".to_owned()])),
        proptest::option::of(select(vec!["salt".to_owned()])),
        prop_oneof![8 => Just(BS), 1 => Just(3u32)],
        prop_oneof![6 => Just(0usize), 1 => Just(1usize)],
        proptest::option::of(proptest::collection::vec(
            proptest::option::of(raw_value()),
            3,
        )),
    )
        .prop_map(
            |(
                hashes,
                parent,
                tokenless,
                pool,
                medium,
                lora_name,
                cache_salt,
                block_size,
                skew,
                extra,
            )| {
                let n = hashes.len();
                let token_ids = if tokenless {
                    Vec::new()
                } else {
                    pool.iter()
                        .cycle()
                        .take(n * BS as usize + skew)
                        .copied()
                        .collect()
                };
                BlockStored {
                    extra_keys: extra.map(|e| e.into_iter().take(n).collect()),
                    block_hashes: hashes,
                    parent_block_hash: parent,
                    token_ids,
                    block_size,
                    medium,
                    lora_name,
                    cache_salt,
                    ..BlockStored::default()
                }
            },
        );
    prop_oneof![
        6 => stored.prop_map(EngineEvent::BlockStored),
        4 => (proptest::collection::vec(hash, 1..4), small_medium)
            .prop_map(|(block_hashes, medium)| EngineEvent::BlockRemoved(BlockRemoved { block_hashes, medium, group_idx: None })),
        1 => Just(EngineEvent::AllBlocksCleared),
        1 => Just(EngineEvent::Unknown { type_name: "X".into() }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn normaliser_agrees_with_the_naive_model(events in proptest::collection::vec(small_event(), 0..60)) {
        let mut real = Normalizer::new(NormalizerConfig { max_resident: CAPACITY, ..NormalizerConfig::new(MODEL, BS) });
        let mut model = Model::default();
        for (i, e) in events.iter().enumerate() {
            let mut got = Vec::new();
            let mut want = Vec::new();
            let r = real.apply(e, &mut got).map_err(|e: NormalizeError| e.metric_label());
            let m = model.apply(e, &mut want);
            prop_assert_eq!(r, m, "event {} {:?}", i, e);
            prop_assert_eq!(&got, &want, "event {} {:?}", i, e);
            let real_pairs: BTreeSet<_> = real.resident().collect();
            prop_assert_eq!(real_pairs, model.resident_pairs());
            prop_assert_eq!(real.resident_len(), model.resident.len());
            prop_assert!(real.resident_len() <= CAPACITY);
        }
    }
}
