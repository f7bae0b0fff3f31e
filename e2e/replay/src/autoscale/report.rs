//! What an autoscaled run achieved: SLA attainment and GPU-hours.
//!
//! **SLA attainment** is read the way the SLO is stated, TTFT and ITL at a percentile: the run
//! is cut into windows (by request send time); a window attains the SLA when the percentile of
//! its requests' TTFTs is within the TTFT objective and the percentile of their ITLs (each
//! request's mean time per output token after the first) within the ITL objective. Failed
//! requests count as an infinite TTFT; a window without requests attains it. Attainment is the
//! fraction of windows that do. The fraction of requests within both objectives is given too.

use engine_model::Nanos;
use planner::Slo;
use workload::percentile::Sorted;
use workload::{RequestRecord, Status};

use crate::replay::EngineLife;

/// SLA attainment over a span of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sla {
    /// Windows in the span.
    pub windows: usize,
    /// Windows whose TTFT and ITL percentiles were within the objectives.
    pub windows_met: usize,
    /// Requests sent in the span.
    pub requests: usize,
    /// Requests within both objectives.
    pub requests_met: usize,
    /// TTFT at the percentile over the whole span, ms.
    pub ttft_ms: Option<f64>,
    /// ITL at the percentile over the whole span, ms.
    pub itl_ms: Option<f64>,
}

impl Sla {
    /// Fraction of windows attaining the SLA (1 for an empty span).
    pub fn attainment(&self) -> f64 {
        if self.windows == 0 {
            1.0
        } else {
            self.windows_met as f64 / self.windows as f64
        }
    }

    /// Fraction of requests within both objectives (1 without requests).
    pub fn request_attainment(&self) -> f64 {
        if self.requests == 0 {
            1.0
        } else {
            self.requests_met as f64 / self.requests as f64
        }
    }
}

fn ttft(r: &RequestRecord) -> f64 {
    match (r.status, r.ttft_ms) {
        (Status::Ok, Some(t)) => t,
        _ => f64::INFINITY,
    }
}

/// SLA attainment of the requests sent in `[from_ms, to_ms)`, in windows of `window_ms`.
pub fn sla(records: &[RequestRecord], slo: &Slo, window_ms: f64, from_ms: f64, to_ms: f64) -> Sla {
    let window_ms = window_ms.max(1e-9);
    let windows = ((to_ms - from_ms) / window_ms).ceil().max(0.0) as usize;
    let mut per: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); windows];
    let (mut all_ttft, mut all_itl) = (Vec::new(), Vec::new());
    let (mut requests, mut requests_met) = (0, 0);
    for r in records {
        if !(r.start_ms >= from_ms && r.start_ms < to_ms) {
            continue;
        }
        let t = ttft(r);
        requests += 1;
        if t <= slo.ttft_ms && r.tpot_ms.is_none_or(|i| i <= slo.itl_ms) {
            requests_met += 1;
        }
        all_ttft.push(t);
        all_itl.extend(r.tpot_ms);
        let w = ((r.start_ms - from_ms) / window_ms) as usize;
        if let Some((ttfts, itls)) = per.get_mut(w) {
            ttfts.push(t);
            itls.extend(r.tpot_ms);
        }
    }
    let p = slo.percentile;
    let windows_met = per
        .into_iter()
        .filter(|(ttfts, itls)| {
            Sorted::new(ttfts.clone())
                .percentile(p)
                .is_none_or(|t| t <= slo.ttft_ms)
                && Sorted::new(itls.clone())
                    .percentile(p)
                    .is_none_or(|i| i <= slo.itl_ms)
        })
        .count();
    Sla {
        windows,
        windows_met,
        requests,
        requests_met,
        ttft_ms: Sorted::new(all_ttft).percentile(p),
        itl_ms: Sorted::new(all_itl).percentile(p),
    }
}

/// GPU-hours of `lives` within `[from, to)`: each engine from its addition (start-up
/// included) to its departure, times `gpus` per engine.
pub fn gpu_hours(lives: &[EngineLife], gpus: u32, from: Nanos, to: Nanos) -> f64 {
    let ns: u128 = lives
        .iter()
        .map(|l| {
            let start = l.added_at.max(from);
            let end = l.gone_at.unwrap_or(to).min(to);
            u128::from(end.saturating_sub(start))
        })
        .sum();
    ns as f64 / 3.6e12 * f64::from(gpus)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    fn record(start_ms: f64, ttft: Option<f64>, tpot: Option<f64>) -> RequestRecord {
        RequestRecord {
            run: "r".into(),
            load: None,
            session: 0,
            turn: 0,
            group: 0,
            start_ms,
            ttft_ms: ttft,
            tpot_ms: tpot,
            e2e_ms: 0.0,
            prompt_tokens: 1,
            output_tokens: 1,
            cached_tokens: None,
            status: if ttft.is_some() {
                Status::Ok
            } else {
                Status::HttpError
            },
            http_status: None,
            endpoint: None,
            error: None,
        }
    }

    #[test]
    fn windows_attain_by_percentile_and_requests_by_both_objectives() {
        let slo = Slo {
            ttft_ms: 100.0,
            itl_ms: 10.0,
            percentile: 50.0,
        };
        let records = [
            // Window 0: TTFT p50 = 50, ITL p50 = 20 → missed on ITL.
            record(0.0, Some(50.0), Some(20.0)),
            record(10.0, Some(60.0), Some(5.0)),
            record(20.0, Some(500.0), Some(30.0)),
            // Window 1: met (the failed request is one of three; p50 is 80).
            record(1000.0, Some(70.0), Some(5.0)),
            record(1100.0, Some(80.0), None),
            record(1200.0, None, None),
            // Window 2 is empty; window 3 is outside the span.
            record(3500.0, Some(1.0), Some(1.0)),
        ];
        let s = sla(&records, &slo, 1000.0, 0.0, 3000.0);
        assert_eq!((s.windows, s.windows_met), (3, 2));
        assert_eq!((s.requests, s.requests_met), (6, 3));
        assert!((s.attainment() - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(s.ttft_ms, Some(70.0));
    }

    #[test]
    fn gpu_hours_count_each_life_inside_the_span() {
        let h = 3_600_000_000_000u64;
        let life = |added_at, gone_at| EngineLife {
            role: scheduler::Role::Decode,
            added_at,
            ready_at: None,
            gone_at,
        };
        let lives = [life(0, None), life(h / 2, Some(h)), life(2 * h, None)];
        assert!((gpu_hours(&lives, 2, 0, 2 * h) - 2.0 * 2.5).abs() < 1e-9);
    }
}
