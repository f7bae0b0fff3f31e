//! From a `PoolAutoscaler`'s spec to the planner's configuration, and from an observation to
//! the planner's input. Pure.

use std::collections::BTreeMap;

use api::autoscaler::{
    PlannerMode, PoolAutoscalerSpec, PredictorKind as CrdPredictor, PredictorSpec, RoleTarget,
};
use planner::{Metrics, Mode, PlannerConfig, PredictorKind, Profile, Role, RoleLimits, Slo};

use crate::observe::Observed;

/// The roles of a spec with their targets, in a fixed order.
pub fn roles(spec: &PoolAutoscalerSpec) -> Vec<(Role, &RoleTarget)> {
    [
        (Role::Prefill, spec.roles.prefill.as_ref()),
        (Role::Decode, spec.roles.decode.as_ref()),
        (Role::Both, spec.roles.both.as_ref()),
    ]
    .into_iter()
    .filter_map(|(r, t)| t.map(|t| (r, t)))
    .collect()
}

fn count(n: i32) -> u32 {
    u32::try_from(n).unwrap_or(0)
}

fn predictor(p: &PredictorSpec) -> PredictorKind {
    match p.kind {
        CrdPredictor::Constant => PredictorKind::Constant,
        CrdPredictor::MovingAverage => PredictorKind::MovingAverage {
            window: p.window.map_or(5, count),
        },
        CrdPredictor::Holt => PredictorKind::Holt {
            alpha: p.alpha.unwrap_or(0.5),
            beta: p.beta.unwrap_or(0.3),
        },
        CrdPredictor::Kalman => PredictorKind::Kalman {
            process_noise: p.process_noise.unwrap_or(0.05),
            measurement_noise: p.measurement_noise.unwrap_or(0.1),
        },
    }
}

/// The planner configuration of `spec`, with its profile (read from the named ConfigMap by the
/// caller) when it has one.
pub fn config(spec: &PoolAutoscalerSpec, profile: Option<Profile>) -> PlannerConfig {
    PlannerConfig {
        mode: match spec.planner.mode {
            PlannerMode::Throughput => Mode::Throughput,
            PlannerMode::Load => Mode::Load,
            PlannerMode::Both => Mode::Both,
        },
        interval_s: f64::from(spec.planner.interval_seconds),
        predictor: predictor(&spec.planner.predictor),
        scale_down_stabilization_s: f64::from(spec.planner.scale_down_stabilization_seconds),
        min_replica_lifetime_s: f64::from(spec.planner.min_replica_lifetime_seconds),
        gpu_budget: spec.gpu_budget.map(count),
        roles: roles(spec)
            .into_iter()
            .map(|(r, t)| {
                (
                    r,
                    RoleLimits {
                        min_replicas: count(t.min_replicas),
                        max_replicas: count(t.max_replicas),
                        gpus_per_replica: count(t.gpus_per_replica),
                    },
                )
            })
            .collect::<BTreeMap<_, _>>(),
        slo: Slo {
            ttft_ms: f64::from(spec.slo.ttft_ms),
            itl_ms: f64::from(spec.slo.itl_ms),
            percentile: f64::from(spec.slo.percentile),
        },
        profile,
        move_between_roles: spec.planner.move_between_roles,
        tuning: planner::Tuning::default(),
    }
}

/// The planner's metrics from an observation.
pub fn metrics(o: &Observed) -> Metrics {
    Metrics {
        rps: o.rps,
        isl_tokens: o.isl_tokens,
        osl_tokens: o.osl_tokens,
        ttft_ms: o.ttft_ms,
        itl_ms: o.itl_ms,
        queue_depth: o.queue_depth,
        decode_requests: o.decode_requests,
    }
}
