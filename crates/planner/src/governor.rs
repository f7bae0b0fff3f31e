//! The anti-flapping rules of one role, as a small state machine:
//!
//! - **Scale-down stabilisation** (Kubernetes HPA's `behavior.scaleDown.stabilizationWindowSeconds`):
//!   a role scales up to its recommendation at once, and down only to the highest
//!   recommendation of the last `window_s` seconds (this one included).
//! - **Minimum replica lifetime**: a role does not scale down until `lifetime_s` after its last
//!   scale-up. A Deployment removes its newest pods first, so this is what keeps every replica
//!   alive for at least `lifetime_s`.
//!
//! State: the recommendations inside the window (O(window / interval) memory) and the time of
//! the last increase. Each call is O(recommendations kept).

use std::collections::VecDeque;

/// What held a role above its recommendation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Held {
    /// Nothing: the role goes to its recommendation.
    No,
    /// A higher recommendation inside the stabilisation window.
    Stabilization,
    /// A scale-up less than the minimum lifetime ago.
    Lifetime,
}

/// One role's stabilisation window and lifetime clock.
#[derive(Debug, Clone)]
pub(crate) struct Governor {
    window_s: f64,
    lifetime_s: f64,
    recommendations: VecDeque<(f64, u32)>,
    last_increase: Option<f64>,
}

impl Governor {
    pub(crate) fn new(window_s: f64, lifetime_s: f64) -> Self {
        Self {
            window_s,
            lifetime_s,
            recommendations: VecDeque::new(),
            last_increase: None,
        }
    }

    /// Records `recommended` at `at` and returns where the role may go from `current`.
    pub(crate) fn govern(&mut self, at: f64, current: u32, recommended: u32) -> (u32, Held) {
        self.recommendations.push_back((at, recommended));
        while self
            .recommendations
            .front()
            .is_some_and(|&(t, _)| t < at - self.window_s)
        {
            self.recommendations.pop_front();
        }
        if recommended >= current {
            return (recommended, Held::No);
        }
        if self.young(at) {
            return (current, Held::Lifetime);
        }
        let highest = self
            .recommendations
            .iter()
            .map(|&(_, r)| r)
            .max()
            .unwrap_or(recommended);
        let target = highest.min(current);
        let held = if target > recommended {
            Held::Stabilization
        } else {
            Held::No
        };
        (target, held)
    }

    /// Whether the role scaled up less than the minimum lifetime before `at`.
    pub(crate) fn young(&self, at: f64) -> bool {
        self.last_increase.is_some_and(|t| at - t < self.lifetime_s)
    }

    /// The decision applied to the role: `from` → `to` at `at`.
    pub(crate) fn applied(&mut self, at: f64, from: u32, to: u32) {
        if to > from {
            self.last_increase = Some(at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_up_is_immediate_and_scale_down_waits_for_the_window() {
        let mut g = Governor::new(60.0, 0.0);
        assert_eq!(g.govern(0.0, 2, 5), (5, Held::No));
        g.applied(0.0, 2, 5);
        assert_eq!(g.govern(30.0, 5, 3), (5, Held::Stabilization));
        assert_eq!(
            g.govern(60.0, 5, 2),
            (5, Held::Stabilization),
            "the window is closed"
        );
        assert_eq!(
            g.govern(61.0, 5, 2),
            (3, Held::Stabilization),
            "5 left the window"
        );
        assert_eq!(g.govern(90.0, 3, 2), (3, Held::Stabilization));
        assert_eq!(g.govern(121.5, 3, 2), (2, Held::No));
    }

    #[test]
    fn a_young_role_does_not_shrink() {
        let mut g = Governor::new(0.0, 100.0);
        g.applied(10.0, 1, 2);
        assert!(g.young(109.0) && !g.young(110.0));
        assert_eq!(g.govern(50.0, 2, 1), (2, Held::Lifetime));
        assert_eq!(g.govern(110.0, 2, 1), (1, Held::No));
        g.applied(120.0, 2, 1);
        assert!(!g.young(121.0), "a decrease does not restart the clock");
    }
}
