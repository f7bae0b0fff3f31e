//! `kvgate-epp`, the endpoint picker: an Envoy `ext_proc` server implementing the Gateway API
//! Inference Extension's Endpoint Picker Protocol. It parses each OpenAI request, tokenizes it,
//! looks its block keys up in the global KV index fed by NATS, and returns the endpoint that
//! minimises the tier-credited prefill cost plus load (DESIGN.md § Index and scoring).
//!
//! Modules: [`extproc`] (the protocol state machine), [`server`] (gRPC, TLS, health), [`routing`]
//! (parse → key → schedule), [`discovery`] (endpoints), [`ingest`] (KV events), [`app`] (wiring).

pub mod app;
mod args;
pub mod discovery;
pub mod extproc;
pub mod ingest;
pub mod load;
pub mod metrics;
pub mod routing;
pub mod server;

pub use args::{Args, Discovery, EngineArg, PoolGroupArg};

/// Runs the EPP until SIGINT/SIGTERM (see [`app`]); [`app::run`] sets up logging and traces.
pub fn run(args: Args) -> Result<(), app::AppError> {
    app::run(args)
}
