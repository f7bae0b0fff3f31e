#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]
//! End-to-end properties of the replay on tiny hand-built workloads.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use engine_model::{Engine, NewRequest, Preset, XxhChain};
use proptest::prelude::*;
use replay::{MS, Replay, ReplayConfig, replay};
use scheduler::{Policy, SchedulerConfig};
use workload::{Pacing, Session, Span, Status, Turn, Vocab, Workload, synth_answer};

fn config(engines: usize, policy: Policy) -> ReplayConfig {
    let mut c = ReplayConfig::new(engines, Preset::Small.config());
    c.scheduler = SchedulerConfig {
        policy,
        ..SchedulerConfig::default()
    };
    c.run = policy.to_string();
    c
}

fn turn(user: Vec<Span>, max_tokens: u32, think_ms: u64) -> Turn {
    Turn {
        user,
        max_tokens,
        think: Duration::from_millis(think_ms),
    }
}

/// `n` single-turn sessions, one per second, sharing a 512-token prefix.
fn shared_prefix(n: u64) -> Workload {
    Workload {
        name: "shared".into(),
        pacing: Pacing::Open,
        vocab: Vocab::default(),
        sessions: (0..n)
            .map(|i| Session {
                id: i,
                start: Duration::from_secs(i),
                group: 0,
                turns: vec![turn(
                    vec![
                        Span { seed: 42, len: 512 },
                        Span {
                            seed: 1000 + i,
                            len: 40,
                        },
                    ],
                    16,
                    0,
                )],
            })
            .collect(),
    }
}

fn per_engine(records: &[workload::RequestRecord]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for r in records {
        *m.entry(r.endpoint.clone().unwrap()).or_default() += 1;
    }
    m
}

#[test]
fn a_shared_prefix_sticks_under_kv_and_spreads_under_round_robin() {
    let w = shared_prefix(12);
    let kv = replay(&w, config(3, Policy::Kv)).unwrap();
    assert_eq!(kv.records.len(), 12);
    assert_eq!(
        per_engine(&kv.records).len(),
        1,
        "{:?}",
        per_engine(&kv.records)
    );
    // After the first request, every prompt finds the 512-token prefix cached.
    let mut by_start = kv.records.clone();
    by_start.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    assert_eq!(by_start[0].cached_tokens, Some(0));
    assert!(by_start[1..].iter().all(|r| r.cached_tokens == Some(512)));

    let rr = replay(&w, config(3, Policy::RoundRobin)).unwrap();
    let spread = per_engine(&rr.records);
    assert_eq!(spread.len(), 3);
    assert!(spread.values().all(|&n| n == 4), "{spread:?}");
    // Each engine computes the prefix once.
    let misses = rr
        .records
        .iter()
        .filter(|r| r.cached_tokens == Some(0))
        .count();
    assert_eq!(misses, 3);
}

#[test]
fn cached_tokens_are_what_the_engine_model_reports() {
    // One engine: the replay's records must equal driving the engine model by hand with the
    // same prompts, one request after another.
    let w = Workload {
        name: "multi".into(),
        pacing: Pacing::Closed { concurrency: 1 },
        vocab: Vocab::default(),
        sessions: (0..3)
            .map(|i| Session {
                id: i,
                start: Duration::ZERO,
                group: 0,
                turns: (0..3)
                    .map(|k| {
                        turn(
                            vec![Span {
                                seed: 7 + i * 10 + k,
                                len: 100,
                            }],
                            50,
                            0,
                        )
                    })
                    .collect(),
            })
            .collect(),
    };
    let c = config(1, Policy::Kv);
    let out = replay(&w, c.clone()).unwrap();
    let mut engine = Engine::new(c.engine.clone()).unwrap();
    let mut now = 0;
    let mut want = Vec::new();
    let mut id = 0;
    for s in &w.sessions {
        let mut answers = Vec::new();
        for (k, t) in s.turns.iter().enumerate() {
            let prompt = s.prompt(&w.vocab, k, &answers).unwrap();
            let output = synth_answer(&w.vocab, s.id, k as u32, t.max_tokens);
            engine
                .add_request(NewRequest {
                    id,
                    prompt,
                    output: output.clone(),
                    hasher: Box::new(XxhChain::new(c.engine_hash_seed)),
                    arrival: now,
                    kv_transfer: None,
                })
                .unwrap();
            id += 1;
            while let Some(step) = engine.step(now) {
                now += step.duration;
                for o in step.outputs {
                    if let Some(cached) = o.num_cached_tokens {
                        want.push(cached);
                    }
                }
            }
            answers.push(output);
        }
    }
    let got: Vec<u32> = out
        .records
        .iter()
        .map(|r| r.cached_tokens.unwrap())
        .collect();
    assert_eq!(got, want);
    assert!(
        got.iter().skip(1).any(|&c| c > 0),
        "later turns hit: {got:?}"
    );
    let hits: u64 = out.engines.iter().map(|e| e.prefix_cache_hits).sum();
    assert_eq!(hits, got.iter().map(|&c| u64::from(c)).sum::<u64>());
}

#[test]
fn closed_loop_concurrency_is_reached_and_never_exceeded() {
    let w = Workload {
        name: "closed".into(),
        pacing: Pacing::Closed { concurrency: 5 },
        vocab: Vocab::default(),
        sessions: (0..40)
            .map(|i| Session {
                id: i,
                start: Duration::ZERO,
                group: (i % 3) as u32,
                turns: (0..1 + i % 3)
                    .map(|k| {
                        turn(
                            vec![Span {
                                seed: i * 7 + k,
                                len: 64 + (i as u32 % 5) * 30,
                            }],
                            8 + (i as u32 % 4),
                            20,
                        )
                    })
                    .collect(),
            })
            .collect(),
    };
    let mut r = Replay::new(&w, config(2, Policy::Kv)).unwrap();
    let mut peak = 0;
    while r.next_event().is_some() {
        assert!(r.sessions_in_flight() <= 5);
        peak = peak.max(r.sessions_in_flight());
    }
    assert_eq!(peak, 5);
    let out = r.finish();
    assert_eq!(out.records.len(), w.requests());
    assert_eq!(out.max_sessions_in_flight, 5);
    // Every session's turns are sequential and separated by the think time.
    let mut by_session: BTreeMap<u64, Vec<&workload::RequestRecord>> = BTreeMap::new();
    for rec in &out.records {
        by_session.entry(rec.session).or_default().push(rec);
    }
    for recs in by_session.values() {
        for pair in recs.windows(2) {
            assert!(pair[1].start_ms >= pair[0].start_ms + pair[0].e2e_ms + 20.0 - 1e-6);
        }
    }
}

#[test]
fn the_same_seed_gives_the_same_records() {
    let w = shared_prefix(20);
    for policy in [Policy::Kv, Policy::Random, Policy::LeastLoad] {
        let mut c = config(4, policy);
        c.seed = 9;
        let a = replay(&w, c.clone()).unwrap();
        let b = replay(&w, c).unwrap();
        assert_eq!(a.records, b.records);
        assert_eq!(a.end, b.end);
    }
}

#[test]
fn stop_at_abandons_later_turns_and_sessions() {
    let w = Workload {
        name: "stop".into(),
        pacing: Pacing::Closed { concurrency: 2 },
        vocab: Vocab::default(),
        sessions: (0..100)
            .map(|i| Session {
                id: i,
                start: Duration::ZERO,
                group: 0,
                turns: vec![turn(vec![Span { seed: i, len: 64 }], 32, 0); 3],
            })
            .collect(),
    };
    let mut c = config(1, Policy::Kv);
    c.stop_at = Some(50 * MS);
    let out = replay(&w, c).unwrap();
    assert!(!out.records.is_empty());
    assert!(out.records.len() < w.requests());
    assert!(out.records.iter().all(|r| r.start_ms < 50.0));
}

/// A turn: shared-prefix length (first turn only), own length, output tokens, think ms.
type TurnSpec = (u32, u32, u32, u64);

#[derive(Debug, Clone)]
struct Case {
    engines: usize,
    policy: Policy,
    closed: Option<u32>,
    sessions: Vec<(u64, Vec<TurnSpec>)>,
    event_delay_ms: u64,
}

fn case() -> impl Strategy<Value = Case> {
    let policy = prop_oneof![
        Just(Policy::Kv),
        Just(Policy::RoundRobin),
        Just(Policy::Random),
        Just(Policy::LeastLoad),
        Just(Policy::PrefixOnly),
    ];
    // A session: start (ms) and turns of (shared-prefix length, own length, output, think ms).
    let session = (
        0u64..3_000,
        proptest::collection::vec((0u32..200, 1u32..150, 1u32..40, 0u64..200), 1..4),
    );
    (
        1usize..5,
        policy,
        proptest::option::of(1u32..6),
        proptest::collection::vec(session, 1..12),
        0u64..50,
    )
        .prop_map(|(engines, policy, closed, sessions, event_delay_ms)| Case {
            engines,
            policy,
            closed,
            sessions,
            event_delay_ms,
        })
}

fn build(c: &Case) -> Workload {
    Workload {
        name: "prop".into(),
        pacing: c
            .closed
            .map_or(Pacing::Open, |concurrency| Pacing::Closed { concurrency }),
        vocab: Vocab::default(),
        sessions: c
            .sessions
            .iter()
            .enumerate()
            .map(|(i, (start, turns))| Session {
                id: i as u64,
                start: Duration::from_millis(*start),
                group: (i % 2) as u32,
                turns: turns
                    .iter()
                    .enumerate()
                    .map(|(k, &(shared, own, out, think))| {
                        let mut user = Vec::new();
                        if k == 0 && shared > 0 {
                            user.push(Span {
                                seed: (i % 2) as u64,
                                len: shared,
                            });
                        }
                        user.push(Span {
                            seed: 1_000 + i as u64 * 10 + k as u64,
                            len: own,
                        });
                        turn(user, out, think)
                    })
                    .collect(),
            })
            .collect(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Every request completes exactly once with all its tokens, the clock never goes
    /// backwards, closed loop stays within its concurrency, and the router's in-flight
    /// accounting is empty at the end.
    #[test]
    fn every_request_completes_once_and_time_only_moves_forward(c in case()) {
        let w = build(&c);
        let mut cfg = config(c.engines, c.policy);
        cfg.event_delay = c.event_delay_ms * MS;
        let mut r = Replay::new(&w, cfg).unwrap();
        let mut last = 0;
        while let Some(t) = r.next_event() {
            prop_assert!(t >= last, "time went back from {} to {}", last, t);
            last = t;
            if let Some(n) = c.closed {
                prop_assert!(r.sessions_in_flight() <= n as usize);
            }
        }
        prop_assert_eq!(r.requests_in_flight(), 0);
        prop_assert_eq!(r.router().inflight_len(), 0);
        let out = r.finish();
        let mut seen = BTreeSet::new();
        for rec in &out.records {
            prop_assert_eq!(rec.status, Status::Ok);
            prop_assert!(seen.insert((rec.session, rec.turn)), "twice: {:?}", (rec.session, rec.turn));
            let want = w.sessions[rec.session as usize].turns[rec.turn as usize].max_tokens;
            prop_assert_eq!(rec.output_tokens, want);
            prop_assert!(rec.ttft_ms.unwrap() <= rec.e2e_ms);
            prop_assert!(rec.cached_tokens.unwrap() <= rec.prompt_tokens);
            prop_assert!(rec.endpoint.as_deref().unwrap().parse::<usize>().unwrap() < c.engines);
        }
        prop_assert_eq!(seen.len(), w.requests());
    }
}

/// A prefix, then fillers that push it out of both engines' small GPU caches, then the prefix
/// again.
fn evicted_prefix() -> Workload {
    let prompt = |seed: u64, tail: u64| vec![Span { seed, len: 600 }, Span { seed: tail, len: 8 }];
    let mut prompts = vec![prompt(42, 1)];
    prompts.extend((0..6).map(|i| prompt(100 + i, 2)));
    prompts.push(prompt(42, 3));
    Workload {
        name: "evicted-prefix".into(),
        pacing: Pacing::Open,
        vocab: Vocab::default(),
        sessions: prompts
            .into_iter()
            .enumerate()
            .map(|(i, user)| Session {
                id: i as u64,
                start: Duration::from_secs(2 * i as u64),
                group: 0,
                turns: vec![turn(user, 4, 0)],
            })
            .collect(),
    }
}

#[test]
fn the_nodes_block_manager_serves_a_prefix_evicted_from_every_gpu() {
    let w = evicted_prefix();
    let run = |node: Option<replay::NodeTierConfig>| {
        let mut c = config(2, Policy::Kv);
        // 47 usable blocks of 16 tokens: one 38-block prompt fits, two do not.
        c.engine.num_gpu_blocks = 48;
        c.engine.max_model_len = 752;
        c.node_tier = node;
        replay(&w, c).unwrap()
    };
    let last = |out: &replay::ReplayOutput| {
        out.records
            .iter()
            .find(|r| r.session == 7)
            .cloned()
            .unwrap()
    };
    let without = run(None);
    assert_eq!(last(&without).cached_tokens, Some(0), "evicted everywhere");
    assert!(without.node.is_none());
    let with = run(Some(replay::NodeTierConfig {
        host_blocks: 1024,
        disk_blocks: 0,
        async_disk_loads: false,
    }));
    let again = last(&with);
    assert!(again.cached_tokens.unwrap() >= 37 * 16, "{again:?}");
    assert!(
        again.ttft_ms.unwrap() < last(&without).ttft_ms.unwrap(),
        "a load from host memory beats recomputing: {:?} vs {:?}",
        again.ttft_ms,
        last(&without).ttft_ms
    );
    let node = with.node.unwrap();
    assert!(node.offloaded >= 8 * 37, "{node:?}");
    assert!(node.onboarded_host >= 37, "{node:?}");
    assert!(with.router.events_applied > without.router.events_applied);
    assert_eq!(
        with.router.normalize_errors, 0,
        "the engines' streams stay whole"
    );
    // With a tiny host memory and a disk, the prefix comes back from disk.
    let disk = run(Some(replay::NodeTierConfig {
        host_blocks: 8,
        disk_blocks: 1024,
        async_disk_loads: false,
    }));
    let node = disk.node.unwrap();
    assert!(node.onboarded_disk >= 30, "{node:?}");
    let from_disk = last(&disk);
    assert!(from_disk.cached_tokens.unwrap() >= 37 * 16);
    assert!(
        from_disk.ttft_ms.unwrap() > again.ttft_ms.unwrap(),
        "disk loads slower than host memory: {:?} vs {:?}",
        from_disk.ttft_ms,
        again.ttft_ms
    );
}
