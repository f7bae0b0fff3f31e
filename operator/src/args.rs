//! Command-line and environment configuration.

/// kvgate operator (PoolAutoscaler controller).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvgate-operator", version, about, long_about = None)]
pub struct Args {
    /// Metrics and health port.
    #[arg(long, default_value_t = 9093)]
    pub metrics_port: u16,
    /// Only reconcile PoolAutoscalers in this namespace (all namespaces when absent).
    #[arg(long, env = "KVGATE_WATCH_NAMESPACE")]
    pub namespace: Option<String>,
    /// Disable leader election (for a single replica).
    #[arg(long)]
    pub no_leader_election: bool,
}

impl Args {
    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.metrics_port == 0 {
            return Err("--metrics-port must be positive".into());
        }
        Ok(())
    }
}
