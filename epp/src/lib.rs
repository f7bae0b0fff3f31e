//! `kvgate-epp`, the endpoint picker: an Envoy `ext_proc` server implementing the Gateway API
//! Inference Extension's Endpoint Picker Protocol. It parses each OpenAI request, tokenizes it,
//! looks its block keys up in the global KV index fed by NATS, and returns the endpoint that
//! minimises the tier-credited prefill cost plus load (DESIGN.md § Index and scoring).
//!
//! This build parses and validates the configuration only; the server lands with issue #5.

mod args;

pub use args::{Args, Discovery};

/// Validates the configuration, then runs the EPP.
pub fn run(args: Args) -> Result<(), cli_support::StartError> {
    args.validate().map_err(cli_support::StartError::Config)?;
    Err(cli_support::NotInThisBuild {
        component: "kvgate-epp",
        capability: "the ext_proc endpoint picker",
        issue: 5,
    }
    .into())
}
