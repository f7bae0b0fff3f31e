//! Shared bench helpers: a seeded RNG, env-configurable sizes, percentiles.

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

/// SplitMix64: small, seeded, good enough for workloads.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A well-mixed 64-bit value from two inputs (stands in for the chained xxh3 of real keys).
pub fn mix(a: u64, b: u64) -> u64 {
    let mut r = Rng::new(a ^ b.rotate_left(32) ^ 0xA076_1D64_78BD_642F);
    r.next()
}

pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The index configuration every bench builds: the default, with the shard count from
/// `KVGATE_BENCH_SHARDS` when set, and `capacity` residencies.
pub fn index_config(capacity: usize) -> kv_index::IndexConfig {
    let default = kv_index::IndexConfig::default();
    kv_index::IndexConfig {
        shards: env_usize("KVGATE_BENCH_SHARDS", default.shards),
        capacity,
    }
}

/// (p50, p99, max) of a sample set, in nanoseconds.
pub fn percentiles(samples: &mut [Duration]) -> (u128, u128, u128) {
    samples.sort_unstable();
    let at = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(i).map_or(0, Duration::as_nanos)
    };
    (at(0.5), at(0.99), at(1.0))
}

#[allow(clippy::print_stdout)]
pub fn report(line: &str) {
    println!("{line}");
}

/// Whether cargo asked for a benchmark run. `cargo bench` passes `--bench`; test runners that
/// build every target (`cargo test --all-targets`, nextest's `--list`) do not, and then these
/// custom-harness binaries must do nothing: they list no tests and run no benchmark.
pub fn bench_requested() -> bool {
    let mut args = std::env::args().skip(1);
    args.any(|a| a == "--bench")
}
