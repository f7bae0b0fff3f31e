//! One scheduling decision (filter → index lookup → load books → rank → speculate) for a
//! 512-block prompt over 64 endpoints, against an index holding ~1 M residencies (64
//! endpoints × 16,384 blocks: 256 shared 64-block system prompts spread over the pool plus
//! private conversation blocks), with requests in flight everywhere.
//!
//! The prompt shares its first 256 blocks with 6 endpoints (4 in GPU at different depths, 2 in
//! host memory), the rest is new. `kv` runs with speculation on (the default: after the first
//! iteration the primary holds the whole prompt speculatively, as in a sticky conversation)
//! and off; `prefix-only` and `round-robin` are there for comparison.
//!
//! Run: `cargo bench -p kvgate-scheduler --bench schedule`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::net::SocketAddr;
use std::sync::LazyLock;

use divan::Bencher;
use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{EndpointId, Holder, IndexConfig, KvIndex};
use scheduler::{
    Endpoint, InflightTracker, LoadBook, Millis, Policy, ScheduleRequest, Scheduler,
    SchedulerConfig,
};

const ENDPOINTS: u32 = 64;
const PROMPT: usize = 512;
const SHARED: usize = 256;
const PREFIXES: u64 = 256;
const PREFIX_LEN: usize = 64;
const PRIVATE_PER_ENDPOINT: usize = 16_384 - 4 * PREFIX_LEN * PREFIXES as usize / 64;

fn main() {
    divan::main();
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn keys(stream: u64, len: usize) -> Vec<BlockKey> {
    (0..len as u64)
        .map(|i| BlockKey(mix(stream.wrapping_mul(0x1_0000_0001) ^ i)))
        .collect()
}

fn ep(i: u32) -> EndpointId {
    EndpointId::new(i).unwrap()
}

fn store(index: &KvIndex, i: u32, keys: &[BlockKey], tier: Tier) {
    index.apply(
        Holder::Endpoint(ep(i)),
        &[KvEvent::Stored {
            keys: keys.to_vec(),
            parent: None,
            tier,
            lora: None,
            token_count: 16,
        }],
    );
}

struct World {
    endpoints: Vec<Endpoint>,
    index: KvIndex,
    inflight: InflightTracker,
    loads: LoadBook,
    prompt: Vec<BlockKey>,
}

static WORLD: LazyLock<World> = LazyLock::new(|| {
    let index = KvIndex::new(IndexConfig::default()).unwrap();
    let inflight = InflightTracker::new();
    let endpoints = (0..ENDPOINTS)
        .map(|i| {
            let addr = SocketAddr::from(([10, 1, (i / 200) as u8, (i % 200) as u8 + 1], 8000));
            Endpoint::new(ep(i), addr)
        })
        .collect();
    // Each shared prefix lives on 4 endpoints.
    for p in 0..PREFIXES {
        let k = keys(1_000_000 + p, PREFIX_LEN);
        for r in 0..4 {
            store(
                &index,
                ((p * 4 + r) % u64::from(ENDPOINTS)) as u32,
                &k,
                Tier::Gpu,
            );
        }
    }
    for i in 0..ENDPOINTS {
        store(
            &index,
            i,
            &keys(2_000_000 + u64::from(i), PRIVATE_PER_ENDPOINT),
            Tier::Gpu,
        );
        for r in 0..(i % 5) {
            let t = inflight.on_routed(ep(i), 128, 32, 16);
            if r % 2 == 0 {
                inflight.on_first_token(t);
            }
        }
    }
    let mut prompt = keys(7, SHARED);
    prompt.extend(keys(8, PROMPT - SHARED));
    for (i, depth) in [(3, 256), (17, 192), (29, 128), (41, 64)] {
        store(&index, i, &prompt[..depth], Tier::Gpu);
    }
    for i in [50, 60] {
        store(&index, i, &prompt[..SHARED], Tier::Host);
    }
    World {
        endpoints,
        index,
        inflight,
        loads: LoadBook::new(),
        prompt,
    }
});

fn run(bencher: Bencher<'_, '_>, config: SchedulerConfig) {
    let w = &*WORLD;
    let s = Scheduler::new(config, 1).unwrap();
    let mut now = 0;
    bencher.bench_local(|| {
        now += 1;
        let req = ScheduleRequest {
            keys: &w.prompt,
            prompt_tokens: (PROMPT * 16) as u32,
            prompt_blocks: None,
            model: "m",
            subset: None,
            now: Millis(now),
            timed: false,
        };
        s.schedule(&req, &w.endpoints, &w.index, &w.inflight, &w.loads)
            .unwrap()
    });
}

#[divan::bench]
fn kv(bencher: Bencher<'_, '_>) {
    run(bencher, SchedulerConfig::default());
}

#[divan::bench]
fn kv_no_speculation(bencher: Bencher<'_, '_>) {
    let mut c = SchedulerConfig::default();
    c.speculation.enabled = false;
    run(bencher, c);
}

#[divan::bench]
fn prefix_only(bencher: Bencher<'_, '_>) {
    let c = SchedulerConfig {
        policy: Policy::PrefixOnly,
        ..SchedulerConfig::default()
    };
    run(bencher, c);
}

#[divan::bench]
fn round_robin(bencher: Bencher<'_, '_>) {
    let c = SchedulerConfig {
        policy: Policy::RoundRobin,
        ..SchedulerConfig::default()
    };
    run(bencher, c);
}
