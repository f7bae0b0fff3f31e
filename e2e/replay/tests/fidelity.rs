#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]
//! Fidelity against seed 001 (the DOKS demo): the round-robin replay of its workload on three
//! `h200-llama70b-fp8` engines reproduces the seed's round-robin TTFT p50/p95, ITL p50 and
//! output tokens/s at concurrency 60–180 within ±25%.
//!
//! Each level replays 60 s of warm-up and 300 s of measurement, as the seed measured. Two
//! figures come from the seed's setup rather than its engines (see `docs/benchmarks.md`):
//! 200 ms from the client's send to the engine (the seed's TTFT is client-side, through a
//! gateway and Dynamo's frontend, which applies the chat template and tokenizes; the seed's
//! engine-side TTFT stayed under 0.26 s while the client's p50 was 0.41 s), and a 3 s think
//! time before each follow-up turn (the seed's user is a Llama-3.1-8B on a serverless endpoint
//! writing the next question from the previous answer). About a second per level: the workspace
//! optimises the replay's crates in test builds too, so it runs with the other tests.

use std::time::Duration;

use engine_model::Preset;
use replay::{MS, ReplayConfig, replay};
use scheduler::{Policy, SchedulerConfig};
use workload::{DoksOptions, Slo, Summary, Window, doks, summarize};

/// Seed 001's round-robin columns: concurrency, TTFT p50, TTFT p95, ITL p50 (ms), output tok/s.
const SEED_RR: [(u32, f64, f64, f64, f64); 7] = [
    (60, 274.0, 655.0, 28.0, 2146.9),
    (80, 306.0, 637.0, 31.0, 2543.2),
    (100, 342.0, 652.0, 38.0, 2547.5),
    (120, 375.0, 643.0, 45.0, 2642.6),
    (140, 398.0, 643.0, 49.0, 2816.8),
    (160, 422.0, 722.0, 51.0, 3126.8),
    (180, 413.0, 732.0, 52.0, 3434.0),
];

const WARMUP_S: u64 = 60;
const THINK_MS: u64 = 3_000;
const REQUEST_LATENCY_MS: u64 = 200;
const MEASURE_S: u64 = 300;

/// The seed's workload and setup at `concurrency` under `policy`.
fn doks_run(concurrency: u32, policy: Policy) -> Summary {
    let stop_s = WARMUP_S + MEASURE_S;
    let mut w = doks(&DoksOptions {
        sessions: concurrency as usize * (2 + stop_s as usize / 15),
        concurrency,
        ..DoksOptions::default()
    });
    for session in &mut w.sessions {
        for turn in session.turns.iter_mut().skip(1) {
            turn.think = Duration::from_millis(THINK_MS);
        }
    }
    let mut c = ReplayConfig::new(3, Preset::H200Llama70bFp8.config());
    c.scheduler = SchedulerConfig {
        policy,
        ..SchedulerConfig::default()
    };
    c.run = policy.to_string();
    c.load = Some(f64::from(concurrency));
    c.stop_at = Some(stop_s * 1_000 * MS);
    c.request_latency = REQUEST_LATENCY_MS * MS;
    let out = replay(&w, c).unwrap();
    summarize(
        &out.records,
        Window {
            from_ms: WARMUP_S as f64 * 1e3,
            to_ms: stop_s as f64 * 1e3,
        },
        Slo::default(),
    )
}

fn rel(got: f64, want: f64) -> f64 {
    (got - want) / want
}

#[test]
fn round_robin_matches_the_seed_within_25_percent() {
    let mut worst: f64 = 0.0;
    let mut lines = Vec::new();
    for (c, ttft50, ttft95, itl50, tops) in SEED_RR {
        let s = doks_run(c, Policy::RoundRobin);
        let nan = f64::NAN;
        let got = [
            s.ttft_ms.p50.unwrap_or(nan),
            s.ttft_ms.p95.unwrap_or(nan),
            s.tpot_ms.p50.unwrap_or(nan),
            s.output_tokens_per_s,
        ];
        let want = [ttft50, ttft95, itl50, tops];
        let errs: Vec<f64> = got.iter().zip(want).map(|(g, w)| rel(*g, w)).collect();
        worst = errs.iter().fold(worst, |m, e| {
            if e.is_nan() {
                f64::INFINITY
            } else {
                m.max(e.abs())
            }
        });
        lines.push(format!(
            "c={c}: ttft p50 {:.0} ({:+.0}%), p95 {:.0} ({:+.0}%), itl p50 {:.1} ({:+.0}%), \
             tok/s {:.0} ({:+.0}%), hit {:.1}%",
            got[0],
            100.0 * errs[0],
            got[1],
            100.0 * errs[1],
            got[2],
            100.0 * errs[2],
            got[3],
            100.0 * errs[3],
            100.0 * s.prefix_hit_rate.unwrap_or(0.0),
        ));
    }
    let report = lines.join("\n");
    eprintln!("{report}");
    assert!(worst <= 0.25, "worst relative error {worst:.2}\n{report}");
}
