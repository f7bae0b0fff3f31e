//! What a planning step returns: the replicas per role, the predicted load, why, and per-role
//! detail.

use std::collections::BTreeMap;
use std::fmt;

use crate::config::Role;
use crate::observation::Load;

/// Why the planner kept the current replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HoldCause {
    /// No metrics for the interval.
    MetricsUnavailable,
    /// Metrics with non-finite or negative figures, or requests without lengths.
    MetricsInvalid,
    /// A configured role's current replicas were not observed.
    ReplicasUnknown,
    /// The observation is older than the previous one.
    ClockWentBack,
    /// A role's recommendation is lower, but a higher one is inside the stabilisation window.
    Stabilizing,
    /// A role's recommendation is lower, but it scaled up less than the minimum lifetime ago.
    MinLifetime,
    /// A role needs more replicas and the GPU budget has none left.
    Budget,
}

impl HoldCause {
    /// Every cause.
    pub const ALL: [HoldCause; 7] = [
        Self::MetricsUnavailable,
        Self::MetricsInvalid,
        Self::ReplicasUnknown,
        Self::ClockWentBack,
        Self::Stabilizing,
        Self::MinLifetime,
        Self::Budget,
    ];

    /// The label spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::MetricsUnavailable => "metrics_unavailable",
            Self::MetricsInvalid => "metrics_invalid",
            Self::ReplicasUnknown => "replicas_unknown",
            Self::ClockWentBack => "clock_went_back",
            Self::Stabilizing => "stabilizing",
            Self::MinLifetime => "min_lifetime",
            Self::Budget => "budget",
        }
    }
}

/// Why a decision is what it is: the most significant change, or why nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Current replicas kept (clamped into bounds and the budget if they were outside).
    Hold(HoldCause),
    /// Every role is where its recommendation is.
    Steady,
    /// A role follows the throughput model.
    Throughput {
        /// The role that changed most.
        role: Role,
        /// Its replicas before.
        from: u32,
        /// After.
        to: u32,
    },
    /// A role follows the load model (one replica per interval).
    Load {
        /// The role that changed most.
        role: Role,
        /// Its replicas before.
        from: u32,
        /// After.
        to: u32,
    },
    /// The budget bound: replicas left one role and joined another in this decision.
    MovedCapacity {
        /// The role that shrank.
        from: Role,
        /// The role that grew.
        to: Role,
        /// Replicas the shrinking role gave up.
        replicas: u32,
    },
    /// A role's replicas were outside its bounds.
    Bounds {
        /// The role.
        role: Role,
        /// Its replicas before.
        from: u32,
        /// After.
        to: u32,
    },
    /// A role shed replicas to fit the budget (which its current replicas exceeded).
    Budget {
        /// The role.
        role: Role,
        /// Its replicas before.
        from: u32,
        /// After.
        to: u32,
    },
}

impl Reason {
    /// A bounded label for metrics.
    pub const fn metric_label(&self) -> &'static str {
        match self {
            Self::Hold(HoldCause::MetricsUnavailable) => "hold_metrics_unavailable",
            Self::Hold(HoldCause::MetricsInvalid) => "hold_metrics_invalid",
            Self::Hold(HoldCause::ReplicasUnknown) => "hold_replicas_unknown",
            Self::Hold(HoldCause::ClockWentBack) => "hold_clock_went_back",
            Self::Hold(HoldCause::Stabilizing) => "hold_stabilizing",
            Self::Hold(HoldCause::MinLifetime) => "hold_min_lifetime",
            Self::Hold(HoldCause::Budget) => "hold_budget",
            Self::Steady => "steady",
            Self::Throughput { .. } => "throughput",
            Self::Load { .. } => "load",
            Self::MovedCapacity { .. } => "moved_capacity",
            Self::Bounds { .. } => "bounds",
            Self::Budget { .. } => "budget",
        }
    }

    /// Whether the decision kept the current replicas on purpose.
    pub const fn is_hold(&self) -> bool {
        matches!(self, Self::Hold(_) | Self::Steady)
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Hold(cause) => write!(f, "hold ({})", cause.as_str().replace('_', " ")),
            Self::Steady => f.write_str("steady"),
            Self::Throughput { role, from, to } => write!(f, "throughput: {role} {from}→{to}"),
            Self::Load { role, from, to } => write!(f, "load: {role} {from}→{to}"),
            Self::MovedCapacity { from, to, replicas } => {
                write!(f, "moved capacity: {replicas} replicas {from}→{to}")
            }
            Self::Bounds { role, from, to } => write!(f, "bounds: {role} {from}→{to}"),
            Self::Budget { role, from, to } => write!(f, "budget: {role} {from}→{to}"),
        }
    }
}

/// Which model produced a role's recommendation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// Not computed (the decision held).
    Held,
    /// The throughput model (throughput mode, or the floor in both mode).
    Throughput,
    /// The load model.
    Load,
}

/// What kept a role from its recommendation (or moved it off it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    /// The recommendation was outside `min..=max`.
    Bounds,
    /// A higher recommendation in the stabilisation window.
    Stabilization,
    /// The minimum replica lifetime.
    Lifetime,
    /// The GPU budget.
    Budget,
    /// It gave replicas to another role (stabilisation bypassed).
    Moved,
}

/// One role's part of a decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoleDecision {
    /// Replicas observed.
    pub current: u32,
    /// Replicas observed ready.
    pub ready: u32,
    /// Replicas needed by the model, before bounds, stabilisation and budget (fractional for
    /// the throughput model; the load model's target count).
    pub need: f64,
    /// The recommendation: the model's answer within bounds.
    pub recommended: u32,
    /// What the role gets.
    pub desired: u32,
    /// Which model recommended.
    pub source: Source,
    /// What kept it off the recommendation, if anything.
    pub limit: Option<Limit>,
}

/// One planning step's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Replicas per role: every configured role, unless the hold cause is
    /// [`HoldCause::ReplicasUnknown`] (then only the roles observed). Always within the roles'
    /// bounds and, all together, within the GPU budget.
    pub desired: BTreeMap<Role, u32>,
    /// The load predicted for the next interval (`None` when the decision held on bad input).
    pub predicted: Option<Load>,
    /// Why.
    pub reason: Reason,
    /// A role got fewer replicas than it asked for because of the budget.
    pub budget_limited: bool,
    /// Per-role detail (empty when the decision held on bad input).
    pub roles: BTreeMap<Role, RoleDecision>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_print_bounded_text_and_distinct_labels() {
        let all = [
            Reason::Steady,
            Reason::Throughput {
                role: Role::Decode,
                from: 3,
                to: 5,
            },
            Reason::Load {
                role: Role::Prefill,
                from: 4,
                to: 3,
            },
            Reason::MovedCapacity {
                from: Role::Prefill,
                to: Role::Decode,
                replicas: 2,
            },
            Reason::Bounds {
                role: Role::Both,
                from: 9,
                to: 8,
            },
            Reason::Budget {
                role: Role::Both,
                from: 9,
                to: 8,
            },
        ]
        .into_iter()
        .chain(HoldCause::ALL.map(Reason::Hold));
        let mut labels = std::collections::BTreeSet::new();
        for r in all {
            assert!(labels.insert(r.metric_label()), "{r:?}");
            assert!(r.to_string().len() < 64);
        }
        assert_eq!(
            Reason::Hold(HoldCause::MetricsUnavailable).to_string(),
            "hold (metrics unavailable)"
        );
        assert_eq!(
            Reason::MovedCapacity {
                from: Role::Prefill,
                to: Role::Decode,
                replicas: 2
            }
            .to_string(),
            "moved capacity: 2 replicas prefill→decode"
        );
        assert!(Reason::Steady.is_hold());
    }
}
