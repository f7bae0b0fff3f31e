//! End-to-end behaviour of `Scheduler::schedule` against a real `KvIndex`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::collections::BTreeSet;

use kv_events::{KvEvent, Tier};
use kv_index::{Holder, NodeId};
use scheduler::{
    EngineLoad, InflightTracker, LoadBook, Millis, NoCandidateReason, Policy, Reason, Role,
    ScheduleError, Scheduler, SchedulerConfig,
};
use support::{addr, chain, endpoints, id, index, request, store, with_role};

fn scheduler(config: SchedulerConfig) -> Scheduler {
    Scheduler::new(config, 42).unwrap()
}

#[test]
fn kv_routes_to_the_longest_cached_prefix_with_distinct_fallbacks() {
    let eps = endpoints(8);
    let idx = index();
    let keys = chain(1, 40);
    store(&idx, 3, &keys[..30], Tier::Gpu);
    store(&idx, 5, &keys[..10], Tier::Gpu);
    let s = scheduler(SchedulerConfig::default());
    let d = s
        .schedule(
            &request(&keys, 0),
            &eps,
            &idx,
            &InflightTracker::new(),
            &LoadBook::new(),
        )
        .unwrap();
    assert_eq!(d.primary.endpoint, id(3));
    assert_eq!(d.primary.address, addr(3));
    assert_eq!(d.reason, Reason::KvHit);
    assert_eq!(d.overlap.hits(Tier::Gpu), 30);
    assert_eq!((d.prompt_blocks, d.uncached_blocks), (40, 10));
    assert_eq!(d.fallbacks.len(), 3);
    assert_eq!(d.fallbacks[0].endpoint, id(5));
    let all: BTreeSet<_> = d.endpoints().map(|p| p.endpoint).collect();
    assert_eq!(all.len(), 4);
    assert_eq!(d.scores.len(), 8);
    assert_eq!(d.scores[0].cost, 10.0);
    assert_eq!(d.scores[0].credit, Some(30.0));
}

#[test]
fn lower_tiers_earn_partial_credit() {
    let eps = endpoints(3);
    let idx = index();
    let keys = chain(2, 40);
    // Endpoint 0: 16 GPU blocks. Endpoint 1: 36 blocks in host memory (credit 27).
    // Endpoint 2: 40 blocks on its node's disk (credit 10).
    store(&idx, 0, &keys[..16], Tier::Gpu);
    store(&idx, 1, &keys[..36], Tier::Host);
    idx.set_endpoint_node(id(2), Some(NodeId::new(7).unwrap()));
    idx.apply(
        Holder::Node(NodeId::new(7).unwrap()),
        &[KvEvent::Stored {
            keys: keys.clone(),
            parent: None,
            tier: Tier::Disk,
            lora: None,
            token_count: 0,
        }],
    );
    let mut c = SchedulerConfig::default();
    c.speculation.enabled = false;
    let d = scheduler(c.clone())
        .schedule(
            &request(&keys, 0),
            &eps,
            &idx,
            &InflightTracker::new(),
            &LoadBook::new(),
        )
        .unwrap();
    assert_eq!(d.primary.endpoint, id(1));
    assert_eq!(d.overlap.hits(Tier::Host), 36);
    assert_eq!(d.uncached_blocks, 4);
    let credits: Vec<_> = d
        .scores
        .iter()
        .map(|c| (c.endpoint.get(), c.credit.unwrap()))
        .collect();
    assert_eq!(credits, vec![(1, 27.0), (0, 16.0), (2, 10.0)]);
    // Host hits worth nothing: the GPU prefix wins.
    c.credit.host = 0.0;
    let d = scheduler(c)
        .schedule(
            &request(&keys, 0),
            &eps,
            &idx,
            &InflightTracker::new(),
            &LoadBook::new(),
        )
        .unwrap();
    assert_eq!(d.primary.endpoint, id(0));
}

#[test]
fn load_outweighs_a_short_hit() {
    let eps = endpoints(2);
    let idx = index();
    let keys = chain(3, 20);
    store(&idx, 0, &keys[..5], Tier::Gpu);
    let inflight = InflightTracker::new();
    let tok = inflight.on_routed(id(0), 30, 30, 10);
    inflight.on_first_token(tok);
    // Dynamo's weighting: every decoding block costs as much as a block to prefill.
    let mut c = SchedulerConfig::default();
    c.weights.decode = 1.0;
    let d = scheduler(c)
        .schedule(&request(&keys, 0), &eps, &idx, &inflight, &LoadBook::new())
        .unwrap();
    // Endpoint 0: 15 uncached + 40 decoding; endpoint 1: 20 uncached.
    assert_eq!(d.primary.endpoint, id(1));
    assert_eq!(d.reason, Reason::Load);
    assert_eq!(d.scores[1].cost, 55.0);
}

#[test]
fn fresh_engine_load_counts_and_stale_load_does_not() {
    let eps = endpoints(2);
    let idx = index();
    let keys = chain(4, 20);
    store(&idx, 0, &keys, Tier::Gpu);
    let loads = LoadBook::new();
    let busy = EngineLoad {
        waiting: 4,
        running: 8,
        kv_usage: 0.9,
        at: Millis(1_000),
    };
    loads.record(id(0), busy);
    let s = scheduler(SchedulerConfig::default());
    // Fresh: 4 waiting × 32 blocks queued on endpoint 0 costs more than computing 20 blocks.
    let d = s
        .schedule(
            &request(&keys, 2_000),
            &eps,
            &idx,
            &InflightTracker::new(),
            &loads,
        )
        .unwrap();
    assert_eq!(d.primary.endpoint, id(1));
    assert_eq!(d.scores[1].load.requests, 12);
    // Stale (older than 5 s): ignored.
    let d = s
        .schedule(
            &request(&keys, 6_001),
            &eps,
            &idx,
            &InflightTracker::new(),
            &loads,
        )
        .unwrap();
    assert_eq!(d.primary.endpoint, id(0));
}

#[test]
fn speculation_makes_back_to_back_requests_stick_until_it_expires() {
    let eps = endpoints(16);
    let idx = index();
    let keys = chain(5, 64);
    let s = scheduler(SchedulerConfig::default());
    let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
    let first = s
        .schedule(&request(&keys, 0), &eps, &idx, &inflight, &loads)
        .unwrap();
    assert_eq!(first.reason, Reason::Load);
    assert_eq!(first.overlap.reach(Tier::Gpu), 0);
    for now in [1, 2, 3] {
        let next = s
            .schedule(&request(&keys, now), &eps, &idx, &inflight, &loads)
            .unwrap();
        assert_eq!(next.primary, first.primary);
        assert_eq!(next.reason, Reason::KvHit);
        assert_eq!(next.overlap.reach(Tier::Gpu), 64);
    }
    // Later decisions found the prefix already speculated and did not renew it: the first
    // decision's entries (at 0) live 2 s.
    assert_eq!(s.expire(&idx, Millis(1_999)), 0);
    assert_eq!(s.expire(&idx, Millis(2_000)), 64);
    let probe = idx.find_matches(&keys, &[first.primary.endpoint]);
    assert_eq!(probe[0].reach(Tier::Gpu), 0);
}

#[test]
fn speculation_covers_only_the_suffix_past_the_gpu_prefix() {
    let eps = endpoints(2);
    let idx = index();
    let keys = chain(16, 20);
    store(&idx, 1, &keys[..12], Tier::Gpu);
    let s = scheduler(SchedulerConfig::default());
    let d = s
        .schedule(
            &request(&keys, 0),
            &eps,
            &idx,
            &InflightTracker::new(),
            &LoadBook::new(),
        )
        .unwrap();
    assert_eq!(d.primary.endpoint, id(1));
    assert_eq!(idx.find_matches(&keys, &[id(1)])[0].reach(Tier::Gpu), 20);
    // Eight speculative entries; the confirmed twelve stay when they expire.
    assert_eq!(s.expire(&idx, Millis(2_000)), 8);
    assert_eq!(idx.find_matches(&keys, &[id(1)])[0].reach(Tier::Gpu), 12);
}

#[test]
fn without_speculation_nothing_is_recorded() {
    let eps = endpoints(4);
    let idx = index();
    let keys = chain(6, 8);
    let mut c = SchedulerConfig::default();
    c.speculation.enabled = false;
    let s = scheduler(c);
    let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
    let d = s
        .schedule(&request(&keys, 0), &eps, &idx, &inflight, &loads)
        .unwrap();
    let again = s
        .schedule(&request(&keys, 1), &eps, &idx, &inflight, &loads)
        .unwrap();
    assert_eq!(again.overlap.reach(Tier::Gpu), 0);
    assert_eq!(
        idx.find_matches(&keys, &[d.primary.endpoint])[0].reach(Tier::Gpu),
        0
    );
}

#[test]
fn approximate_mode_records_routes_as_cache_contents() {
    let eps = endpoints(8);
    let idx = index();
    let keys = chain(7, 32);
    let mut c = SchedulerConfig::default();
    c.approximate.enabled = true;
    c.approximate.ttl_ms = 10_000;
    let s = scheduler(c);
    let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
    let first = s
        .schedule(&request(&keys, 0), &eps, &idx, &inflight, &loads)
        .unwrap();
    let next = s
        .schedule(&request(&keys, 500), &eps, &idx, &inflight, &loads)
        .unwrap();
    assert_eq!(next.primary, first.primary);
    assert_eq!(next.overlap.reach(Tier::Gpu), 32);
    // Not speculation: a speculative-entry sweep leaves it alone.
    assert_eq!(idx.expire(Millis(5_000)), 0);
    assert_eq!(s.expire(&idx, Millis(9_000)), 0);
    // Ten seconds after the last route (500) the blocks are assumed evicted.
    assert_eq!(s.expire(&idx, Millis(10_500)), 32);
    assert_eq!(
        idx.find_matches(&keys, &[first.primary.endpoint])[0].reach(Tier::Gpu),
        0
    );
    s.remove_endpoint(first.primary.endpoint);
}

#[test]
fn subset_hints_restrict_the_pick() {
    let eps = endpoints(4);
    let idx = index();
    let keys = chain(8, 10);
    store(&idx, 0, &keys, Tier::Gpu);
    store(&idx, 2, &keys[..4], Tier::Gpu);
    let s = scheduler(SchedulerConfig::default());
    let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
    let subset = vec![addr(1).to_string(), addr(2).to_string()];
    let mut req = request(&keys, 0);
    req.subset = Some(&subset);
    let d = s.schedule(&req, &eps, &idx, &inflight, &loads).unwrap();
    // Best within the subset (partial match), and only subset members as fallbacks.
    assert_eq!(d.primary.endpoint, id(2));
    assert_eq!(
        d.fallbacks.iter().map(|p| p.endpoint).collect::<Vec<_>>(),
        vec![id(1)]
    );
    let empty: Vec<String> = Vec::new();
    req.subset = Some(&empty);
    let err = s.schedule(&req, &eps, &idx, &inflight, &loads).unwrap_err();
    assert_eq!(
        err,
        ScheduleError::NoCandidates {
            reason: NoCandidateReason::EmptySubset
        }
    );
    assert_eq!(err.metric_label(), "empty_subset");
    let elsewhere = vec!["192.168.0.1:8000".to_string()];
    req.subset = Some(&elsewhere);
    let err = s.schedule(&req, &eps, &idx, &inflight, &loads).unwrap_err();
    assert_eq!(err.metric_label(), "subset_matches_nothing");
}

#[test]
fn model_readiness_and_role_filters_apply() {
    let mut eps = endpoints(3);
    eps[0].models.insert("llama".into());
    eps[1].models.insert("llama".into());
    eps[1].ready = false;
    eps[2].models.insert("qwen".into());
    let idx = index();
    let keys = chain(9, 4);
    let s = scheduler(SchedulerConfig::default());
    let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
    let mut req = request(&keys, 0);
    req.model = "llama";
    let d = s.schedule(&req, &eps, &idx, &inflight, &loads).unwrap();
    assert_eq!(d.primary.endpoint, id(0));
    assert!(d.fallbacks.is_empty());
    req.model = "gemma";
    let err = s.schedule(&req, &eps, &idx, &inflight, &loads).unwrap_err();
    assert_eq!(err.metric_label(), "model_not_served");
    eps[0].role = Role::Prefill;
    req.model = "llama";
    let err = s.schedule(&req, &eps, &idx, &inflight, &loads).unwrap_err();
    assert_eq!(err.metric_label(), "model_not_served");
    for e in &mut eps {
        e.role = Role::Prefill;
    }
    let err = s.schedule(&req, &eps, &idx, &inflight, &loads).unwrap_err();
    assert_eq!(err.metric_label(), "no_decode_endpoints");
    for e in &mut eps {
        e.ready = false;
    }
    let err = s.schedule(&req, &eps, &idx, &inflight, &loads).unwrap_err();
    assert_eq!(err.metric_label(), "no_ready_endpoints");
}

#[test]
fn disaggregation_picks_a_prefill_endpoint_for_long_uncached_prompts() {
    let eps = vec![
        with_role(scheduler::Endpoint::new(id(0), addr(0)), Role::Decode),
        with_role(scheduler::Endpoint::new(id(1), addr(1)), Role::Decode),
        with_role(scheduler::Endpoint::new(id(2), addr(2)), Role::Prefill),
        with_role(scheduler::Endpoint::new(id(3), addr(3)), Role::Prefill),
    ];
    let idx = index();
    let keys = chain(10, 100);
    let cached = chain(11, 100);
    store(&idx, 0, &cached[..90], Tier::Gpu);
    store(&idx, 3, &keys[..50], Tier::Gpu);
    let (inflight, loads) = (InflightTracker::new(), LoadBook::new());

    // Disabled by default.
    let mut quiet = SchedulerConfig::default();
    quiet.speculation.enabled = false;
    assert!(!quiet.disaggregation.enabled);
    let d = scheduler(quiet)
        .schedule(&request(&keys, 0), &eps, &idx, &inflight, &loads)
        .unwrap();
    assert_eq!(d.prefill, None);
    assert!(matches!(d.primary.endpoint.get(), 0 | 1));

    let mut c = SchedulerConfig::default();
    c.disaggregation.enabled = true;
    c.disaggregation.min_uncached_blocks = 32;
    c.speculation.enabled = false;
    let s = scheduler(c.clone());
    let d = s
        .schedule(&request(&keys, 0), &eps, &idx, &inflight, &loads)
        .unwrap();
    assert!(matches!(d.primary.endpoint.get(), 0 | 1));
    // The prefill endpoint holding half the prompt wins.
    assert_eq!(d.prefill.map(|p| p.endpoint), Some(id(3)));
    // Prefill-only endpoints are never primary or fallback.
    assert!(d.endpoints().all(|p| p.endpoint.get() < 2));

    // The decode endpoint already holds most of this prompt: 10 uncached < 32.
    let d = s
        .schedule(&request(&cached, 0), &eps, &idx, &inflight, &loads)
        .unwrap();
    assert_eq!(d.primary.endpoint, id(0));
    assert_eq!(d.prefill, None);

    // A queue on the cached prefill endpoint sends the leg to the other one.
    inflight.on_routed(id(3), 200, 200, 0);
    let d = s
        .schedule(&request(&keys, 0), &eps, &idx, &inflight, &loads)
        .unwrap();
    assert_eq!(d.prefill.map(|p| p.endpoint), Some(id(2)));

    // Short prompts stay local.
    let mut short = c.clone();
    short.disaggregation.min_prompt_tokens = 4096;
    let d = scheduler(short)
        .schedule(&request(&keys, 0), &eps, &idx, &inflight, &loads)
        .unwrap();
    assert_eq!(d.prefill, None);

    // No prefill endpoint: no leg.
    let d = s
        .schedule(&request(&keys, 0), &eps[..2], &idx, &inflight, &loads)
        .unwrap();
    assert_eq!(d.prefill, None);
}

#[test]
fn the_prefill_leg_is_speculated_too() {
    let eps = vec![
        with_role(scheduler::Endpoint::new(id(0), addr(0)), Role::Decode),
        with_role(scheduler::Endpoint::new(id(1), addr(1)), Role::Prefill),
    ];
    let idx = index();
    let keys = chain(12, 64);
    let mut c = SchedulerConfig::default();
    c.disaggregation.enabled = true;
    let d = scheduler(c)
        .schedule(
            &request(&keys, 0),
            &eps,
            &idx,
            &InflightTracker::new(),
            &LoadBook::new(),
        )
        .unwrap();
    assert_eq!(d.prefill.map(|p| p.endpoint), Some(id(1)));
    let m = idx.find_matches(&keys, &[id(0), id(1)]);
    assert_eq!((m[0].reach(Tier::Gpu), m[1].reach(Tier::Gpu)), (64, 64));
}

#[test]
fn fallback_count_is_configurable() {
    let eps = endpoints(5);
    let idx = index();
    let keys = chain(13, 4);
    let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
    for (n, expected) in [(0, 0), (2, 2), (16, 4)] {
        let c = SchedulerConfig {
            fallbacks: n,
            ..SchedulerConfig::default()
        };
        let d = scheduler(c)
            .schedule(&request(&keys, 0), &eps, &idx, &inflight, &loads)
            .unwrap();
        assert_eq!(d.fallbacks.len(), expected);
    }
}

#[test]
fn round_robin_cycles_through_the_candidates() {
    let eps = endpoints(3);
    let idx = index();
    let keys = chain(14, 4);
    let c = SchedulerConfig {
        policy: Policy::RoundRobin,
        ..SchedulerConfig::default()
    };
    let s = scheduler(c);
    let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
    let picks: Vec<u32> = (0..6)
        .map(|_| {
            let d = s
                .schedule(&request(&keys, 0), &eps, &idx, &inflight, &loads)
                .unwrap();
            assert_eq!(d.reason, Reason::RoundRobin);
            d.primary.endpoint.get()
        })
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
}

#[test]
fn every_policy_reports_the_primarys_overlap() {
    let eps = endpoints(4);
    let idx = index();
    let keys = chain(15, 12);
    for i in 0..4 {
        store(&idx, i, &keys[..(3 * i as usize)], Tier::Gpu);
    }
    let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
    for policy in Policy::ALL {
        let mut c = SchedulerConfig {
            policy,
            ..SchedulerConfig::default()
        };
        c.speculation.enabled = false;
        let d = scheduler(c)
            .schedule(&request(&keys, 0), &eps, &idx, &inflight, &loads)
            .unwrap();
        let i = d.primary.endpoint.get();
        assert_eq!(d.overlap.reach(Tier::Gpu), 3 * i, "{policy}");
        assert_eq!(d.uncached_blocks, 12 - 3 * i, "{policy}");
        if matches!(policy, Policy::Kv | Policy::PrefixOnly) {
            assert_eq!(i, 3, "{policy}");
        }
    }
}

#[test]
fn concurrent_decisions_share_one_scheduler() {
    let eps = endpoints(16);
    let idx = index();
    let s = scheduler(SchedulerConfig::default());
    let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (s, eps, idx, inflight, loads) = (&s, &eps, &idx, &inflight, &loads);
            scope.spawn(move || {
                for i in 0..200u64 {
                    let keys = chain(t * 1000 + i % 7, 16);
                    let d = s
                        .schedule(&request(&keys, i), eps, idx, inflight, loads)
                        .unwrap();
                    let tok = inflight.on_routed(d.primary.endpoint, 16, d.uncached_blocks, 4);
                    inflight.on_first_token(tok);
                    if i % 3 != 0 {
                        inflight.on_finished(tok);
                    }
                }
            });
        }
    });
    assert_eq!(inflight.len(), 4 * 67);
}

#[test]
fn bounded_load_spreads_a_hot_prefix_and_min_cap_keeps_light_load_together() {
    let eps = endpoints(4);
    let keys = chain(17, 64);
    let route = |config: SchedulerConfig, n: usize| -> Vec<(u32, Reason)> {
        let idx = index();
        store(&idx, 0, &keys, Tier::Gpu);
        let s = scheduler(config);
        let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
        (0..n)
            .map(|i| {
                let d = s
                    .schedule(&request(&keys, i as u64), &eps, &idx, &inflight, &loads)
                    .unwrap();
                // Only the prefix term: load alone would never move these requests.
                inflight.on_routed(d.primary.endpoint, 64, d.uncached_blocks, 0);
                (d.primary.endpoint.get(), d.reason)
            })
            .collect()
    };
    let mut c = SchedulerConfig::default();
    c.weights.decode = 0.0;
    c.weights.queue = 0.0;
    // The default floor keeps the first 8 together.
    let picks = route(c.clone(), 9);
    assert!(
        picks[..8].iter().all(|&p| p == (0, Reason::KvHit)),
        "{picks:?}"
    );
    assert_eq!(picks[8].1, Reason::BoundedLoadOverride);
    // The rule as stated: with 1 request in flight over 4 endpoints the cap is 1.
    c.bounded_load.min_cap = 0;
    let picks = route(c.clone(), 2);
    assert_eq!(picks[0], (0, Reason::KvHit));
    assert_ne!(picks[1].0, 0);
    assert_eq!(picks[1].1, Reason::BoundedLoadOverride);
    // A floor of 4 keeps the first four together; the fifth overflows.
    c.bounded_load.min_cap = 4;
    let picks = route(c.clone(), 5);
    assert!(
        picks[..4].iter().all(|&p| p == (0, Reason::KvHit)),
        "{picks:?}"
    );
    assert_eq!(picks[4].1, Reason::BoundedLoadOverride);
    // Without the rule everything sticks.
    c.bounded_load.enabled = false;
    assert!(route(c, 12).iter().all(|&(e, _)| e == 0));
}

#[test]
fn shared_state_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Scheduler>();
    check::<InflightTracker>();
    check::<LoadBook>();
}

#[test]
fn the_pool_is_saturated_only_when_every_decode_candidate_is() {
    let mut eps = endpoints(3);
    let s = scheduler(SchedulerConfig::default());
    let loads = LoadBook::new();
    let now = Millis(10_000);
    let sample = |waiting, kv_usage| EngineLoad {
        waiting,
        running: 1,
        kv_usage,
        at: now,
    };
    // No samples at all: unknown is not saturated.
    assert!(!s.pool_saturated("m", &eps, &loads, now));
    loads.record(id(0), sample(5, 0.1));
    loads.record(id(1), sample(0, 0.8));
    assert!(
        !s.pool_saturated("m", &eps, &loads, now),
        "endpoint 2 has no sample"
    );
    loads.record(id(2), sample(4, 0.79));
    assert!(!s.pool_saturated("m", &eps, &loads, now));
    loads.record(id(2), sample(6, 0.0));
    assert!(s.pool_saturated("m", &eps, &loads, now));
    // Stale samples stop counting.
    assert!(!s.pool_saturated("m", &eps, &loads, Millis(10_000 + 5_001)));
    // Endpoints that are not ready or cannot decode do not keep the pool open.
    eps.push(with_role(
        scheduler::Endpoint::new(id(3), addr(3)),
        Role::Prefill,
    ));
    assert!(s.pool_saturated("m", &eps, &loads, now));
    eps[2].ready = false;
    loads.record(id(2), sample(0, 0.0));
    assert!(s.pool_saturated("m", &eps, &loads, now));
    // No candidate at all is not saturation.
    assert!(!s.pool_saturated("m", &[], &loads, now));
}
