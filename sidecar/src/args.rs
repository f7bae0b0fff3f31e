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
    /// Data-parallel ranks served by the engine. Rank r's KV events come from the event and
    /// replay ports + r, its API from the engine port + r, and the proxy serves it on
    /// `--proxy-port` + r (the InferencePool's r-th target port). At most 8, as GIE's targetPorts.
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
    /// The address the proxy and the metrics/health server listen on.
    #[arg(long, env = "KVGATE_LISTEN_ADDRESS", default_value = "0.0.0.0")]
    pub listen_address: std::net::IpAddr,
    /// Proxy port in front of the engine.
    #[arg(long, default_value_t = 8000)]
    pub proxy_port: u16,
    /// Metrics and health port.
    #[arg(long, default_value_t = 9091)]
    pub metrics_port: u16,
    #[command(flatten)]
    pub proxy: crate::proxy::ProxyArgs,
    /// Topic prefix to subscribe to on the engine's PUB socket (empty: every topic).
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Do not use the engine's replay socket (gaps then always publish `Cleared`).
    #[arg(long)]
    pub no_replay: bool,
    /// The pod's IP, written into the envelopes' source.
    #[arg(long, env = "POD_IP")]
    pub pod_ip: Option<String>,
    /// The node the pod runs on, written into the envelopes' source.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Most block keys in one envelope.
    #[arg(long, default_value_t = 4096)]
    pub batch_max_keys: usize,
    /// Longest an engine event waits to be batched, in milliseconds (envelopes also go out as
    /// soon as the engine socket has nothing more waiting).
    #[arg(long, default_value_t = 5)]
    pub batch_max_delay_ms: u64,
    /// Envelopes queued for NATS at most; beyond it envelopes are dropped and a new epoch starts.
    #[arg(long, default_value_t = 1024)]
    pub publish_queue: usize,
    /// Engine `/metrics` scrape interval for the load relay, in milliseconds.
    #[arg(long, default_value_t = 50)]
    pub load_interval_ms: u64,
    /// Request traces (OpenTelemetry, OTLP/gRPC): off unless `--otlp-endpoint` is set.
    #[command(flatten)]
    pub tracing: otel::TracingArgs,
}

/// The most data-parallel ranks one sidecar serves (GIE's limit on an InferencePool's target ports).
pub(crate) const MAX_DP_SIZE: u32 = 8;

impl Args {
    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        self.tracing.validate().map_err(|e| e.to_string())?;
        if self.block_size == 0 {
            return Err("--block-size must be positive".into());
        }
        if self.dp_size == 0 || self.dp_size > MAX_DP_SIZE {
            return Err(format!("--dp-size must be in 1..={MAX_DP_SIZE}"));
        }
        self.proxy.validate()?;
        let engine = crate::proxy::engine_authority(&self.engine_url)?;
        crate::proxy::rank_authorities(&engine, self.dp_size)?;
        let ports = u32::from(self.proxy_port)..u32::from(self.proxy_port) + self.dp_size;
        if ports.end > 65_536 {
            return Err("--proxy-port + --dp-size exceeds port 65535".into());
        }
        if ports.contains(&u32::from(self.metrics_port)) {
            return Err(format!(
                "--metrics-port {} collides with a rank's proxy port ({}..{})",
                self.metrics_port, ports.start, ports.end
            ));
        }
        if self.batch_max_keys == 0 || self.batch_max_keys > 100_000 {
            return Err("--batch-max-keys must be in 1..=100000".into());
        }
        if self.batch_max_delay_ms > 1000 {
            return Err("--batch-max-delay-ms must be at most 1000".into());
        }
        if self.publish_queue == 0 {
            return Err("--publish-queue must be positive".into());
        }
        if self.load_interval_ms == 0 {
            return Err("--load-interval-ms must be positive".into());
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

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use clap::Parser as _;

    use super::*;

    fn args(extra: &[&str]) -> Args {
        let base = [
            "kvgate-sidecar",
            "--model",
            "m",
            "--pool",
            "p",
            "--pod",
            "a",
        ];
        Args::try_parse_from(base.iter().chain(extra)).unwrap()
    }

    #[test]
    fn data_parallel_ranks_are_bounded_and_their_ports_checked() {
        assert!(args(&[]).validate().is_ok());
        assert!(args(&["--dp-size", "8"]).validate().is_ok());
        for (extra, why) in [
            (&["--dp-size", "0"][..], "--dp-size must be in 1..=8"),
            (&["--dp-size", "9"][..], "--dp-size must be in 1..=8"),
            (
                &[
                    "--dp-size",
                    "2",
                    "--proxy-port",
                    "9090",
                    "--metrics-port",
                    "9091",
                ][..],
                "collides with a rank's proxy port",
            ),
            (
                &["--dp-size", "2", "--proxy-port", "65535"][..],
                "exceeds port 65535",
            ),
            (
                &["--dp-size", "2", "--engine-url", "http://127.0.0.1:65535"][..],
                "exceeds 65535",
            ),
            (&["--metrics-port", "8000"][..], "collides"),
        ] {
            let err = args(extra).validate().unwrap_err();
            assert!(err.contains(why), "{extra:?}: {err}");
        }
    }
}
