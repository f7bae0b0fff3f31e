//! The pieces of a candidate's cost: its effective load (the EPP's accounting refined by a
//! fresh engine sample), its tier-credited cache hit, and the `kv` cost that combines them.

use kv_events::Tier;
use kv_index::Overlap;

use crate::config::{EngineLoadConfig, TierCredit, Weights};
use crate::inflight::InflightLoad;
use crate::load::EngineLoad;

/// A candidate's load as a decision sees it.
///
/// Without a fresh engine sample it is the EPP's own [`InflightLoad`]. With one, each figure is
/// the larger of the EPP's own and the engine's (which also counts requests from other EPP
/// replicas and traffic the EPP never saw; the larger, not the sum, because the engine's
/// figures include this EPP's requests): `requests` vs `running + waiting`, `prefill_blocks`
/// vs `waiting × waiting_request_blocks`, `decode_blocks` vs `kv_usage × kv_capacity_blocks`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct EffectiveLoad {
    /// Requests in flight.
    pub requests: u64,
    /// Prompt blocks queued for prefill.
    pub prefill_blocks: u64,
    /// Blocks held by decoding requests.
    pub decode_blocks: u64,
}

impl EffectiveLoad {
    /// Combines the EPP's own figures with an engine sample already checked for freshness.
    pub fn new(own: InflightLoad, engine: Option<EngineLoad>, config: &EngineLoadConfig) -> Self {
        let mut load = EffectiveLoad {
            requests: own.requests,
            prefill_blocks: own.prefill_blocks,
            decode_blocks: own.decode_blocks,
        };
        if let Some(s) = engine {
            let queued = u64::from(s.waiting) * u64::from(config.waiting_request_blocks);
            // kv_usage is in 0..=1 (the load book clamps it), so the product fits.
            let used = (s.kv_usage * config.kv_capacity_blocks as f64).round() as u64;
            load.requests = load
                .requests
                .max(u64::from(s.running) + u64::from(s.waiting));
            load.prefill_blocks = load.prefill_blocks.max(queued);
            load.decode_blocks = load.decode_blocks.max(used);
        }
        load
    }

    /// Prefill plus decode blocks.
    pub const fn blocks(&self) -> u64 {
        self.prefill_blocks.saturating_add(self.decode_blocks)
    }
}

/// The cache credit of an overlap, in blocks: `gpu_hits + host·host_hits + disk·disk_hits +
/// remote·remote_hits`.
pub fn credit(overlap: &Overlap, weights: &TierCredit) -> f64 {
    f64::from(overlap.hits(Tier::Gpu))
        + weights.host * f64::from(overlap.hits(Tier::Host))
        + weights.disk * f64::from(overlap.hits(Tier::Disk))
        + weights.remote * f64::from(overlap.hits(Tier::Remote))
}

/// Prompt blocks with no copy in any tier that earns credit: what the endpoint would compute.
pub fn uncached_blocks(prompt_blocks: u32, overlap: &Overlap, weights: &TierCredit) -> u32 {
    let reach = if weights.remote > 0.0 {
        overlap.reach(Tier::Remote)
    } else if weights.disk > 0.0 {
        overlap.reach(Tier::Disk)
    } else if weights.host > 0.0 {
        overlap.reach(Tier::Host)
    } else {
        overlap.reach(Tier::Gpu)
    };
    prompt_blocks.saturating_sub(reach)
}

/// Snaps a cost to a 1/4096-block grid so that costs equal up to float rounding tie (and ties
/// are broken at random, not by rounding noise).
pub(crate) fn snap(cost: f64) -> f64 {
    (cost * 4096.0).round() / 4096.0
}

/// The `kv` policy's cost (lower wins):
/// `overlap·max(prompt_blocks − credit, 0) + decode·decode_blocks + queue·prefill_blocks`.
pub fn kv_cost(prompt_blocks: u32, credit: f64, load: &EffectiveLoad, weights: &Weights) -> f64 {
    let prefill = (f64::from(prompt_blocks) - credit).max(0.0);
    snap(
        weights.overlap * prefill
            + weights.decode * load.decode_blocks as f64
            + weights.queue * load.prefill_blocks as f64,
    )
}

/// The prefill leg's cost: the `kv` cost without the decode term (a prefill endpoint holds no
/// decoding requests).
pub fn prefill_cost(
    prompt_blocks: u32,
    credit: f64,
    load: &EffectiveLoad,
    weights: &Weights,
) -> f64 {
    let prefill = (f64::from(prompt_blocks) - credit).max(0.0);
    snap(weights.overlap * prefill + weights.queue * load.prefill_blocks as f64)
}

#[cfg(test)]
mod tests {
    use kv_index::{EndpointId, Millis};

    use super::*;

    fn overlap(reach: [u32; 4]) -> Overlap {
        Overlap::new(EndpointId::new(0).unwrap(), reach)
    }

    #[test]
    fn credit_weights_each_tiers_hits() {
        let c = TierCredit::default();
        // 4 GPU, 4 more in host, 2 more on disk, 2 more remote.
        let o = overlap([4, 8, 10, 12]);
        assert_eq!(credit(&o, &c), 4.0 + 0.75 * 4.0 + 0.25 * 2.0);
        assert_eq!(uncached_blocks(16, &o, &c), 6);
        let all = TierCredit {
            host: 1.0,
            disk: 1.0,
            remote: 1.0,
        };
        assert_eq!(credit(&o, &all), 12.0);
        assert_eq!(uncached_blocks(16, &o, &all), 4);
        let none = TierCredit {
            host: 0.0,
            disk: 0.0,
            remote: 0.0,
        };
        assert_eq!(credit(&o, &none), 4.0);
        assert_eq!(uncached_blocks(16, &o, &none), 12);
        assert_eq!(uncached_blocks(2, &o, &none), 0);
    }

    #[test]
    fn kv_cost_matches_the_formula() {
        let w = Weights {
            overlap: 2.0,
            decode: 0.5,
            queue: 3.0,
        };
        let load = EffectiveLoad {
            requests: 3,
            prefill_blocks: 4,
            decode_blocks: 10,
        };
        assert_eq!(
            kv_cost(20, 6.5, &load, &w),
            2.0 * 13.5 + 0.5 * 10.0 + 3.0 * 4.0
        );
        // The prefill term never goes negative.
        assert_eq!(kv_cost(4, 6.5, &load, &w), 5.0 + 12.0);
        assert_eq!(prefill_cost(20, 6.5, &load, &w), 27.0 + 12.0);
    }

    #[test]
    fn engine_samples_raise_the_load_never_lower_it() {
        let cfg = EngineLoadConfig {
            max_age_ms: 1,
            waiting_request_blocks: 8,
            kv_capacity_blocks: 1000,
        };
        let own = InflightLoad {
            requests: 5,
            prefill_blocks: 30,
            decode_blocks: 100,
        };
        assert_eq!(
            EffectiveLoad::new(own, None, &cfg),
            EffectiveLoad {
                requests: 5,
                prefill_blocks: 30,
                decode_blocks: 100
            }
        );
        let busy = EngineLoad {
            waiting: 6,
            running: 4,
            kv_usage: 0.5,
            at: Millis(0),
        };
        let l = EffectiveLoad::new(own, Some(busy), &cfg);
        assert_eq!(
            (l.requests, l.prefill_blocks, l.decode_blocks),
            (10, 48, 500)
        );
        assert_eq!(l.blocks(), 548);
        let idle = EngineLoad::default();
        assert_eq!(
            EffectiveLoad::new(own, Some(idle), &cfg),
            EffectiveLoad::new(own, None, &cfg)
        );
    }

    #[test]
    fn snapping_merges_rounding_noise() {
        assert_eq!(snap(0.1 + 0.2), snap(0.3));
        assert_ne!(snap(1.0), snap(1.001));
    }
}
