//! Property: a receiver that applies a snapshot, then the envelopes with `seq ≥ next_seq` of
//! the snapshot's epoch (re-fetching a snapshot whenever it sees a new epoch), converges
//! exactly to the publisher's resident set — over random engine event streams, random seal
//! points, random snapshot points, streams lost to gaps and envelopes dropped for a slow NATS.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kv_bridge::rank::{BatchLimits, RankBridge, Sealed};
use kv_events::engine::{
    BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, WireFormat, encode_batch,
};
use kv_events::envelope::EngineKind;
use kv_events::snapshot::Snapshot;
use kv_events::tier::Medium;
use kv_events::{Envelope, KvEvent, NormalizerConfig, Source, Tier};
use proptest::prelude::*;

const BS: u32 = 4;

#[derive(Debug, Clone)]
enum Op {
    /// Store `n` blocks after the `parent`-th known hash (or as a root).
    Store {
        parent: Option<usize>,
        n: usize,
        tok: u32,
        gpu: bool,
    },
    /// Copy the `i`-th known hash to the CPU tier without tokens.
    Offload(usize),
    /// Evict the `i`-th known hash from GPU or CPU.
    Remove { i: usize, gpu: bool },
    /// Reset the prefix cache.
    Clear,
    /// Seal the batch (the socket drained).
    Seal,
    /// A gap replay could not cover.
    Lose,
    /// The last sealed envelope could not be queued: new epoch.
    Drop,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (proptest::option::of(0usize..64), 1usize..5, 0u32..4, any::<bool>())
            .prop_map(|(parent, n, tok, gpu)| Op::Store { parent, n, tok, gpu }),
        2 => (0usize..64).prop_map(Op::Offload),
        4 => (0usize..64, any::<bool>()).prop_map(|(i, gpu)| Op::Remove { i, gpu }),
        1 => Just(Op::Clear),
        4 => Just(Op::Seal),
        1 => Just(Op::Lose),
        1 => Just(Op::Drop),
    ]
}

fn source() -> Source {
    Source {
        namespace: "ns".into(),
        pool: Some("pool".into()),
        pod: Some("pod".into()),
        ip: None,
        port: Some(8000),
        dp_rank: 0,
        node: None,
        model: "m".into(),
        engine: EngineKind::Vllm,
        block_size: BS,
    }
}

type Set = HashSet<(u64, Tier)>;

/// The naive receiver model.
fn apply(set: &mut Set, env: &Envelope) {
    for ev in &env.events {
        match ev {
            KvEvent::Stored { keys, tier, .. } => set.extend(keys.iter().map(|k| (k.0, *tier))),
            KvEvent::Removed { keys, tier } => {
                for k in keys {
                    set.remove(&(k.0, *tier));
                }
            }
            KvEvent::Cleared { tier: None } => set.clear(),
            KvEvent::Cleared { tier: Some(t) } => set.retain(|(_, x)| x != t),
            KvEvent::Unknown => {}
        }
    }
}

fn entries(s: &Snapshot) -> Set {
    s.entries().map(|(k, t)| (k.0, t)).collect()
}

struct Run {
    /// Envelopes that reached NATS, with the op index after which they were delivered.
    delivered: Vec<(usize, Envelope)>,
    /// Every envelope sealed, delivered or not.
    sealed: Vec<Envelope>,
    /// The snapshot a request answered after op i would get.
    snaps: Vec<Snapshot>,
    bridge: RankBridge,
}

fn drive(ops: &[Op], max_keys: usize) -> Run {
    let limits = BatchLimits {
        max_keys,
        max_events: 3,
        max_delay: Duration::from_secs(3600),
    };
    let mut bridge = RankBridge::new(source(), NormalizerConfig::new("m", BS), limits, 1);
    let mut known: Vec<EngineHash> = Vec::new();
    let mut next_hash = 1u64;
    let (mut delivered, mut sealed, mut snaps) = (Vec::new(), Vec::new(), Vec::new());
    let mut epoch = 100;
    let now = Instant::now();
    for (i, op) in ops.iter().enumerate() {
        let mut events = Vec::new();
        match op {
            Op::Store {
                parent,
                n,
                tok,
                gpu,
            } => {
                let parent = parent.and_then(|p| known.get(p % known.len().max(1)).copied());
                let hashes: Vec<EngineHash> = (0..*n)
                    .map(|_| {
                        next_hash += 1;
                        EngineHash(next_hash)
                    })
                    .collect();
                known.extend(&hashes);
                events.push(EngineEvent::BlockStored(BlockStored {
                    block_hashes: hashes,
                    parent_block_hash: parent,
                    token_ids: (0..*n as u32 * BS).map(|t| t % 3 + tok).collect(),
                    block_size: BS,
                    medium: Some(if *gpu { Medium::Gpu } else { Medium::Cpu }),
                    ..BlockStored::default()
                }));
            }
            Op::Offload(i) if !known.is_empty() => {
                events.push(EngineEvent::BlockStored(BlockStored {
                    block_hashes: vec![known[i % known.len()]],
                    block_size: BS,
                    medium: Some(Medium::Cpu),
                    ..BlockStored::default()
                }));
            }
            Op::Remove { i, gpu } if !known.is_empty() => {
                events.push(EngineEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![known[i % known.len()]],
                    medium: Some(if *gpu { Medium::Gpu } else { Medium::Cpu }),
                    group_idx: None,
                }));
            }
            Op::Clear => events.push(EngineEvent::AllBlocksCleared),
            Op::Seal => bridge.seal(),
            Op::Lose => bridge.lose(now),
            Op::Drop => {}
            Op::Offload(_) | Op::Remove { .. } => {}
        }
        if !events.is_empty() {
            let payload = encode_batch(
                &EventBatch {
                    ts: 0.0,
                    events,
                    dp_rank: Some(0),
                },
                WireFormat::VllmMap,
            );
            bridge.ingest(&payload, now).unwrap();
        }
        let mut out: Vec<Sealed> = Vec::new();
        bridge.take_sealed(&mut out);
        for s in out {
            sealed.push(s.envelope.clone());
            delivered.push((i, s.envelope));
        }
        if matches!(op, Op::Drop) && delivered.last().is_some_and(|(at, _)| *at == i) {
            delivered.pop();
            epoch += 1;
            bridge.new_epoch(epoch);
        } else if matches!(op, Op::Drop) {
            // Nothing was sealed at this point: drop the pending batch's envelope instead.
            bridge.seal();
            let mut out = Vec::new();
            bridge.take_sealed(&mut out);
            sealed.extend(out.into_iter().map(|s| s.envelope));
            epoch += 1;
            bridge.new_epoch(epoch);
        }
        snaps.push(bridge.snapshot());
    }
    bridge.seal();
    let mut out = Vec::new();
    bridge.take_sealed(&mut out);
    let last = ops.len();
    for s in out {
        sealed.push(s.envelope.clone());
        delivered.push((last, s.envelope));
    }
    snaps.push(bridge.snapshot());
    Run {
        delivered,
        sealed,
        snaps,
        bridge,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn receivers_converge_to_the_publishers_set(
        ops in proptest::collection::vec(op(), 1..80),
        join in any::<prop::sample::Index>(),
        delays in proptest::collection::vec(0usize..6, 8),
        max_keys in 1usize..6,
    ) {
        let run = drive(&ops, max_keys);
        let end = run.snaps.len() - 1;
        // The publisher's set is exactly what every sealed envelope adds up to.
        let mut all = Set::new();
        for env in &run.sealed {
            apply(&mut all, env);
        }
        let publisher = entries(&run.snaps[end]);
        prop_assert_eq!(&all, &publisher);
        prop_assert_eq!(run.bridge.resident().len(), publisher.len());

        // Envelopes never exceed the key bound unless one event alone does (never: events split).
        for env in &run.sealed {
            let keys: usize = env.events.iter().map(KvEvent::key_count).sum();
            prop_assert!(keys <= max_keys, "{} keys > {}", keys, max_keys);
        }

        // A receiver joins after op `p`, and re-fetches a snapshot (answered a little later)
        // whenever it sees an epoch it does not know.
        let p = join.index(ops.len());
        let mut snap = &run.snaps[p];
        let mut set = entries(snap);
        let (mut epoch, mut expect) = (snap.epoch, snap.next_seq);
        let mut refetches = 0usize;
        let mut last_r = p;
        for (at, env) in run.delivered.iter().filter(|(at, _)| *at > p) {
            if env.epoch != epoch {
                let r = (*at + delays[refetches % delays.len()]).min(end).max(last_r);
                last_r = r;
                refetches += 1;
                snap = &run.snaps[r];
                set = entries(snap);
                epoch = snap.epoch;
                expect = snap.next_seq;
            }
            if env.epoch != epoch || env.seq < expect {
                continue;
            }
            prop_assert_eq!(env.seq, expect, "contiguous seq within an epoch");
            apply(&mut set, env);
            expect += 1;
        }
        prop_assert_eq!(epoch, run.snaps[end].epoch);
        prop_assert_eq!(set, publisher);
    }
}
