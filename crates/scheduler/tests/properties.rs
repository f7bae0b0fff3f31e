//! Property tests: the scheduler's guarantees over random pools, index contents and loads, and
//! the in-flight tracker against a naive model.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use kv_events::Tier;
use kv_index::{EndpointId, KvIndex, Overlap};
use proptest::prelude::*;
use proptest::sample::select;
use scheduler::{
    Decision, Endpoint, InflightLoad, InflightToken, InflightTracker, LoadBook, Millis, Policy,
    Reason, Role, ScheduleRequest, Scheduler, SchedulerConfig,
};
use support::{chain, id, index, store};

const TIERS: [Tier; 4] = [Tier::Gpu, Tier::Host, Tier::Disk, Tier::Remote];

/// Two endpoints per IP (ports 8000 and 8001), so bare-IP subset entries cover several.
fn address(i: u32) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, (i / 2) as u8 + 1], 8000 + (i % 2) as u16))
}

#[derive(Debug, Clone)]
struct Spec {
    ready: bool,
    role: Role,
    models: Vec<&'static str>,
    /// (prefix length of conversation 0 held, tier).
    held: (usize, usize),
    /// Requests already in flight: (prompt, uncached, decode, first token seen).
    inflight: Vec<(u32, u32, u32, bool)>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        prop::bool::weighted(0.85),
        select(vec![Role::Both, Role::Both, Role::Decode, Role::Prefill]),
        prop::sample::subsequence(vec!["a", "b"], 0..=2),
        (0usize..=32, 0usize..4),
        prop::collection::vec((0u32..40, 0u32..40, 0u32..20, any::<bool>()), 0..4),
    )
        .prop_map(|(ready, role, models, held, inflight)| Spec {
            ready,
            role,
            models,
            held,
            inflight,
        })
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        select(Policy::ALL.to_vec()),
        0usize..6,
        select(vec![0.0, 0.0, 0.3, 2.0]),
        (0.0f64..3.0, 0.0f64..3.0, 0.0f64..3.0),
        (0.0f64..=1.0, 0.0f64..=1.0, 0.0f64..=1.0),
        (any::<bool>(), select(vec![0.0, 0.25, 1.0]), 0u64..4),
    )
        .prop_map(|(policy, fallbacks, temperature, w, credit, bounded)| {
            let mut c = SchedulerConfig {
                policy,
                fallbacks,
                temperature,
                ..SchedulerConfig::default()
            };
            (c.weights.overlap, c.weights.decode, c.weights.queue) = w;
            (c.credit.host, c.credit.disk, c.credit.remote) = credit;
            (
                c.bounded_load.enabled,
                c.bounded_load.epsilon,
                c.bounded_load.min_cap,
            ) = bounded;
            c
        })
}

/// Builds the pool, the index contents and the tracker from specs.
fn setup(specs: &[Spec]) -> (Vec<Endpoint>, KvIndex, InflightTracker) {
    let idx = index();
    let tracker = InflightTracker::new();
    let keys = chain(0, 32);
    let eps = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let i = i as u32;
            let (len, tier) = s.held;
            if len > 0 {
                store(&idx, i, &keys[..len], TIERS[tier]);
            }
            for &(prompt, uncached, decode, first) in &s.inflight {
                let t = tracker.on_routed(id(i), prompt, uncached, decode);
                if first {
                    tracker.on_first_token(t);
                }
            }
            let mut e = Endpoint::new(id(i), address(i));
            e.ready = s.ready;
            e.role = s.role;
            e.models = s.models.iter().map(|m| m.to_string()).collect();
            e
        })
        .collect();
    (eps, idx, tracker)
}

fn credit_of(o: &Overlap, c: &SchedulerConfig) -> f64 {
    f64::from(o.hits(Tier::Gpu))
        + c.credit.host * f64::from(o.hits(Tier::Host))
        + c.credit.disk * f64::from(o.hits(Tier::Disk))
        + c.credit.remote * f64::from(o.hits(Tier::Remote))
}

/// Subset entries: exact addresses, bare IPs, and addresses of nobody.
fn subset() -> impl Strategy<Value = Option<Vec<String>>> {
    prop::option::of(prop::collection::vec(
        (0u32..12, 0u8..3).prop_map(|(i, kind)| match kind {
            0 => address(i).to_string(),
            1 => address(i).ip().to_string(),
            _ => format!("192.168.9.{i}:9000"),
        }),
        0..4,
    ))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The primary and fallbacks pass every filter; fallbacks are distinct, exclude the
    /// primary, number min(configured, candidates − 1) and follow the policy's cost order; the
    /// `kv` costs are the documented formula.
    #[test]
    fn decisions_respect_filters_and_cost_order(
        specs in prop::collection::vec(spec(), 1..12),
        config in config(),
        model in select(vec!["a", "b", ""]),
        subset in subset(),
        seed in any::<u64>(),
    ) {
        let (eps, idx, tracker) = setup(&specs);
        let keys = chain(0, 32);
        let allowed: BTreeSet<EndpointId> = eps
            .iter()
            .filter(|e| {
                e.ready
                    && e.role != Role::Prefill
                    && (model.is_empty() || e.models.is_empty() || e.models.contains(model))
                    && subset.as_ref().is_none_or(|s| {
                        s.contains(&e.address.to_string()) || s.contains(&e.address.ip().to_string())
                    })
            })
            .map(|e| e.id)
            .collect();
        let ids: Vec<EndpointId> = allowed.iter().copied().collect();
        let before: BTreeMap<EndpointId, Overlap> =
            idx.find_matches(&keys, &ids).into_iter().map(|o| (o.endpoint, o)).collect();
        let s = Scheduler::new(config.clone(), seed).unwrap();
        let req = ScheduleRequest {
            keys: &keys,
            prompt_tokens: 32 * 16,
            prompt_blocks: None,
            model,
            subset: subset.as_deref(),
            now: Millis(0),
            timed: false,
        };
        let result = s.schedule(&req, &eps, &idx, &tracker, &LoadBook::new());
        if allowed.is_empty() {
            prop_assert!(result.is_err());
            return Ok(());
        }
        let d = result.unwrap();
        prop_assert!(allowed.contains(&d.primary.endpoint));
        prop_assert_eq!(d.primary.address, address(d.primary.endpoint.get()));
        let mut seen = BTreeSet::from([d.primary.endpoint]);
        for f in &d.fallbacks {
            prop_assert!(allowed.contains(&f.endpoint));
            prop_assert!(seen.insert(f.endpoint), "duplicate {:?}", f.endpoint);
        }
        prop_assert_eq!(d.fallbacks.len(), config.fallbacks.min(allowed.len() - 1));
        prop_assert_eq!(d.scores.len(), allowed.len());
        let rank: BTreeMap<EndpointId, (bool, f64)> =
            d.scores.iter().map(|c| (c.endpoint, (c.over_cap, c.cost))).collect();
        let keyed: Vec<(bool, f64)> = d.fallbacks.iter().map(|f| rank[&f.endpoint]).collect();
        for w in keyed.windows(2) {
            prop_assert!((!w[0].0 && w[1].0) || (w[0].0 == w[1].0 && w[0].1 <= w[1].1), "{:?}", keyed);
        }
        if config.policy != Policy::Kv {
            prop_assert!(d.scores.iter().all(|c| !c.over_cap));
        }
        if config.policy == Policy::Kv {
            for c in &d.scores {
                let own = tracker.load(c.endpoint);
                let credit = credit_of(&before[&c.endpoint], &config);
                let expected = config.weights.overlap * (32.0 - credit).max(0.0)
                    + config.weights.decode * own.decode_blocks as f64
                    + config.weights.queue * own.prefill_blocks as f64;
                prop_assert!((c.cost - expected).abs() < 1e-3, "{} vs {}", c.cost, expected);
            }
            // At temperature 0 the primary is the best row under the cap.
            if config.temperature == 0.0 {
                let p = rank[&d.primary.endpoint];
                prop_assert!(d.scores.iter().all(|c| (c.over_cap, c.cost) >= p));
            }
        }
        prop_assert_eq!(d.overlap, before[&d.primary.endpoint]);
    }

    /// With temperature 0 and nothing in flight, `kv` picks an endpoint with the maximal
    /// credited prefix.
    #[test]
    fn kv_without_load_takes_a_maximal_credited_prefix(
        held in prop::collection::vec(((0usize..=32, 0usize..4), (0usize..=32, 0usize..4)), 1..16),
        credit in (0.0f64..=1.0, 0.0f64..=1.0, 0.0f64..=1.0),
        seed in any::<u64>(),
    ) {
        let idx = index();
        let keys = chain(0, 32);
        for (i, &((a, ta), (b, tb))) in held.iter().enumerate() {
            store(&idx, i as u32, &keys[..a], TIERS[ta]);
            store(&idx, i as u32, &keys[..b], TIERS[tb]);
        }
        let eps: Vec<Endpoint> =
            (0..held.len() as u32).map(|i| Endpoint::new(id(i), address(i))).collect();
        let mut config = SchedulerConfig::default();
        (config.credit.host, config.credit.disk, config.credit.remote) = credit;
        let ids: Vec<EndpointId> = eps.iter().map(|e| e.id).collect();
        let credits: Vec<f64> =
            idx.find_matches(&keys, &ids).iter().map(|o| credit_of(o, &config)).collect();
        let best = credits.iter().copied().fold(0.0, f64::max);
        let d = Scheduler::new(config, seed)
            .unwrap()
            .schedule(
                &support::request(&keys, 0),
                &eps,
                &idx,
                &InflightTracker::new(),
                &LoadBook::new(),
            )
            .unwrap();
        let got = credits[d.primary.endpoint.get() as usize];
        prop_assert!((got - best).abs() < 1e-3, "picked credit {} of max {}", got, best);
        prop_assert_eq!(d.reason, if best > 0.0 { Reason::KvHit } else { Reason::Load });
    }

    /// Bounded load: taking a request never lifts the primary above
    /// `ceil((1 + ε) × mean)` in-flight requests (mean over the candidates, this request
    /// counted), over random sequences of routes, first tokens and finishes, with every
    /// conversation's prefix cached on endpoint 0 (maximal stickiness).
    #[test]
    fn bounded_load_holds_over_random_sequences(
        n in 2u32..9,
        epsilon in select(vec![0.0, 0.1, 0.25, 1.0]),
        min_cap in select(vec![0u64, 0, 3]),
        temperature in select(vec![0.0, 0.5]),
        ops in prop::collection::vec((0u8..3, 0usize..64, 0u64..4), 1..150),
        seed in any::<u64>(),
    ) {
        let eps: Vec<Endpoint> = (0..n).map(|i| Endpoint::new(id(i), address(i))).collect();
        let idx = index();
        for conv in 0..4 {
            store(&idx, 0, &chain(conv, 24), Tier::Gpu);
        }
        let mut config = SchedulerConfig::default();
        config.bounded_load.epsilon = epsilon;
        config.bounded_load.min_cap = min_cap;
        config.temperature = temperature;
        let s = Scheduler::new(config, seed).unwrap();
        let tracker = InflightTracker::new();
        let loads = LoadBook::new();
        let mut live: Vec<InflightToken> = Vec::new();
        for (step, &(op, pick, conv)) in ops.iter().enumerate() {
            match op {
                0 => {
                    let keys = chain(conv, 24);
                    let before: Vec<u64> = (0..n).map(|i| tracker.load(id(i)).requests).collect();
                    let total: u64 = before.iter().sum();
                    let proportional = ((1.0 + epsilon) * (total + 1) as f64 / f64::from(n) - 1e-9).ceil() as u64;
                    let cap = proportional.max(min_cap);
                    let d = s.schedule(&support::request(&keys, step as u64), &eps, &idx, &tracker, &loads).unwrap();
                    let p = d.primary.endpoint;
                    prop_assert!(
                        before[p.get() as usize] < cap.max(1),
                        "endpoint {:?} at {} with cap {} (loads {:?})", p, before[p.get() as usize], cap, before
                    );
                    live.push(tracker.on_routed(p, 24, d.uncached_blocks, 4));
                }
                1 if !live.is_empty() => {
                    tracker.on_first_token(live[pick % live.len()]);
                }
                _ if !live.is_empty() => {
                    let t = live.swap_remove(pick % live.len());
                    tracker.on_finished(t);
                }
                _ => {}
            }
        }
        for t in live {
            tracker.on_finished(t);
        }
        prop_assert!(tracker.is_empty());
    }

    /// The same seed and the same calls give the same decisions, for every policy.
    #[test]
    fn same_seed_same_decisions(
        config in config(),
        requests in prop::collection::vec((0u64..6, 1usize..40, any::<bool>()), 1..40),
        seed in any::<u64>(),
    ) {
        let run = || -> Vec<Decision> {
            let eps = support::endpoints(8);
            let idx = index();
            store(&idx, 2, &chain(1, 20), Tier::Gpu);
            store(&idx, 5, &chain(2, 30), Tier::Host);
            let s = Scheduler::new(config.clone(), seed).unwrap();
            let tracker = InflightTracker::new();
            let loads = LoadBook::new();
            let mut out = Vec::new();
            for (step, &(conv, len, finish)) in requests.iter().enumerate() {
                let keys = chain(conv, len);
                let d = s.schedule(&support::request(&keys, step as u64 * 100), &eps, &idx, &tracker, &loads).unwrap();
                let t = tracker.on_routed(d.primary.endpoint, len as u32, d.uncached_blocks, 2);
                if finish {
                    tracker.on_finished(t);
                }
                out.push(d);
            }
            out
        };
        prop_assert_eq!(run(), run());
    }
}

/// One step of the tracker's naive-model test.
#[derive(Debug, Clone)]
enum Op {
    Route {
        endpoint: u32,
        prompt: u32,
        uncached: u32,
        decode: u32,
    },
    First(usize),
    Finish(usize),
    Remove(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..4, 0u32..100, 0u32..120, 0u32..50).prop_map(|(endpoint, prompt, uncached, decode)| {
            Op::Route { endpoint, prompt, uncached, decode }
        }),
        3 => any::<usize>().prop_map(Op::First),
        3 => any::<usize>().prop_map(Op::Finish),
        1 => (0u32..4).prop_map(Op::Remove),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Prefill,
    Decode,
    Gone,
}

/// The naive model: every token ever issued, with its state; loads are recomputed by summing.
#[derive(Debug, Default)]
struct Model {
    tokens: Vec<(InflightToken, u32, u64, u64, State)>,
}

impl Model {
    fn load(&self, endpoint: u32) -> InflightLoad {
        let mut l = InflightLoad::default();
        for &(_, ep, uncached, footprint, state) in &self.tokens {
            if ep != endpoint || state == State::Gone {
                continue;
            }
            l.requests += 1;
            match state {
                State::Prefill => l.prefill_blocks += uncached,
                State::Decode => l.decode_blocks += footprint,
                State::Gone => {}
            }
        }
        l
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The tracker equals the naive model after every operation (repeated, late and unknown
    /// calls included) and is empty once every request finished.
    #[test]
    fn inflight_tracker_matches_a_naive_model(ops in prop::collection::vec(op(), 0..200)) {
        let tracker = InflightTracker::new();
        let mut model = Model::default();
        for op in ops {
            match op {
                Op::Route { endpoint, prompt, uncached, decode } => {
                    let t = tracker.on_routed(id(endpoint), prompt, uncached, decode);
                    prop_assert_eq!(t.endpoint(), id(endpoint));
                    model.tokens.push((
                        t,
                        endpoint,
                        u64::from(uncached.min(prompt)),
                        u64::from(prompt) + u64::from(decode),
                        State::Prefill,
                    ));
                }
                Op::First(i) if !model.tokens.is_empty() => {
                    let i = i % model.tokens.len();
                    let entry = &mut model.tokens[i];
                    let changed = entry.4 == State::Prefill;
                    if changed {
                        entry.4 = State::Decode;
                    }
                    prop_assert_eq!(tracker.on_first_token(entry.0), changed);
                }
                Op::Finish(i) if !model.tokens.is_empty() => {
                    let i = i % model.tokens.len();
                    let entry = &mut model.tokens[i];
                    let changed = entry.4 != State::Gone;
                    entry.4 = State::Gone;
                    prop_assert_eq!(tracker.on_finished(entry.0), changed);
                }
                Op::Remove(endpoint) => {
                    let mut n = 0;
                    for entry in &mut model.tokens {
                        if entry.1 == endpoint && entry.4 != State::Gone {
                            entry.4 = State::Gone;
                            n += 1;
                        }
                    }
                    prop_assert_eq!(tracker.remove_endpoint(id(endpoint)), n);
                }
                _ => {}
            }
            for ep in 0..4 {
                prop_assert_eq!(tracker.load(id(ep)), model.load(ep));
            }
            let live = model.tokens.iter().filter(|t| t.4 != State::Gone).count();
            prop_assert_eq!(tracker.len(), live);
        }
        for t in &model.tokens {
            tracker.on_finished(t.0);
        }
        prop_assert!(tracker.is_empty());
    }
}
