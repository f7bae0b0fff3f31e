//! What a scheduling decision returns, and how it can fail.

use std::time::Instant;

use kv_index::{EndpointId, Overlap};
use thiserror::Error;

use crate::cost::EffectiveLoad;
use crate::endpoint::Pick;
use crate::filter::NoCandidateReason;

/// Why the primary was chosen: a bounded label value for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// `kv`: the lowest cost, with part of the prompt cached there.
    KvHit,
    /// `kv`: the lowest cost with nothing cached there: chosen on load.
    Load,
    /// `kv`: the lowest-cost candidate was over the bounded-load cap; the best one under it won.
    BoundedLoadOverride,
    /// `kv` with temperature > 0: sampled, and not the lowest cost.
    Sampled,
    /// `prefix-only`: the longest GPU-resident prefix.
    PrefixHit,
    /// `prefix-only`: nothing cached anywhere: the least loaded.
    PrefixMiss,
    /// `least-load`.
    LeastLoad,
    /// `round-robin`.
    RoundRobin,
    /// `random`.
    Random,
}

impl Reason {
    /// Every reason, for metric pre-registration.
    pub const ALL: [Reason; 9] = [
        Reason::KvHit,
        Reason::Load,
        Reason::BoundedLoadOverride,
        Reason::Sampled,
        Reason::PrefixHit,
        Reason::PrefixMiss,
        Reason::LeastLoad,
        Reason::RoundRobin,
        Reason::Random,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::KvHit => "kv-hit",
            Reason::Load => "load",
            Reason::BoundedLoadOverride => "bounded-load-override",
            Reason::Sampled => "sampled",
            Reason::PrefixHit => "prefix-hit",
            Reason::PrefixMiss => "prefix-miss",
            Reason::LeastLoad => "least-load",
            Reason::RoundRobin => "round-robin",
            Reason::Random => "random",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One candidate's figures in a decision (for debugging and decision logs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CandidateScore {
    /// The candidate.
    pub endpoint: EndpointId,
    /// Its cost under the policy (lower ranks first). `kv`: the cost in blocks;
    /// `prefix-only`: minus its GPU prefix plus a load fraction below 1; `least-load`:
    /// requests plus a block fraction below 1; `round-robin`: its distance from the turn;
    /// `random`: its rank in the draw.
    pub cost: f64,
    /// Its prefix overlap, when the policy looked the prompt up (`kv`, `prefix-only`).
    pub overlap: Option<Overlap>,
    /// Its tier-credited cache hit in blocks, when looked up.
    pub credit: Option<f64>,
    /// Its effective load.
    pub load: EffectiveLoad,
    /// `kv`: whether the bounded-load rule excluded it from being primary.
    pub over_cap: bool,
}

/// A scheduling decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Where the request goes.
    pub primary: Pick,
    /// Where it goes if the primary cannot be reached, best first (distinct, primary excluded).
    pub fallbacks: Vec<Pick>,
    /// The prefill endpoint of a disaggregated request (`x-prefiller-host-port`).
    pub prefill: Option<Pick>,
    /// Why the primary won.
    pub reason: Reason,
    /// The primary's overlap with the prompt, per tier, before this decision's speculation.
    pub overlap: Overlap,
    /// The prompt's full blocks (the request's keys).
    pub prompt_blocks: u32,
    /// Prompt blocks the primary holds in no credited tier (what it, or the prefill endpoint,
    /// computes): the `uncached_blocks` to give [`crate::InflightTracker::on_routed`].
    pub uncached_blocks: u32,
    /// Every candidate's figures, in the policy's rank order (best first; with temperature > 0
    /// the primary may not be the first row).
    pub scores: Vec<CandidateScore>,
    /// When the lookup and the ranking ran, for a request that asked
    /// ([`crate::ScheduleRequest::timed`]); `None` otherwise.
    pub phases: Option<Phases>,
}

/// When a timed decision's two stages ran, as `(start, end)` on the monotonic clock: a traced
/// request's `index_lookup` and `score` spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phases {
    /// Gathering the candidates: the index lookup and each candidate's load.
    pub lookup: (Instant, Instant),
    /// Ranking the candidates.
    pub score: (Instant, Instant),
}

impl Decision {
    /// The primary then the fallbacks: the destination header's order.
    pub fn endpoints(&self) -> impl Iterator<Item = &Pick> {
        std::iter::once(&self.primary).chain(&self.fallbacks)
    }
}

/// A request the scheduler cannot place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ScheduleError {
    /// The filters left no candidate (answer 503).
    #[error("no endpoint can take the request ({})", reason.metric_label())]
    NoCandidates {
        /// The filter that left nothing.
        reason: NoCandidateReason,
    },
}

impl ScheduleError {
    /// A bounded label value for metrics and the drop-reason header.
    pub const fn metric_label(&self) -> &'static str {
        match self {
            ScheduleError::NoCandidates { reason } => reason.metric_label(),
        }
    }
}

impl From<NoCandidateReason> for ScheduleError {
    fn from(reason: NoCandidateReason) -> Self {
        ScheduleError::NoCandidates { reason }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_have_distinct_labels() {
        let labels: std::collections::BTreeSet<_> =
            Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), Reason::ALL.len());
        assert_eq!(
            Reason::BoundedLoadOverride.to_string(),
            "bounded-load-override"
        );
    }

    #[test]
    fn errors_label_by_reason() {
        let e = ScheduleError::from(NoCandidateReason::EmptySubset);
        assert_eq!(e.metric_label(), "empty_subset");
        assert!(e.to_string().contains("empty_subset"));
    }
}
