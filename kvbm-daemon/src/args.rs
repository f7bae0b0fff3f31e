//! Command-line and environment configuration.

use std::path::PathBuf;

/// kvgate KV block manager (node daemon).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvgate-kvbm", version, about, long_about = None)]
pub struct Args {
    /// Control socket for engine connectors.
    #[arg(long, default_value = "/run/kvgate/kvbm.sock")]
    pub socket: PathBuf,
    /// gRPC port.
    #[arg(long, default_value_t = 9400)]
    pub grpc_port: u16,
    /// Metrics port.
    #[arg(long, default_value_t = 9092)]
    pub metrics_port: u16,
    /// Host-memory tier (G2) capacity in bytes; 0 disables it.
    #[arg(long, default_value_t = 8 << 30)]
    pub host_bytes: u64,
    /// Directory for the disk tier (G3); disabled when absent.
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// Remote tier (G4) URL, `redis://…` or `s3://…`; disabled when absent.
    #[arg(long)]
    pub remote_url: Option<String>,
    /// Node name (from the downward API in Kubernetes).
    #[arg(long, env = "NODE_NAME")]
    pub node: String,
}

impl Args {
    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(url) = &self.remote_url
            && !["redis://", "rediss://", "s3://"]
                .iter()
                .any(|p| url.starts_with(p))
        {
            return Err(format!(
                "--remote-url must be redis://, rediss:// or s3://, got {url:?}"
            ));
        }
        if self.grpc_port == self.metrics_port {
            return Err("--grpc-port and --metrics-port must differ".into());
        }
        Ok(())
    }
}
