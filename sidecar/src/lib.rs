//! `kvgate-sidecar` runs beside each model server: it turns the engine's ZMQ KV events into
//! kvgate envelopes on NATS, answers snapshot requests, relays engine load, proxies
//! prefill/decode requests on :8000 in front of the engine on :8200, and drains on SIGTERM.
//!
//! Modules: [`proxy`] (pass-through and the P/D flow, SSRF allow-list), [`health`] (liveness,
//! readiness, canary, drain), [`lifecycle`] (wiring).

mod args;
pub mod health;
pub mod lifecycle;
pub mod proxy;

pub use args::{Args, Engine};
pub use lifecycle::RunError;

/// Validates the configuration, then runs the proxy and health parts until SIGTERM.
pub fn run(args: Args) -> Result<(), RunError> {
    args.validate().map_err(cli_support::StartError::Config)?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(RunError::Runtime)?;
    runtime.block_on(lifecycle::run(args, std::sync::Arc::new(health::NoHook)))
}
