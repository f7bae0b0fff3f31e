//! Random interleavings of add, step, abort and reset on small engines (few blocks, so
//! preemption and eviction happen; shared prefixes, so hits and duplicates happen), checked
//! after every operation against a model rebuilt from the engine's own outputs and events.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::HashMap;

use engine_model::{
    CacheEvent, Engine, EngineConfig, KvTransfer, Lookup, LookupRequest, Nanos, NewRequest,
    Offload, OffloadTier, Preset, RequestId, Sources, StepOutput, XxhChain,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add {
        prefix: usize,
        suffix: Vec<u32>,
        output_len: usize,
        transfer: u8,
        remote_tokens: u32,
        delay: Nanos,
    },
    Step,
    Abort(usize),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (
            0..4usize,
            prop::collection::vec(0..6u32, 0..7),
            1..6usize,
            0..6u8,
            0..16u32,
            prop_oneof![4 => Just(0u64), 1 => 0..20_000_000u64],
        )
            .prop_map(|(prefix, suffix, output_len, transfer, remote_tokens, delay)| Op::Add {
                prefix,
                suffix,
                output_len,
                transfer,
                remote_tokens,
                delay,
            }),
        6 => Just(Op::Step),
        1 => (0..8usize).prop_map(Op::Abort),
        1 => Just(Op::Reset),
    ]
}

#[derive(Debug, Clone)]
struct Setup {
    block_size: u32,
    blocks: u32,
    seqs: u32,
    budget: u32,
    threshold: u32,
    caching: bool,
    /// Host-tier blocks (0: no offloading).
    host: u32,
    /// Without a host tier: offload to [`InStepTier`] instead.
    in_step_tier: bool,
}

/// A tier as kvgate's connector uses the node's block manager: it keeps every block offloaded
/// to it, finds the leading ones held, and loads them in the step that schedules the request.
#[derive(Debug, Default)]
struct InStepTier {
    held: std::collections::HashSet<u64>,
}

impl OffloadTier for InStepTier {
    fn offload(&mut self, b: Offload<'_>, _events: &mut Vec<CacheEvent>) {
        self.held.extend(b.hashes.iter().copied());
    }

    fn lookup(&mut self, r: LookupRequest<'_>) -> Lookup {
        let host = r
            .hashes
            .iter()
            .take_while(|h| self.held.contains(h))
            .count();
        Lookup::Found(Sources {
            host,
            ..Sources::default()
        })
    }

    fn loads_in_step(&self, _sources: &Sources) -> bool {
        true
    }

    fn clear(&mut self) {}

    fn len(&self) -> usize {
        0
    }

    fn hashes(&self) -> Vec<u64> {
        Vec::new()
    }
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        prop_oneof![Just(2u32), Just(4u32)],
        5..14u32,
        1..5u32,
        4..20u32,
        prop_oneof![Just(0u32), Just(3u32)],
        prop_oneof![4 => Just(true), 1 => Just(false)],
        prop_oneof![1 => Just(0u32), 2 => 1..12u32],
        any::<bool>(),
    )
        .prop_map(
            |(block_size, blocks, seqs, budget, threshold, caching, host, tier)| Setup {
                block_size,
                blocks,
                seqs,
                budget: budget.max(seqs),
                threshold,
                caching,
                host,
                in_step_tier: tier && host == 0,
            },
        )
}

impl Setup {
    fn config(&self) -> EngineConfig {
        let mut c = Preset::Small.config();
        c.block_size = self.block_size;
        c.num_gpu_blocks = self.blocks;
        c.max_num_seqs = self.seqs;
        c.max_num_batched_tokens = self.budget;
        c.long_prefill_token_threshold = self.threshold;
        c.enable_prefix_caching = self.caching;
        c.max_model_len = (self.blocks - 1) * self.block_size;
        c.kv_bytes_per_token = 1_000;
        c.kv_transfer_bandwidth = 1_000_000_000; // 1 µs per token
        c.num_host_blocks = self.host;
        c.host_load_bandwidth = 4_000_000_000; // 0.25 µs per token
        c
    }
}

/// Shared prefixes: the empty one and three of different lengths.
const PREFIXES: [&[u32]; 4] = [
    &[],
    &[1, 2, 3, 4],
    &[1, 2, 3, 4, 5, 6, 7],
    &[9, 8, 7, 6, 5, 4, 3, 2, 1],
];

#[derive(Debug)]
struct Expected {
    output: Vec<u32>,
    got: Vec<u32>,
}

/// The test's view of the engine, rebuilt only from what the engine reports.
#[derive(Debug, Default)]
struct Model {
    now: Nanos,
    next_id: RequestId,
    live: HashMap<RequestId, Expected>,
    order: Vec<RequestId>,
    /// Cached hashes with multiplicity, from Stored / Removed / Cleared.
    cached: HashMap<u64, usize>,
    /// The host tier's hashes, from HostStored / HostRemoved / Cleared.
    host: std::collections::HashSet<u64>,
    finished: usize,
}

impl Model {
    fn apply_events(&mut self, events: &[CacheEvent]) -> Result<(), TestCaseError> {
        for ev in events {
            match ev {
                CacheEvent::Stored { hashes, .. } => {
                    for h in hashes {
                        *self.cached.entry(*h).or_default() += 1;
                    }
                }
                CacheEvent::Removed { hashes } => {
                    prop_assert_eq!(hashes.len(), 1);
                    let n = self.cached.get_mut(&hashes[0]);
                    prop_assert!(n.is_some(), "Removed a hash that is not cached");
                    let n = n.unwrap();
                    *n -= 1;
                    if *n == 0 {
                        self.cached.remove(&hashes[0]);
                    }
                }
                CacheEvent::HostStored { hashes } => {
                    for h in hashes {
                        // Write-through: only what the GPU holds is copied, once.
                        prop_assert!(
                            self.cached.contains_key(h),
                            "host copy of an uncached block"
                        );
                        prop_assert!(self.host.insert(*h), "host copy reported twice");
                    }
                }
                CacheEvent::HostRemoved { hashes } => {
                    prop_assert_eq!(hashes.len(), 1);
                    prop_assert!(self.host.remove(&hashes[0]), "host drop of an absent block");
                }
                CacheEvent::Cleared => {
                    self.cached.clear();
                    self.host.clear();
                }
            }
        }
        Ok(())
    }

    fn apply_step(&mut self, out: &StepOutput) -> Result<(), TestCaseError> {
        for o in &out.outputs {
            let exp = self.live.get_mut(&o.id);
            prop_assert!(
                exp.is_some(),
                "output for unknown or aborted request {}",
                o.id
            );
            let exp = exp.unwrap();
            prop_assert!(o.new_tokens.len() <= 1);
            if o.preempted {
                prop_assert!(o.new_tokens.is_empty() && o.finished.is_none());
            }
            let first = exp.got.is_empty() && !o.new_tokens.is_empty();
            prop_assert_eq!(
                o.num_cached_tokens.is_some(),
                first,
                "first token exactly once"
            );
            exp.got.extend(&o.new_tokens);
            prop_assert!(exp.output.starts_with(&exp.got), "tokens out of order");
            if o.finished.is_some() {
                prop_assert_eq!(&exp.got, &exp.output);
                self.live.remove(&o.id);
                self.finished += 1;
            }
        }
        self.apply_events(&out.events)
    }

    fn check(&self, e: &Engine) -> Result<(), TestCaseError> {
        e.check_invariants().map_err(TestCaseError::fail)?;
        let s = e.stats();
        prop_assert_eq!(s.used_blocks + s.free_blocks, s.total_blocks);
        prop_assert!(s.prefix_cache_hits <= s.prefix_cache_queries);
        prop_assert!(s.preempted_prefix_cache_hits <= s.preempted_prefix_cache_queries);
        prop_assert!(
            (s.kv_usage - f64::from(s.used_blocks) / f64::from(s.total_blocks)).abs() < 1e-9
        );
        let mut model: Vec<u64> = self
            .cached
            .iter()
            .flat_map(|(&h, &n)| std::iter::repeat_n(h, n))
            .collect();
        model.sort_unstable();
        prop_assert_eq!(model, e.cached_hashes(), "events disagree with the cache");
        prop_assert_eq!(s.cached_blocks as usize, e.cached_hashes().len());
        let mut host: Vec<u64> = self.host.iter().copied().collect();
        host.sort_unstable();
        prop_assert_eq!(host, e.host_hashes(), "events disagree with the host tier");
        prop_assert_eq!(s.host_blocks as usize, self.host.len());
        prop_assert!(s.host_blocks <= e.config().num_host_blocks);
        prop_assert_eq!(e.has_unfinished(), !self.live.is_empty());
        Ok(())
    }

    fn step(&mut self, e: &mut Engine) -> Result<bool, TestCaseError> {
        match e.step(self.now) {
            Some(out) => {
                self.now += out.duration;
                self.apply_step(&out)?;
                Ok(true)
            }
            None => {
                let events = e.take_events();
                self.apply_events(&events)?;
                if let Some(t) = e.next_wakeup() {
                    prop_assert!(t > self.now, "a wake-up in the past would spin");
                    self.now = self.now.max(t);
                    return Ok(true);
                }
                Ok(false)
            }
        }
    }
}

fn run(setup: &Setup, ops: &[Op]) -> Result<(), TestCaseError> {
    let cfg = setup.config();
    let max_len = cfg.max_model_len as usize;
    let mut e = if setup.in_step_tier {
        Engine::with_offload(cfg, Box::<InStepTier>::default()).unwrap()
    } else {
        Engine::new(cfg).unwrap()
    };
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Add {
                prefix,
                suffix,
                output_len,
                transfer,
                remote_tokens,
                delay,
            } => {
                let mut prompt = PREFIXES[*prefix].to_vec();
                prompt.extend(suffix);
                if prompt.is_empty() {
                    prompt.push(42);
                }
                let id = m.next_id;
                m.next_id += 1;
                let output: Vec<u32> = (0..*output_len as u32).map(|i| 1000 + i % 3).collect();
                let kv_transfer = match transfer {
                    0 => Some(KvTransfer::PrefillOnly),
                    1 => Some(KvTransfer::RemotePrefill {
                        num_tokens: *remote_tokens,
                    }),
                    _ => None,
                };
                let effective = if *transfer == 0 {
                    output[..1].to_vec()
                } else {
                    output.clone()
                };
                let too_long = prompt.len() + effective.len() > max_len;
                let res = e.add_request(NewRequest {
                    id,
                    prompt,
                    output,
                    hasher: Box::new(XxhChain::new(0)),
                    arrival: m.now + delay,
                    kv_transfer,
                });
                prop_assert_eq!(res.is_err(), too_long);
                if !too_long {
                    m.live.insert(
                        id,
                        Expected {
                            output: effective,
                            got: Vec::new(),
                        },
                    );
                    m.order.push(id);
                }
            }
            Op::Step => {
                m.step(&mut e)?;
            }
            Op::Abort(i) => {
                if let Some(&id) = m.order.get(*i % m.order.len().max(1)) {
                    let live = m.live.remove(&id).is_some();
                    prop_assert_eq!(e.abort(id), live);
                }
            }
            Op::Reset => {
                let idle = e.stats().used_blocks == 0;
                prop_assert_eq!(e.reset_prefix_cache(), idle);
                let events = e.take_events();
                m.apply_events(&events)?;
            }
        }
        m.check(&e)?;
    }
    // Drain: every request left must finish with exactly its tokens.
    let mut guard = 0;
    while m.step(&mut e)? {
        m.check(&e)?;
        guard += 1;
        prop_assert!(guard < 20_000, "no progress");
    }
    prop_assert!(
        m.live.is_empty(),
        "unfinished: {:?}",
        m.live.keys().collect::<Vec<_>>()
    );
    prop_assert!(!e.has_unfinished());
    prop_assert_eq!(e.stats().used_blocks, 0);
    m.check(&e)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn engine_matches_its_event_model(setup in setup(), ops in prop::collection::vec(op(), 1..80)) {
        run(&setup, &ops)?;
    }
}

/// A fixed scenario that exercises preemption, eviction and duplicates at once, so the
/// property above is known to reach them.
#[test]
fn the_random_workload_reaches_preemption_eviction_and_hits() {
    let setup = Setup {
        block_size: 2,
        blocks: 6,
        seqs: 4,
        budget: 8,
        threshold: 3,
        caching: true,
        host: 0,
        in_step_tier: false,
    };
    let mut e = Engine::new(setup.config()).unwrap();
    for id in 0..6u64 {
        let mut prompt = PREFIXES[2].to_vec();
        prompt.push(id as u32);
        e.add_request(NewRequest {
            id,
            prompt,
            output: vec![1, 2],
            hasher: Box::new(XxhChain::new(0)),
            arrival: 0,
            kv_transfer: None,
        })
        .unwrap();
    }
    let mut now = 0;
    let mut removed = 0;
    while let Some(out) = e.step(now) {
        now += out.duration;
        removed += out
            .events
            .iter()
            .filter(|ev| matches!(ev, CacheEvent::Removed { .. }))
            .count();
    }
    let s = e.stats();
    assert!(!e.has_unfinished());
    assert!(s.num_preemptions > 0, "{s:?}");
    assert!(removed > 0);
    assert!(s.prefix_cache_hits > 0);
}

/// The host tier is reached: a prompt whose blocks the GPU evicted loads them back from host
/// memory (a wait at the host bandwidth, not a prefill), reports them as cached tokens, and
/// the events describe it.
#[test]
fn an_evicted_prefix_loads_back_from_the_host_tier() {
    let setup = Setup {
        block_size: 2,
        blocks: 6,
        seqs: 1,
        budget: 16,
        threshold: 0,
        caching: true,
        host: 16,
        in_step_tier: false,
    };
    let mut e = Engine::new(setup.config()).unwrap();
    let mut m = Model::default();
    let prompts: [Vec<u32>; 3] = [
        vec![1, 2, 3, 4, 5, 6, 7, 8, 9],
        vec![21, 22, 23, 24, 25, 26, 27, 28, 29],
        vec![1, 2, 3, 4, 5, 6, 7, 8, 10],
    ];
    let mut cached = Vec::new();
    let mut loading = Vec::new();
    for (id, prompt) in prompts.into_iter().enumerate() {
        let id = id as u64;
        e.add_request(NewRequest {
            id,
            prompt,
            output: vec![1000],
            hasher: Box::new(XxhChain::new(0)),
            arrival: m.now,
            kv_transfer: None,
        })
        .unwrap();
        m.live.insert(
            id,
            Expected {
                output: vec![1000],
                got: Vec::new(),
            },
        );
        let before = m.now;
        while !m.live.is_empty() {
            if e.stats().transferring > 0 {
                loading.push(id);
            }
            if let Some(out) = e.step(m.now) {
                for o in &out.outputs {
                    if let Some(n) = o.num_cached_tokens {
                        cached.push((id, n, m.now + out.duration - before));
                    }
                }
                m.now += out.duration;
                m.apply_step(&out).unwrap();
            } else {
                m.apply_events(&e.take_events()).unwrap();
                let t = e.next_wakeup().expect("a load in flight wakes the engine");
                m.now = m.now.max(t);
            }
            m.check(&e).unwrap();
        }
    }
    // The second prompt evicted the first one's blocks from the 5-block GPU; the third
    // shares the first one's four full blocks, and finds them in the host tier.
    assert_eq!(cached[0].1, 0);
    assert_eq!(cached[2].1, 8, "{cached:?}");
    // Only the third waited for a load (8 tokens × 1,000 B at 4 GB/s: 2 µs).
    assert!(
        !loading.is_empty() && loading.iter().all(|&id| id == 2),
        "{loading:?}"
    );
    assert!(!e.cached_hashes().is_empty());
    let s = e.stats();
    assert_eq!(s.host_hit_tokens, 8);
    assert_eq!(s.prefix_cache_hits, 0, "the GPU itself had none of them");
    assert!(s.host_blocks >= 8, "{s:?}");
}
