//! The baseline autoscaler: a Kubernetes HPA per role on the engines' queue depth (vLLM's
//! `num_requests_waiting`, averaged over the role's pods), with the HPA controller's rules:
//! `desired = ⌈current × metric / target⌉`; pods not ready yet count as an empty queue when
//! the ratio says up, and as at the target when it says down (no change if that reverses the
//! direction); no change within the tolerance; at most `max(2 × current, current + 4)` per
//! decision (the default scale-up policy, here per interval); scale-down to the highest
//! recommendation of the stabilisation window; the role's bounds. Each role scales on its
//! own; there is no GPU budget.

use std::collections::{BTreeMap, VecDeque};

use engine_model::Nanos;
use planner::{Role, RoleLimits};

use super::PoolView;

/// The HPA's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct HpaConfig {
    /// Target requests waiting per ready replica.
    pub target_queue: f64,
    /// No change while `|metric / target − 1|` is within it (HPA: 0.1).
    pub tolerance: f64,
    /// Scale-down stabilisation window (HPA: 300 s).
    pub stabilization: Nanos,
    /// Each role's bounds.
    pub limits: BTreeMap<Role, RoleLimits>,
}

/// An HPA per role.
#[derive(Debug, Clone)]
pub struct Hpa {
    config: HpaConfig,
    recommendations: BTreeMap<Role, VecDeque<(Nanos, u32)>>,
}

impl Hpa {
    /// A fresh HPA.
    pub fn new(config: HpaConfig) -> Self {
        Self {
            config,
            recommendations: BTreeMap::new(),
        }
    }

    /// The replicas per role at `at`.
    pub fn decide(&mut self, at: Nanos, pool: &PoolView) -> BTreeMap<Role, u32> {
        let mut out = BTreeMap::new();
        for (&role, limits) in &self.config.limits {
            let current = pool.replicas.get(&role).copied().unwrap_or(0);
            let ready = pool.ready.get(&role).copied().unwrap_or(0);
            let target = self.config.target_queue;
            let waiting = pool.waiting.get(&role).copied().unwrap_or(0.0) * f64::from(ready);
            let unready = f64::from(current.saturating_sub(ready));
            let pods = f64::from(current.max(ready));
            let ready_ratio = if ready == 0 {
                1.0
            } else {
                waiting / f64::from(ready) / target
            };
            let ratio = if ready_ratio > 1.0 {
                // Up: pods still starting count as idle.
                waiting / pods / target
            } else {
                // Down: pods still starting count as at the target.
                (waiting + unready * target) / pods / target
            };
            let reverses = (ready_ratio > 1.0) != (ratio > 1.0);
            let raw = if ready == 0 || reverses || (ratio - 1.0).abs() <= self.config.tolerance {
                current
            } else {
                let want = (pods * ratio - 1e-9).ceil().max(0.0);
                let cap = f64::from(current.saturating_mul(2).max(current.saturating_add(4)));
                want.min(cap) as u32
            };
            let rec = raw.clamp(limits.min_replicas, limits.max_replicas);
            let window = self.recommendations.entry(role).or_default();
            window.push_back((at, rec));
            while window
                .front()
                .is_some_and(|&(t, _)| t.saturating_add(self.config.stabilization) < at)
            {
                window.pop_front();
            }
            let desired = if rec >= current {
                rec
            } else {
                let highest = window.iter().map(|&(_, r)| r).max().unwrap_or(rec);
                highest.min(current).max(limits.min_replicas)
            };
            out.insert(role, desired);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    const S: Nanos = 1_000_000_000;

    fn hpa() -> Hpa {
        Hpa::new(HpaConfig {
            target_queue: 2.0,
            tolerance: 0.1,
            stabilization: 60 * S,
            limits: [(
                Role::Prefill,
                RoleLimits {
                    min_replicas: 1,
                    max_replicas: 20,
                    gpus_per_replica: 1,
                },
            )]
            .into(),
        })
    }

    fn pool(replicas: u32, ready: u32, waiting: f64) -> PoolView {
        PoolView {
            replicas: [(Role::Prefill, replicas)].into(),
            ready: [(Role::Prefill, ready)].into(),
            waiting: [(Role::Prefill, waiting)].into(),
            decode_requests: 0,
        }
    }

    #[test]
    fn follows_the_queue_ratio_with_tolerance_rate_limit_and_window() {
        let mut h = hpa();
        assert_eq!(
            h.decide(0, &pool(4, 4, 2.1))[&Role::Prefill],
            4,
            "within 10%"
        );
        assert_eq!(h.decide(30 * S, &pool(4, 4, 3.0))[&Role::Prefill], 6);
        assert_eq!(
            h.decide(60 * S, &pool(6, 6, 20.0))[&Role::Prefill],
            12,
            "2× at most"
        );
        assert_eq!(
            h.decide(90 * S, &pool(12, 12, 0.0))[&Role::Prefill],
            12,
            "window"
        );
        assert_eq!(h.decide(119 * S, &pool(12, 12, 0.0))[&Role::Prefill], 12);
        assert_eq!(
            h.decide(121 * S, &pool(12, 12, 0.0))[&Role::Prefill],
            1,
            "12 left"
        );
    }

    #[test]
    fn starting_pods_count_idle_going_up_and_at_target_going_down() {
        let mut h = hpa();
        // 4 ready with 4 waiting each (16), 4 starting: 16 / 8 pods = 2 = the target.
        assert_eq!(h.decide(0, &pool(8, 4, 4.0))[&Role::Prefill], 8);
        // 4 ready with 6 waiting each: 24 / 8 / 2 = 1.5 → 12.
        assert_eq!(h.decide(30 * S, &pool(8, 4, 6.0))[&Role::Prefill], 12);
        // 2 ready and empty, 2 starting: (0 + 2 × 2) / 4 / 2 = 0.5 → 2.
        let mut h = hpa();
        assert_eq!(h.decide(0, &pool(4, 2, 0.0))[&Role::Prefill], 2);
    }
}
