//! Property: stopping keying at the first key no endpoint holds leaves the decision unchanged.
//!
//! For random index states (prefixes of the prompt's chain and stray keys of it, on random
//! endpoints and tiers, some speculated), random chunkings of the keys and random loads and
//! in-flight work, the scheduler's decision over the keys [`StopRule`] stopped at, chunks found
//! in the segment cache at random (they are keyed without a probe) (with the
//! full block count given as `prompt_blocks`) equals its decision over every key, on an
//! identical index with an identically seeded scheduler.
#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{EndpointId, Holder, IndexConfig, KvIndex, Millis};
use proptest::prelude::*;
use scheduler::{
    Endpoint, EngineLoad, InflightTracker, LoadBook, Policy, Role, ScheduleRequest, Scheduler,
    SchedulerConfig,
};

use super::keys::StopRule;

#[derive(Debug, Clone)]
struct State {
    endpoints: u32,
    prompt: Vec<BlockKey>,
    /// (endpoint, from, to, tier index, speculated): a run of the prompt's keys it holds.
    runs: Vec<(u32, usize, usize, usize, bool)>,
    chunks: Vec<usize>,
    /// Whether each chunk (cycled with `chunks`) is in the segment cache.
    cached: Vec<bool>,
    loads: Vec<(u32, u32, u32)>,
    inflight: Vec<(u32, u32)>,
    policy: usize,
    prefill: bool,
    seed: u64,
}

fn state() -> impl Strategy<Value = State> {
    (1u32..7, 0usize..48).prop_flat_map(|(endpoints, len)| {
        let runs = prop::collection::vec(
            (0..endpoints, 0..=len, 0..=len, 0usize..4, any::<bool>()),
            0..10,
        );
        let loads = prop::collection::vec((0..endpoints, 0u32..8, 0u32..4), 0..6);
        let inflight = prop::collection::vec((0..endpoints, 0u32..64), 0..6);
        (
            Just(endpoints),
            prop::collection::vec(any::<u64>(), len),
            runs,
            prop::collection::vec(1usize..9, 1..12),
            prop::collection::vec(any::<bool>(), 1..12),
            loads,
            inflight,
            0usize..2,
            any::<bool>(),
            any::<u64>(),
        )
            .prop_map(
                |(endpoints, raw, runs, chunks, cached, loads, inflight, policy, prefill, seed)| {
                    State {
                        endpoints,
                        prompt: raw.into_iter().map(BlockKey).collect(),
                        runs,
                        chunks,
                        cached,
                        loads,
                        inflight,
                        policy,
                        prefill,
                        seed,
                    }
                },
            )
    })
}

fn id(i: u32) -> EndpointId {
    EndpointId::new(i).unwrap()
}

const TIERS: [Tier; 4] = [Tier::Gpu, Tier::Host, Tier::Disk, Tier::Remote];

/// The index, scheduler and books a decision runs against, built afresh from `s`.
fn world(s: &State) -> (KvIndex, Scheduler, InflightTracker, LoadBook, Vec<Endpoint>) {
    let index = KvIndex::new(IndexConfig::default()).unwrap();
    for &(e, a, b, tier, spec) in &s.runs {
        let (from, to) = (a.min(b), a.max(b));
        let keys = s.prompt[from..to].to_vec();
        if keys.is_empty() {
            continue;
        }
        if spec {
            index.speculate(id(e), &keys, Millis(0), Millis(60_000));
        } else {
            let stored = KvEvent::Stored {
                keys,
                parent: None,
                tier: TIERS[tier],
                lora: None,
                token_count: 0,
            };
            index.apply(Holder::Endpoint(id(e)), &[stored]);
        }
    }
    let mut config = SchedulerConfig {
        policy: [Policy::Kv, Policy::PrefixOnly][s.policy],
        ..SchedulerConfig::default()
    };
    config.disaggregation.enabled = s.prefill;
    config.disaggregation.min_uncached_blocks = 2;
    let scheduler = Scheduler::new(config, s.seed).unwrap();
    let endpoints: Vec<Endpoint> = (0..s.endpoints)
        .map(|i| {
            let mut e = Endpoint::new(id(i), format!("10.0.0.{i}:8000").parse().unwrap());
            if s.prefill && i == 0 && s.endpoints > 1 {
                e.role = Role::Prefill;
            }
            e
        })
        .collect();
    let loads = LoadBook::new();
    for &(e, waiting, running) in &s.loads {
        loads.record(
            id(e),
            EngineLoad {
                waiting,
                running,
                kv_usage: 0.5,
                at: Millis(0),
            },
        );
    }
    let inflight = InflightTracker::new();
    for &(e, blocks) in &s.inflight {
        let _ = inflight.on_routed(id(e), blocks, blocks / 2, 4);
    }
    (index, scheduler, inflight, loads, endpoints)
}

/// How many keys early stopping computes: chunk by chunk, a chunk missing from the cache only
/// after [`StopRule`] says go on.
fn keys_computed(s: &State, index: &KvIndex, candidates: &[EndpointId]) -> usize {
    let mut held = |key: BlockKey| {
        index
            .find_matches(&[key], candidates)
            .iter()
            .any(|o| o.reach(Tier::Remote) > 0)
    };
    let mut rule = StopRule::default();
    let mut n = 0;
    let mut chunks = s.chunks.iter().zip(s.cached.iter().cycle()).cycle();
    while n < s.prompt.len() {
        let (step, cached) = chunks.next().map_or((1, false), |(&c, &h)| (c, h));
        if !cached && !rule.may_tokenize(&s.prompt[..n], &mut held) {
            break;
        }
        n = (n + step).min(s.prompt.len());
    }
    n
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn early_stop_leaves_the_decision_unchanged(s in state()) {
        let (index, scheduler, inflight, loads, endpoints) = world(&s);
        let candidates: Vec<EndpointId> = endpoints.iter().map(|e| e.id).collect();
        let n = keys_computed(&s, &index, &candidates);
        let tokens = u32::try_from(s.prompt.len() * 16 + 5).unwrap();
        let blocks = u32::try_from(s.prompt.len()).unwrap();
        let full = ScheduleRequest {
            keys: &s.prompt,
            prompt_tokens: tokens,
            prompt_blocks: None,
            model: "",
            subset: None,
            now: Millis(1),
            timed: false,
        };
        let want = scheduler.schedule(&full, &endpoints, &index, &inflight, &loads);

        let (index2, scheduler2, inflight2, loads2, endpoints2) = world(&s);
        let early = ScheduleRequest {
            keys: &s.prompt[..n],
            prompt_blocks: Some(blocks),
            ..full
        };
        let got = scheduler2.schedule(&early, &endpoints2, &index2, &inflight2, &loads2);
        prop_assert_eq!(got, want, "stopped after {} of {} keys", n, s.prompt.len());
    }
}

/// The generator reaches both outcomes: some states stop early, some key everything.
#[test]
fn the_states_cover_early_and_full_keying() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut early, mut full) = (0, 0);
    for _ in 0..300 {
        let s = state().new_tree(&mut runner).unwrap().current();
        let (index, _, _, _, endpoints) = world(&s);
        let candidates: Vec<EndpointId> = endpoints.iter().map(|e| e.id).collect();
        let n = keys_computed(&s, &index, &candidates);
        if n < s.prompt.len() {
            early += 1;
        } else if n > 0 {
            full += 1;
        }
    }
    assert!(early > 30 && full > 30, "early {early}, full {full}");
}
