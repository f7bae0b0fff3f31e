//! What the planner is told: the roles and their bounds, the SLO, the mode, the predictor, the
//! anti-flapping rules, the GPU budget and the profile. [`PlannerConfig::validate`] refuses
//! every combination the planner cannot honour.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::profile::{Profile, ProfileError};

/// A role of a pool's replicas: a pool has either [`Role::Both`] alone (aggregated serving),
/// or [`Role::Prefill`] and [`Role::Decode`] together (disaggregated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Prefill only: computes prompts and hands their KV to a decode replica.
    Prefill,
    /// Decode: pulls a prompt's KV and generates the output.
    Decode,
    /// Prefill and decode on the same replica.
    Both,
}

impl Role {
    /// The label spelling (`kvgate.io/role`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One role's replica bounds and its GPUs per replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleLimits {
    /// Fewest replicas (may be 0).
    pub min_replicas: u32,
    /// Most replicas (at least 1, at least `min_replicas`).
    pub max_replicas: u32,
    /// GPUs one replica uses, counted against the budget (0: not counted).
    pub gpus_per_replica: u32,
}

/// The latency objective: TTFT and inter-token latency at a percentile.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    /// Time to first token, milliseconds.
    pub ttft_ms: f64,
    /// Inter-token latency, milliseconds.
    pub itl_ms: f64,
    /// The percentile both are measured at, in percent (`90.0` for p90); the metrics handed to
    /// the planner are read at it.
    pub percentile: f64,
}

/// How replicas are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// From the profile and the predicted load, corrected by observed / expected latency.
    Throughput,
    /// From an online regression of latency on load per replica, one replica per interval.
    Load,
    /// Load mode, with the throughput mode's answer as a floor; where the load model has no
    /// usable regression yet (a latency flat under load), the throughput answer alone.
    Both,
}

/// How the next interval's load is predicted (one predictor per series: request rate, input
/// length, output length).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum PredictorKind {
    /// The last observation.
    Constant,
    /// The mean of the last `window` observations.
    MovingAverage {
        /// Observations averaged, at least 1.
        window: u32,
    },
    /// Holt's linear trend (double exponential smoothing).
    Holt {
        /// Level smoothing, in (0, 1].
        alpha: f64,
        /// Trend smoothing, in [0, 1].
        beta: f64,
    },
    /// A local-linear-trend Kalman filter (state: level and slope). Both noises are variances
    /// of the series divided by its first non-zero value, so one setting fits request rates and
    /// token counts alike.
    Kalman {
        /// Process noise, positive.
        process_noise: f64,
        /// Measurement noise, positive.
        measurement_noise: f64,
    },
}

impl PredictorKind {
    /// The name the CRD uses.
    pub const fn as_str(&self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::MovingAverage { .. } => "moving-average",
            Self::Holt { .. } => "holt",
            Self::Kalman { .. } => "kalman",
        }
    }
}

/// Second-order knobs, with defaults that the evaluation (`docs/autoscaling.md`) used.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Tuning {
    /// Correction factors are kept within `[1 / max_correction, max_correction]` (≥ 1).
    pub max_correction: f64,
    /// A correction factor is learned only while the observed load per replica is at least this
    /// fraction of the profiled capacity (below it, latency says little about capacity).
    pub correction_min_utilisation: f64,
    /// Weight of a new ratio in a correction factor's moving average, in (0, 1].
    pub correction_smoothing: f64,
    /// Throughput mode plans for this fraction of the profiled capacity, in (0, 1]: headroom
    /// for prediction error and for the start-up delay of new replicas.
    pub target_utilisation: f64,
    /// Load mode: weight kept by older points at each new one (exponential forgetting), in
    /// (0, 1].
    pub regression_forgetting: f64,
    /// Dead band, in [0, 1): a role scales up as soon as it needs more than it has, and down
    /// only to a count that leaves this fraction of headroom over its need (HPA's 10%
    /// tolerance), so a need hovering at a boundary does not flap.
    pub tolerance: f64,
    /// Load mode: how long, in seconds, the least load per replica at which a latency missed
    /// its objective keeps the role from scaling down to that load again (≥ 0).
    pub miss_memory_s: f64,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            max_correction: 2.0,
            correction_min_utilisation: 0.3,
            correction_smoothing: 0.5,
            target_utilisation: 0.85,
            regression_forgetting: 0.9,
            tolerance: 0.1,
            miss_memory_s: 600.0,
        }
    }
}

/// Everything the planner needs; the operator builds it from a `PoolAutoscaler`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannerConfig {
    /// How replicas are computed.
    pub mode: Mode,
    /// Seconds between decisions. Observations further apart than
    /// [`STALE_INTERVALS`](crate::STALE_INTERVALS) intervals restart the predictors and the
    /// regressions (their history no longer describes the present).
    pub interval_s: f64,
    /// The load predictor.
    pub predictor: PredictorKind,
    /// A role scales down to the highest recommendation of this many past seconds (HPA's
    /// scale-down stabilisation window); scale-ups are immediate.
    pub scale_down_stabilization_s: f64,
    /// A role does not scale down until this many seconds after its last scale-up: its newest
    /// replica (the one a Deployment removes first) has lived that long.
    pub min_replica_lifetime_s: f64,
    /// GPUs all roles may use together; `None`: unbounded.
    pub gpu_budget: Option<u32>,
    /// The pool's roles: `Both` alone, or `Prefill` and `Decode`.
    pub roles: BTreeMap<Role, RoleLimits>,
    /// The latency objective.
    pub slo: Slo,
    /// Per-replica throughput (required by the `Throughput` and `Both` modes).
    pub profile: Option<Profile>,
    /// When the budget binds, take replicas from a role whose own recommendation is lower (its
    /// stabilisation window still holds them) and give them to a role that needs more, in one
    /// decision.
    pub move_between_roles: bool,
    /// Second-order knobs.
    #[serde(default)]
    pub tuning: Tuning,
}

/// A configuration the planner refuses.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The roles are not `Both` alone nor `Prefill` with `Decode`.
    #[error("roles must be `both` alone, or `prefill` and `decode` together (got {got})")]
    RoleSet {
        /// The roles given, comma-separated.
        got: String,
    },
    /// `min_replicas > max_replicas`, or `max_replicas` is 0.
    #[error("{role}: replica bounds {min}..={max} are empty or allow no replica")]
    Bounds {
        /// The role.
        role: Role,
        /// `min_replicas`.
        min: u32,
        /// `max_replicas`.
        max: u32,
    },
    /// The budget cannot hold every role's minimum.
    #[error("GPU budget {budget} is below the {needed} GPUs the roles' minimum replicas use")]
    BudgetBelowMinimum {
        /// The budget.
        budget: u32,
        /// Σ min_replicas × gpus_per_replica.
        needed: u64,
    },
    /// The mode needs a profile and none was given.
    #[error("mode {0:?} needs a profile")]
    ProfileRequired(Mode),
    /// The profile is invalid.
    #[error("profile")]
    Profile(#[source] ProfileError),
    /// A number that must be finite and positive is not.
    #[error("{field} must be a finite positive number, got {value}")]
    NotPositive {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// A number outside its range.
    #[error("{field} = {value} is outside {range}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
        /// The allowed range, as text.
        range: &'static str,
    },
}

impl ConfigError {
    /// A bounded label for metrics and events.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::RoleSet { .. } => "role_set",
            Self::Bounds { .. } => "bounds",
            Self::BudgetBelowMinimum { .. } => "budget_below_minimum",
            Self::ProfileRequired(_) => "profile_required",
            Self::Profile(_) => "profile",
            Self::NotPositive { .. } => "not_positive",
            Self::OutOfRange { .. } => "out_of_range",
        }
    }
}

fn positive(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::NotPositive { field, value })
    }
}

fn within(
    field: &'static str,
    value: f64,
    ok: bool,
    range: &'static str,
) -> Result<(), ConfigError> {
    if ok && value.is_finite() {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange {
            field,
            value,
            range,
        })
    }
}

impl PlannerConfig {
    /// Checks every field and their combinations.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let roles: Vec<Role> = self.roles.keys().copied().collect();
        if roles != [Role::Both] && roles != [Role::Prefill, Role::Decode] {
            return Err(ConfigError::RoleSet {
                got: roles
                    .iter()
                    .map(|r| r.as_str())
                    .collect::<Vec<_>>()
                    .join(","),
            });
        }
        for (&role, l) in &self.roles {
            if l.max_replicas == 0 || l.min_replicas > l.max_replicas {
                return Err(ConfigError::Bounds {
                    role,
                    min: l.min_replicas,
                    max: l.max_replicas,
                });
            }
        }
        if let Some(budget) = self.gpu_budget {
            let needed: u64 = self
                .roles
                .values()
                .map(|l| u64::from(l.min_replicas) * u64::from(l.gpus_per_replica))
                .sum();
            if u64::from(budget) < needed {
                return Err(ConfigError::BudgetBelowMinimum { budget, needed });
            }
        }
        positive("interval_s", self.interval_s)?;
        positive("slo.ttft_ms", self.slo.ttft_ms)?;
        positive("slo.itl_ms", self.slo.itl_ms)?;
        let p = self.slo.percentile;
        within("slo.percentile", p, p > 0.0 && p <= 100.0, "(0, 100]")?;
        for (field, v) in [
            (
                "scale_down_stabilization_s",
                self.scale_down_stabilization_s,
            ),
            ("min_replica_lifetime_s", self.min_replica_lifetime_s),
        ] {
            within(field, v, v >= 0.0, "[0, ∞)")?;
        }
        match self.predictor {
            PredictorKind::Constant => {}
            PredictorKind::MovingAverage { window } => {
                let w = f64::from(window);
                within("predictor.window", w, window >= 1, "[1, 2^32)")?;
            }
            PredictorKind::Holt { alpha, beta } => {
                within(
                    "predictor.alpha",
                    alpha,
                    alpha > 0.0 && alpha <= 1.0,
                    "(0, 1]",
                )?;
                within(
                    "predictor.beta",
                    beta,
                    (0.0..=1.0).contains(&beta),
                    "[0, 1]",
                )?;
            }
            PredictorKind::Kalman {
                process_noise,
                measurement_noise,
            } => {
                positive("predictor.process_noise", process_noise)?;
                positive("predictor.measurement_noise", measurement_noise)?;
            }
        }
        let t = &self.tuning;
        within(
            "tuning.max_correction",
            t.max_correction,
            t.max_correction >= 1.0,
            "[1, ∞)",
        )?;
        let unit = |v: f64| v > 0.0 && v <= 1.0;
        within(
            "tuning.correction_min_utilisation",
            t.correction_min_utilisation,
            (0.0..=1.0).contains(&t.correction_min_utilisation),
            "[0, 1]",
        )?;
        within(
            "tuning.correction_smoothing",
            t.correction_smoothing,
            unit(t.correction_smoothing),
            "(0, 1]",
        )?;
        within(
            "tuning.target_utilisation",
            t.target_utilisation,
            unit(t.target_utilisation),
            "(0, 1]",
        )?;
        within(
            "tuning.regression_forgetting",
            t.regression_forgetting,
            unit(t.regression_forgetting),
            "(0, 1]",
        )?;
        within(
            "tuning.tolerance",
            t.tolerance,
            (0.0..1.0).contains(&t.tolerance),
            "[0, 1)",
        )?;
        within(
            "tuning.miss_memory_s",
            t.miss_memory_s,
            t.miss_memory_s.is_finite() && t.miss_memory_s >= 0.0,
            "[0, ∞)",
        )?;
        match (&self.profile, self.mode) {
            (None, Mode::Throughput | Mode::Both) => Err(ConfigError::ProfileRequired(self.mode)),
            (Some(p), _) => p.validate().map_err(ConfigError::Profile),
            (None, Mode::Load) => Ok(()),
        }
    }

    /// The GPUs `replicas` use (roles not in the configuration count zero).
    pub fn gpus(&self, replicas: &BTreeMap<Role, u32>) -> u64 {
        replicas
            .iter()
            .map(|(role, &n)| {
                self.roles
                    .get(role)
                    .map_or(0, |l| u64::from(n) * u64::from(l.gpus_per_replica))
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::tests::profile;

    pub(crate) fn config() -> PlannerConfig {
        let limits = RoleLimits {
            min_replicas: 1,
            max_replicas: 8,
            gpus_per_replica: 1,
        };
        PlannerConfig {
            mode: Mode::Throughput,
            interval_s: 30.0,
            predictor: PredictorKind::Constant,
            scale_down_stabilization_s: 300.0,
            min_replica_lifetime_s: 120.0,
            gpu_budget: Some(12),
            roles: [(Role::Prefill, limits), (Role::Decode, limits)].into(),
            slo: Slo {
                ttft_ms: 2000.0,
                itl_ms: 50.0,
                percentile: 90.0,
            },
            profile: Some(profile()),
            move_between_roles: true,
            tuning: Tuning::default(),
        }
    }

    #[test]
    fn a_sound_config_passes() {
        config().validate().unwrap();
        let mut load = config();
        load.mode = Mode::Load;
        load.profile = None;
        load.validate().unwrap();
    }

    #[test]
    fn every_rule_has_its_error() {
        let label = |f: &dyn Fn(&mut PlannerConfig)| {
            let mut c = config();
            f(&mut c);
            c.validate().unwrap_err().metric_label()
        };
        assert_eq!(
            label(&|c| {
                c.roles.remove(&Role::Decode);
            }),
            "role_set"
        );
        assert_eq!(
            label(&|c| {
                let l = c.roles[&Role::Decode];
                c.roles.insert(Role::Both, l);
            }),
            "role_set"
        );
        assert_eq!(
            label(&|c| c.roles.get_mut(&Role::Prefill).unwrap().min_replicas = 9),
            "bounds"
        );
        assert_eq!(
            label(&|c| c.roles.get_mut(&Role::Prefill).unwrap().max_replicas = 0),
            "bounds"
        );
        assert_eq!(label(&|c| c.gpu_budget = Some(1)), "budget_below_minimum");
        assert_eq!(label(&|c| c.profile = None), "profile_required");
        assert_eq!(
            label(&|c| {
                c.mode = Mode::Both;
                c.profile = None;
            }),
            "profile_required"
        );
        assert_eq!(
            label(&|c| c.profile.as_mut().unwrap().prefill.clear()),
            "profile"
        );
        assert_eq!(label(&|c| c.interval_s = 0.0), "not_positive");
        assert_eq!(label(&|c| c.slo.itl_ms = f64::NAN), "not_positive");
        assert_eq!(label(&|c| c.slo.percentile = 101.0), "out_of_range");
        assert_eq!(
            label(&|c| c.scale_down_stabilization_s = -1.0),
            "out_of_range"
        );
        assert_eq!(
            label(&|c| c.predictor = PredictorKind::MovingAverage { window: 0 }),
            "out_of_range"
        );
        assert_eq!(
            label(&|c| c.predictor = PredictorKind::Holt {
                alpha: 0.0,
                beta: 0.5
            }),
            "out_of_range"
        );
        assert_eq!(
            label(&|c| c.predictor = PredictorKind::Kalman {
                process_noise: 0.0,
                measurement_noise: 1.0
            }),
            "not_positive"
        );
        assert_eq!(
            label(&|c| c.tuning.target_utilisation = 1.5),
            "out_of_range"
        );
        assert_eq!(label(&|c| c.tuning.max_correction = 0.5), "out_of_range");
    }

    #[test]
    fn config_round_trips_through_yaml_and_reads_the_crd_spellings() {
        let c = config();
        let text = serde_yaml_ng::to_string(&c).unwrap();
        let back: PlannerConfig = serde_yaml_ng::from_str(&text).unwrap();
        assert_eq!(back, c);
        let p: PredictorKind =
            serde_yaml_ng::from_str("kind: moving-average\nwindow: 4\n").unwrap();
        assert_eq!(p, PredictorKind::MovingAverage { window: 4 });
        assert_eq!(p.as_str(), "moving-average");
        let roles: BTreeMap<Role, u32> =
            serde_yaml_ng::from_str("prefill: 1\ndecode: 2\n").unwrap();
        assert_eq!(
            roles.keys().map(|r| r.as_str()).collect::<Vec<_>>(),
            ["prefill", "decode"]
        );
    }

    #[test]
    fn gpus_count_each_role_at_its_width() {
        let mut c = config();
        c.roles.get_mut(&Role::Decode).unwrap().gpus_per_replica = 4;
        let r = [(Role::Prefill, 3), (Role::Decode, 2), (Role::Both, 9)].into();
        assert_eq!(c.gpus(&r), 3 + 8);
    }
}
