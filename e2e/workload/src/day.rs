//! A day-shaped load built from a trace's arrival pattern: the Mooncake conversation trace's
//! arrivals, time-warped onto a diurnal request rate with bursts, and an hour whose requests
//! are prefill-heavy and one whose requests are decode-heavy.
//!
//! **Arrivals.** The trace's arrival times `t_i` (rate `r = N / T`) become unit-rate
//! "operational" times `u_i = r·t_i`; the trace is repeated end to end (`u + k·N` for the
//! `k`-th copy) as often as the day needs. With the day's cumulative rate
//! `Λ(τ) = ∫₀^τ λ(s) ds`, request `i` arrives at `τ_i = Λ⁻¹(u_i)`. So the day keeps the trace's
//! burstiness (its gaps, its simultaneous arrivals) scaled to the rate of the moment.
//!
//! **Rate.** `λ(τ) = peak_rps · diurnal(h) · burst(h)` with `h = τ / hour` the hour of the day:
//! `diurnal(h) = trough + (1 − trough)·(1 + cos(2π (h − peak_hour) / 24)) / 2` (1 at
//! `peak_hour`, `trough` twelve hours away), and `burst(h)` each burst's factor inside it.
//!
//! **Content.** Each request keeps its trace row's prompt blocks and output length; the `k`-th
//! copy of the trace draws its blocks from another seed, so copies share nothing. In the
//! prefill-heavy hour prompts are lengthened by `prefill_isl` (new, unshared blocks) and
//! outputs shortened by `prefill_osl`; in the decode-heavy hour prompts are cut by
//! `decode_isl` and outputs lengthened by `decode_osl`. Prompts are then cut to
//! `max_prompt_tokens` and outputs to `max_output_tokens`. Each session's `group` is its hour
//! of the day.
//!
//! O(requests × spans + hours × `STEPS_PER_HOUR`), deterministic for its inputs.

use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::content::Span;
use crate::mooncake::BLOCK_TOKENS;
use crate::session::{Pacing, Session, Turn, Workload};

/// Resolution of the cumulative rate, steps per hour of the day.
const STEPS_PER_HOUR: usize = 3600;

/// A burst: the rate times `factor` for `hours` from `start_hour`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Burst {
    /// Hour of the day it starts at (fractional).
    pub start_hour: f64,
    /// How long it lasts, in hours of the day.
    pub hours: f64,
    /// Rate multiplier inside it (> 0).
    pub factor: f64,
}

/// How the day is shaped.
#[derive(Debug, Clone, PartialEq)]
pub struct DayOptions {
    /// Hours in the day.
    pub hours: u32,
    /// How long one hour of the day lasts in the replay (compression: 5 min makes a 2-hour
    /// day).
    pub hour: Duration,
    /// Request rate at the diurnal peak, before bursts.
    pub peak_rps: f64,
    /// Rate at the trough as a fraction of the peak, in (0, 1].
    pub trough: f64,
    /// Hour of the diurnal peak.
    pub peak_hour: f64,
    /// Bursts.
    pub bursts: Vec<Burst>,
    /// The hour whose requests are prefill-heavy.
    pub prefill_heavy_hour: Option<u32>,
    /// The hour whose requests are decode-heavy.
    pub decode_heavy_hour: Option<u32>,
    /// Prompt length multiplier in the prefill-heavy hour.
    pub prefill_isl: f64,
    /// Output length multiplier in the prefill-heavy hour.
    pub prefill_osl: f64,
    /// Prompt length multiplier in the decode-heavy hour.
    pub decode_isl: f64,
    /// Output length multiplier in the decode-heavy hour.
    pub decode_osl: f64,
    /// Longest prompt, tokens (longer ones are cut).
    pub max_prompt_tokens: u32,
    /// Longest output, tokens.
    pub max_output_tokens: u32,
    /// Salts the content of the trace's copies.
    pub seed: u64,
}

impl Default for DayOptions {
    /// 24 hours of 5 minutes; the peak at 15:00, a quarter of it at 03:00; bursts of 1.5×
    /// at 10:30 (for 15 minutes of the day) and 1.4× at 19:00 (20 minutes); a prefill-heavy
    /// 13:00 (prompts 2×, outputs ¼) and a decode-heavy 14:00 (prompts ½, outputs 4×);
    /// prompts cut at 16,384 tokens, outputs at 2,048.
    fn default() -> Self {
        Self {
            hours: 24,
            hour: Duration::from_secs(300),
            peak_rps: 8.0,
            trough: 0.25,
            peak_hour: 15.0,
            bursts: vec![
                Burst {
                    start_hour: 10.5,
                    hours: 0.25,
                    factor: 1.5,
                },
                Burst {
                    start_hour: 19.0,
                    hours: 1.0 / 3.0,
                    factor: 1.4,
                },
            ],
            prefill_heavy_hour: Some(13),
            decode_heavy_hour: Some(14),
            prefill_isl: 2.0,
            prefill_osl: 0.25,
            decode_isl: 0.5,
            decode_osl: 4.0,
            max_prompt_tokens: 16_384,
            max_output_tokens: 2_048,
            seed: 1,
        }
    }
}

/// Why a day could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DayError {
    /// An option out of its range.
    #[error("day option {0} is out of range")]
    Options(&'static str),
    /// The trace has no request, or all at one instant.
    #[error("the trace needs requests spread over time")]
    Trace,
}

impl DayError {
    /// A bounded label for metrics and logs.
    #[must_use]
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Options(_) => "options",
            Self::Trace => "trace",
        }
    }
}

impl DayOptions {
    fn validate(&self) -> Result<(), DayError> {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        let checks: [(&'static str, bool); 11] = [
            ("hours", self.hours > 0),
            ("hour", !self.hour.is_zero()),
            ("peak_rps", positive(self.peak_rps)),
            ("trough", positive(self.trough) && self.trough <= 1.0),
            ("peak_hour", self.peak_hour.is_finite()),
            (
                "bursts",
                self.bursts
                    .iter()
                    .all(|b| positive(b.factor) && b.start_hour.is_finite() && b.hours.is_finite()),
            ),
            ("prefill_isl", positive(self.prefill_isl)),
            ("prefill_osl", positive(self.prefill_osl)),
            ("decode_isl", positive(self.decode_isl)),
            ("decode_osl", positive(self.decode_osl)),
            (
                "max_tokens",
                self.max_prompt_tokens > 0 && self.max_output_tokens > 0,
            ),
        ];
        match checks.iter().find(|(_, ok)| !ok) {
            Some((name, _)) => Err(DayError::Options(name)),
            None => Ok(()),
        }
    }

    /// The request rate at hour `h` of the day.
    #[must_use]
    pub fn rate(&self, h: f64) -> f64 {
        let phase = 2.0 * std::f64::consts::PI * (h - self.peak_hour) / 24.0;
        let diurnal = self.trough + (1.0 - self.trough) * (1.0 + phase.cos()) / 2.0;
        let burst: f64 = self
            .bursts
            .iter()
            .filter(|b| h >= b.start_hour && h < b.start_hour + b.hours)
            .map(|b| b.factor)
            .product();
        self.peak_rps * diurnal * burst
    }
}

/// The cumulative rate on a grid of `STEPS_PER_HOUR` steps per hour: `cum[k] = Λ(k·dt)`.
fn cumulative(options: &DayOptions) -> (Vec<f64>, f64) {
    let steps = options.hours as usize * STEPS_PER_HOUR;
    let dt = options.hour.as_secs_f64() / STEPS_PER_HOUR as f64;
    let mut cum = Vec::with_capacity(steps + 1);
    let mut total = 0.0;
    cum.push(0.0);
    for k in 0..steps {
        // Midpoint rule: exact for a rate constant over the step, and bursts change at
        // step boundaries only to within one step.
        let h = (k as f64 + 0.5) / STEPS_PER_HOUR as f64;
        total += options.rate(h) * dt;
        cum.push(total);
    }
    (cum, dt)
}

/// `Λ⁻¹(u)` on the grid (linear inside a step); `None` past the end of the day.
fn invert(cum: &[f64], dt: f64, u: f64) -> Option<f64> {
    let last = *cum.last()?;
    if u > last {
        return None;
    }
    let k = cum.partition_point(|&c| c < u);
    if k == 0 {
        return Some(0.0);
    }
    let (lo, hi) = (*cum.get(k - 1)?, *cum.get(k)?);
    let frac = if hi > lo { (u - lo) / (hi - lo) } else { 0.0 };
    Some(((k - 1) as f64 + frac) * dt)
}

/// A new seed for `seed` in copy `copy` of the trace (copy 0 keeps the trace's seeds).
fn reseed(seed: u64, copy: u64, salt: u64) -> u64 {
    if copy == 0 {
        seed
    } else {
        xxh3_64_with_seed(&seed.to_le_bytes(), salt ^ copy)
    }
}

/// `spans` resized to `tokens` (cut, or extended with spans seeded by `fresh`), in blocks of
/// [`BLOCK_TOKENS`].
fn resize(spans: &[Span], tokens: u32, fresh: u64) -> Vec<Span> {
    let mut out = Vec::new();
    let mut left = tokens.max(1);
    for s in spans {
        if left == 0 {
            break;
        }
        let len = s.len.min(left);
        out.push(Span { seed: s.seed, len });
        left -= len;
    }
    let mut i = 0u64;
    while left > 0 {
        let len = left.min(BLOCK_TOKENS);
        out.push(Span {
            seed: xxh3_64_with_seed(&i.to_le_bytes(), fresh),
            len,
        });
        left -= len;
        i += 1;
    }
    out
}

fn scale(n: u32, factor: f64) -> u32 {
    (f64::from(n) * factor)
        .round()
        .clamp(1.0, f64::from(u32::MAX)) as u32
}

/// Builds the day from `trace` (an open-loop workload of single-turn sessions, such as
/// [`read_mooncake`](crate::read_mooncake)'s at speed-up 1; later turns are ignored).
pub fn day(trace: &Workload, options: &DayOptions) -> Result<Workload, DayError> {
    options.validate()?;
    let rows: Vec<&Session> = trace
        .sessions
        .iter()
        .filter(|s| !s.turns.is_empty())
        .collect();
    let (first, last) = match (rows.first(), rows.last()) {
        (Some(f), Some(l)) => (f.start, l.start),
        _ => return Err(DayError::Trace),
    };
    let span = last.saturating_sub(first).as_secs_f64();
    if span <= 0.0 || rows.len() < 2 {
        return Err(DayError::Trace);
    }
    let n = rows.len() as f64;
    // The trace's mean rate counts the gap before the next copy as one mean gap.
    let rate = n / (span * n / (n - 1.0));
    let (cum, dt) = cumulative(options);
    let hour_s = options.hour.as_secs_f64();
    let salt = xxh3_64_with_seed(b"day", options.seed);
    let mut sessions = Vec::new();
    'copies: for copy in 0u64.. {
        for (i, row) in rows.iter().enumerate() {
            let u = (row.start.saturating_sub(first).as_secs_f64() * rate) + copy as f64 * n;
            let Some(at) = invert(&cum, dt, u) else {
                break 'copies;
            };
            let hour = (at / hour_s).floor() as u32;
            let Some(turn) = row.turns.first() else {
                continue;
            };
            let id = copy * trace.sessions.len() as u64 + i as u64;
            let user: Vec<Span> = turn
                .user
                .iter()
                .map(|s| Span {
                    seed: reseed(s.seed, copy, salt),
                    len: s.len,
                })
                .collect();
            let isl: u32 = user.iter().map(|s| s.len).sum();
            let (isl_factor, osl_factor) = if Some(hour) == options.prefill_heavy_hour {
                (options.prefill_isl, options.prefill_osl)
            } else if Some(hour) == options.decode_heavy_hour {
                (options.decode_isl, options.decode_osl)
            } else {
                (1.0, 1.0)
            };
            let prompt = scale(isl, isl_factor).min(options.max_prompt_tokens);
            let output = scale(turn.max_tokens, osl_factor).min(options.max_output_tokens);
            let fresh = xxh3_64_with_seed(&id.to_le_bytes(), salt);
            sessions.push(Session {
                id,
                start: Duration::from_secs_f64(at),
                group: hour,
                turns: vec![Turn {
                    user: resize(&user, prompt, fresh),
                    max_tokens: output,
                    think: Duration::ZERO,
                }],
            });
        }
    }
    sessions.sort_by_key(|s| s.start);
    Ok(Workload {
        name: "day".into(),
        pacing: Pacing::Open,
        vocab: trace.vocab,
        sessions,
    })
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
    use crate::content::Vocab;

    /// A trace of `n` single-turn rows, one every `gap_ms`, each 1,100 prompt tokens in three
    /// blocks (the first shared) and 100 output tokens.
    fn trace(n: u64, gap_ms: u64) -> Workload {
        Workload {
            name: "t".into(),
            pacing: Pacing::Open,
            vocab: Vocab::default(),
            sessions: (0..n)
                .map(|i| Session {
                    id: i,
                    start: Duration::from_millis(i * gap_ms),
                    group: 0,
                    turns: vec![Turn {
                        user: vec![
                            Span { seed: 0, len: 512 },
                            Span {
                                seed: 10 + i,
                                len: 512,
                            },
                            Span {
                                seed: 1000 + i,
                                len: 76,
                            },
                        ],
                        max_tokens: 100,
                        think: Duration::ZERO,
                    }],
                })
                .collect(),
        }
    }

    fn flat() -> DayOptions {
        DayOptions {
            hours: 4,
            hour: Duration::from_secs(100),
            peak_rps: 2.0,
            trough: 1.0,
            bursts: Vec::new(),
            prefill_heavy_hour: None,
            decode_heavy_hour: None,
            ..DayOptions::default()
        }
    }

    fn per_hour(w: &Workload, hours: usize) -> Vec<usize> {
        let mut counts = vec![0; hours];
        for s in &w.sessions {
            counts[s.group as usize] += 1;
        }
        counts
    }

    #[test]
    fn a_flat_day_has_the_rate_and_repeats_the_trace_with_new_content() {
        // 10 rows one second apart: 400 s at 2 rps is 800 requests, 80 copies.
        let t = trace(10, 1000);
        let w = day(&t, &flat()).unwrap();
        assert!(
            (798..=801).contains(&w.sessions.len()),
            "{}",
            w.sessions.len()
        );
        assert_eq!(per_hour(&w, 4).iter().sum::<usize>(), w.sessions.len());
        for h in per_hour(&w, 4) {
            assert!((198..=202).contains(&h), "{h}");
        }
        assert!(w.sessions.windows(2).all(|p| p[0].start <= p[1].start));
        // Copy 0 keeps the trace's content; copy 1 draws other blocks.
        let by_id = |id: u64| w.sessions.iter().find(|s| s.id == id).unwrap();
        assert_eq!(by_id(3).turns[0].user, t.sessions[3].turns[0].user);
        assert_ne!(by_id(13).turns[0].user[1], t.sessions[3].turns[0].user[1]);
        assert_eq!(
            by_id(13).turns[0].user[0],
            by_id(15).turns[0].user[0],
            "a copy keeps the shared block shared"
        );
        let ids: std::collections::BTreeSet<u64> = w.sessions.iter().map(|s| s.id).collect();
        assert_eq!(ids.len(), w.sessions.len());
    }

    #[test]
    fn the_diurnal_curve_bursts_and_shifted_hours() {
        let options = DayOptions {
            hours: 24,
            hour: Duration::from_secs(60),
            peak_rps: 5.0,
            trough: 0.2,
            peak_hour: 15.0,
            bursts: vec![Burst {
                start_hour: 20.0,
                hours: 1.0,
                factor: 2.0,
            }],
            prefill_heavy_hour: Some(12),
            decode_heavy_hour: Some(16),
            ..DayOptions::default()
        };
        assert!((options.rate(15.0) - 5.0).abs() < 1e-9);
        assert!((options.rate(3.0) - 1.0).abs() < 1e-9);
        assert!((options.rate(20.5) - 2.0 * options.rate(20.5 - 24.0)).abs() < 1e-9);
        let w = day(&trace(50, 200), &options).unwrap();
        let counts = per_hour(&w, 24);
        // Hour 15 at ~5 rps × 60 s; hour 3 at ~1 rps; the burst doubles hour 20.
        assert!((290..=310).contains(&counts[15]), "{counts:?}");
        assert!((55..=65).contains(&counts[3]), "{counts:?}");
        let expect_20 = 2.0 * 60.0 * options.rate(20.5 - 24.0);
        assert!(
            (f64::from(counts[20] as u32) - expect_20).abs() < 0.05 * expect_20,
            "{counts:?}"
        );
        let tokens = |s: &Session| s.turns[0].user.iter().map(|s| s.len).sum::<u32>();
        for s in &w.sessions {
            let (isl, osl) = match s.group {
                12 => (2200, 25),
                16 => (550, 400),
                _ => (1100, 100),
            };
            assert_eq!(
                (tokens(s), s.turns[0].max_tokens),
                (isl, osl),
                "hour {}",
                s.group
            );
        }
    }

    #[test]
    fn caps_and_bad_options() {
        let options = DayOptions {
            max_prompt_tokens: 600,
            max_output_tokens: 50,
            ..flat()
        };
        let w = day(&trace(5, 1000), &options).unwrap();
        for s in &w.sessions {
            let spans = &s.turns[0].user;
            assert_eq!(spans.iter().map(|s| s.len).sum::<u32>(), 600);
            assert_eq!(spans[1].len, 88, "cut inside the second block");
            assert_eq!(s.turns[0].max_tokens, 50);
        }
        for (bad, label) in [
            (
                DayOptions {
                    peak_rps: 0.0,
                    ..flat()
                },
                "peak_rps",
            ),
            (
                DayOptions {
                    trough: 1.5,
                    ..flat()
                },
                "trough",
            ),
            (
                DayOptions {
                    hour: Duration::ZERO,
                    ..flat()
                },
                "hour",
            ),
        ] {
            assert_eq!(day(&trace(5, 1000), &bad), Err(DayError::Options(label)));
        }
        assert_eq!(day(&trace(1, 1000), &flat()), Err(DayError::Trace));
        assert_eq!(day(&trace(5, 0), &flat()), Err(DayError::Trace));
    }
}
