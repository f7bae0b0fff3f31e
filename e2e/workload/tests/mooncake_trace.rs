//! The real Mooncake conversation trace from `../shared/traces` (or `$KVGATE_SHARED/traces`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::io::BufReader;
use std::path::PathBuf;
use std::time::Duration;

use workload::{MooncakeOptions, Pacing, read_mooncake};

/// The shared trace; a missing one fails the test (the bootstrap's `../shared` holds it).
fn trace() -> PathBuf {
    let shared = std::env::var_os("KVGATE_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    let path = shared.join("traces/mooncake_conversation_trace.jsonl");
    assert!(
        path.is_file(),
        "{} not found (set KVGATE_SHARED)",
        path.display()
    );
    path
}

#[test]
fn the_whole_trace_reads_into_12031_sessions() {
    let path = trace();
    let file = BufReader::new(std::fs::File::open(&path).unwrap());
    let w = read_mooncake(file, &MooncakeOptions::default()).unwrap();
    assert_eq!(w.pacing, Pacing::Open);
    assert_eq!(w.sessions.len(), 12_031);
    assert_eq!(w.requests(), 12_031);
    assert!(w.sessions.windows(2).all(|p| p[0].start <= p[1].start));
    let last = w.sessions.last().unwrap().start;
    assert!(
        last > Duration::from_secs(3_500) && last <= Duration::from_secs(3_600),
        "{last:?}"
    );
    let mean_input = w.sessions.iter().map(|s| s.user_tokens()).sum::<u64>() as f64 / 12_031.0;
    assert!(
        (mean_input - 12_035.0).abs() < 50.0,
        "README: ~12,035, got {mean_input}"
    );
    let mean_output = w
        .sessions
        .iter()
        .map(|s| f64::from(s.turns[0].max_tokens))
        .sum::<f64>()
        / 12_031.0;
    assert!(
        (mean_output - 343.0).abs() < 10.0,
        "README: ~343, got {mean_output}"
    );
}

#[test]
fn a_sped_up_window_of_the_trace() {
    let path = trace();
    let options = MooncakeOptions {
        speedup: 10.0,
        window: Some(Duration::from_secs(600)..Duration::from_secs(1_200)),
        limit: Some(500),
        ..MooncakeOptions::default()
    };
    let file = BufReader::new(std::fs::File::open(&path).unwrap());
    let w = read_mooncake(file, &options).unwrap();
    assert_eq!(w.sessions.len(), 500);
    assert!(w.sessions.iter().all(|s| s.start < Duration::from_secs(60)));
}
