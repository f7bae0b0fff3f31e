//! A run's figures from its [`RequestRecord`]s: counts, latency percentiles, throughput,
//! goodput and prefix-cache hit rate over a measurement window.
//!
//! A record belongs to the window when it *started* inside it (`from ≤ start_ms < to`).
//! Latency figures are over successful requests only; throughput is successful requests'
//! output tokens (and requests) divided by the window's length. Percentiles are nearest-rank
//! ([`crate::percentile`]).

use serde::{Deserialize, Serialize};

use crate::percentile::{Sorted, Stats};
use crate::record::{RequestRecord, Status};

/// The service-level objective goodput counts against. [`Default`] is seed 001's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Time to first token at most this, in milliseconds.
    pub ttft_ms: f64,
    /// Time per output token at most this, in milliseconds (requests of one output token have
    /// no TPOT and meet it).
    pub tpot_ms: f64,
}

impl Default for Slo {
    fn default() -> Self {
        Self {
            ttft_ms: 600.0,
            tpot_ms: 60.0,
        }
    }
}

impl Slo {
    /// Whether `r` succeeded within the objective.
    #[must_use]
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        r.status == Status::Ok
            && r.ttft_ms.is_some_and(|t| t <= self.ttft_ms)
            && r.tpot_ms.is_none_or(|t| t <= self.tpot_ms)
    }
}

/// The measurement window, in milliseconds from the start of the run: `[from_ms, to_ms)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// Start, inclusive.
    pub from_ms: f64,
    /// End, exclusive; after `from_ms` for rates to mean anything.
    pub to_ms: f64,
}

impl Window {
    /// From the first request's start to the last request's end: the whole run.
    #[must_use]
    pub fn covering(records: &[RequestRecord]) -> Self {
        let from_ms = records
            .iter()
            .map(|r| r.start_ms)
            .fold(f64::INFINITY, f64::min);
        let to_ms = records
            .iter()
            .map(|r| r.start_ms + r.e2e_ms)
            .fold(f64::NEG_INFINITY, f64::max);
        if from_ms.is_finite() && to_ms.is_finite() {
            // Open at the end, so the last request is inside.
            Self {
                from_ms,
                to_ms: to_ms.max(from_ms) + f64::EPSILON.max(to_ms.abs() * f64::EPSILON),
            }
        } else {
            Self {
                from_ms: 0.0,
                to_ms: 0.0,
            }
        }
    }

    /// Whether a request that started at `start_ms` counts.
    #[must_use]
    pub fn contains(&self, start_ms: f64) -> bool {
        self.from_ms <= start_ms && start_ms < self.to_ms
    }

    /// Length in seconds (0 when empty or inverted).
    #[must_use]
    pub fn seconds(&self) -> f64 {
        ((self.to_ms - self.from_ms) / 1_000.0).max(0.0)
    }
}

/// One run's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The records' run label.
    pub run: String,
    /// The records' load, when they carry one.
    pub load: Option<f64>,
    /// The window summarized.
    pub window: Window,
    /// Requests that started in the window.
    pub requests: usize,
    /// Of those, the successful.
    pub ok: usize,
    /// Of those, the failed (any status but [`Status::Ok`]).
    pub failed: usize,
    /// Of the failed, those refused with HTTP 429.
    pub rejected: usize,
    /// Time to first token, ms.
    pub ttft_ms: Stats,
    /// Time per output token after the first, ms.
    pub tpot_ms: Stats,
    /// Send to last byte, ms.
    pub e2e_ms: Stats,
    /// Successful requests' output tokens per second of window.
    pub output_tokens_per_s: f64,
    /// Successful requests per second of window.
    pub requests_per_s: f64,
    /// The objective goodput counted against.
    pub slo: Slo,
    /// Requests meeting the objective.
    pub good: usize,
    /// Requests meeting the objective per second of window.
    pub goodput_per_s: f64,
    /// Σ cached ÷ Σ prompt tokens over successful requests that report cached tokens; `None`
    /// when none do.
    pub prefix_hit_rate: Option<f64>,
}

/// Summarizes the records of one run that started inside `window`. `run` and `load` are taken
/// from the first record in the window (callers pass one run's records; see [`summarize_runs`]).
#[must_use]
pub fn summarize(records: &[RequestRecord], window: Window, slo: Slo) -> Summary {
    let inside: Vec<&RequestRecord> = records
        .iter()
        .filter(|r| window.contains(r.start_ms))
        .collect();
    let ok: Vec<&RequestRecord> = inside
        .iter()
        .copied()
        .filter(|r| r.status == Status::Ok)
        .collect();
    let seconds = window.seconds();
    let per_s = |x: f64| if seconds > 0.0 { x / seconds } else { 0.0 };
    let stats = |f: fn(&RequestRecord) -> Option<f64>| {
        Sorted::new(ok.iter().filter_map(|r| f(r)).collect()).stats()
    };
    let (cached, prompt) = ok
        .iter()
        .filter_map(|r| {
            r.cached_tokens
                .map(|c| (u64::from(c), u64::from(r.prompt_tokens)))
        })
        .fold((0u64, 0u64), |(c, p), (dc, dp)| (c + dc, p + dp));
    let output: u64 = ok.iter().map(|r| u64::from(r.output_tokens)).sum();
    let good = inside.iter().filter(|r| slo.met_by(r)).count();
    let first = inside.first().copied().or(records.first());
    Summary {
        run: first.map(|r| r.run.clone()).unwrap_or_default(),
        load: first.and_then(|r| r.load),
        window,
        requests: inside.len(),
        ok: ok.len(),
        failed: inside.len() - ok.len(),
        rejected: inside
            .iter()
            .filter(|r| r.status != Status::Ok && r.http_status == Some(429))
            .count(),
        ttft_ms: stats(|r| r.ttft_ms),
        tpot_ms: stats(|r| r.tpot_ms),
        e2e_ms: stats(|r| Some(r.e2e_ms)),
        output_tokens_per_s: per_s(output as f64),
        requests_per_s: per_s(ok.len() as f64),
        slo,
        good,
        goodput_per_s: per_s(good as f64),
        prefix_hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
    }
}

/// Splits records by (run, load), in order of first appearance, and summarizes each group over
/// the window `window_of` gives for its records (for example [`Window::covering`], or a window
/// after a warm-up).
#[must_use]
pub fn summarize_runs(
    records: &[RequestRecord],
    window_of: impl Fn(&[RequestRecord]) -> Window,
    slo: Slo,
) -> Vec<Summary> {
    // (run, load bits) → that run's records.
    type Key = (String, Option<u64>);
    let mut groups: Vec<(Key, Vec<RequestRecord>)> = Vec::new();
    for r in records {
        let key = (r.run.clone(), r.load.map(f64::to_bits));
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, group)) => group.push(r.clone()),
            None => groups.push((key, vec![r.clone()])),
        }
    }
    groups
        .into_iter()
        .map(|(_, group)| summarize(&group, window_of(&group), slo))
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]
    use super::*;

    fn record(start_ms: f64, ttft: f64, tpot: f64, status: Status) -> RequestRecord {
        RequestRecord {
            run: "kv".into(),
            load: Some(60.0),
            session: 0,
            turn: 0,
            group: 0,
            start_ms,
            ttft_ms: (status == Status::Ok).then_some(ttft),
            tpot_ms: (status == Status::Ok).then_some(tpot),
            e2e_ms: ttft + 99.0 * tpot,
            prompt_tokens: 1_000,
            output_tokens: if status == Status::Ok { 100 } else { 0 },
            cached_tokens: (status == Status::Ok).then_some(900),
            status,
            http_status: Some(if status == Status::Ok { 200 } else { 429 }),
            endpoint: None,
            error: None,
        }
    }

    #[test]
    fn counts_rates_goodput_and_hit_rate() {
        let records = vec![
            record(0.0, 100.0, 20.0, Status::Ok),     // before the window
            record(1_000.0, 200.0, 20.0, Status::Ok), // good
            record(2_000.0, 700.0, 20.0, Status::Ok), // TTFT too slow
            record(3_000.0, 300.0, 70.0, Status::Ok), // TPOT too slow
            record(4_000.0, 0.0, 0.0, Status::HttpError),
            record(11_000.0, 100.0, 20.0, Status::Ok), // after
        ];
        let window = Window {
            from_ms: 1_000.0,
            to_ms: 11_000.0,
        };
        let s = summarize(&records, window, Slo::default());
        assert_eq!(
            (s.requests, s.ok, s.failed, s.rejected, s.good),
            (4, 3, 1, 1, 1)
        );
        assert_eq!(s.ttft_ms.p50, Some(300.0));
        assert_eq!(s.ttft_ms.p99, Some(700.0));
        assert_eq!(s.tpot_ms.p50, Some(20.0));
        assert!((s.output_tokens_per_s - 30.0).abs() < 1e-9);
        assert!((s.requests_per_s - 0.3).abs() < 1e-9);
        assert!((s.goodput_per_s - 0.1).abs() < 1e-9);
        assert!((s.prefix_hit_rate.unwrap() - 0.9).abs() < 1e-9);
        assert_eq!(s.run, "kv");
        assert_eq!(s.load, Some(60.0));
        let relaxed = summarize(
            &records,
            window,
            Slo {
                ttft_ms: 1_000.0,
                tpot_ms: 100.0,
            },
        );
        assert_eq!(relaxed.good, 3);
    }

    #[test]
    fn runs_are_split_by_label_and_load_and_the_covering_window_takes_everything() {
        let mut records = vec![
            record(0.0, 100.0, 20.0, Status::Ok),
            record(5.0, 100.0, 20.0, Status::Ok),
        ];
        let mut other = record(0.0, 100.0, 20.0, Status::Ok);
        other.run = "round-robin".into();
        records.push(other);
        let mut higher = record(0.0, 100.0, 20.0, Status::Ok);
        higher.load = Some(120.0);
        records.push(higher);
        let runs = summarize_runs(&records, Window::covering, Slo::default());
        let keys: Vec<(&str, Option<f64>, usize)> = runs
            .iter()
            .map(|s| (s.run.as_str(), s.load, s.requests))
            .collect();
        assert_eq!(
            keys,
            [
                ("kv", Some(60.0), 2),
                ("round-robin", Some(60.0), 1),
                ("kv", Some(120.0), 1)
            ]
        );
        let empty = summarize(&[], Window::covering(&[]), Slo::default());
        assert_eq!(
            (
                empty.requests,
                empty.output_tokens_per_s,
                empty.prefix_hit_rate
            ),
            (0, 0.0, None)
        );
    }
}
