//! Measures a replica's [`Profile`] on the engine model, in virtual time: the prefill TTFT
//! curve of a prefill-only engine, and the decode throughput of a decode engine over a grid of
//! context lengths × inter-token latencies. `kvgate-bench profile` writes the result as a
//! ConfigMap for the operator; `kvgate-bench autoscale` measures one for its planner.
//!
//! - **Saturation**: `SATURATION_REQUESTS` prompts at once; prompt tokens ÷ makespan is the
//!   engine's prefill rate.
//! - **Prefill**: for each load (a fraction of that rate per engine), Poisson arrivals of
//!   one-token requests with distinct prompts whose lengths are drawn from `prompt_tokens`
//!   (the workload's distribution: TTFT at a percentile depends on it), on a pool of `pool`
//!   engines routed by the EPP's scheduler (the replay); TTFT is the first token's, plus the
//!   time a decode engine takes to pull the prompt's KV (`kv_bytes_per_token × tokens ÷
//!   kv_transfer_bandwidth`); the curve's point is TTFT at `percentile` against the load per
//!   engine. The curve is made non-decreasing (running maximum) against sampling noise.
//! - **Decode**: for each context `c` and batch `b` (≤ `max_num_seqs`), `b` requests whose
//!   `c`-token prompts arrive as remote prefills (`do_remote_prefill`) and decode
//!   `decode_tokens` each; the ITL is the mean duration of the steps that decode, the
//!   throughput the tokens they decode ÷ the time from the first decode step to the end
//!   (preemption when the cache is too small shows as lower throughput). Each context's
//!   (ITL, throughput) points are read off on one ITL axis: 0 below the single-sequence ITL
//!   (the target is out of reach), linear between points, the largest batch's beyond.

use engine_model::{
    AdmitError, ConfigError, Engine, EngineConfig, KvTransfer, Nanos, NewRequest, StepOutput,
    XxhChain,
};
use std::time::Duration;

use planner::{DecodeTable, PrefillPoint, Profile, ProfileError};
use workload::percentile::Sorted;
use workload::{Pacing, Session, Span, Turn, Vocab, Workload};

use crate::config::ReplayConfig;
use crate::replay::ReplayError;

/// Prompts sent at once to find the prefill rate.
pub const SATURATION_REQUESTS: u64 = 32;

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileOptions {
    /// The engine.
    pub engine: EngineConfig,
    /// Prompt lengths of the prefill curve, tokens: each request draws one (uniformly, with
    /// replacement). One entry: every prompt that long.
    pub prompt_tokens: Vec<u32>,
    /// The TTFT percentile, in percent.
    pub percentile: f64,
    /// Prefill loads as fractions of the saturated prefill rate, increasing.
    pub loads: Vec<f64>,
    /// Requests per prefill load (over the whole pool).
    pub requests_per_load: u64,
    /// Prefill engines measured together: a replica's TTFT under a load depends on the pool
    /// it shares that load with (a load-aware router sends a request to the least busy one),
    /// so the curve is measured on a pool of about the size it will serve in.
    pub pool: usize,
    /// Decode context lengths, increasing.
    pub contexts: Vec<u32>,
    /// Decode batch sizes, increasing (those above `max_num_seqs` are skipped).
    pub batches: Vec<u32>,
    /// Points on the ITL axis.
    pub itl_points: usize,
    /// Output tokens per decode request.
    pub decode_tokens: u32,
    /// Seeds the arrivals.
    pub seed: u64,
}

impl ProfileOptions {
    /// Defaults for `engine`: 8,192-token prompts at p90, twelve loads from 10% to 100%, 4,000
    /// requests each on a pool of 8; contexts of 1k–32k tokens, batches of 1–256, 24 ITL points, 64 decode
    /// tokens.
    pub fn new(engine: EngineConfig) -> Self {
        Self {
            engine,
            prompt_tokens: vec![8192],
            percentile: 90.0,
            loads: vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0],
            requests_per_load: 4000,
            pool: 8,
            contexts: vec![1024, 2048, 4096, 8192, 16384, 32768],
            batches: vec![1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256],
            itl_points: 24,
            decode_tokens: 64,
            seed: 1,
        }
    }
}

/// Why a profile could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum ProfilerError {
    /// The engine configuration is invalid.
    #[error("engine configuration")]
    Engine(#[from] ConfigError),
    /// An option out of range.
    #[error("profile option {0} is out of range")]
    Options(&'static str),
    /// The engine refused a request (a prompt longer than the model allows).
    #[error("the engine refused a request")]
    Admit(#[from] AdmitError),
    /// The measurements do not make a valid profile (no decode point fits the engine).
    #[error("the measurements make no valid profile")]
    Profile(#[from] ProfileError),
}

impl ProfilerError {
    /// A bounded label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Engine(_) => "engine",
            Self::Options(_) => "options",
            Self::Admit(_) => "admit",
            Self::Profile(_) => "profile",
        }
    }
}

/// Distinct token ids for request `r` (no two requests share a block).
fn prompt(r: u64, tokens: u32) -> Vec<u32> {
    const SPAN: u64 = 99_000;
    (0..u64::from(tokens))
        .map(|j| 1000 + u32::try_from((r * 7919 + j) % SPAN).unwrap_or(0))
        .collect()
}

/// Runs `engine` from `now` until it is idle, calling `f(start, step)` for each step.
fn run(engine: &mut Engine, mut now: Nanos, mut f: impl FnMut(Nanos, &StepOutput)) {
    loop {
        match engine.step(now) {
            Some(step) => {
                f(now, &step);
                now += step.duration;
            }
            None => match engine.next_wakeup() {
                Some(t) => now = t,
                None => break,
            },
        }
    }
}

/// SplitMix64, for the Poisson arrivals.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Rng {
    /// A prompt length drawn from `lengths`.
    fn length(&mut self, lengths: &[u32]) -> u32 {
        let i = (self.unit() * lengths.len() as f64) as usize;
        lengths.get(i).or(lengths.last()).copied().unwrap_or(1)
    }
}

/// The engine's prefill rate, prompt tokens/s.
fn saturation(options: &ProfileOptions) -> Result<f64, ProfilerError> {
    let mut engine = Engine::new(options.engine.clone())?;
    let mut rng = Rng(options.seed);
    let mut tokens = 0.0;
    for r in 0..SATURATION_REQUESTS {
        let len = rng.length(&options.prompt_tokens);
        tokens += f64::from(len);
        engine.add_request(prefill_request(options, r, len, 0))?;
    }
    let mut end = 0;
    run(&mut engine, 0, |start, step| end = start + step.duration);
    Ok(tokens / (end.max(1) as f64 / 1e9))
}

fn prefill_request(options: &ProfileOptions, r: u64, len: u32, arrival: Nanos) -> NewRequest {
    NewRequest {
        id: r,
        prompt: prompt(r, len),
        output: vec![7],
        hasher: Box::new(XxhChain::new(options.seed)),
        arrival,
        kv_transfer: Some(KvTransfer::PrefillOnly),
    }
}

/// The TTFT percentile at `rate` prompt tokens/s per engine, on a pool of `options.pool`
/// engines routed by the EPP's scheduler (the replay).
fn prefill_ttft(options: &ProfileOptions, rate: f64, stream: u64) -> Result<f64, ProfilerError> {
    let mut rng = Rng(options.seed ^ stream.wrapping_mul(0x2545_F491_4F6C_DD1D));
    let lengths = &options.prompt_tokens;
    let mean = lengths.iter().map(|&l| f64::from(l)).sum::<f64>() / lengths.len().max(1) as f64;
    let pool = options.pool.max(1);
    let mean_gap = mean / (rate * pool as f64);
    let mut at = 0.0;
    let sessions = (0..options.requests_per_load)
        .map(|r| {
            at += -mean_gap * (1.0 - rng.unit()).ln();
            Session {
                id: r,
                start: Duration::from_secs_f64(at),
                group: 0,
                turns: vec![Turn {
                    user: vec![Span {
                        seed: options.seed ^ (stream << 40) ^ r,
                        len: rng.length(lengths),
                    }],
                    max_tokens: 1,
                    think: Duration::ZERO,
                }],
            }
        })
        .collect();
    let workload = Workload {
        name: "profile".into(),
        pacing: Pacing::Open,
        vocab: Vocab::default(),
        sessions,
    };
    let mut config = ReplayConfig::new(pool, options.engine.clone());
    config.seed = options.seed;
    let out = crate::replay(&workload, config).map_err(|e| match e {
        ReplayError::Engine(e) => ProfilerError::Engine(e),
        _ => ProfilerError::Options("pool"),
    })?;
    let c = &options.engine;
    let block = u64::from(c.block_size);
    // The decode engine then pulls the prompt's full blocks.
    let ttfts = out
        .records
        .iter()
        .map(|r| {
            let pulled = u64::from(r.prompt_tokens) / block * block;
            let transfer_ms =
                (pulled * c.kv_bytes_per_token) as f64 / c.kv_transfer_bandwidth as f64 * 1e3;
            r.ttft_ms.map_or(f64::INFINITY, |t| t + transfer_ms)
        })
        .collect();
    Ok(Sorted::new(ttfts)
        .percentile(options.percentile)
        .unwrap_or(f64::INFINITY))
}

/// (ITL ms, output tokens/s) of `batch` sequences decoding at `context`.
fn decode_point(
    options: &ProfileOptions,
    context: u32,
    batch: u32,
) -> Result<(f64, f64), ProfilerError> {
    let mut engine = Engine::new(options.engine.clone())?;
    for r in 0..u64::from(batch) {
        engine.add_request(NewRequest {
            id: r,
            prompt: prompt(r, context),
            output: (0..options.decode_tokens).map(|i| 1000 + i).collect(),
            hasher: Box::new(XxhChain::new(options.seed)),
            arrival: 0,
            kv_transfer: Some(KvTransfer::RemotePrefill {
                num_tokens: context,
            }),
        })?;
    }
    let (mut first, mut end, mut busy, mut steps, mut tokens) = (None, 0, 0, 0u64, 0u64);
    run(&mut engine, 0, |start, step| {
        if step.shape.num_decode_seqs > 0 {
            first.get_or_insert(start);
            busy += step.duration;
            steps += 1;
            tokens += u64::from(step.shape.num_decode_seqs);
        }
        end = start + step.duration;
    });
    let span = end.saturating_sub(first.unwrap_or(0)).max(1);
    let itl = busy as f64 / steps.max(1) as f64 / 1e6;
    Ok((itl, tokens as f64 / (span as f64 / 1e9)))
}

/// Measures the profile.
pub fn measure(options: &ProfileOptions) -> Result<Profile, ProfilerError> {
    let increasing = |v: &[f64]| v.windows(2).all(|w| matches!(w, [a, b] if b > a));
    if options.prompt_tokens.is_empty()
        || options.prompt_tokens.contains(&0)
        || options.requests_per_load == 0
        || options.pool == 0
    {
        return Err(ProfilerError::Options("prompt_tokens, requests_per_load"));
    }
    if options.loads.is_empty()
        || !increasing(&options.loads)
        || options.loads[..]
            .iter()
            .any(|&f| !(f > 0.0 && f.is_finite()))
    {
        return Err(ProfilerError::Options("loads"));
    }
    if !(options.percentile > 0.0 && options.percentile <= 100.0) {
        return Err(ProfilerError::Options("percentile"));
    }
    if options.itl_points < 2 || options.decode_tokens < 2 {
        return Err(ProfilerError::Options("itl_points, decode_tokens"));
    }
    let rate = saturation(options)?;
    let mut prefill = Vec::new();
    let mut highest = 0.0f64;
    for (i, &f) in options.loads.iter().enumerate() {
        let ttft = prefill_ttft(options, f * rate, i as u64)?;
        highest = highest.max(ttft);
        prefill.push(PrefillPoint {
            tokens_per_s: f * rate,
            ttft_ms: highest,
        });
    }
    let c = &options.engine;
    let capacity = c.usable_blocks() * u64::from(c.block_size);
    let contexts: Vec<u32> = options
        .contexts
        .iter()
        .copied()
        .filter(|&ctx| {
            u64::from(ctx) + u64::from(options.decode_tokens) <= u64::from(c.max_model_len)
                && u64::from(ctx) + u64::from(options.decode_tokens) <= capacity
        })
        .collect();
    let batches: Vec<u32> = options
        .batches
        .iter()
        .copied()
        .filter(|&b| b >= 1 && b <= c.max_num_seqs)
        .collect();
    let mut rows = Vec::new();
    for &ctx in &contexts {
        let mut points = Vec::new();
        for &b in &batches {
            points.push(decode_point(options, ctx, b)?);
        }
        rows.push(points);
    }
    let itls: Vec<f64> = rows.iter().flatten().map(|&(itl, _)| itl).collect();
    let lo = itls.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = itls.iter().copied().fold(0.0, f64::max);
    let n = options.itl_points;
    let mut axis: Vec<f64> = (0..n)
        .map(|i| ((lo + (hi - lo) * i as f64 / (n - 1) as f64) * 10.0).round() / 10.0)
        .collect();
    axis.dedup_by(|a, b| a <= b);
    let tokens_per_s = rows
        .iter()
        .map(|points| {
            let mut sorted = points.clone();
            sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut best = 0.0f64;
            axis.iter()
                .map(|&l| {
                    let v = read_off(&sorted, l);
                    best = best.max(v);
                    best
                })
                .collect()
        })
        .collect();
    let profile = Profile {
        description: format!(
            "engine model: prompts of {} tokens (mean of {} lengths), TTFT p{} (+ KV transfer) on \
             a pool of {}, prefill rate {:.0} tokens/s; decode {} tokens per request; block {}, \
             max_num_seqs {}, max_num_batched_tokens {}",
            options
                .prompt_tokens
                .iter()
                .map(|&l| u64::from(l))
                .sum::<u64>()
                / options.prompt_tokens.len().max(1) as u64,
            options.prompt_tokens.len(),
            options.percentile,
            options.pool,
            rate,
            options.decode_tokens,
            c.block_size,
            c.max_num_seqs,
            c.max_num_batched_tokens
        ),
        prefill,
        decode: DecodeTable {
            context_tokens: contexts.iter().map(|&c| f64::from(c)).collect(),
            itl_ms: axis,
            tokens_per_s,
        },
    };
    profile.validate()?;
    Ok(profile)
}

/// Throughput at ITL `l` on `(itl, tokens/s)` points sorted by ITL: 0 below the first,
/// linear between, the last beyond.
fn read_off(points: &[(f64, f64)], l: f64) -> f64 {
    match points.iter().position(|&(itl, _)| itl >= l) {
        None => points.last().map_or(0.0, |&(_, t)| t),
        Some(0) => match points.first() {
            Some(&(itl, t)) if itl <= l => t,
            _ => 0.0,
        },
        Some(i) => match (points.get(i - 1), points.get(i)) {
            (Some(&(l0, t0)), Some(&(l1, t1))) if l1 > l0 => t0 + (t1 - t0) * (l - l0) / (l1 - l0),
            (_, Some(&(_, t))) => t,
            _ => 0.0,
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use engine_model::Preset;

    fn small() -> ProfileOptions {
        ProfileOptions {
            prompt_tokens: vec![1024, 2048, 3072],
            loads: vec![0.2, 0.5, 0.9],
            requests_per_load: 60,
            pool: 2,
            contexts: vec![1024, 4096],
            batches: vec![1, 8, 32],
            itl_points: 6,
            decode_tokens: 16,
            ..ProfileOptions::new(Preset::Small.config())
        }
    }

    #[test]
    fn a_measured_profile_is_valid_and_shaped_like_an_engine() {
        let p = measure(&small()).unwrap();
        p.validate().unwrap();
        assert_eq!(p.prefill.len(), 3);
        // TTFT grows with load; the lightest load's is about one prefill plus the transfer.
        assert!(p.prefill[2].ttft_ms > p.prefill[0].ttft_ms);
        // Decode: more throughput at a longer ITL, less at a longer context.
        let d = &p.decode;
        let last = d.itl_ms.len() - 1;
        assert!(d.tokens_per_s[0][last] > d.tokens_per_s[0][0]);
        assert!(d.tokens_per_s[1][last] < d.tokens_per_s[0][last]);
        assert_eq!(
            d.tokens_per_s[0][0], 0.0,
            "below the single-sequence ITL of the long context"
        );
    }

    #[test]
    fn read_off_interpolates_and_clamps() {
        let pts = [(10.0, 100.0), (20.0, 300.0)];
        assert_eq!(read_off(&pts, 5.0), 0.0);
        assert_eq!(read_off(&pts, 10.0), 100.0);
        assert_eq!(read_off(&pts, 15.0), 200.0);
        assert_eq!(read_off(&pts, 50.0), 300.0);
    }

    #[test]
    fn bad_options_are_refused() {
        let mut o = small();
        o.loads = vec![0.5, 0.2];
        assert_eq!(measure(&o).unwrap_err().metric_label(), "options");
        let mut o = small();
        o.percentile = 0.0;
        assert_eq!(measure(&o).unwrap_err().metric_label(), "options");
    }
}
