//! Command-line arguments. Flags mirror vLLM's where they mean the same thing.

use std::net::IpAddr;
use std::path::PathBuf;

use engine_model::Preset;

use super::bootstrap::DisaggMode;
use super::kv_config::KvEventsConfig;

/// KV-event wire layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EventFormat {
    /// vLLM ≥ 0.24: events as maps with a `type` key.
    Map,
    /// vLLM ≤ 0.23: events as positional arrays.
    Array,
}

/// Replay reply layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReplayLayoutArg {
    /// vLLM ≥ 0.26: `[b"", topic, seq, payload]`.
    WithTopic,
    /// vLLM ≤ 0.25: `[b"", seq, payload]`.
    Legacy,
}

/// What a full waiting queue answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum QueueFullStatus {
    /// 429 Too Many Requests.
    #[value(name = "429")]
    TooMany,
    /// 503 Service Unavailable.
    #[value(name = "503")]
    Unavailable,
}

/// kvgate-sim: a vLLM-compatible engine simulator (OpenAI HTTP API, vLLM metrics, vLLM KV events
/// over ZMQ) driven by a calibrated engine model, for testing and benchmarking routers without
/// GPUs.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvgate-sim", version, about, long_about = None)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// The address a wildcard KV-event bind (`tcp://*:port`, as vLLM's `--kv-events-config`
    /// writes it) binds on; all interfaces when unset. Several simulated pods on one machine
    /// each set their own.
    #[arg(long, env = "KVGATE_LISTEN_ADDRESS")]
    pub listen_address: Option<IpAddr>,
    /// HTTP port (OpenAI API, /health, /metrics).
    #[arg(long, default_value_t = 8200)]
    pub port: u16,
    /// Model name (also the served name unless --served-model-name is given).
    #[arg(long, default_value = "sim")]
    pub model: String,
    /// Names the model is served under (the first is the default and appears in metrics).
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// Tokenizer directory (tokenizer.json + tokenizer_config.json). Without it a deterministic
    /// byte tokenizer is used (4 UTF-8 bytes per token; see docs/simulator.md).
    #[arg(long, env = "KVGATE_TOKENIZER_DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Engine preset: hardware, model and step-time calibration.
    #[arg(long, default_value = "small")]
    pub preset: Preset,
    /// KV block size in tokens (default: the preset's).
    #[arg(long)]
    pub block_size: Option<u32>,
    /// KV cache size in blocks (default: the preset's).
    #[arg(long, alias = "num-gpu-blocks")]
    pub num_gpu_blocks_override: Option<u32>,
    /// Most sequences in one batch (default: the preset's).
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Most tokens in one batch (default: the preset's).
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// Context length (default: the preset's).
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// Disable automatic prefix caching.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// vLLM's KVEventsConfig as JSON, e.g.
    /// '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'.
    #[arg(long, value_parser = KvEventsConfig::parse)]
    pub kv_events_config: Option<KvEventsConfig>,
    /// KV-event payload layout.
    #[arg(long, value_enum, default_value_t = EventFormat::Map)]
    pub kv_events_format: EventFormat,
    /// Replay reply layout.
    #[arg(long, value_enum, default_value_t = ReplayLayoutArg::WithTopic)]
    pub kv_events_replay_layout: ReplayLayoutArg,
    /// vLLM's PYTHONHASHSEED: seeds NONE_HASH of the sha256_cbor block hashes.
    #[arg(long, env = "PYTHONHASHSEED")]
    pub python_hash_seed: Option<String>,
    /// Data-parallel rank: written into event batches and added to the event ports.
    #[arg(long, default_value_t = 0)]
    pub data_parallel_rank: u16,
    /// Model time runs this many times faster than wall time (1 = real time).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Most requests waiting for the engine; more are refused (0 = unbounded).
    #[arg(long, default_value_t = 1024)]
    pub max_waiting: u32,
    /// Status returned when the waiting queue is full.
    #[arg(long, value_enum, default_value_t = QueueFullStatus::TooMany)]
    pub queue_full_status: QueueFullStatus,
    /// Mean output length when a request does not set ignore_eos (EOS after a geometric length).
    #[arg(long, default_value_t = 128)]
    pub mean_output_tokens: u32,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// This pod's name, returned in the x-kvgate-pod response header.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// Address other engines and routers reach this one at (topic, P/D parameters).
    #[arg(long, env = "POD_IP", default_value = "127.0.0.1")]
    pub advertise_ip: IpAddr,
    /// P/D: KV transfer bandwidth from a remote prefill engine, in GB/s (default: the preset's).
    #[arg(long)]
    pub kv_transfer_gbps: Option<f64>,
    /// Host memory for KV offloading, GiB (vLLM's `--kv-offloading-size` with the native CPU
    /// backend): every block cached on the GPU is copied there, the least recently used is
    /// dropped, and prompts load blocks found there at PCIe speed instead of recomputing them.
    /// The copies are published as KV events with the `CPU` medium. 0: off.
    #[arg(long, default_value_t = 0.0)]
    pub kv_offloading_size: f64,
    /// Offload to the node's KV block manager (`kvgate-kvbm`) through its connector socket
    /// instead: every block cached on the GPU is offloaded there (with the preset's real block
    /// size in bytes), and prompts onboard the blocks it holds, charged at the bandwidth of the
    /// level they come from (host memory, disk, remote store). The daemon publishes its own KV
    /// events. Not with --kv-offloading-size; needs prefix caching.
    #[arg(long, env = "KVGATE_KVBM_SOCKET")]
    pub kvbm_socket: Option<std::path::PathBuf>,
    /// Benchmarks on small machines only: the bytes each offloaded block really carries to the
    /// block manager (default: the preset's real block size). The load time the engine charges
    /// still follows the preset's block size; the daemon's budgets then count blocks of this
    /// size. It lets a laptop run a trace whose real KV volume it could not copy.
    #[arg(long, requires = "kvbm_socket")]
    pub kvbm_payload_bytes: Option<u64>,
    /// SGLang P/D role for requests carrying bootstrap_host/port/room: `null` (record them only),
    /// `prefill` (one-token prefill, serve the room) or `decode` (wait for the room, then decode
    /// with the pulled KV).
    #[arg(long, value_enum, default_value_t = DisaggMode::Null)]
    pub disaggregation_mode: DisaggMode,
    /// SGLang P/D, prefill role: the bootstrap port rooms are served on (SGLang's default 8998).
    #[arg(long, default_value_t = 8998)]
    pub disaggregation_bootstrap_port: u16,
    /// SGLang P/D, decode role: how long (wall ms) to wait for a room to become ready.
    #[arg(long, default_value_t = 30_000)]
    pub disaggregation_bootstrap_timeout_ms: u64,
    /// Seed for generated output and fault injection.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Fault: fraction of requests answered with --fault-status instead of running.
    #[arg(long, default_value_t = 0.0)]
    pub fault_error_rate: f64,
    /// Fault: the status of injected errors.
    #[arg(long, default_value_t = 500)]
    pub fault_status: u16,
    /// Fault: fraction of streams that stall once, mid-stream, for --fault-stall-ms.
    #[arg(long, default_value_t = 0.0)]
    pub fault_stall_rate: f64,
    /// Fault: stall length in wall milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub fault_stall_ms: u64,
    /// Fault: wait this long (wall ms) before listening at all (slow start).
    #[arg(long, default_value_t = 0)]
    pub startup_delay_ms: u64,
    /// Fault: answer /health with 503 for this long (wall ms) after listening.
    #[arg(long, default_value_t = 0)]
    pub ready_delay_ms: u64,
    /// Fault: enable POST /sim/crash, which kills the process at once (exit code 137-like).
    #[arg(long)]
    pub enable_crash_endpoint: bool,
}

impl Args {
    /// The names this server answers to.
    pub fn served_names(&self) -> Vec<String> {
        if self.served_model_name.is_empty() {
            vec![self.model.clone()]
        } else {
            self.served_model_name.clone()
        }
    }

    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err("--time-scale must be a positive number".into());
        }
        for (name, v) in [
            ("--fault-error-rate", self.fault_error_rate),
            ("--fault-stall-rate", self.fault_stall_rate),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{name} must be between 0 and 1"));
            }
        }
        if !(400..=599).contains(&self.fault_status) {
            return Err("--fault-status must be a 4xx or 5xx status".into());
        }
        if let Some(g) = self.kv_transfer_gbps
            && !(g.is_finite() && g > 0.0)
        {
            return Err("--kv-transfer-gbps must be positive".into());
        }
        if self.served_names().iter().any(String::is_empty) {
            return Err("model names must not be empty".into());
        }
        if self.kvbm_payload_bytes == Some(0) {
            return Err("--kvbm-payload-bytes must be positive".into());
        }
        if self.kvbm_socket.is_some() {
            if self.kv_offloading_size > 0.0 {
                return Err(
                    "--kvbm-socket and --kv-offloading-size are two offloading connectors: give one"
                        .into(),
                );
            }
            if self.no_enable_prefix_caching {
                return Err(
                    "--kvbm-socket needs prefix caching (nothing is offloaded without it)".into(),
                );
            }
        }
        Ok(())
    }

    /// The engine configuration: the preset with the overrides applied.
    pub fn engine_config(&self) -> Result<engine_model::EngineConfig, String> {
        let mut c = self.preset.config();
        if let Some(v) = self.block_size {
            c.block_size = v;
        }
        if let Some(v) = self.num_gpu_blocks_override {
            c.num_gpu_blocks = v;
        }
        if let Some(v) = self.max_num_seqs {
            c.max_num_seqs = v;
        }
        if let Some(v) = self.max_num_batched_tokens {
            c.max_num_batched_tokens = v;
        }
        if let Some(v) = self.max_model_len {
            c.max_model_len = v;
        }
        if self.no_enable_prefix_caching {
            c.enable_prefix_caching = false;
        }
        if let Some(g) = self.kv_transfer_gbps {
            c.kv_transfer_bandwidth = (g * 1e9) as u64;
        }
        c.set_offloading_gib(self.kv_offloading_size)
            .map_err(|e| format!("--kv-offloading-size: {e}"))?;
        Ok(c)
    }

    /// The layout registered with the KV block manager: the preset's model and KV dtype, at the
    /// configured block size, all of the engine's tensor-parallel shards as one block.
    pub fn kvbm_layout(&self, config: &engine_model::EngineConfig) -> kvgate_kvbm::store::Layout {
        let d = self.preset.deployment();
        kvgate_kvbm::store::Layout {
            model: self.served_names().first().cloned().unwrap_or_default(),
            dtype: match d.kv_element_bytes {
                1 => "fp8",
                4 => "float32",
                _ => "bfloat16",
            }
            .to_owned(),
            layers: u32::try_from(d.model.layers).unwrap_or(u32::MAX),
            block_size: config.block_size,
            block_bytes: self
                .kvbm_payload_bytes
                .unwrap_or(config.kv_bytes_per_token * u64::from(config.block_size)),
            shard: 0,
            shards: 1,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use clap::Parser as _;

    use super::*;

    fn parse(extra: &[&str]) -> Args {
        Args::try_parse_from(["kvgate-sim"].iter().chain(extra)).unwrap()
    }

    #[test]
    fn the_block_manager_is_one_offloading_connector_and_needs_prefix_caching() {
        let ok = parse(&["--kvbm-socket", "/run/kvgate/kvbm.sock"]);
        assert_eq!(ok.validate(), Ok(()));
        let both = parse(&["--kvbm-socket", "/s", "--kv-offloading-size", "1"]);
        assert!(both.validate().unwrap_err().contains("give one"));
        let uncached = parse(&["--kvbm-socket", "/s", "--no-enable-prefix-caching"]);
        assert!(uncached.validate().unwrap_err().contains("prefix caching"));
    }

    #[test]
    fn the_registered_layout_is_the_presets_real_block() {
        let args = parse(&["--model", "m", "--served-model-name", "served", "other"]);
        let config = args.engine_config().unwrap();
        let layout = args.kvbm_layout(&config);
        // Llama-3.1-8B in BF16: 2 (K, V) × 32 layers × 8 KV heads × 128 × 2 bytes per token.
        assert_eq!(layout.block_bytes, 2 * 32 * 8 * 128 * 2 * 16);
        assert_eq!(
            (layout.model.as_str(), layout.dtype.as_str(), layout.layers),
            ("served", "bfloat16", 32)
        );
        assert_eq!((layout.shard, layout.shards), (0, 1));
        assert!(layout.validate().is_ok());
        // A benchmark may carry fewer bytes; the engine still charges the real block's load.
        let small = parse(&["--kvbm-socket", "/s", "--kvbm-payload-bytes", "16384"]);
        assert_eq!(small.kvbm_layout(&config).block_bytes, 16384);
        assert_eq!(
            small.engine_config().unwrap().kv_bytes_per_token,
            config.kv_bytes_per_token
        );
        assert!(
            parse(&["--kvbm-socket", "/s", "--kvbm-payload-bytes", "0"])
                .validate()
                .is_err()
        );
        assert!(Args::try_parse_from(["kvgate-sim", "--kvbm-payload-bytes", "1"]).is_err());
    }
}
