//! Decode + normalise throughput, in block events per second, on a seeded stream shaped like
//! the captured vLLM traffic: per engine step, one multi-block prompt store, a few one-block
//! stores of generated tokens, and one-hash removals evicting the oldest blocks of a bounded
//! cache (vLLM publishes one `BlockRemoved` per evicted block).
//!
//! `cargo bench -p kvgate-kv-events --bench decode_normalize`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::collections::VecDeque;

use divan::counter::ItemsCount;
use kv_events::engine::{
    BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, WireFormat, decode_batch,
    encode_batch,
};
use kv_events::tier::Medium;
use kv_events::{Normalizer, NormalizerConfig};

const BLOCK_SIZE: u32 = 16;
const STEPS: usize = 2_000;
const CACHE_BLOCKS: usize = 20_000;

fn main() {
    divan::main();
}

/// A tiny seeded generator (SplitMix64) so the stream is the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn stored(rng: &mut Rng, parent: Option<EngineHash>, blocks: usize) -> (BlockStored, EngineHash) {
    let hashes: Vec<EngineHash> = (0..blocks).map(|_| EngineHash(rng.next())).collect();
    let tokens = (0..blocks * BLOCK_SIZE as usize)
        .map(|_| rng.below(151_936) as u32)
        .collect();
    let last = *hashes.last().unwrap();
    let s = BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size: BLOCK_SIZE,
        medium: Some(Medium::Gpu),
        extra_keys: Some(vec![None; blocks]),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        ..BlockStored::default()
    };
    (s, last)
}

/// Engine steps of a busy engine, with a consistent resident set.
fn stream() -> (Vec<EventBatch>, u64) {
    let mut rng = Rng(42);
    let mut resident: VecDeque<EngineHash> = VecDeque::new();
    let mut tails: Vec<EngineHash> = Vec::new();
    let mut batches = Vec::with_capacity(STEPS);
    let mut blocks = 0u64;
    for step in 0..STEPS {
        let mut events = Vec::new();
        // A new prompt of 4..64 blocks, sometimes continuing a cached prefix.
        let parent = if !tails.is_empty() && rng.below(2) == 0 {
            Some(tails[rng.below(tails.len() as u64) as usize])
        } else {
            None
        };
        let len = 4 + rng.below(60) as usize;
        let (s, tail) = stored(&mut rng, parent, len);
        resident.extend(s.block_hashes.iter().copied());
        events.push(EngineEvent::BlockStored(s));
        tails.push(tail);
        // Generated tokens filling blocks of running requests.
        for _ in 0..rng.below(8) {
            let at = tails.len() - 1 - rng.below(tails.len().min(16) as u64) as usize;
            let (s, tail) = stored(&mut rng, Some(tails[at]), 1);
            resident.extend(s.block_hashes.iter().copied());
            events.push(EngineEvent::BlockStored(s));
            tails[at] = tail;
        }
        // Evict the oldest blocks beyond the cache size, one event per block.
        while resident.len() > CACHE_BLOCKS {
            let h = resident.pop_front().unwrap();
            tails.retain(|t| *t != h);
            events.push(EngineEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![h],
                medium: Some(Medium::Gpu),
                group_idx: Some(0),
            }));
        }
        if tails.len() > 256 {
            tails.drain(..128);
        }
        blocks += events.iter().map(EngineEvent::block_count).sum::<usize>() as u64;
        batches.push(EventBatch {
            ts: 1.7e9 + step as f64 * 0.01,
            events,
            dp_rank: Some(0),
        });
    }
    (batches, blocks)
}

fn payloads(format: WireFormat) -> (Vec<Vec<u8>>, u64) {
    let (batches, blocks) = stream();
    (
        batches.iter().map(|b| encode_batch(b, format)).collect(),
        blocks,
    )
}

fn decode_and_normalise(bencher: divan::Bencher<'_, '_>, format: WireFormat) {
    let (payloads, blocks) = payloads(format);
    bencher.counter(ItemsCount::new(blocks)).bench_local(|| {
        let mut n = Normalizer::new(NormalizerConfig::new("bench-model", BLOCK_SIZE));
        let mut out = Vec::with_capacity(64);
        for p in &payloads {
            let batch = decode_batch(p).unwrap();
            for e in &batch.events {
                n.apply(e, &mut out).unwrap();
            }
            out.clear();
        }
        n.resident_len()
    });
}

fn decode_only(bencher: divan::Bencher<'_, '_>, format: WireFormat) {
    let (payloads, blocks) = payloads(format);
    bencher.counter(ItemsCount::new(blocks)).bench_local(|| {
        payloads
            .iter()
            .map(|p| decode_batch(p).unwrap().events.len())
            .sum::<usize>()
    });
}

#[divan::bench(sample_count = 20)]
fn decode_normalise_vllm_map(b: divan::Bencher<'_, '_>) {
    decode_and_normalise(b, WireFormat::VllmMap);
}

#[divan::bench(sample_count = 20)]
fn decode_normalise_vllm_array(b: divan::Bencher<'_, '_>) {
    decode_and_normalise(b, WireFormat::VllmArray);
}

#[divan::bench(sample_count = 20)]
fn decode_normalise_sglang(b: divan::Bencher<'_, '_>) {
    decode_and_normalise(b, WireFormat::Sglang);
}

#[divan::bench(sample_count = 20)]
fn decode_only_vllm_map(b: divan::Bencher<'_, '_>) {
    decode_only(b, WireFormat::VllmMap);
}
