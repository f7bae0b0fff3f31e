//! Index configuration and its validation.

use thiserror::Error;

/// How the index is laid out and bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Number of shards (a power of two, 1..=1024). More shards let writers of different
    /// sources contend less, but cost every lookup one shared-lock pair per shard it touches
    /// (a prompt's keys touch them all) and every `apply` a fixed cost per shard its keys
    /// land in. The default, 4, was measured against 16 (crate README, fifth session).
    pub shards: usize,
    /// The most (block, holder) residencies kept; beyond it the least recently used blocks
    /// (CLOCK approximation, per shard) are evicted with all their holders.
    pub capacity: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            shards: 4,
            capacity: 64 << 20,
        }
    }
}

/// A configuration the index cannot use.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// The shard count is not a power of two in 1..=1024.
    #[error("shard count {0} must be a power of two between 1 and 1024")]
    Shards(usize),
    /// The capacity is smaller than one residency per shard.
    #[error("capacity {capacity} must be at least the shard count {shards}")]
    Capacity {
        /// The requested capacity.
        capacity: usize,
        /// The shard count.
        shards: usize,
    },
}

impl ConfigError {
    /// A bounded label value for metrics.
    pub const fn metric_label(&self) -> &'static str {
        match self {
            ConfigError::Shards(_) => "shards",
            ConfigError::Capacity { .. } => "capacity",
        }
    }
}

impl IndexConfig {
    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.shards.is_power_of_two() || self.shards > 1024 {
            return Err(ConfigError::Shards(self.shards));
        }
        if self.capacity < self.shards {
            return Err(ConfigError::Capacity {
                capacity: self.capacity,
                shards: self.shards,
            });
        }
        Ok(())
    }
}
