//! kvgate's SLA planner: how many replicas each role of a pool (prefill, decode, or both)
//! should have to meet a TTFT / ITL objective at the least GPU cost.
//!
//! Pure and synchronous: no async runtime, no I/O, no clock (time is the observation's
//! `at_s`). The operator calls [`Planner::plan`] once per interval with the pool's metrics and
//! replica counts and writes the [`Decision`]'s replicas to each role's `/scale`;
//! `kvgate-bench autoscale` calls it in virtual time against engine models.
//!
//! - [`Mode::Throughput`]: replicas = predicted load ÷ per-replica capacity from a
//!   [`Profile`], corrected by observed / expected latency ([`Corrections`], bounded).
//! - [`Mode::Load`]: an online regression of latency on load per replica gives the load a
//!   replica can take within the SLO; one replica per interval toward it.
//! - [`Mode::Both`]: load mode above the throughput mode's floor.
//! - Predictors ([`PredictorKind`]): constant, moving average, Holt, Kalman.
//! - Anti-flapping: HPA's scale-down stabilisation window and a minimum replica lifetime.
//! - A GPU budget shared by the roles; when it binds, replicas move from a role whose own
//!   recommendation fell to one that needs more, in one decision.
//! - Bad or missing metrics hold the current replicas; no decision is ever outside the roles'
//!   bounds or the budget.
//!
//! The crate README has the formulas, the complexity and the API summary.
//!
//! ```
//! use std::collections::BTreeMap;
//! use planner::{
//!     Metrics, Mode, Observation, PlannerConfig, Planner, PredictorKind, Role, RoleLimits, Slo,
//!     Tuning,
//! };
//!
//! let limits = RoleLimits { min_replicas: 1, max_replicas: 8, gpus_per_replica: 1 };
//! let mut planner = Planner::new(PlannerConfig {
//!     mode: Mode::Load,
//!     interval_s: 30.0,
//!     predictor: PredictorKind::Holt { alpha: 0.5, beta: 0.3 },
//!     scale_down_stabilization_s: 300.0,
//!     min_replica_lifetime_s: 120.0,
//!     gpu_budget: Some(10),
//!     roles: BTreeMap::from([(Role::Both, limits)]),
//!     slo: Slo { ttft_ms: 1000.0, itl_ms: 50.0, percentile: 90.0 },
//!     profile: None,
//!     move_between_roles: true,
//!     tuning: Tuning::default(),
//! })?;
//! let decision = planner.plan(&Observation {
//!     at_s: 0.0,
//!     metrics: Some(Metrics {
//!         rps: 4.0,
//!         isl_tokens: 2000.0,
//!         osl_tokens: 200.0,
//!         ttft_ms: Some(1500.0),
//!         itl_ms: Some(30.0),
//!         queue_depth: None,
//!         decode_requests: None,
//!     }),
//!     replicas: BTreeMap::from([(Role::Both, 2)]),
//!     ready: BTreeMap::new(),
//! });
//! // No regression yet and TTFT above the objective: one more replica.
//! assert_eq!(decision.desired[&Role::Both], 3);
//! assert_eq!(decision.reason.metric_label(), "load");
//! # Ok::<(), planner::ConfigError>(())
//! ```

mod budget;
mod config;
mod decision;
mod governor;
mod observation;
mod planner;
mod predictor;
mod profile;
mod regression;

pub use config::{ConfigError, Mode, PlannerConfig, PredictorKind, Role, RoleLimits, Slo, Tuning};
pub use decision::{Decision, HoldCause, Limit, Reason, RoleDecision, Source};
pub use observation::{Load, Metrics, Observation};
pub use planner::{Corrections, Planner, STALE_INTERVALS, concurrency_need, throughput_need};
pub use predictor::Predictor;
pub use profile::{DecodeTable, PrefillPoint, Profile, ProfileError};
pub use regression::{Line, Regression};
