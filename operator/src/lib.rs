//! `kvgate-operator` reconciles `PoolAutoscaler` resources: an SLA planner that scales prefill
//! and decode workloads through their `/scale` subresource to meet TTFT/ITL targets within a
//! GPU budget.
//!
//! This build parses and validates the configuration only; the rest lands with issue #9.

mod args;

pub use args::Args;

/// Validates the configuration, then runs the component.
pub fn run(args: Args) -> Result<(), cli_support::StartError> {
    args.validate().map_err(cli_support::StartError::Config)?;
    Err(cli_support::NotInThisBuild {
        component: "kvgate-operator",
        capability: "the PoolAutoscaler controller",
        issue: 9,
    }
    .into())
}
