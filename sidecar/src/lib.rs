//! `kvgate-sidecar` runs beside each model server: it turns the engine's ZMQ KV events into
//! kvgate envelopes on NATS, answers snapshot requests from the pod's authoritative resident
//! set, relays engine load, and serves its metrics on :9091.
//!
//! Layout: [`bridge`] (pure per-rank core and the receive-thread edge), [`nats`] (publisher and
//! snapshot responder), [`load`] (load relay over [`http`]), [`metrics`] (the composable
//! metrics router), `app` (wiring). The receive loop and gap repair are `engine_zmq`'s, shared
//! with the EPP's direct mode.

mod app;
mod args;
pub mod bridge;
pub mod http;
pub mod load;
pub mod metrics;
pub mod nats;

pub use app::{AppError, source};
pub use args::{Args, Engine};

/// Validates the configuration, then runs the sidecar until SIGTERM or SIGINT.
pub fn run(args: Args) -> Result<(), AppError> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    app::run(args)
}
