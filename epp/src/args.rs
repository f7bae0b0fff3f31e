//! Command-line and environment configuration.

use std::path::PathBuf;

/// Where endpoints come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Discovery {
    /// Watch the InferencePool and its Pods in Kubernetes.
    Kubernetes,
    /// Read endpoints from a YAML file, reloaded when it changes.
    File,
}

/// Which InferencePool API versions Kubernetes discovery watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PoolGroupArg {
    /// Both; `inference.networking.k8s.io/v1` wins when the pool exists in both.
    Auto,
    /// `inference.networking.k8s.io/v1` only.
    #[value(name = "inference.networking.k8s.io", alias = "v1")]
    V1,
    /// `inference.networking.x-k8s.io/v1alpha2` only.
    #[value(name = "inference.networking.x-k8s.io", alias = "v1alpha2")]
    V1Alpha2,
}

/// What the destination header carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DestinationHeaderArg {
    /// The picked endpoint alone.
    Primary,
    /// The picked endpoint and its fallbacks.
    All,
}

/// How the pool's engines fold a request's `cache_salt` into their block hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineArg {
    /// vLLM (and kvgate-sim): the salt is the first block's extra key.
    Vllm,
    /// SGLang: the salt seeds the hash chain.
    Sglang,
}

/// kvgate endpoint picker (Envoy ext_proc, Gateway API Inference Extension).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvgate-epp", version, about, long_about = None)]
pub struct Args {
    /// InferencePool this EPP serves.
    #[arg(long, env = "KVGATE_POOL_NAME")]
    pub pool_name: String,
    /// Namespace of the InferencePool; its Pods and InferenceObjectives are watched there too
    /// (the Downward API's POD_NAMESPACE puts the EPP's own namespace here). Also the
    /// `<namespace>` token of the NATS subjects.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub pool_namespace: String,
    /// InferencePool API group for `--discovery kubernetes`: `auto` watches both versions.
    #[arg(long, value_enum, env = "KVGATE_POOL_GROUP", default_value_t = PoolGroupArg::Auto)]
    pub pool_group: PoolGroupArg,
    /// Endpoint discovery mode. `kubernetes` uses the in-cluster service account (or a
    /// kubeconfig) and needs list and watch on pods, inferencepools and inferenceobjectives in
    /// the pool namespace; `file` reads `--endpoints-file`.
    #[arg(long, value_enum, default_value_t = Discovery::Kubernetes)]
    pub discovery: Discovery,
    /// The longest wait between two attempts of a failing Kubernetes watch, in milliseconds.
    /// While the API server is away the EPP routes on its last view; after it returns, the
    /// watches list again within this delay.
    #[arg(long, env = "KVGATE_KUBE_MAX_BACKOFF_MS", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(100..=300_000))]
    pub kube_max_backoff_ms: u64,
    /// How often every Kubernetes watch lists its objects again from scratch, in seconds (0:
    /// only after failures). Catches changes a watch missed without an error.
    #[arg(long, env = "KVGATE_KUBE_RELIST_SECONDS", default_value_t = 300)]
    pub kube_relist_seconds: u64,
    /// Endpoints file, for `--discovery file`.
    #[arg(long, env = "KVGATE_ENDPOINTS_FILE")]
    pub endpoints_file: Option<PathBuf>,
    /// The address the ext_proc, health and metrics servers listen on.
    #[arg(long, env = "KVGATE_LISTEN_ADDRESS", default_value = "0.0.0.0")]
    pub listen_address: std::net::IpAddr,
    /// ext_proc gRPC port.
    #[arg(long, default_value_t = 9002)]
    pub grpc_port: u16,
    /// gRPC health port.
    #[arg(long, default_value_t = 9003)]
    pub grpc_health_port: u16,
    /// Prometheus metrics port.
    #[arg(long, default_value_t = 9090)]
    pub metrics_port: u16,
    /// Serve ext_proc without TLS (TLS with a generated self-signed certificate is the default).
    #[arg(long)]
    pub plaintext: bool,
    /// PEM certificate chain for ext_proc TLS (with --key); a self-signed one is generated without.
    #[arg(
        long,
        env = "KVGATE_TLS_CERT",
        requires = "key",
        conflicts_with = "plaintext"
    )]
    pub cert: Option<PathBuf>,
    /// PEM private key for ext_proc TLS (with --cert).
    #[arg(
        long,
        env = "KVGATE_TLS_KEY",
        requires = "cert",
        conflicts_with = "plaintext"
    )]
    pub key: Option<PathBuf>,
    /// On shutdown, how long open ext_proc streams may finish before they are cut, in seconds.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_seconds: u64,
    /// NATS server URL (e.g. `nats://nats:4222`; several comma-separated). When set, the EPP
    /// takes sidecar KV-event envelopes, snapshots and load samples from NATS and shares
    /// in-flight load with its peer replicas; empty or absent disables NATS.
    #[arg(long, env = "KVGATE_NATS_URL")]
    pub nats_url: Option<String>,
    /// How long a snapshot request to a sidecar may take before it is retried (with backoff),
    /// in milliseconds.
    #[arg(long, env = "KVGATE_SNAPSHOT_TIMEOUT_MS", default_value_t = 2000)]
    pub snapshot_timeout_ms: u64,
    /// Share in-flight load with the pool's other EPP replicas over NATS (active-active); only
    /// with --nats-url.
    #[arg(long, env = "KVGATE_INFLIGHT_SHARING", default_value_t = true, action = clap::ArgAction::Set)]
    pub inflight_sharing: bool,
    /// Scheduler configuration file (YAML); built-in defaults when absent.
    #[arg(long, env = "KVGATE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Model rewrite rules (YAML `rules: [{model, targets: [{modelRewrite, weight}]}]`, GIE's
    /// InferenceModelRewrite semantics): requests for `model` are served as a weighted choice
    /// of targets, and responses carry the client's name back. The header
    /// `x-gateway-model-name-rewrite` overrides them per request.
    #[arg(long, env = "KVGATE_MODEL_REWRITES")]
    pub model_rewrites: Option<PathBuf>,
    /// Tokenizer directory (tokenizer.json + tokenizer_config.json); approximate keys without.
    #[arg(long, env = "KVGATE_TOKENIZER_DIR")]
    pub tokenizer_dir: Option<PathBuf>,
    /// Largest request body accepted, in bytes (larger: 413). Prompts and rendered chats up to
    /// this size are keyed. With a gateway that buffers bodies (fail-open), give it the same
    /// buffer limit.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// The pool's served model: requests without `model` are keyed as this one, and the
    /// tokenizer directory belongs to it.
    #[arg(long, env = "KVGATE_MODEL", default_value = "default")]
    pub model: String,
    /// The engines' KV block size in tokens (vLLM `--block-size`).
    #[arg(long, env = "KVGATE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// The engines' kind, for how `cache_salt` is keyed.
    #[arg(long, value_enum, default_value_t = EngineArg::Vllm)]
    pub engine: EngineArg,
    /// Tokenize the rest of early-stopped prompts on a background thread, so a conversation's
    /// next turn finds them in the tokenization cache.
    #[arg(long, env = "KVGATE_FINISH_PROMPTS", default_value_t = true, action = clap::ArgAction::Set)]
    pub finish_prompts: bool,
    /// Most bytes of prompt text the background finisher takes per second; prompts over it
    /// are left for their next turn to tokenize. 0: no budget (the queue bound only).
    #[arg(long, env = "KVGATE_FINISH_BYTES_PER_SECOND", default_value_t = 0)]
    pub finish_bytes_per_second: u64,
    /// The background finisher thread's `nice` value (19: about 1.5% of a CPU that a
    /// default-priority thread wants, so mostly idle time; below 0 needs privileges).
    #[arg(long, env = "KVGATE_FINISH_NICE", default_value_t = crate::routing::finish::DEFAULT_NICE,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub finish_nice: i32,
    /// Tokio worker threads serving ext_proc (0: one per CPU).
    #[arg(long, env = "KVGATE_WORKER_THREADS", default_value_t = 0)]
    pub worker_threads: usize,
    /// Let clients send the prefill/decode transfer fields (`kv_transfer_params`,
    /// `bootstrap_host`/`bootstrap_port`/`bootstrap_room`). By default such requests get 400:
    /// the fields tell an engine where to pull KV from, kvgate's sidecar sets them itself, and
    /// from a client they would point the engine at a host of the client's choosing.
    #[arg(long, env = "KVGATE_ALLOW_CLIENT_TRANSFER_PARAMS", default_value_t = false, action = clap::ArgAction::Set)]
    pub allow_client_transfer_params: bool,
    /// What the `x-gateway-destination-endpoint` header carries: `primary` (the picked endpoint
    /// alone, which ORIGINAL_DST clusters and agentgateway require) or `all` (the primary and
    /// its fallbacks, comma-separated). The `envoy.lb` metadata always carries all of them.
    #[arg(long, value_enum, env = "KVGATE_DESTINATION_HEADER", default_value_t = DestinationHeaderArg::Primary)]
    pub destination_header: DestinationHeaderArg,
    /// The gateway observes responses through a second ext_proc filter in observability mode
    /// (the local stack's layout; see docs/kubernetes.md): the routing filter sends only the
    /// request, so the EPP is off the response path and streams in flight survive its loss.
    /// Each routing stream parks its request's ticket under `x-request-id`; the observer stream
    /// claims it and reports first byte, usage and end. Tickets nobody claims are aborted within
    /// two seconds (`kvgate_epp_response_handoffs_total{outcome="expired"}`). With `--nats-url`,
    /// several replicas relay to each other: an observer stream whose request another replica
    /// routed sends the response's events to that replica over NATS.
    #[arg(long, env = "KVGATE_RESPONSE_OBSERVER", default_value_t = false, action = clap::ArgAction::Set)]
    pub response_observer: bool,
    /// With `--response-observer true`: a second ext_proc port whose every stream is the
    /// response observer's, for gateways that cannot send the observer filter's gRPC metadata
    /// `x-kvgate-ext-proc-role: response` (Envoy Gateway's EnvoyExtensionPolicy): point the
    /// observer filter here instead. Same TLS as the ext_proc port. 0 (the default): none.
    #[arg(long, env = "KVGATE_OBSERVER_PORT", default_value_t = 0)]
    pub observer_port: u16,
    /// HTTP/2 adaptive flow-control windows on the ext_proc listener (BDP estimation).
    #[arg(long, env = "KVGATE_HTTP2_ADAPTIVE_WINDOW", default_value_t = false, action = clap::ArgAction::Set)]
    pub http2_adaptive_window: bool,
    /// Request traces (OpenTelemetry, OTLP/gRPC): off unless `--otlp-endpoint` is set.
    #[command(flatten)]
    pub tracing: otel::TracingArgs,
}

impl Args {
    /// The NATS URL, when NATS is enabled (set and not blank).
    pub fn nats(&self) -> Option<&str> {
        self.nats_url
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty())
    }

    /// Checks what clap cannot: combinations and ranges.
    pub fn validate(&self) -> Result<(), String> {
        self.tracing.validate().map_err(|e| e.to_string())?;
        if self.discovery == Discovery::File && self.endpoints_file.is_none() {
            return Err("--discovery file needs --endpoints-file".into());
        }
        if self.pool_name.is_empty() || self.pool_namespace.is_empty() {
            return Err("--pool-name and --pool-namespace must not be empty".into());
        }
        let mut ports = vec![self.grpc_port, self.grpc_health_port, self.metrics_port];
        if self.observer_port != 0 {
            if !self.response_observer {
                return Err("--observer-port needs --response-observer true".into());
            }
            ports.push(self.observer_port);
        }
        if ports
            .iter()
            .enumerate()
            .any(|(i, p)| ports.iter().skip(i + 1).any(|q| q == p))
        {
            return Err(format!("ports must differ, got {ports:?}"));
        }
        if self.block_size == 0 {
            return Err("--block-size must be positive".into());
        }
        if self.snapshot_timeout_ms == 0 {
            return Err("--snapshot-timeout-ms must be positive".into());
        }
        if self.max_body_bytes == 0 {
            return Err("--max-body-bytes must be positive".into());
        }
        Ok(())
    }

    /// How the background prompt finisher is held back.
    pub fn finish(&self) -> crate::routing::finish::FinishConfig {
        crate::routing::finish::FinishConfig {
            enabled: self.finish_prompts,
            bytes_per_second: (self.finish_bytes_per_second > 0)
                .then_some(self.finish_bytes_per_second),
            nice: self.finish_nice,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[test]
    fn the_observer_port_needs_the_observer_layout_and_its_own_port() {
        let parse = |extra: &[&str]| {
            let base = ["kvgate-epp", "--pool-name", "p", "--discovery", "file"];
            let mut a = Args::try_parse_from(base.iter().chain(extra)).unwrap();
            a.endpoints_file = Some("e.yaml".into());
            a.validate()
        };
        assert!(
            parse(&["--observer-port", "9004"])
                .unwrap_err()
                .contains("--response-observer")
        );
        assert!(
            parse(&["--response-observer", "true", "--observer-port", "9002"])
                .unwrap_err()
                .contains("ports must differ")
        );
        parse(&["--response-observer", "true", "--observer-port", "9004"]).unwrap();
        parse(&["--response-observer", "true"]).unwrap();
    }

    #[test]
    fn defaults_follow_design_ports() {
        let a = Args::try_parse_from(["kvgate-epp", "--pool-name", "p"]).unwrap();
        assert_eq!(
            (a.grpc_port, a.grpc_health_port, a.metrics_port),
            (9002, 9003, 9090)
        );
        assert!(a.validate().is_ok());
    }

    #[test]
    fn bad_combinations_are_refused() {
        let a = Args::try_parse_from(["kvgate-epp", "--pool-name", "p", "--discovery", "file"])
            .unwrap();
        assert!(a.validate().unwrap_err().contains("--endpoints-file"));
        let a = Args::try_parse_from(["kvgate-epp", "--pool-name", "p", "--metrics-port", "9002"])
            .unwrap();
        assert!(a.validate().unwrap_err().contains("ports must differ"));
        assert!(
            Args::try_parse_from(["kvgate-epp"]).is_err(),
            "the pool name is required"
        );
    }

    #[test]
    fn nats_is_off_unless_a_url_is_given_and_sharing_follows_it() {
        let base = ["kvgate-epp", "--pool-name", "p"];
        let with = |extra: &[&str]| Args::try_parse_from(base.iter().chain(extra)).unwrap();
        let a = with(&[]);
        assert_eq!(a.nats(), None);
        assert!(a.inflight_sharing);
        assert_eq!(a.snapshot_timeout_ms, 2000);
        assert_eq!(with(&["--nats-url", "  "]).nats(), None);
        let a = with(&["--nats-url", "nats://n:4222", "--inflight-sharing", "false"]);
        assert_eq!(a.nats(), Some("nats://n:4222"));
        assert!(!a.inflight_sharing);
        let a = with(&["--snapshot-timeout-ms", "0"]);
        assert!(a.validate().unwrap_err().contains("snapshot"));
    }

    #[test]
    fn pool_group_and_namespace() {
        let base = ["kvgate-epp", "--pool-name", "p"];
        let with = |extra: &[&str]| Args::try_parse_from(base.iter().chain(extra));
        assert_eq!(with(&[]).unwrap().pool_group, PoolGroupArg::Auto);
        for (arg, want) in [
            ("inference.networking.k8s.io", PoolGroupArg::V1),
            ("v1", PoolGroupArg::V1),
            ("inference.networking.x-k8s.io", PoolGroupArg::V1Alpha2),
            ("v1alpha2", PoolGroupArg::V1Alpha2),
        ] {
            assert_eq!(with(&["--pool-group", arg]).unwrap().pool_group, want);
        }
        assert!(with(&["--pool-group", "apps"]).is_err());
        let a = with(&["--pool-namespace", ""]).unwrap();
        assert!(a.validate().unwrap_err().contains("--pool-namespace"));
    }

    #[test]
    fn tls_files_come_in_pairs_and_exclude_plaintext() {
        let base = ["kvgate-epp", "--pool-name", "p"];
        let with = |extra: &[&str]| Args::try_parse_from(base.iter().chain(extra));
        let a = with(&["--cert", "c.pem", "--key", "k.pem"]).unwrap();
        assert_eq!(a.cert.as_deref(), Some(std::path::Path::new("c.pem")));
        assert!(with(&["--cert", "c.pem"]).is_err(), "--cert needs --key");
        assert!(with(&["--key", "k.pem"]).is_err(), "--key needs --cert");
        assert!(with(&["--cert", "c", "--key", "k", "--plaintext"]).is_err());
        assert_eq!(with(&[]).unwrap().drain_timeout_seconds, 30);
    }
}
