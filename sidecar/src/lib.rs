//! `kvgate-sidecar` runs beside each model server: it turns the engine's ZMQ KV events into
//! kvgate envelopes on NATS, answers snapshot requests from the pod's authoritative resident
//! set, relays engine load, proxies requests on :8000 in front of the engine (plain or the P/D
//! flow), serves health, readiness and metrics on :9091, and drains on SIGTERM, publishing
//! `Cleared` once in-flight requests are done.
//!
//! Layout: [`bridge`] (pure per-rank core and the receive-thread edge), [`nats`] (publisher and
//! snapshot responder), [`load`] (load relay, through the proxy's HTTP client), [`metrics`]
//! (the composable metrics router), `app` (wiring). The receive loop and gap repair are `engine_zmq`'s, shared
//! with the EPP's direct mode.
//! Modules: [`proxy`] (pass-through and the P/D flow, SSRF allow-list), [`health`] (liveness,
//! readiness, canary, drain), [`lifecycle`] (wiring).

mod app;
mod args;
pub mod bridge;
pub mod health;
pub mod lifecycle;
pub mod load;
pub mod metrics;
pub mod nats;
pub mod proxy;

pub use app::{AppError, source};
pub use args::{Args, Engine};
pub use lifecycle::RunError;

/// Validates the configuration, then runs the sidecar until SIGTERM or SIGINT.
/// `app::run` sets up logging and traces.
pub fn run(args: Args) -> Result<(), AppError> {
    app::run(args)
}
