//! Command-line and environment configuration.

/// Which engine the sidecar wraps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    /// vLLM (any release with ZMQ KV events).
    Vllm,
    /// SGLang.
    Sglang,
    /// kvgate's engine simulator (speaks vLLM's protocol).
    Sim,
}

/// kvgate model-server sidecar.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvgate-sidecar", version, about, long_about = None)]
pub struct Args {
    /// The engine's HTTP base URL.
    #[arg(
        long,
        env = "KVGATE_ENGINE_URL",
        default_value = "http://127.0.0.1:8200"
    )]
    pub engine_url: String,
    /// Engine kind.
    #[arg(long, value_enum, default_value_t = Engine::Vllm)]
    pub engine: Engine,
    /// The engine's KV-event PUB endpoint (rank 0; rank r uses port + r).
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    pub kv_events_endpoint: String,
    /// The engine's replay ROUTER endpoint (rank 0; rank r uses port + r).
    #[arg(long, default_value = "tcp://127.0.0.1:5558")]
    pub replay_endpoint: String,
    /// Data-parallel ranks served by the engine.
    #[arg(long, default_value_t = 1)]
    pub dp_size: u32,
    /// Served model name (the key seed).
    #[arg(long, env = "KVGATE_MODEL")]
    pub model: String,
    /// The engine's KV block size in tokens.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Namespace, pool and pod identity (from the downward API in Kubernetes).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// InferencePool name.
    #[arg(long, env = "KVGATE_POOL_NAME")]
    pub pool: String,
    /// Pod name.
    #[arg(long, env = "POD_NAME")]
    pub pod: String,
    /// NATS server URL.
    #[arg(long, env = "KVGATE_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// Proxy port in front of the engine.
    #[arg(long, default_value_t = 8000)]
    pub proxy_port: u16,
    /// Metrics and health port.
    #[arg(long, default_value_t = 9091)]
    pub metrics_port: u16,
    #[command(flatten)]
    pub proxy: crate::proxy::ProxyArgs,
}

impl Args {
    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.block_size == 0 {
            return Err("--block-size must be positive".into());
        }
        if self.dp_size == 0 {
            return Err("--dp-size must be at least 1".into());
        }
        self.proxy.validate()?;
        crate::proxy::engine_authority(&self.engine_url)?;
        if self.proxy_port == self.metrics_port {
            return Err("--proxy-port and --metrics-port must differ".into());
        }
        for (flag, ep) in [
            ("--kv-events-endpoint", &self.kv_events_endpoint),
            ("--replay-endpoint", &self.replay_endpoint),
        ] {
            if !ep.starts_with("tcp://") && !ep.starts_with("ipc://") {
                return Err(format!(
                    "{flag} must be a tcp:// or ipc:// endpoint, got {ep:?}"
                ));
            }
        }
        Ok(())
    }
}
