//! Engine configuration: vLLM's cache and scheduler settings plus the cost model.

use serde::{Deserialize, Serialize};

use crate::cost::{CostError, CostModel};

/// One engine's settings. Names follow vLLM's flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Tokens per KV block (`--block-size`).
    pub block_size: u32,
    /// KV blocks on the GPU as vLLM reports them (`num_gpu_blocks`). Block 0 is vLLM's reserved
    /// null block, so `num_gpu_blocks − 1` blocks hold tokens.
    pub num_gpu_blocks: u32,
    /// Most requests running at once (`--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Token budget of one step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// Longest prompt + output (`--max-model-len`).
    pub max_model_len: u32,
    /// Automatic prefix caching (`--enable-prefix-caching`).
    pub enable_prefix_caching: bool,
    /// Largest prefill chunk of one request in one step (`--long-prefill-token-threshold`);
    /// 0 = no limit beyond the step's budget.
    pub long_prefill_token_threshold: u32,
    /// KV-cache bytes per token, all layers and all GPUs of the engine.
    pub kv_bytes_per_token: u64,
    /// Bytes/s at which a remote engine's KV blocks arrive (P/D disaggregation).
    pub kv_transfer_bandwidth: u64,
    /// Blocks of host (CPU) memory a KV offloading connector keeps (vLLM's
    /// `--kv-offloading-size`, Dynamo KVBM's G2 tier); 0 = no offloading. Write-through: every
    /// block the GPU caches is copied there too, the least recently used is dropped.
    #[serde(default)]
    pub num_host_blocks: u32,
    /// Bytes/s at which offloaded blocks load back into GPU memory (PCIe host → device).
    #[serde(default = "default_host_load_bandwidth")]
    pub host_load_bandwidth: u64,
    /// Bytes/s at which offloaded blocks load from a node's local disk tier (NVMe read, with
    /// GPUDirect Storage or through host memory).
    #[serde(default = "default_disk_load_bandwidth")]
    pub disk_load_bandwidth: u64,
    /// Bytes/s at which offloaded blocks load from a remote store (Redis, S3) over the node's
    /// network.
    #[serde(default = "default_remote_load_bandwidth")]
    pub remote_load_bandwidth: u64,
    /// Analysis only, no real engine has it: prefill chunks cost no compute and no KV reads
    /// (a prefilling sequence still takes its slot in the step, and a step with only prefill
    /// still streams the weights). A run with it bounds what any placement could gain by
    /// avoiding prefill (`kvgate-bench replay --free-prefill`). Off by default.
    #[serde(default, skip_serializing_if = "is_false")]
    pub free_prefill: bool,
    /// The step-cost model.
    pub cost: CostModel,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// PCIe Gen5 x16 host → device with pinned buffers, as achieved (not the 64 GB/s line rate).
pub(crate) const PCIE5_H2D_BYTES_PER_S: u64 = 50_000_000_000;

fn default_host_load_bandwidth() -> u64 {
    PCIE5_H2D_BYTES_PER_S
}

/// One PCIe Gen4 NVMe drive's sequential read, as achieved (~7 GB/s rated).
pub(crate) const NVME_READ_BYTES_PER_S: u64 = 6_000_000_000;

/// A 25 Gb/s node network, as achieved by one client of a store.
pub(crate) const REMOTE_READ_BYTES_PER_S: u64 = 2_500_000_000;

fn default_disk_load_bandwidth() -> u64 {
    NVME_READ_BYTES_PER_S
}

fn default_remote_load_bandwidth() -> u64 {
    REMOTE_READ_BYTES_PER_S
}

/// A configuration the engine cannot run with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A setting that must be positive is zero.
    #[error("{field} must be positive")]
    Zero {
        /// The setting.
        field: &'static str,
    },
    /// Fewer than two blocks: vLLM reserves one as the null block.
    #[error("num_gpu_blocks is {0}: at least 2 are needed (block 0 is the reserved null block)")]
    TooFewBlocks(u32),
    /// The step budget cannot hold one token per running sequence (vLLM checks the same).
    #[error("max_num_batched_tokens ({batched}) is smaller than max_num_seqs ({seqs})")]
    BudgetBelowSeqs {
        /// `max_num_batched_tokens`.
        batched: u32,
        /// `max_num_seqs`.
        seqs: u32,
    },
    /// One request of `max_model_len` tokens would not fit in the KV cache (vLLM refuses to
    /// start in that case).
    #[error("max_model_len {max_model_len} exceeds the KV cache ({capacity} tokens)")]
    ModelLenExceedsCache {
        /// `max_model_len`.
        max_model_len: u32,
        /// Tokens the usable blocks hold.
        capacity: u64,
    },
    /// A KV offloading size that is negative, not a number, or more blocks than a `u32`.
    #[error("KV offloading size {gib} GiB must be a non-negative number of at most 2^32 blocks")]
    OffloadingSize {
        /// The requested size, GiB.
        gib: f64,
    },
    /// The cost model is invalid.
    #[error(transparent)]
    Cost(#[from] CostError),
}

impl ConfigError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Zero { .. } => "zero",
            Self::TooFewBlocks(_) => "too_few_blocks",
            Self::BudgetBelowSeqs { .. } => "budget_below_seqs",
            Self::ModelLenExceedsCache { .. } => "model_len_exceeds_cache",
            Self::OffloadingSize { .. } => "offloading_size",
            Self::Cost(e) => e.metric_label(),
        }
    }
}

impl EngineConfig {
    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("block_size", u64::from(self.block_size)),
            ("max_num_seqs", u64::from(self.max_num_seqs)),
            (
                "max_num_batched_tokens",
                u64::from(self.max_num_batched_tokens),
            ),
            ("max_model_len", u64::from(self.max_model_len)),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
            ("kv_transfer_bandwidth", self.kv_transfer_bandwidth),
            ("host_load_bandwidth", self.host_load_bandwidth),
            ("disk_load_bandwidth", self.disk_load_bandwidth),
            ("remote_load_bandwidth", self.remote_load_bandwidth),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if self.num_gpu_blocks < 2 {
            return Err(ConfigError::TooFewBlocks(self.num_gpu_blocks));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(ConfigError::BudgetBelowSeqs {
                batched: self.max_num_batched_tokens,
                seqs: self.max_num_seqs,
            });
        }
        let capacity = self.usable_blocks() * u64::from(self.block_size);
        if u64::from(self.max_model_len) > capacity {
            return Err(ConfigError::ModelLenExceedsCache {
                max_model_len: self.max_model_len,
                capacity,
            });
        }
        self.cost.validate()?;
        Ok(())
    }

    /// Sets the host tier to `gib` GiB of this engine's KV blocks (vLLM's
    /// `--kv-offloading-size`); 0 turns offloading off.
    pub fn set_offloading_gib(&mut self, gib: f64) -> Result<(), ConfigError> {
        self.num_host_blocks = self.blocks_in_gib(gib)?;
        Ok(())
    }

    /// How many of this engine's KV blocks `gib` GiB hold (rounded down); refuses a negative
    /// or non-finite size, or more than `u32::MAX` blocks.
    pub fn blocks_in_gib(&self, gib: f64) -> Result<u32, ConfigError> {
        let block_bytes = (self.kv_bytes_per_token * u64::from(self.block_size)).max(1) as f64;
        let blocks = (gib * f64::from(1u32 << 30) / block_bytes).floor();
        if !(gib.is_finite() && gib >= 0.0 && blocks <= f64::from(u32::MAX)) {
            return Err(ConfigError::OffloadingSize { gib });
        }
        Ok(blocks as u32)
    }

    /// Blocks that hold tokens: all but the null block.
    pub fn usable_blocks(&self) -> u64 {
        u64::from(self.num_gpu_blocks.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Preset;

    fn small() -> EngineConfig {
        let mut c = Preset::Small.config();
        c.num_gpu_blocks = 9;
        c.block_size = 4;
        c.max_model_len = 32;
        c.max_num_seqs = 4;
        c.max_num_batched_tokens = 16;
        c
    }

    #[test]
    fn accepts_a_tight_config() {
        small().validate().unwrap();
    }

    #[test]
    fn rejects_bad_settings_with_typed_errors() {
        let mut c = small();
        c.block_size = 0;
        assert_eq!(
            c.validate(),
            Err(ConfigError::Zero {
                field: "block_size"
            })
        );
        let mut c = small();
        c.num_gpu_blocks = 1;
        assert_eq!(c.validate(), Err(ConfigError::TooFewBlocks(1)));
        let mut c = small();
        c.max_model_len = 33;
        assert_eq!(
            c.validate().unwrap_err().metric_label(),
            "model_len_exceeds_cache"
        );
        let mut c = small();
        c.max_num_batched_tokens = 3;
        assert_eq!(
            c.validate().unwrap_err().metric_label(),
            "budget_below_seqs"
        );
        let mut c = small();
        c.kv_transfer_bandwidth = 0;
        assert!(c.validate().is_err());
        let mut c = small();
        c.set_offloading_gib(1.0).unwrap();
        assert_eq!(
            u64::from(c.num_host_blocks),
            (1u64 << 30) / (c.kv_bytes_per_token * u64::from(c.block_size))
        );
        c.set_offloading_gib(0.0).unwrap();
        assert_eq!(c.num_host_blocks, 0);
        for gib in [-1.0, f64::NAN, f64::INFINITY, 1e30] {
            assert_eq!(
                c.set_offloading_gib(gib).unwrap_err().metric_label(),
                "offloading_size"
            );
        }
        let mut c = small();
        c.host_load_bandwidth = 0;
        assert_eq!(
            c.validate(),
            Err(ConfigError::Zero {
                field: "host_load_bandwidth"
            })
        );
        let mut c = small();
        c.cost.flops_per_second = 0.0;
        assert_eq!(c.validate().unwrap_err().metric_label(), "bad_rate");
    }
}
