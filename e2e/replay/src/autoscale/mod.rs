//! Autoscaling in virtual time: a workload against a pool whose replica counts a scaler
//! changes as the replay runs.
//!
//! Every `interval` the driver reads what the gateway saw (request rate, mean input and output
//! lengths, TTFT and per-request ITL at the SLO's percentile, as the EPP's metrics give them;
//! engines' queues) and the pool (replicas asked for and ready, per role), asks the scaler for
//! replicas per role, and applies the answer: new engines become routable `start_up` later;
//! removed engines are the newest first (as a Deployment scales down), still-starting ones
//! before serving ones, and a serving one drains (no new requests; it leaves when its requests
//! finish). GPU time runs from an engine's addition to its departure.
//!
//! Scalers: the [`planner::Planner`] (any mode, with or without moving capacity between
//! roles), an HPA-like policy on queue depth ([`Hpa`]), and a [`Schedule`] of replicas per
//! interval (static provisioning; the oracle with perfect foresight, [`oracle_schedule`]).

mod hpa;
mod oracle;
mod report;

use std::collections::BTreeMap;

use engine_model::Nanos;
use planner::{Metrics, Observation, Planner, Role, Slo};
use workload::Workload;
use workload::percentile::Sorted;

use crate::config::ReplayConfig;
use crate::replay::{Life, Replay, ReplayError, ReplayOutput};

pub use hpa::{Hpa, HpaConfig};
pub use oracle::{OracleOptions, interval_loads, oracle_schedule, peak};
pub use report::{Sla, gpu_hours, sla};

/// How the pool is run.
#[derive(Debug, Clone)]
pub struct AutoscaleConfig {
    /// The replay: engines, scheduler (disaggregation on for a prefill/decode pool), delays,
    /// seed. `engines` and `prefill_engines` are the initial replicas, ready at time zero.
    pub replay: ReplayConfig,
    /// Between two scaling decisions.
    pub interval: Nanos,
    /// From an engine's addition to its first request.
    pub start_up: Nanos,
    /// GPUs per engine.
    pub gpus_per_replica: u32,
    /// TTFT and ITL are read at `slo.percentile` for the scaler.
    pub slo: Slo,
    /// Scaling stops here and GPU time is counted up to here (the day's end); requests still
    /// running finish on the engines there are.
    pub horizon: Nanos,
}

/// Why an autoscaled replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum AutoscaleError {
    /// The replay could not start or an engine could not be added.
    #[error("replay")]
    Replay(#[from] ReplayError),
    /// A zero interval.
    #[error("the scaling interval must be positive")]
    Interval,
}

impl AutoscaleError {
    /// A bounded label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Replay(_) => "replay",
            Self::Interval => "interval",
        }
    }
}

/// Replicas per interval, decided in advance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Replicas per role at tick `k` (time `k × interval`); past the end, the last entry.
    pub ticks: Vec<BTreeMap<Role, u32>>,
}

/// Who decides the replicas.
#[derive(Debug)]
pub enum Scaler {
    /// kvgate's planner.
    Planner(Box<Planner>),
    /// An HPA on engine queue depth, one per role.
    Hpa(Hpa),
    /// Replicas decided in advance (static provisioning, the oracle).
    Schedule(Schedule),
}

/// What the pool looks like to a scaler.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolView {
    /// Replicas asked for (starting or serving) per role.
    pub replicas: BTreeMap<Role, u32>,
    /// Replicas serving per role.
    pub ready: BTreeMap<Role, u32>,
    /// Mean requests waiting per serving engine, per role.
    pub waiting: BTreeMap<Role, f64>,
    /// Requests running or waiting on the serving decode engines (the EPP's
    /// `kvgate_epp_pool_requests{role="decode"}`).
    pub decode_requests: u64,
}

/// A scaler's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleDecision {
    /// Replicas per role.
    pub desired: BTreeMap<Role, u32>,
    /// A bounded label (the planner's reason label, `hpa`, `schedule`).
    pub label: &'static str,
    /// The reason as text.
    pub reason: String,
    /// The budget held a role back.
    pub budget_limited: bool,
    /// The planner's need per role (replicas, before bounds and stabilisation).
    pub need: BTreeMap<Role, f64>,
    /// The planner's correction factors (prefill, decode).
    pub corrections: Option<(f64, f64)>,
}

impl Scaler {
    /// The replicas for the interval starting at tick `k` (time `at`).
    pub fn decide(
        &mut self,
        k: usize,
        at: Nanos,
        obs: &Observation,
        pool: &PoolView,
    ) -> ScaleDecision {
        match self {
            Scaler::Planner(p) => {
                let d = p.plan(obs);
                let c = p.corrections();
                ScaleDecision {
                    desired: d.desired,
                    label: d.reason.metric_label(),
                    reason: d.reason.to_string(),
                    budget_limited: d.budget_limited,
                    need: d.roles.iter().map(|(&r, x)| (r, x.need)).collect(),
                    corrections: Some((c.prefill, c.decode)),
                }
            }
            Scaler::Hpa(h) => ScaleDecision {
                desired: h.decide(at, pool),
                label: "hpa",
                reason: "hpa".into(),
                budget_limited: false,
                need: BTreeMap::new(),
                corrections: None,
            },
            Scaler::Schedule(s) => ScaleDecision {
                desired: s
                    .ticks
                    .get(k)
                    .or(s.ticks.last())
                    .cloned()
                    .unwrap_or_else(|| pool.replicas.clone()),
                label: "schedule",
                reason: "schedule".into(),
                budget_limited: false,
                need: BTreeMap::new(),
                corrections: None,
            },
        }
    }
}

/// One interval of an autoscaled run.
#[derive(Debug, Clone, PartialEq)]
pub struct Tick {
    /// The decision's time, seconds.
    pub at_s: f64,
    /// Replicas asked for before the decision (starting or serving).
    pub replicas: BTreeMap<Role, u32>,
    /// Replicas serving before the decision.
    pub ready: BTreeMap<Role, u32>,
    /// What the scaler asked for.
    pub desired: BTreeMap<Role, u32>,
    /// The interval's metrics, as the scaler saw them.
    pub metrics: Metrics,
    /// The decision's label.
    pub label: &'static str,
    /// The decision's reason.
    pub reason: String,
    /// The budget held a role back.
    pub budget_limited: bool,
    /// The planner's need per role.
    pub need: BTreeMap<Role, f64>,
    /// The planner's correction factors (prefill, decode).
    pub corrections: Option<(f64, f64)>,
}

/// An autoscaled run's result.
#[derive(Debug, Clone)]
pub struct AutoscaleOutput {
    /// The replay's records, engine counters and engine lives.
    pub replay: ReplayOutput,
    /// One per interval up to the horizon.
    pub ticks: Vec<Tick>,
    /// GPU-hours from time zero to the horizon.
    pub gpu_hours: f64,
}

/// The scheduler's role for a planner role.
pub fn engine_role(role: Role) -> scheduler::Role {
    match role {
        Role::Prefill => scheduler::Role::Prefill,
        Role::Decode => scheduler::Role::Decode,
        Role::Both => scheduler::Role::Both,
    }
}

fn planner_role(role: scheduler::Role) -> Role {
    match role {
        scheduler::Role::Prefill => Role::Prefill,
        scheduler::Role::Decode => Role::Decode,
        scheduler::Role::Both => Role::Both,
    }
}

/// The pool's roles (those of the initial engines).
fn pool_view(replay: &Replay<'_>, roles: &[Role]) -> PoolView {
    let mut view = PoolView::default();
    let mut waiting: BTreeMap<Role, u64> = BTreeMap::new();
    for &r in roles {
        view.replicas.insert(r, 0);
        view.ready.insert(r, 0);
    }
    for e in replay.engines() {
        let role = planner_role(e.role);
        match e.life {
            Life::Starting => *view.replicas.entry(role).or_default() += 1,
            Life::Serving => {
                *view.replicas.entry(role).or_default() += 1;
                *view.ready.entry(role).or_default() += 1;
                *waiting.entry(role).or_default() += u64::from(e.waiting);
                if role == Role::Decode {
                    view.decode_requests += u64::from(e.waiting) + u64::from(e.running);
                }
            }
            Life::Draining | Life::Gone => {}
        }
    }
    for (&role, &ready) in &view.ready {
        let w = waiting.get(&role).copied().unwrap_or(0);
        view.waiting.insert(
            role,
            if ready == 0 {
                0.0
            } else {
                w as f64 / f64::from(ready)
            },
        );
    }
    view
}

/// Adds or removes engines so each role has `desired` replicas asked for.
fn apply(
    replay: &mut Replay<'_>,
    pool: &PoolView,
    desired: &BTreeMap<Role, u32>,
    start_up: Nanos,
) -> Result<(), ReplayError> {
    for (&role, &want) in desired {
        let have = pool.replicas.get(&role).copied().unwrap_or(0);
        if want > have {
            for _ in have..want {
                replay.add_engine(engine_role(role), start_up)?;
            }
        } else if want < have {
            // Newest first, still-starting before serving (a ReplicaSet's deletion order).
            let mut victims: Vec<(bool, Nanos, usize)> = replay
                .engines()
                .filter(|e| planner_role(e.role) == role)
                .filter(|e| matches!(e.life, Life::Starting | Life::Serving))
                .map(|e| {
                    (
                        e.life == Life::Serving,
                        std::cmp::Reverse(e.added_at).0,
                        e.index,
                    )
                })
                .collect();
            victims.sort_by_key(|&(serving, added, index)| {
                (serving, std::cmp::Reverse(added), std::cmp::Reverse(index))
            });
            for &(_, _, index) in victims.iter().take((have - want) as usize) {
                replay.remove_engine(index);
            }
        }
    }
    Ok(())
}

/// The interval's metrics from what the gateway saw; the output length is the last one known
/// while no request completes.
fn metrics(
    stats: &crate::replay::IntervalStats,
    pool: &PoolView,
    interval_s: f64,
    percentile: f64,
    last_osl: &mut f64,
) -> Metrics {
    if stats.completed > 0 {
        *last_osl = stats.output_tokens as f64 / stats.completed as f64;
    }
    let isl = if stats.sent > 0 {
        stats.prompt_tokens as f64 / stats.sent as f64
    } else {
        0.0
    };
    Metrics {
        rps: stats.sent as f64 / interval_s,
        isl_tokens: isl,
        osl_tokens: if stats.sent > 0 { *last_osl } else { 0.0 },
        ttft_ms: Sorted::new(stats.ttft_ms.clone()).percentile(percentile),
        itl_ms: Sorted::new(stats.tpot_ms.clone()).percentile(percentile),
        queue_depth: None,
        decode_requests: pool
            .ready
            .contains_key(&Role::Decode)
            .then_some(pool.decode_requests as f64),
    }
}

/// Runs `workload` on a pool scaled by `scaler`.
pub fn autoscale(
    workload: &Workload,
    config: &AutoscaleConfig,
    scaler: &mut Scaler,
) -> Result<AutoscaleOutput, AutoscaleError> {
    if config.interval == 0 {
        return Err(AutoscaleError::Interval);
    }
    let mut replay = Replay::new(workload, config.replay.clone())?;
    let roles: Vec<Role> = if config.replay.prefill_engines > 0 {
        vec![Role::Prefill, Role::Decode]
    } else {
        vec![Role::Both]
    };
    let interval_s = config.interval as f64 / 1e9;
    let mut ticks = Vec::new();
    let mut last_osl = 0.0;
    for k in 1.. {
        let at = config.interval.saturating_mul(k as u64);
        if at > config.horizon {
            break;
        }
        replay.run_until(at);
        let stats = replay.take_interval();
        let pool = pool_view(&replay, &roles);
        let m = metrics(
            &stats,
            &pool,
            interval_s,
            config.slo.percentile,
            &mut last_osl,
        );
        let obs = Observation {
            at_s: at as f64 / 1e9,
            metrics: Some(m),
            replicas: pool.replicas.clone(),
            ready: pool.ready.clone(),
        };
        let decision = scaler.decide(k, at, &obs, &pool);
        apply(&mut replay, &pool, &decision.desired, config.start_up)?;
        ticks.push(Tick {
            at_s: obs.at_s,
            replicas: pool.replicas,
            ready: pool.ready,
            desired: decision.desired,
            metrics: m,
            label: decision.label,
            reason: decision.reason,
            budget_limited: decision.budget_limited,
            need: decision.need,
            corrections: decision.corrections,
        });
    }
    while replay.next_event().is_some() {}
    let out = replay.finish();
    let gpu_hours = gpu_hours(&out.lives, config.gpus_per_replica, 0, config.horizon);
    Ok(AutoscaleOutput {
        replay: out,
        ticks,
        gpu_hours,
    })
}
