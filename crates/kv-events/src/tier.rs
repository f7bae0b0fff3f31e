//! Storage tiers and the engines' medium names.

use serde::{Deserialize, Serialize};

/// Where a KV block lives, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Accelerator memory (vLLM/SGLang `GPU`).
    Gpu,
    /// Host memory (vLLM `CPU`, SGLang `CPU_PINNED`, the KV block manager's G2).
    Host,
    /// Local disk (vLLM `STORAGE`, SGLang `DISK`, the KV block manager's G3).
    Disk,
    /// Remote storage (SGLang `EXTERNAL`, the KV block manager's G4).
    Remote,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Tier; 4] = [Tier::Gpu, Tier::Host, Tier::Disk, Tier::Remote];

    /// A small dense index (0..4), for per-tier arrays.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// A bounded label value for metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::Remote => "remote",
        }
    }
}

/// The medium an engine reports for a block, as it appears on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// `GPU` (vLLM and SGLang; vLLM reports it on its CPU backend too).
    Gpu,
    /// vLLM `CPU`.
    Cpu,
    /// SGLang `CPU_PINNED`.
    CpuPinned,
    /// vLLM `STORAGE`.
    Storage,
    /// SGLang `DISK`.
    Disk,
    /// SGLang `EXTERNAL`.
    External,
}

impl Medium {
    /// Parses a wire name; `None` for names no engine is known to send.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "GPU" => Medium::Gpu,
            "CPU" => Medium::Cpu,
            "CPU_PINNED" => Medium::CpuPinned,
            "STORAGE" => Medium::Storage,
            "DISK" => Medium::Disk,
            "EXTERNAL" => Medium::External,
            _ => return None,
        })
    }

    /// The wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::CpuPinned => "CPU_PINNED",
            Medium::Storage => "STORAGE",
            Medium::Disk => "DISK",
            Medium::External => "EXTERNAL",
        }
    }

    /// The kvgate tier this medium maps to.
    pub const fn tier(self) -> Tier {
        match self {
            Medium::Gpu => Tier::Gpu,
            Medium::Cpu | Medium::CpuPinned => Tier::Host,
            Medium::Storage | Medium::Disk => Tier::Disk,
            Medium::External => Tier::Remote,
        }
    }
}

/// The tier of an event whose medium may be absent: engines omit it for GPU blocks.
pub fn tier_of(medium: Option<Medium>) -> Tier {
    medium.map_or(Tier::Gpu, Medium::tier)
}

/// A set of tiers, as a bit mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TierSet(u8);

impl TierSet {
    /// The empty set.
    pub const EMPTY: TierSet = TierSet(0);

    /// Adds a tier.
    pub fn insert(&mut self, tier: Tier) {
        self.0 |= 1 << tier.index();
    }

    /// Removes a tier; returns whether it was present.
    pub fn remove(&mut self, tier: Tier) -> bool {
        let had = self.contains(tier);
        self.0 &= !(1 << tier.index());
        had
    }

    /// Whether the tier is in the set.
    pub const fn contains(self, tier: Tier) -> bool {
        self.0 & (1 << tier.index()) != 0
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_medium_maps_to_its_tier() {
        let cases = [
            ("GPU", Tier::Gpu),
            ("CPU", Tier::Host),
            ("CPU_PINNED", Tier::Host),
            ("STORAGE", Tier::Disk),
            ("DISK", Tier::Disk),
            ("EXTERNAL", Tier::Remote),
        ];
        for (name, tier) in cases {
            let m = Medium::parse(name).unwrap();
            assert_eq!(m.as_str(), name);
            assert_eq!(m.tier(), tier);
        }
        assert_eq!(Medium::parse("gpu"), None);
        assert_eq!(tier_of(None), Tier::Gpu);
    }

    #[test]
    fn tier_set_tracks_membership() {
        let mut s = TierSet::EMPTY;
        s.insert(Tier::Host);
        s.insert(Tier::Gpu);
        assert!(s.contains(Tier::Host) && s.contains(Tier::Gpu) && !s.contains(Tier::Disk));
        assert!(s.remove(Tier::Gpu));
        assert!(!s.remove(Tier::Gpu));
        assert!(s.remove(Tier::Host));
        assert!(s.is_empty());
    }
}
