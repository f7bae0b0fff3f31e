//! The sidecar's pure relay path on one core: engine payload decode → normalise → batch →
//! seal → envelope encode (what the receive thread does per frame), over vLLM-shaped payloads.
//!
//! Prints sustained block events per second and the per-frame cost percentiles at a paced
//! 100k block events/s. Run: `cargo bench -p kvgate-kv-bridge --bench relay`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::print_stdout
)]

use std::time::{Duration, Instant};

use kv_bridge::rank::{BatchLimits, RankBridge, Sealed};
use kv_events::engine::{
    BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, WireFormat, encode_batch,
};
use kv_events::envelope::EngineKind;
use kv_events::tier::Medium;
use kv_events::{NormalizerConfig, Source};

const BS: u32 = 16;

fn source() -> Source {
    Source {
        namespace: "default".into(),
        pool: Some("pool".into()),
        pod: Some("pod-0".into()),
        ip: Some("10.0.0.1".into()),
        port: Some(8000),
        dp_rank: 0,
        node: None,
        model: "meta-llama/Llama-3.1-8B-Instruct".into(),
        engine: EngineKind::Vllm,
        block_size: BS,
    }
}

/// Engine steps as vLLM publishes them: each step stores `per_step` requests' new blocks
/// (`blocks` each, chained) and evicts as many single blocks, keeping the cache bounded.
fn payloads(steps: usize, per_step: usize, blocks: usize) -> (Vec<Vec<u8>>, usize) {
    let mut next = 1u64;
    let mut live: std::collections::VecDeque<u64> = Default::default();
    let mut out = Vec::with_capacity(steps);
    let mut block_events = 0;
    for step in 0..steps {
        let mut events = Vec::new();
        for r in 0..per_step {
            let hashes: Vec<EngineHash> = (0..blocks)
                .map(|_| {
                    next += 1;
                    EngineHash(next.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                })
                .collect();
            live.extend(hashes.iter().map(|h| h.0));
            let tokens = (0..blocks as u32 * BS)
                .map(|t| (t * 7 + step as u32 * 13 + r as u32) % 151_000)
                .collect();
            events.push(EngineEvent::BlockStored(BlockStored {
                block_hashes: hashes,
                token_ids: tokens,
                block_size: BS,
                medium: Some(Medium::Gpu),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..BlockStored::default()
            }));
            block_events += blocks;
        }
        while live.len() > 50_000 {
            let h = live.pop_front().unwrap();
            events.push(EngineEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(h)],
                medium: Some(Medium::Gpu),
                group_idx: Some(0),
            }));
            block_events += 1;
        }
        out.push(encode_batch(
            &EventBatch {
                ts: 1.7e9,
                events,
                dp_rank: Some(0),
            },
            WireFormat::VllmMap,
        ));
    }
    (out, block_events)
}

/// One frame through the path; returns encoded bytes produced.
fn relay(bridge: &mut RankBridge, payload: &[u8], sealed: &mut Vec<Sealed>) -> usize {
    let now = Instant::now();
    bridge.ingest(payload, now).unwrap();
    bridge.seal();
    bridge.take_sealed(sealed);
    let mut bytes = 0;
    for s in sealed.drain(..) {
        bytes += s.envelope.encode().unwrap().len();
    }
    bytes
}

fn bridge() -> RankBridge {
    RankBridge::new(
        source(),
        NormalizerConfig::new("meta-llama/Llama-3.1-8B-Instruct", BS),
        BatchLimits::default(),
        42,
    )
}

fn throughput(per_step: usize, blocks: usize) {
    let (payloads, block_events) = payloads(4000, per_step, blocks);
    let mut b = bridge();
    let mut sealed = Vec::new();
    // Warm up (fills the cache to its steady size).
    for p in &payloads {
        relay(&mut b, p, &mut sealed);
    }
    let mut rounds = 0usize;
    let mut bytes = 0usize;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        // Replays the same steps: after a round the hashes are known, so stores re-key them,
        // exactly the normaliser's per-block work; removals of absent hashes are skipped work, so
        // a fresh bridge is used each round to keep every removal real.
        b = bridge();
        for p in &payloads {
            bytes += relay(&mut b, p, &mut sealed);
        }
        rounds += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let rate = (rounds * block_events) as f64 / secs;
    println!(
        "throughput  steps of {per_step} stores x {blocks} blocks (+ evictions): {:.2} M block events/s, {:.1} MB/s of envelopes ({rounds} rounds, {:.2} s)",
        rate / 1e6,
        bytes as f64 / secs / 1e6,
        secs
    );
}

fn paced_latency(target_block_events_per_s: f64) {
    // Steps of 8 requests x 4 blocks (+ evictions once warm) ≈ 40 block events a frame.
    let (payloads, block_events) = payloads(20_000, 8, 4);
    let per_frame = block_events as f64 / payloads.len() as f64;
    let interval = Duration::from_secs_f64(per_frame / target_block_events_per_s);
    let mut b = bridge();
    let mut sealed = Vec::new();
    let mut lat = Vec::with_capacity(payloads.len());
    let start = Instant::now();
    for (i, p) in payloads.iter().enumerate() {
        let due = start + interval * i as u32;
        while Instant::now() < due {
            std::hint::spin_loop();
        }
        let t = Instant::now();
        relay(&mut b, p, &mut sealed);
        lat.push(t.elapsed());
    }
    lat.sort();
    let q = |f: f64| lat[((lat.len() as f64 * f) as usize).min(lat.len() - 1)];
    println!(
        "paced       {:.0}k block events/s ({per_frame:.0} per frame, {} frames): per-frame decode→encode p50 {:?} p99 {:?} p99.9 {:?} max {:?}",
        target_block_events_per_s / 1e3,
        lat.len(),
        q(0.5),
        q(0.99),
        q(0.999),
        lat[lat.len() - 1]
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    throughput(8, 4);
    throughput(32, 16);
    throughput(1, 1);
    paced_latency(100_000.0);
}
