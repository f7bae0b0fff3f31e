//! Replays the Mooncake conversation trace against 16 simulated engines and times the index.
//!
//! Each 512-token `hash_id` expands to 32 chained 16-token block keys (the prompt's full
//! blocks only). Each engine is an LRU cache of `KVGATE_BENCH_ENGINE_BLOCKS` blocks (default
//! 32768), simulated with [`kv_index::ApproxTracker`] (no TTL), whose `Stored`/`Removed`
//! events are applied to the index as the engine's own would be. Two routing policies run on
//! the same trace: `index` (longest GPU prefix, among engines within 1.25× the mean of the
//! last 256 assignments) and `rr` (round-robin).
//!
//! The trace is found at `$KVGATE_SHARED/traces/mooncake_conversation_trace.jsonl`, else at
//! `../../../shared/traces/…` from this crate. Run:
//! `cargo bench -p kvgate-kv-index --bench mooncake`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{env_usize, index_config, mix, percentiles, report};
use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{ApproxTracker, EndpointId, Holder, IndexConfig, KvIndex, Millis};

const ENGINES: usize = 16;
const SUB_BLOCKS: u64 = 32;

fn trace_path() -> PathBuf {
    let shared = std::env::var_os("KVGATE_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    shared.join("traces/mooncake_conversation_trace.jsonl")
}

fn load() -> Vec<Vec<BlockKey>> {
    let path = trace_path();
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!(
            "mooncake bench: trace not found at {} (set KVGATE_SHARED to the shared folder)",
            path.display()
        );
        std::process::exit(2);
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON row");
            let input = v["input_length"].as_u64().unwrap_or(0);
            let full = (input / 16) as usize;
            let mut prev = 0x6B76_6761_7465_u64;
            let mut keys = Vec::with_capacity(full);
            'ids: for id in v["hash_ids"].as_array().into_iter().flatten() {
                let id = id.as_u64().unwrap_or(0);
                for sub in 0..SUB_BLOCKS {
                    if keys.len() >= full {
                        break 'ids;
                    }
                    prev = mix(prev, id * SUB_BLOCKS + sub);
                    keys.push(BlockKey(prev));
                }
            }
            keys
        })
        .collect()
}

fn replay(prompts: &[Vec<BlockKey>], policy: &str, capacity: usize) {
    let idx = KvIndex::new(index_config(IndexConfig::default().capacity)).unwrap();
    let mut engines = ApproxTracker::new(Millis(u64::MAX / 4), capacity);
    let cands: Vec<EndpointId> = (0..ENGINES as u32)
        .map(|e| EndpointId::new(e).unwrap())
        .collect();
    let mut recent: VecDeque<usize> = VecDeque::new();
    let mut load = [0usize; ENGINES];
    let (mut lookups, mut applies) = (Vec::new(), Duration::ZERO);
    let (mut events, mut hit, mut total) = (0usize, 0u64, 0u64);
    let mut out = Vec::new();
    for (i, keys) in prompts.iter().enumerate() {
        out.clear();
        let t = Instant::now();
        idx.find_matches_into(keys, &cands, &mut out);
        lookups.push(t.elapsed());
        let chosen = if policy == "rr" {
            i % ENGINES
        } else {
            let cap = (recent.len() as f64 / ENGINES as f64 * 1.25).ceil() as usize + 1;
            (0..ENGINES)
                .map(|j| (i + j) % ENGINES)
                .filter(|&e| load[e] <= cap)
                .max_by_key(|&e| {
                    (
                        out[e].reach(Tier::Gpu),
                        ENGINES - ((e + ENGINES - i % ENGINES) % ENGINES),
                    )
                })
                .unwrap_or(i % ENGINES)
        };
        hit += u64::from(out[chosen].reach(Tier::Gpu));
        total += keys.len() as u64;
        recent.push_back(chosen);
        load[chosen] += 1;
        if recent.len() > 256 {
            let e = recent.pop_front().unwrap();
            load[e] -= 1;
        }
        let evs = engines.record_route(cands[chosen], keys, Millis(i as u64));
        events += evs.iter().map(KvEvent::key_count).sum::<usize>();
        let t = Instant::now();
        idx.apply(Holder::Endpoint(cands[chosen]), &evs);
        applies += t.elapsed();
    }
    let (p50, p99, max) = percentiles(&mut lookups);
    let st = idx.stats();
    report(&format!(
        "mooncake {policy}: {} requests, {total} prompt blocks, GPU prefix hit rate {:.1}%; lookup p50 {:.2} us, p99 {:.2} us, max {:.1} us; \
         apply {events} block events at {:.2} M/s; resident at end {} (blocks {})",
        prompts.len(),
        100.0 * hit as f64 / total.max(1) as f64,
        p50 as f64 / 1e3,
        p99 as f64 / 1e3,
        max as f64 / 1e3,
        events as f64 / applies.as_secs_f64().max(1e-9) / 1e6,
        st.residencies,
        st.blocks
    ));
}

fn main() {
    if !common::bench_requested() {
        return;
    }
    let prompts = load();
    let capacity = env_usize("KVGATE_BENCH_ENGINE_BLOCKS", 32768);
    report(&format!(
        "mooncake: {} prompts, {ENGINES} engines × {capacity} blocks of 16 tokens",
        prompts.len()
    ));
    for policy in ["index", "rr"] {
        replay(&prompts, policy, capacity);
    }
}
