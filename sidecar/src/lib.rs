//! `kvgate-sidecar` runs beside each model server: it turns the engine's ZMQ KV events into
//! kvgate envelopes on NATS, answers snapshot requests, relays engine load, proxies
//! prefill/decode requests on :8000 in front of the engine on :8200, and drains on SIGTERM.
//!
//! This build parses and validates the configuration only; the rest lands with issue #6.

mod args;

pub use args::{Args, Engine};

/// Validates the configuration, then runs the component.
pub fn run(args: Args) -> Result<(), cli_support::StartError> {
    args.validate().map_err(cli_support::StartError::Config)?;
    Err(cli_support::NotInThisBuild {
        component: "kvgate-sidecar",
        capability: "the sidecar (event bridge, snapshots, load relay, P/D proxy)",
        issue: 6,
    }
    .into())
}
