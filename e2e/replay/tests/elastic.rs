#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]
//! The replay with prefill/decode roles and a pool that changes while it runs: engines added
//! after a start-up delay, engines drained and removed.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use engine_model::{Nanos, Preset};
use proptest::prelude::*;
use replay::{Life, MS, Replay, ReplayConfig, ReplayError, replay};
use scheduler::{Role, SchedulerConfig};
use workload::{Pacing, Session, Span, Status, Turn, Vocab, Workload};

/// `n` single-turn sessions `gap_ms` apart with `prompt`-token prompts (unshared) and
/// `output` output tokens.
fn sessions(n: u64, gap_ms: u64, prompt: u32, output: u32) -> Workload {
    Workload {
        name: "w".into(),
        pacing: Pacing::Open,
        vocab: Vocab::default(),
        sessions: (0..n)
            .map(|i| Session {
                id: i,
                start: Duration::from_millis(i * gap_ms),
                group: 0,
                turns: vec![Turn {
                    user: vec![Span {
                        seed: 7 + i,
                        len: prompt,
                    }],
                    max_tokens: output,
                    think: Duration::ZERO,
                }],
            })
            .collect(),
    }
}

fn pd(prefill: usize, decode: usize) -> ReplayConfig {
    let mut c = ReplayConfig::new(prefill + decode, Preset::Small.config());
    c.prefill_engines = prefill;
    c.scheduler = SchedulerConfig::default();
    c.scheduler.disaggregation.enabled = true;
    c.scheduler.disaggregation.min_uncached_blocks = 4;
    c
}

#[test]
fn disaggregated_requests_prefill_on_one_engine_and_decode_on_another() {
    let w = sessions(20, 100, 4000, 32);
    let out = replay(&w, pd(2, 2)).unwrap();
    assert_eq!(out.records.len(), 20);
    for r in &out.records {
        assert_eq!(r.status, Status::Ok);
        assert_eq!(
            r.output_tokens, 32,
            "every output token from the decode engine"
        );
        let e: usize = r.endpoint.as_deref().unwrap().parse().unwrap();
        assert!(e >= 2, "the client's engine is a decode engine: {e}");
        // The decode engine pulled the prompt's full blocks (16-token blocks: 3,984 of 4,000).
        assert_eq!(r.cached_tokens, Some(3984), "{r:?}");
    }
    // The prefill engines computed the prompts; the decode engines only the last block.
    let prompt_tokens: Vec<u64> = out.engines.iter().map(|e| e.prompt_tokens).collect();
    assert!(
        prompt_tokens[0] + prompt_tokens[1] == 20 * 4000,
        "{prompt_tokens:?}"
    );
    let generated: Vec<u64> = out.engines.iter().map(|e| e.generation_tokens).collect();
    assert_eq!(generated[0] + generated[1], 20, "one token per prefill leg");
    assert_eq!(generated[2] + generated[3], 20 * 32);
    assert!(out.lives.iter().all(|l| l.gone_at.is_none()));
}

#[test]
fn a_pool_without_disaggregation_or_decode_engines_is_refused() {
    let w = sessions(1, 0, 100, 2);
    let mut c = pd(1, 1);
    c.scheduler.disaggregation.enabled = false;
    assert!(matches!(replay(&w, c), Err(ReplayError::Disaggregation)));
    assert!(matches!(
        replay(&w, pd(2, 0)),
        Err(ReplayError::Disaggregation)
    ));
}

#[test]
fn added_engines_serve_after_their_start_up_and_drained_ones_leave_when_idle() {
    // 200 requests, one every 50 ms, each ~0.1–0.3 s of work.
    let w = sessions(200, 50, 1500, 64);
    let mut c = ReplayConfig::new(1, Preset::Small.config());
    c.scheduler.policy = scheduler::Policy::RoundRobin;
    let mut r = Replay::new(&w, c).unwrap();
    r.run_until(2_000 * MS);
    let added = r.add_engine(Role::Both, 1_000 * MS).unwrap();
    assert_eq!(added, 1);
    r.run_until(5_000 * MS);
    assert!(r.remove_engine(0));
    assert!(!r.remove_engine(0), "already draining");
    let drained_at = r.now();
    while r.next_event().is_some() {}
    let out = r.finish();
    assert_eq!(out.records.len(), 200);
    let lives = &out.lives;
    assert_eq!(lives[1].added_at, 2_000 * MS);
    assert_eq!(lives[1].ready_at, Some(3_000 * MS));
    let gone = lives[0].gone_at.unwrap();
    assert!(gone >= drained_at);
    for rec in &out.records {
        let e: usize = rec.endpoint.as_deref().unwrap().parse().unwrap();
        let sent = (rec.start_ms * 1e6).round() as Nanos;
        match e {
            0 => assert!(sent <= drained_at, "sent to engine 0 after it drained"),
            1 => assert!(sent >= 3_000 * MS, "sent to engine 1 before it was ready"),
            _ => panic!("{e}"),
        }
        let finished = sent + (rec.e2e_ms * 1e6).round() as Nanos;
        if e == 0 {
            assert!(
                finished <= gone + 1,
                "engine 0 left before its request finished"
            );
        }
    }
    assert_eq!(r_engine_lives(&out.lives), vec![Life::Gone, Life::Serving]);
}

fn r_engine_lives(lives: &[replay::EngineLife]) -> Vec<Life> {
    lives
        .iter()
        .map(|l| match (l.ready_at, l.gone_at) {
            (_, Some(_)) => Life::Gone,
            (Some(_), None) => Life::Serving,
            (None, None) => Life::Starting,
        })
        .collect()
}

#[test]
fn removing_a_starting_engine_drops_it_at_once() {
    let w = sessions(20, 100, 200, 8);
    let mut r = Replay::new(&w, ReplayConfig::new(1, Preset::Small.config())).unwrap();
    r.run_until(100 * MS);
    let e = r.add_engine(Role::Both, 10_000 * MS).unwrap();
    r.run_until(500 * MS);
    assert!(r.remove_engine(e));
    let views: Vec<_> = r.engines().collect();
    assert_eq!(views[1].life, Life::Gone);
    while r.next_event().is_some() {}
    let out = r.finish();
    assert_eq!(out.lives[1].gone_at, Some(500 * MS));
    assert_eq!(out.lives[1].ready_at, None);
    assert!(
        out.records
            .iter()
            .all(|r| r.endpoint.as_deref() == Some("0"))
    );
}

#[derive(Debug, Clone)]
enum Op {
    Add(Role, u64),
    Remove(usize),
}

fn op() -> impl Strategy<Value = (u64, Op)> {
    (
        0u64..4_000,
        prop_oneof![
            (
                prop_oneof![Just(Role::Prefill), Just(Role::Decode)],
                0u64..800
            )
                .prop_map(|(r, s)| Op::Add(r, s)),
            (0usize..8).prop_map(Op::Remove),
        ],
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random additions and removals during a random disaggregated workload: every request
    /// completes exactly once with all its tokens, was sent to a decode engine that was serving
    /// then, finished before its engine left; the in-flight accounting ends empty.
    #[test]
    fn any_scaling_sequence_completes_every_request_once(
        n in 5u64..40,
        gap in 20u64..200,
        prompt in 100u32..3000,
        output in 2u32..40,
        mut ops in proptest::collection::vec(op(), 0..10),
    ) {
        let w = sessions(n, gap, prompt, output);
        let mut r = Replay::new(&w, pd(1, 1)).unwrap();
        ops.sort_by_key(|(at, _)| *at);
        // When each engine was removed (routing stopped).
        let mut removed: BTreeMap<usize, Nanos> = BTreeMap::new();
        for (at, op) in ops {
            r.run_until(at * MS);
            match op {
                Op::Add(role, start_up) => {
                    r.add_engine(role, start_up * MS).unwrap();
                }
                Op::Remove(e) => {
                    // Keep one serving engine of each role, as the autoscaler's minimums do.
                    let views: Vec<_> = r.engines().collect();
                    let Some(v) = views.get(e) else { continue };
                    let serving = views
                        .iter()
                        .filter(|x| x.role == v.role && x.life == Life::Serving)
                        .count();
                    if v.life == Life::Serving && serving < 2 {
                        continue;
                    }
                    let now = r.now();
                    if r.remove_engine(e) {
                        removed.insert(e, now);
                    }
                }
            }
        }
        while r.next_event().is_some() {}
        prop_assert_eq!(r.requests_in_flight(), 0);
        prop_assert_eq!(r.router().inflight_len(), 0);
        let out = r.finish();
        prop_assert_eq!(out.records.len(), n as usize);
        let sessions: BTreeSet<u64> = out.records.iter().map(|r| r.session).collect();
        prop_assert_eq!(sessions.len(), n as usize);
        for rec in &out.records {
            prop_assert_eq!(rec.status, Status::Ok);
            prop_assert_eq!(rec.output_tokens, output);
            let e: usize = rec.endpoint.as_deref().unwrap().parse().unwrap();
            let life = out.lives[e];
            prop_assert_ne!(life.role, Role::Prefill);
            let sent = (rec.start_ms * 1e6).round() as Nanos;
            prop_assert!(life.ready_at.is_some_and(|t| t <= sent), "{rec:?} {life:?}");
            prop_assert!(removed.get(&e).is_none_or(|&t| sent <= t), "{rec:?} {life:?}");
            let done = sent + (rec.e2e_ms * 1e6).round() as Nanos;
            prop_assert!(life.gone_at.is_none_or(|g| done <= g + 1), "{rec:?} {life:?}");
        }
    }
}
