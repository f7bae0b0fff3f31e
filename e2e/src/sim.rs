//! `kvgate-sim`: configuration of the engine simulator.

/// vLLM-compatible engine simulator.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvgate-sim", version, about, long_about = None)]
pub struct Args {
    /// HTTP port (OpenAI API, /health, /metrics).
    #[arg(long, default_value_t = 8200)]
    pub port: u16,
    /// Served model name.
    #[arg(long, default_value = "sim")]
    pub model: String,
    /// KV block size in tokens.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV cache size in blocks.
    #[arg(long, default_value_t = 8192)]
    pub num_gpu_blocks: u32,
    /// KV-event PUB endpoint.
    #[arg(long, default_value = "tcp://*:5557")]
    pub kv_events_endpoint: String,
}

/// Validates the configuration, then runs the simulator.
pub fn run(args: Args) -> Result<(), cli_support::StartError> {
    if args.block_size == 0 || args.num_gpu_blocks == 0 {
        return Err(cli_support::StartError::Config(
            "--block-size and --num-gpu-blocks must be positive".into(),
        ));
    }
    Err(cli_support::NotInThisBuild {
        component: "kvgate-sim",
        capability: "the engine simulator",
        issue: 4,
    }
    .into())
}
