//! Model, GPU and deployment descriptions, and the arithmetic that turns them into an engine's
//! KV-cache size and cost-model constants. The presets are built from these, so every number
//! in a preset can be traced to a datasheet figure or a stated assumption.

/// A dense decoder-only transformer with grouped-query attention and a gated (SwiGLU) MLP,
/// as the Llama 3 family. Norm weights are ignored (under 0.01% of the parameters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSpec {
    /// Hugging Face name.
    pub name: &'static str,
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Query heads.
    pub q_heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Dimension of one head.
    pub head_dim: u64,
    /// MLP intermediate size.
    pub intermediate: u64,
    /// Vocabulary size.
    pub vocab: u64,
}

impl ModelSpec {
    /// Llama-3.1-70B (`config.json`: 80 layers, hidden 8192, 64 query / 8 KV heads of 128,
    /// intermediate 28672, vocabulary 128256): 70.55 B parameters.
    pub const LLAMA_3_1_70B: Self = Self {
        name: "meta-llama/Llama-3.1-70B-Instruct",
        layers: 80,
        hidden: 8192,
        q_heads: 64,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 28672,
        vocab: 128_256,
    };

    /// Llama-3.1-8B (32 layers, hidden 4096, 32 query / 8 KV heads of 128, intermediate
    /// 14336, vocabulary 128256): 8.03 B parameters.
    pub const LLAMA_3_1_8B: Self = Self {
        name: "meta-llama/Llama-3.1-8B-Instruct",
        layers: 32,
        hidden: 4096,
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14336,
        vocab: 128_256,
    };

    /// Matmul parameters of the transformer layers: per layer Q and O (`hidden × q_heads ×
    /// head_dim` each), K and V (`hidden × kv_heads × head_dim` each) and gate, up, down
    /// (`hidden × intermediate` each).
    pub fn layer_params(&self) -> u64 {
        let attn = 2 * self.hidden * self.q_heads * self.head_dim
            + 2 * self.hidden * self.kv_heads * self.head_dim;
        let mlp = 3 * self.hidden * self.intermediate;
        self.layers * (attn + mlp)
    }

    /// Parameters of the `lm_head` (and, the same again, of the untied input embedding).
    pub fn head_params(&self) -> u64 {
        self.hidden * self.vocab
    }

    /// All parameters: layers, embedding and `lm_head`.
    pub fn total_params(&self) -> u64 {
        self.layer_params() + 2 * self.head_params()
    }

    /// KV-cache bytes per token: K and V × layers × KV heads × head dim × element size.
    pub fn kv_bytes_per_token(&self, element_bytes: u64) -> u64 {
        2 * self.layers * self.kv_heads * self.head_dim * element_bytes
    }

    /// Attention FLOPs per (query, key) pair: `QKᵀ` and `PV` are `head_dim` multiply-adds each
    /// per query head and layer: 4 × layers × query heads × head dim.
    pub fn attention_flops_per_pair(&self) -> f64 {
        (4 * self.layers * self.q_heads * self.head_dim) as f64
    }
}

/// One GPU's datasheet figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSpec {
    /// Product name.
    pub name: &'static str,
    /// Memory the driver reports (`nvidia-smi` total), bytes.
    pub memory_bytes: u64,
    /// Peak HBM bandwidth, bytes/s.
    pub hbm_bandwidth: f64,
    /// Peak dense BF16 tensor FLOP/s.
    pub bf16_flops: f64,
    /// Peak dense FP8 tensor FLOP/s.
    pub fp8_flops: f64,
}

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

impl GpuSpec {
    /// H100 SXM5 80 GB: `nvidia-smi` reports 81,559 MiB; 3.35 TB/s HBM3; 989.4 TFLOP/s dense
    /// BF16, 1,978.9 TFLOP/s dense FP8 (NVIDIA H100 datasheet, figures without sparsity).
    pub const H100_SXM: Self = Self {
        name: "NVIDIA H100 SXM5 80GB",
        memory_bytes: 81_559 * MIB,
        hbm_bandwidth: 3.35e12,
        bf16_flops: 989.4e12,
        fp8_flops: 1_978.9e12,
    };

    /// H200 SXM 141 GB: `nvidia-smi` reports 143,771 MiB; 4.8 TB/s HBM3e; the same tensor
    /// cores as the H100 (989.4 / 1,978.9 TFLOP/s dense BF16 / FP8; NVIDIA H200 datasheet).
    pub const H200_SXM: Self = Self {
        name: "NVIDIA H200 SXM 141GB",
        memory_bytes: 143_771 * MIB,
        hbm_bandwidth: 4.8e12,
        bf16_flops: 989.4e12,
        fp8_flops: 1_978.9e12,
    };
}

/// How the serving engine sizes its KV cache from GPU memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvMemoryRule {
    /// vLLM `--gpu-memory-utilization u`: the engine may use `u × memory` per GPU; the KV cache
    /// gets what is left after weights and the runtime reserve (activation peak, CUDA graphs,
    /// NCCL buffers).
    VllmGpuMemoryUtilization(f64),
    /// TensorRT-LLM `kv_cache_config.free_gpu_memory_fraction f`: the KV cache gets `f` of the
    /// memory still free after weights and the runtime reserve.
    TrtLlmFreeGpuMemoryFraction(f64),
}

/// A model served on some GPUs by one engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Deployment {
    /// The model.
    pub model: ModelSpec,
    /// The GPU.
    pub gpu: GpuSpec,
    /// GPUs per engine (tensor parallelism).
    pub num_gpus: u64,
    /// Bytes per parameter of the transformer layers (2 for BF16, 1 for FP8).
    pub layer_param_bytes: u64,
    /// Bytes per parameter of the embedding and `lm_head` (FP8 checkpoints keep them BF16).
    pub head_param_bytes: u64,
    /// Bytes per KV-cache element (2 for BF16, 1 for FP8).
    pub kv_element_bytes: u64,
    /// Tokens per KV block.
    pub block_size: u64,
    /// How the KV cache is sized.
    pub kv_memory: KvMemoryRule,
    /// Memory per GPU kept for activations, CUDA graphs and communication buffers (an
    /// assumption: engines measure it by profiling at start-up).
    pub runtime_reserve_per_gpu: u64,
}

impl Deployment {
    /// Bytes of weights resident in GPU memory (all GPUs).
    pub fn weight_memory_bytes(&self) -> u64 {
        self.model.layer_params() * self.layer_param_bytes
            + 2 * self.model.head_params() * self.head_param_bytes
    }

    /// Bytes of weights streamed from HBM by one forward pass: every layer plus `lm_head`.
    pub fn streamed_weight_bytes(&self) -> f64 {
        (self.model.layer_params() * self.layer_param_bytes
            + self.model.head_params() * self.head_param_bytes) as f64
    }

    /// KV-cache bytes per token, all GPUs.
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.model.kv_bytes_per_token(self.kv_element_bytes)
    }

    /// KV-cache bytes per block, all GPUs.
    pub fn block_bytes(&self) -> u64 {
        self.block_size * self.kv_bytes_per_token()
    }

    /// Bytes available for the KV cache, all GPUs.
    pub fn kv_pool_bytes(&self) -> f64 {
        let gpus = self.num_gpus as f64;
        let memory = self.gpu.memory_bytes as f64 * gpus;
        let reserve = self.runtime_reserve_per_gpu as f64 * gpus;
        let weights = self.weight_memory_bytes() as f64;
        let bytes = match self.kv_memory {
            KvMemoryRule::VllmGpuMemoryUtilization(u) => u * memory - weights - reserve,
            KvMemoryRule::TrtLlmFreeGpuMemoryFraction(f) => f * (memory - weights - reserve),
        };
        bytes.max(0.0)
    }

    /// KV blocks: the pool divided by the block size, rounded down (vLLM reports this as
    /// `num_gpu_blocks`, null block included).
    pub fn num_gpu_blocks(&self) -> u32 {
        let blocks = (self.kv_pool_bytes() / self.block_bytes() as f64).floor();
        // Saturating float-to-int conversion is the intent.
        blocks as u32
    }

    /// Peak dense tensor FLOP/s of all GPUs at the weight precision.
    pub fn peak_flops(&self) -> f64 {
        let per_gpu = if self.layer_param_bytes == 1 {
            self.gpu.fp8_flops
        } else {
            self.gpu.bf16_flops
        };
        per_gpu * self.num_gpus as f64
    }

    /// Peak HBM bandwidth of all GPUs.
    pub fn peak_bandwidth(&self) -> f64 {
        self.gpu.hbm_bandwidth * self.num_gpus as f64
    }
}

/// `n` GiB in bytes.
pub(crate) const fn gib(n: u64) -> u64 {
    n * GIB
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_parameter_counts_match_the_published_sizes() {
        // 70,553,706,496 and 8,030,261,248 published; the difference is the norm weights.
        let p70 = ModelSpec::LLAMA_3_1_70B.total_params();
        assert_eq!(p70, 70_552_387_584);
        assert!((70_553_706_496 - p70) < 2_000_000);
        let p8 = ModelSpec::LLAMA_3_1_8B.total_params();
        assert!((8_030_261_248 - p8) < 300_000);
    }

    #[test]
    fn kv_bytes_per_token() {
        assert_eq!(ModelSpec::LLAMA_3_1_70B.kv_bytes_per_token(2), 327_680);
        assert_eq!(ModelSpec::LLAMA_3_1_70B.kv_bytes_per_token(1), 163_840);
        assert_eq!(ModelSpec::LLAMA_3_1_8B.kv_bytes_per_token(2), 131_072);
    }
}
