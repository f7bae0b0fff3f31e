//! Command-line and environment configuration.

use std::time::Duration;

/// kvgate operator: scales the prefill and decode workloads of InferencePools to meet TTFT and
/// inter-token-latency SLOs within a GPU budget (the PoolAutoscaler resource), and keeps the
/// prefill/decode allow-list ConfigMap of the decode pods' sidecars.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvgate-operator", version, about, long_about = None)]
pub struct Args {
    /// Metrics and health port (`/metrics`, `/healthz`, `/readyz`).
    #[arg(long, default_value_t = 9093)]
    pub metrics_port: u16,
    /// The address the metrics and health server listens on.
    #[arg(long, env = "KVGATE_LISTEN_ADDRESS", default_value = "0.0.0.0")]
    pub listen_address: std::net::IpAddr,
    /// Only reconcile PoolAutoscalers in this namespace (all namespaces when absent; the
    /// Role then needs to be a ClusterRole).
    #[arg(long, env = "KVGATE_WATCH_NAMESPACE")]
    pub namespace: Option<String>,
    /// Act without leader election (one replica only).
    #[arg(long)]
    pub no_leader_election: bool,
    /// The Lease the replicas elect a leader on.
    #[arg(long, default_value = "kvgate-operator")]
    pub lease_name: String,
    /// The Lease's namespace (the operator's own, from the Downward API).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub lease_namespace: String,
    /// This replica's identity in the Lease (its pod name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// How long a leader's renewal holds, seconds; another replica takes over this long after
    /// the leader stops renewing.
    #[arg(long, default_value_t = 15)]
    pub lease_duration_seconds: u64,
    /// How long a leader tries to renew before it stops acting, seconds (less than the lease).
    #[arg(long, default_value_t = 10)]
    pub renew_deadline_seconds: u64,
    /// How often the replicas renew or try to acquire the Lease, seconds.
    #[arg(long, default_value_t = 2)]
    pub retry_period_seconds: u64,
    /// Deadline of one `/metrics` scrape or Prometheus query, milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub scrape_timeout_ms: u64,
}

impl Args {
    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.metrics_port == 0 {
            return Err("--metrics-port must be positive".into());
        }
        if self.lease_name.is_empty() || self.lease_namespace.is_empty() {
            return Err("--lease-name and --lease-namespace must not be empty".into());
        }
        if self.retry_period_seconds == 0
            || self.renew_deadline_seconds <= self.retry_period_seconds
            || self.lease_duration_seconds <= self.renew_deadline_seconds
        {
            return Err(
                "the lease timings must satisfy 0 < --retry-period-seconds < --renew-deadline-seconds < --lease-duration-seconds"
                    .into(),
            );
        }
        if self.scrape_timeout_ms == 0 {
            return Err("--scrape-timeout-ms must be positive".into());
        }
        Ok(())
    }

    /// This replica's identity: `--identity`, else the host name.
    pub fn identity(&self) -> String {
        self.identity
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| format!("kvgate-operator-{}", std::process::id()))
    }

    /// The scrape deadline.
    pub fn scrape_timeout(&self) -> Duration {
        Duration::from_millis(self.scrape_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use clap::Parser as _;

    use super::*;

    #[test]
    fn defaults_validate_and_lease_timings_are_ordered() {
        let a = Args::try_parse_from(["kvgate-operator"]).unwrap();
        assert_eq!(a.metrics_port, 9093);
        a.validate().unwrap();
        let bad =
            Args::try_parse_from(["kvgate-operator", "--renew-deadline-seconds", "20"]).unwrap();
        assert!(bad.validate().unwrap_err().contains("lease timings"));
    }
}
