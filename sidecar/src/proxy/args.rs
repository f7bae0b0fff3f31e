//! The proxy's command-line flags (flattened into the sidecar's `Args`).

use std::path::PathBuf;
use std::time::Duration;

use crate::health::HealthArgs;

use super::bootstrap::DEFAULT_BOOTSTRAP_PORT;
use super::connector::Connector;
use super::retry::RetryPolicy;

/// Default request-body bound: 16 MiB.
pub const DEFAULT_MAX_BODY: usize = 16 << 20;

/// P/D proxy, SSRF protection, health and drain.
#[derive(Debug, Clone, clap::Args)]
pub struct ProxyArgs {
    /// Largest request body the proxy accepts (413 beyond).
    #[arg(long, default_value_t = DEFAULT_MAX_BODY)]
    pub proxy_max_body_bytes: usize,
    /// Prefill-leg attempts in all (retries on 502/503/504, connect errors, timeouts).
    #[arg(long, default_value_t = 3)]
    pub prefill_max_attempts: u32,
    /// Delay before the first prefill retry; doubles per retry.
    #[arg(long, default_value_t = 100)]
    pub prefill_retry_backoff_ms: u64,
    /// Upper bound on one prefill retry delay.
    #[arg(long, default_value_t = 2000)]
    pub prefill_max_backoff_ms: u64,
    /// Per prefill attempt: the whole answer within this.
    #[arg(long, default_value_t = 60_000)]
    pub prefill_timeout_ms: u64,
    /// TCP connect timeout towards the engine and prefillers.
    #[arg(long, default_value_t = 2000)]
    pub upstream_connect_timeout_ms: u64,
    /// The prefiller allow-list: the EPP's discovery YAML or a list of ip:port (watched). In
    /// Kubernetes: the InferencePool's endpoints.
    #[arg(long, env = "KVGATE_PREFILLER_ALLOW_LIST")]
    pub prefiller_allow_list: Option<PathBuf>,
    /// How often the allow-list file is checked for changes.
    #[arg(long, default_value_t = 2000)]
    pub allow_list_poll_ms: u64,
    /// Contact any prefiller the header names (turns SSRF protection off; trusted networks only).
    #[arg(long)]
    pub disable_ssrf_protection: bool,
    /// P/D protocol for requests naming a prefiller: `nixlv2` (vLLM NIXL connector: prefill,
    /// then decode with the returned kv_transfer_params) or `sglang` (SGLang bootstrap: the
    /// request with bootstrap_host/port/room sent to prefiller and engine at once).
    #[arg(long, value_enum, default_value_t = Connector::Nixlv2)]
    pub kv_connector: Connector,
    /// `--kv-connector sglang`: the prefill servers' bootstrap port (SGLang's
    /// `--disaggregation-bootstrap-port`; one port for every prefiller of the pool).
    #[arg(long, env = "SGLANG_BOOTSTRAP_PORT", default_value_t = DEFAULT_BOOTSTRAP_PORT)]
    pub sglang_bootstrap_port: u16,
    /// Mid-stream migration: when the engine fails during a streamed answer, this many attempts
    /// to have another pool endpoint (from the EPP's fallback list, allowed by SSRF protection)
    /// generate the rest into the same stream. 0 turns migration off.
    #[arg(long, env = "KVGATE_MIGRATE_MAX_ATTEMPTS", default_value_t = 2)]
    pub migrate_max_attempts: u32,
    /// Health, readiness and drain.
    #[command(flatten)]
    pub health: HealthArgs,
}

impl ProxyArgs {
    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.proxy_max_body_bytes == 0 {
            return Err("--proxy-max-body-bytes must be positive".into());
        }
        if self.prefill_max_attempts == 0 {
            return Err("--prefill-max-attempts must be at least 1".into());
        }
        if self.prefill_timeout_ms == 0 || self.upstream_connect_timeout_ms == 0 {
            return Err(
                "--prefill-timeout-ms and --upstream-connect-timeout-ms must be positive".into(),
            );
        }
        if self.sglang_bootstrap_port == 0 {
            return Err("--sglang-bootstrap-port must be positive".into());
        }
        if self.allow_list_poll_ms == 0 {
            return Err("--allow-list-poll-ms must be positive".into());
        }
        if self.disable_ssrf_protection && self.prefiller_allow_list.is_some() {
            return Err(
                "--disable-ssrf-protection and --prefiller-allow-list contradict each other".into(),
            );
        }
        self.health.validate()
    }

    /// The prefill retry policy.
    pub fn retry(&self) -> RetryPolicy {
        RetryPolicy {
            max_attempts: self.prefill_max_attempts,
            backoff: Duration::from_millis(self.prefill_retry_backoff_ms),
            max_backoff: Duration::from_millis(self.prefill_max_backoff_ms),
        }
    }
}

/// The `host:port` of an `http://host:port[/]` engine URL.
pub fn engine_authority(url: &str) -> Result<String, String> {
    let uri: axum::http::Uri = url
        .parse()
        .map_err(|e| format!("--engine-url {url:?}: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("--engine-url {url:?} must be http://host:port"));
    }
    if uri.path_and_query().is_some_and(|pq| pq.as_str() != "/") {
        return Err(format!("--engine-url {url:?} must have no path"));
    }
    uri.authority()
        .map(ToString::to_string)
        .ok_or_else(|| format!("--engine-url {url:?} has no host"))
}

/// The engine authority of each data-parallel rank: rank `r` is served on the engine's port + `r`
/// (vLLM's per-rank API servers with an external load balancer, and GIE's `targetPorts`), and the
/// proxy in front of it on `--proxy-port` + `r`. An error names a port that overflows.
pub fn rank_authorities(engine: &str, dp_size: u32) -> Result<Vec<String>, String> {
    let (host, port) = engine
        .rsplit_once(':')
        .ok_or_else(|| format!("engine authority {engine:?} has no port"))?;
    let port: u16 = port
        .parse()
        .map_err(|e| format!("engine authority {engine:?}: port: {e}"))?;
    (0..dp_size)
        .map(|rank| {
            u16::try_from(u32::from(port) + rank)
                .map(|p| format!("{host}:{p}"))
                .map_err(|_| format!("engine port {port} + rank {rank} exceeds 65535"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]
    use super::*;

    #[test]
    fn engine_url_forms() {
        assert_eq!(
            engine_authority("http://127.0.0.1:8200").unwrap(),
            "127.0.0.1:8200"
        );
        assert_eq!(
            engine_authority("http://engine:8200/").unwrap(),
            "engine:8200"
        );
        assert!(engine_authority("https://127.0.0.1:8200").is_err());
        assert!(engine_authority("http://127.0.0.1:8200/v1").is_err());
        assert!(engine_authority("127.0.0.1:8200").is_err());
    }

    #[test]
    fn ranks_take_consecutive_engine_ports() {
        assert_eq!(
            rank_authorities("127.0.0.1:8200", 3).unwrap(),
            ["127.0.0.1:8200", "127.0.0.1:8201", "127.0.0.1:8202"]
        );
        assert_eq!(rank_authorities("[::1]:8200", 1).unwrap(), ["[::1]:8200"]);
        assert!(
            rank_authorities("127.0.0.1:65535", 2)
                .unwrap_err()
                .contains("65535")
        );
        assert!(rank_authorities("localhost", 1).is_err());
    }
}
