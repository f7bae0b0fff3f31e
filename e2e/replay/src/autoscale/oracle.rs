//! The oracle: perfect foresight of the load. For every interval it knows the requests that
//! will arrive (their rate and mean lengths) and asks, ahead of time, for the replicas the
//! throughput model gives for that load — the planner's own formula, with no prediction error,
//! no correction, no lag and no hysteresis, at the planner's target utilisation. Replicas asked
//! for at tick `k` serve from `k × interval + start_up` until the next decision's are ready,
//! so tick `k` asks for the most any interval overlapping `[t, t + start_up + interval)` needs;
//! removals take effect at once. It is an oracle of the load, not of capacity: the profile's
//! errors are its errors too.
//!
//! Static provisioning for the peak ([`peak`]) is the largest of those needs over the day, per
//! role, all day.

use std::collections::BTreeMap;

use engine_model::Nanos;
use planner::{Corrections, Load, Profile, Role, RoleLimits, Slo, throughput_need};
use workload::Workload;

/// What the oracle plans with.
#[derive(Debug, Clone, PartialEq)]
pub struct OracleOptions {
    /// The replica profile.
    pub profile: Profile,
    /// The objective.
    pub slo: Slo,
    /// The fraction of profiled capacity planned for (the planner's `target_utilisation`).
    pub utilisation: f64,
    /// Between two decisions.
    pub interval: Nanos,
    /// From an engine's addition to its first request.
    pub start_up: Nanos,
    /// Each role's bounds.
    pub limits: BTreeMap<Role, RoleLimits>,
}

/// The load of each interval `[j × interval, (j + 1) × interval)` before `horizon`: request
/// rate, mean prompt and output lengths of the sessions starting in it (their first turn).
pub fn interval_loads(workload: &Workload, interval: Nanos, horizon: Nanos) -> Vec<Load> {
    let n = usize::try_from(horizon.div_ceil(interval.max(1))).unwrap_or(0);
    let mut sums = vec![(0u64, 0u64, 0u64); n];
    for s in &workload.sessions {
        let at = u64::try_from(s.start.as_nanos()).unwrap_or(u64::MAX);
        let j = usize::try_from(at / interval.max(1)).unwrap_or(usize::MAX);
        if let (Some(sum), Some(turn)) = (sums.get_mut(j), s.turns.first()) {
            sum.0 += 1;
            sum.1 += turn.user.iter().map(|s| u64::from(s.len)).sum::<u64>();
            sum.2 += u64::from(turn.max_tokens);
        }
    }
    let secs = interval as f64 / 1e9;
    sums.iter()
        .map(|&(count, isl, osl)| {
            let c = count.max(1) as f64;
            Load {
                rps: count as f64 / secs,
                isl_tokens: isl as f64 / c,
                osl_tokens: osl as f64 / c,
            }
        })
        .collect()
}

/// Each interval's replicas per role, within bounds.
fn needs(loads: &[Load], o: &OracleOptions) -> Vec<BTreeMap<Role, u32>> {
    loads
        .iter()
        .map(|load| {
            o.limits
                .iter()
                .map(|(&role, l)| {
                    let need = throughput_need(
                        &o.profile,
                        &o.slo,
                        load,
                        o.utilisation,
                        Corrections::NONE,
                        role,
                    );
                    let n = if need.is_finite() {
                        (need - 1e-9).ceil().max(0.0) as u32
                    } else {
                        l.max_replicas
                    };
                    (role, n.clamp(l.min_replicas, l.max_replicas))
                })
                .collect()
        })
        .collect()
}

/// The oracle's replicas at tick `k` (time `k × interval`) for `k` in `0..=loads.len()`; tick 0
/// is the pool it starts with.
pub fn oracle_schedule(loads: &[Load], o: &OracleOptions) -> Vec<BTreeMap<Role, u32>> {
    let needs = needs(loads, o);
    let ahead = usize::try_from(o.start_up.div_ceil(o.interval.max(1))).unwrap_or(0);
    let floor: BTreeMap<Role, u32> = o.limits.iter().map(|(&r, l)| (r, l.min_replicas)).collect();
    (0..=needs.len())
        .map(|k| {
            let mut want = floor.clone();
            for need in needs.iter().skip(k).take(ahead + 1) {
                for (role, &n) in need {
                    let w = want.entry(*role).or_default();
                    *w = (*w).max(n);
                }
            }
            want
        })
        .collect()
}

/// The most replicas each role needs in any interval: static provisioning for the peak.
pub fn peak(loads: &[Load], o: &OracleOptions) -> BTreeMap<Role, u32> {
    let mut out: BTreeMap<Role, u32> = o.limits.iter().map(|(&r, l)| (r, l.min_replicas)).collect();
    for need in needs(loads, o) {
        for (role, n) in need {
            let w = out.entry(role).or_default();
            *w = (*w).max(n);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use planner::{DecodeTable, PrefillPoint};
    use std::time::Duration;
    use workload::{Pacing, Session, Span, Turn, Vocab};

    const S: Nanos = 1_000_000_000;

    fn options() -> OracleOptions {
        let limits = RoleLimits {
            min_replicas: 1,
            max_replicas: 50,
            gpus_per_replica: 1,
        };
        OracleOptions {
            // 1,000 prompt tokens/s at the 1 s TTFT; 100 output tokens/s at any ITL.
            profile: Profile {
                description: String::new(),
                prefill: vec![
                    PrefillPoint {
                        tokens_per_s: 1000.0,
                        ttft_ms: 1000.0,
                    },
                    PrefillPoint {
                        tokens_per_s: 2000.0,
                        ttft_ms: 9000.0,
                    },
                ],
                decode: DecodeTable {
                    context_tokens: vec![1000.0],
                    itl_ms: vec![10.0],
                    tokens_per_s: vec![vec![100.0]],
                },
            },
            slo: Slo {
                ttft_ms: 1000.0,
                itl_ms: 50.0,
                percentile: 90.0,
            },
            utilisation: 1.0,
            interval: 10 * S,
            start_up: 15 * S,
            limits: [(Role::Prefill, limits), (Role::Decode, limits)].into(),
        }
    }

    /// `rps[j]` requests per second in interval j (10 s each), 500 prompt and 20 output tokens.
    fn workload(rps: &[u64]) -> Workload {
        let mut sessions = Vec::new();
        for (j, &r) in rps.iter().enumerate() {
            for i in 0..r * 10 {
                sessions.push(Session {
                    id: sessions.len() as u64,
                    start: Duration::from_millis(j as u64 * 10_000 + i * 1000 / r),
                    group: 0,
                    turns: vec![Turn {
                        user: vec![Span { seed: 1, len: 500 }],
                        max_tokens: 20,
                        think: Duration::ZERO,
                    }],
                });
            }
        }
        Workload {
            name: "w".into(),
            pacing: Pacing::Open,
            vocab: Vocab::default(),
            sessions,
        }
    }

    #[test]
    fn loads_schedule_and_peak_follow_the_future() {
        let o = options();
        let loads = interval_loads(&workload(&[2, 2, 8, 2, 2]), o.interval, 50 * S);
        assert_eq!(loads.len(), 5);
        assert_eq!(loads[2].rps, 8.0);
        assert_eq!((loads[0].isl_tokens, loads[0].osl_tokens), (500.0, 20.0));
        // Prefill: rps × 500 / 1,000; decode: rps × 20 / 100.
        let s = oracle_schedule(&loads, &o);
        assert_eq!(s.len(), 6);
        let p = |k: usize| s[k][&Role::Prefill];
        // A 15 s start-up looks two intervals ahead: the 8-rps interval (4 replicas) is asked
        // for at ticks 0, 1 and 2, and dropped at tick 3.
        assert_eq!((p(0), p(1), p(2), p(3), p(4), p(5)), (4, 4, 4, 1, 1, 1));
        assert_eq!(s[2][&Role::Decode], 2);
        assert_eq!(
            peak(&loads, &o),
            [(Role::Prefill, 4), (Role::Decode, 2)].into()
        );
    }
}
