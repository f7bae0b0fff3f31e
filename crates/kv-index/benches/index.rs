//! The index's target benchmarks, in one seeded binary that prints percentiles (divan reports
//! means, the targets are percentiles). Sizes come from env vars, defaulting to the targets':
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `KVGATE_BENCH_APPLY_EVENTS` | 10000000 | block events in the apply run |
//! | `KVGATE_BENCH_SOURCES` | 256 | sources (= endpoints) |
//! | `KVGATE_BENCH_ENTRIES` | 10000000 | resident (block, holder) entries for lookups |
//! | `KVGATE_BENCH_PROMPT` | 512 | keys per looked-up prompt |
//! | `KVGATE_BENCH_PREFIXES` | 1024 | shared system-prompt prefixes (64 keys each) |
//! | `KVGATE_BENCH_LOOKUPS` | 20000 | timed lookups per phase |
//! | `KVGATE_BENCH_WRITER_RATE` | 1000000 | block events/s the background writer is paced at |
//! | `KVGATE_BENCH_WRITER_SECS` | 2 | least seconds of lookups under the writer |
//! | `KVGATE_BENCH_NAIVE` | 1 | also run the naive model (0: skip) |
//! | `KVGATE_BENCH_SPEC_CALLS` | 20000 | `speculate` calls in the speculation run |
//! | `KVGATE_BENCH_SHARDS` | the index's default | shards of every index built (also the mooncake bench) |
//! | `KVGATE_BENCH_GROW_ENTRIES` | 10000000 | blocks written in the growth run |
//! | `KVGATE_BENCH_GROW_HOLDERS` | 1 | endpoints the growth run's batches go to, in turn |
//!
//! Memory is counted by a wrapping global allocator: bytes live after building the index
//! minus bytes live before, per resident (block, holder) entry.
//!
//! Run: `cargo bench -p kvgate-kv-index --bench index` (`-- apply`, `-- lookup`,
//! `-- speculate` or `-- grow` for one).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cap::Cap;
use common::{Rng, env_usize, index_config, mix, percentiles, report};
use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{EndpointId, Holder, KvIndex};
use mimalloc::MiMalloc;

const SHARED_LEN: usize = 64;

/// Counts live heap bytes (for the memory figure), over the EPP's allocator (mimalloc), the one
/// the index runs on in production.
#[global_allocator]
static ALLOC: Cap<MiMalloc> = Cap::new(MiMalloc, usize::MAX);

fn ep(i: usize) -> EndpointId {
    EndpointId::new(i as u32).unwrap()
}

fn stored(keys: Vec<BlockKey>) -> KvEvent {
    KvEvent::Stored {
        keys,
        parent: None,
        tier: Tier::Gpu,
        lora: None,
        token_count: 256,
    }
}

/// Per source: store 16 fresh keys, and once past a 4096-key window remove the 16 oldest.
fn apply_workload(sources: usize, events: usize, seed: u64) -> Vec<(Holder, Vec<KvEvent>)> {
    let mut rng = Rng::new(seed);
    let mut next = vec![0u64; sources];
    let mut out = Vec::new();
    let mut n = 0;
    while n < events {
        let s = rng.below(sources as u64) as usize;
        let base = next[s];
        let keys: Vec<BlockKey> = (base..base + 16)
            .map(|i| BlockKey(mix(s as u64, i)))
            .collect();
        let mut evs = vec![stored(keys)];
        n += 16;
        if base >= 4096 {
            let old: Vec<BlockKey> = (base - 4096..base - 4080)
                .map(|i| BlockKey(mix(s as u64, i)))
                .collect();
            evs.push(KvEvent::Removed {
                keys: old,
                tier: Tier::Gpu,
            });
            n += 16;
        }
        next[s] += 16;
        out.push((Holder::Endpoint(ep(s)), evs));
    }
    out
}

fn bench_apply() {
    let sources = env_usize("KVGATE_BENCH_SOURCES", 256);
    let events = env_usize("KVGATE_BENCH_APPLY_EVENTS", 10_000_000);
    let work = apply_workload(sources, events, 1);
    let total: usize = work
        .iter()
        .flat_map(|(_, e)| e)
        .map(KvEvent::key_count)
        .sum();
    let idx = KvIndex::new(index_config(1 << 30)).unwrap();
    let t = Instant::now();
    for (h, evs) in &work {
        idx.apply(*h, evs);
    }
    let dt = t.elapsed();
    let rate = total as f64 / dt.as_secs_f64();
    report(&format!(
        "apply: {total} block events from {sources} sources in {:.3} s = {:.2} M events/s (resident at end: {})",
        dt.as_secs_f64(),
        rate / 1e6,
        idx.stats().residencies
    ));
    if env_usize("KVGATE_BENCH_NAIVE", 1) != 0 {
        let mut model = support::Model::default();
        let t = Instant::now();
        for (h, evs) in &work {
            model.apply(*h, evs);
        }
        let nrate = total as f64 / t.elapsed().as_secs_f64();
        report(&format!(
            "apply naive model: {:.2} M events/s (index/naive = {:.1}x)",
            nrate / 1e6,
            rate / nrate
        ));
    }
}

struct Population {
    /// Every resident chain: (endpoint, keys).
    chains: Vec<(usize, Vec<BlockKey>)>,
}

/// Chains of `prompt` keys: a shared 64-key system prompt (one of `prefixes`) then a suffix
/// unique to the chain, spread over endpoints until `entries` residencies exist.
fn population(
    endpoints: usize,
    entries: usize,
    prompt: usize,
    prefixes: usize,
    seed: u64,
) -> Population {
    let mut rng = Rng::new(seed);
    let mut chains = Vec::new();
    let mut n = 0;
    let mut id = 0u64;
    while n < entries {
        let e = chains.len() % endpoints;
        let p = rng.below(prefixes as u64);
        let keys: Vec<BlockKey> = (0..prompt)
            .map(|i| {
                if i < SHARED_LEN {
                    BlockKey(mix(p, i as u64))
                } else {
                    // Bit 50: `mix` rotates the index into bits 32 and up, and with bit 40
                    // the suffix keys 256..320 of chains 0..1024 were the shared prefixes'
                    // keys (5% of the chains then had 64 blocks shared mid-suffix).
                    BlockKey(mix(1 << 50 | id, i as u64))
                }
            })
            .collect();
        id += 1;
        n += prompt;
        chains.push((e, keys));
    }
    Population { chains }
}

/// Times lookups of random resident prompts: at least `n`, and for at least `min` wall time.
fn time_lookups(
    idx: &KvIndex,
    pop: &Population,
    cands: &[EndpointId],
    n: usize,
    min: Duration,
    seed: u64,
) -> Vec<Duration> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(cands.len());
    let mut samples = Vec::with_capacity(n);
    let mut sink = 0u64;
    let mut keys = Vec::new();
    let start = Instant::now();
    while samples.len() < n || start.elapsed() < min {
        // The EPP looks a prompt up right after hashing its keys, so they are in cache: copy
        // them into one reused buffer first (not timed) rather than read them cold from the
        // 80 MB population.
        keys.clear();
        keys.extend_from_slice(&pop.chains[rng.below(pop.chains.len() as u64) as usize].1);
        out.clear();
        let t = Instant::now();
        idx.find_matches_into(&keys, cands, &mut out);
        samples.push(t.elapsed());
        sink += out
            .iter()
            .map(|o| u64::from(o.reach(Tier::Gpu)))
            .sum::<u64>();
    }
    assert!(sink > 0);
    samples
}

fn bench_lookup() {
    let endpoints = env_usize("KVGATE_BENCH_SOURCES", 256);
    let entries = env_usize("KVGATE_BENCH_ENTRIES", 10_000_000);
    let prompt = env_usize("KVGATE_BENCH_PROMPT", 512);
    let prefixes = env_usize("KVGATE_BENCH_PREFIXES", 1024);
    let lookups = env_usize("KVGATE_BENCH_LOOKUPS", 20_000);
    let pop = population(endpoints, entries, prompt, prefixes, 2);
    let mem0 = ALLOC.allocated();
    let idx = Arc::new(KvIndex::new(index_config(1 << 30)).unwrap());
    let t = Instant::now();
    // The longest single `apply`: where a shard's table doubles under its exclusive lock,
    // which every lookup needing that shard waits for (or where the host stalled the thread).
    let mut longest = Duration::ZERO;
    for (e, keys) in &pop.chains {
        let event = [stored(keys.clone())];
        let one = Instant::now();
        idx.apply(Holder::Endpoint(ep(*e)), &event);
        longest = longest.max(one.elapsed());
    }
    let build = t.elapsed();
    let st = idx.stats();
    let mem = ALLOC.allocated().saturating_sub(mem0);
    let per_entry = mem as f64 / st.residencies as f64;
    report(&format!(
        "build: {} residencies, {} blocks in {:.2} s (longest apply {:.1} ms, {} shards); memory: allocator {} MB live = {:.1} B/residency (tables' own estimate {:.1} B)",
        st.residencies,
        st.blocks,
        build.as_secs_f64(),
        longest.as_secs_f64() * 1e3,
        index_config(0).shards,
        mem >> 20,
        per_entry,
        st.heap_bytes as f64 / st.residencies as f64
    ));
    let cands: Vec<EndpointId> = (0..endpoints).map(ep).collect();
    time_lookups(&idx, &pop, &cands, lookups / 10, Duration::ZERO, 3); // warm-up
    let mut s = time_lookups(&idx, &pop, &cands, lookups, Duration::ZERO, 4);
    let (p50, p99, max) = percentiles(&mut s);
    let p50_idle = p50;
    report(&format!(
        "lookup: {prompt}-key resident prompt vs {endpoints} endpoints, {} residencies: p50 {:.2} us, p99 {:.2} us, max {:.1} us ({} lookups)",
        st.residencies,
        p50 as f64 / 1e3,
        p99 as f64 / 1e3,
        max as f64 / 1e3,
        s.len()
    ));

    // The same lookups while a writer thread applies `rate` block events/s: paced by the
    // clock (it sleeps whenever ahead, so it catches up in short bursts, as an event thread
    // would; it never spins), its achieved rate reported.
    let rate = env_usize("KVGATE_BENCH_WRITER_RATE", 1_000_000) as u64;
    let secs = env_usize("KVGATE_BENCH_WRITER_SECS", 2) as u64;
    let stop = Arc::new(AtomicBool::new(false));
    let applied = Arc::new(AtomicU64::new(0));
    let work = apply_workload(endpoints, 4_000_000, 5);
    let writer = {
        let (idx, stop, applied) = (Arc::clone(&idx), Arc::clone(&stop), Arc::clone(&applied));
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut done = 0u64;
            'run: for (h, evs) in work.iter().cycle() {
                let due = Duration::from_nanos(done * 1_000_000_000 / rate.max(1));
                loop {
                    if stop.load(Ordering::Relaxed) {
                        break 'run;
                    }
                    match due.checked_sub(start.elapsed()) {
                        Some(ahead) if !ahead.is_zero() => std::thread::sleep(ahead),
                        _ => break,
                    }
                }
                idx.apply(*h, evs);
                done += evs.iter().map(KvEvent::key_count).sum::<usize>() as u64;
                applied.store(done, Ordering::Relaxed);
            }
            start.elapsed()
        })
    };
    // Let the writer reach its pace, then time.
    std::thread::sleep(Duration::from_millis(100));
    let before = (applied.load(Ordering::Relaxed), Instant::now());
    let mut s = time_lookups(&idx, &pop, &cands, lookups, Duration::from_secs(secs), 6);
    let during = applied.load(Ordering::Relaxed) - before.0;
    let achieved = during as f64 / before.1.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let (p50, p99, max) = percentiles(&mut s);
    report(&format!(
        "lookup under writer (paced at {:.2} M events/s, achieved {:.2} M/s = {:.0}%{}): p50 {:.2} us, p99 {:.2} us, max {:.1} us ({} lookups)",
        rate as f64 / 1e6,
        achieved / 1e6,
        100.0 * achieved / rate as f64,
        if achieved < 0.95 * rate as f64 {
            ", BELOW TARGET RATE"
        } else {
            ""
        },
        p50 as f64 / 1e3,
        p99 as f64 / 1e3,
        max as f64 / 1e3,
        s.len()
    ));

    if env_usize("KVGATE_BENCH_NAIVE", 1) != 0 {
        let mem0 = ALLOC.allocated();
        let t = Instant::now();
        let mut model = support::Model::default();
        for (e, keys) in &pop.chains {
            model.apply(Holder::Endpoint(ep(*e)), &[stored(keys.clone())]);
        }
        let build_naive = t.elapsed();
        let mem_naive = ALLOC.allocated().saturating_sub(mem0);
        let mut rng = Rng::new(4);
        let mut ns = Vec::new();
        for _ in 0..(lookups / 20).max(10) {
            let (_, keys) = &pop.chains[rng.below(pop.chains.len() as u64) as usize];
            let t = Instant::now();
            let r: u32 = cands.iter().map(|&c| model.find(keys, c)[0]).sum();
            ns.push(t.elapsed());
            assert!(r > 0);
        }
        let (np50, np99, _) = percentiles(&mut ns);
        let naive_entry = mem_naive as f64 / st.residencies as f64;
        report(&format!(
            "naive model: build {:.2} s, memory {:.1} B/residency (naive/index = {:.1}x), lookup p50 {:.1} us, p99 {:.1} us (naive/index p50 = {:.1}x)",
            build_naive.as_secs_f64(),
            naive_entry,
            naive_entry / per_entry,
            np50 as f64 / 1e3,
            np99 as f64 / 1e3,
            np50 as f64 / p50_idle.max(1) as f64
        ));
    }
}

/// What a routed request's speculation costs: `speculate` of a new 128-key chain on one of 256
/// endpoints per call, 250 calls per virtual second, a 2 s TTL, `expire` every half second (as
/// the EPP's upkeep does), over an index already holding ~1 M residencies. Reports the calls'
/// percentiles and the mean per key, and `expire`'s mean per entry.
fn bench_speculate() {
    let endpoints = env_usize("KVGATE_BENCH_SOURCES", 256);
    let calls = env_usize("KVGATE_BENCH_SPEC_CALLS", 20_000);
    const KEYS: usize = 128;
    let idx = KvIndex::new(index_config(1 << 30)).unwrap();
    let pop = population(endpoints, 1 << 20, 512, 1024, 7);
    for (e, keys) in &pop.chains {
        idx.apply(Holder::Endpoint(ep(*e)), &[stored(keys.clone())]);
    }
    let mut rng = Rng::new(8);
    let ttl = kv_index::Millis(2_000);
    let mut samples = Vec::with_capacity(calls);
    let (mut expired, mut expire_time) = (0usize, Duration::ZERO);
    let mut keys = Vec::with_capacity(KEYS);
    for c in 0..calls {
        let now = kv_index::Millis(c as u64 * 4);
        if c % 125 == 0 {
            let t = Instant::now();
            expired += idx.expire(now);
            expire_time += t.elapsed();
        }
        let seed = rng.next();
        keys.clear();
        keys.extend((0..KEYS as u64).map(|i| BlockKey(mix(seed, i))));
        let e = ep(rng.below(endpoints as u64) as usize);
        let t = Instant::now();
        idx.speculate(e, &keys, now, ttl);
        samples.push(t.elapsed());
    }
    let total: Duration = samples.iter().sum();
    let (p50, p99, max) = percentiles(&mut samples);
    report(&format!(
        "speculate: {KEYS}-key chains, {calls} calls: p50 {:.1} us, p99 {:.1} us, max {:.1} us per call; mean {:.0} ns per key; expire {:.0} ns per entry ({expired} entries)",
        p50 as f64 / 1e3,
        p99 as f64 / 1e3,
        max as f64 / 1e3,
        total.as_nanos() as f64 / (calls * KEYS) as f64,
        expire_time.as_nanos() as f64 / expired.max(1) as f64,
    ));
}

/// Lookups while the index grows from empty: one thread writes `KVGATE_BENCH_GROW_ENTRIES`
/// new blocks in 32-key batches while another looks up one resident 512-key prompt without
/// pause. Run twice, the blocks written as stores (`apply`: tables grow from a copy built under
/// the shared lock) and as speculation (`speculate`: tables double in place under the
/// exclusive lock, as every writer did before), so the lookup tail shows what a doubling costs
/// the request path each way.
fn bench_grow() {
    let entries = env_usize("KVGATE_BENCH_GROW_ENTRIES", 10_000_000);
    let holders = env_usize("KVGATE_BENCH_GROW_HOLDERS", 1).max(1);
    let prompt: Vec<BlockKey> = (0..512u64).map(|i| BlockKey(mix(i, 0xFEED))).collect();
    let cands = [ep(0), ep(1)];
    for mode in ["stores (apply)", "speculation"] {
        let idx = Arc::new(KvIndex::new(index_config(1 << 30)).unwrap());
        idx.apply(Holder::Endpoint(ep(0)), &[stored(prompt.clone())]);
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (idx, stop, prompt) = (Arc::clone(&idx), Arc::clone(&stop), prompt.clone());
            std::thread::spawn(move || {
                let mut samples = Vec::new();
                let mut out = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    out.clear();
                    let t = Instant::now();
                    idx.find_matches_into(&prompt, &cands, &mut out);
                    samples.push(t.elapsed());
                    assert_eq!(out[0].reach(Tier::Gpu), 512);
                }
                samples
            })
        };
        let t = Instant::now();
        let mut key = 0u64;
        while (key as usize) < entries {
            let keys: Vec<BlockKey> = (key..key + 32).map(|k| BlockKey(mix(k, 7))).collect();
            let writer = ep(1 + (key as usize / 32) % holders);
            key += 32;
            if mode == "speculation" {
                idx.speculate(
                    writer,
                    &keys,
                    kv_index::Millis(0),
                    kv_index::Millis(u64::MAX / 2),
                );
            } else {
                idx.apply(Holder::Endpoint(writer), &[stored(keys)]);
            }
        }
        let build = t.elapsed();
        stop.store(true, Ordering::Relaxed);
        let mut s = reader.join().unwrap();
        let n = s.len();
        s.sort_unstable();
        let p999 = s[(n * 999 / 1000).min(n - 1)].as_nanos();
        let over_ms = s.iter().filter(|d| d.as_micros() >= 1000).count();
        let (p50, p99, max) = percentiles(&mut s);
        let st = idx.stats();
        report(&format!(
            "grow, {mode}, {holders} writer endpoint(s): {} blocks written in {:.2} s while looking up a resident 512-key prompt: p50 {:.2} us, p99 {:.2} us, p99.9 {:.1} us, max {:.1} ms, {over_ms} over 1 ms ({n} lookups); table growths: {} in place, {} from a copy",
            st.blocks - 512,
            build.as_secs_f64(),
            p50 as f64 / 1e3,
            p99 as f64 / 1e3,
            p999 as f64 / 1e3,
            max as f64 / 1e6,
            st.table_growths_blocking,
            st.table_growths_shared,
        ));
    }
}

fn main() {
    if !common::bench_requested() {
        return;
    }
    let which = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_default();
    if which.is_empty() || which == "apply" {
        bench_apply();
    }
    if which.is_empty() || which == "lookup" {
        bench_lookup();
    }
    if which.is_empty() || which == "speculate" {
        bench_speculate();
    }
    if which.is_empty() || which == "grow" {
        bench_grow();
    }
}
