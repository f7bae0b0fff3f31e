//! The result of a prefix lookup for one candidate endpoint.

use kv_events::Tier;

use crate::id::EndpointId;

/// How much of a prompt's key chain one endpoint can serve from cache.
///
/// `reach(t)` is the length of the longest prefix (from key 0) every block of which the
/// endpoint holds in tier `t` *or a faster one* (its own tiers, its node's host/disk/remote
/// tiers, and speculative GPU entries). So `reach(Gpu) ≤ reach(Host) ≤ reach(Disk) ≤
/// reach(Remote)`, and `hits(t)` is how many blocks the best-tier walk first finds in `t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Overlap {
    /// The candidate.
    pub endpoint: EndpointId,
    pub(crate) reach: [u32; 4],
}

impl Overlap {
    /// An overlap with explicit per-tier reaches (for tests and reference models).
    pub const fn new(endpoint: EndpointId, reach: [u32; 4]) -> Self {
        Self { endpoint, reach }
    }

    /// Prefix length served from `tier` or faster.
    pub const fn reach(&self, tier: Tier) -> u32 {
        match tier {
            Tier::Gpu => self.reach[0],
            Tier::Host => self.reach[1],
            Tier::Disk => self.reach[2],
            Tier::Remote => self.reach[3],
        }
    }

    /// Blocks of the prefix whose fastest copy is in `tier`.
    pub const fn hits(&self, tier: Tier) -> u32 {
        match tier {
            Tier::Gpu => self.reach[0],
            Tier::Host => self.reach[1] - self.reach[0],
            Tier::Disk => self.reach[2] - self.reach[1],
            Tier::Remote => self.reach[3] - self.reach[2],
        }
    }

    /// All four reaches, fastest tier first.
    pub const fn reaches(&self) -> [u32; 4] {
        self.reach
    }
}
