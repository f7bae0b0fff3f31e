//! `kvgate-kvbm` is the per-node KV block manager: G2 host memory, G3 NVMe (O_DIRECT, GDS when
//! present) and G4 remote (Redis or S3) tiers, an offload/onboard API for engine connectors
//! over a Unix socket with shared-memory block data, and tier residency published on NATS.
//!
//! This build parses and validates the configuration only; the rest lands with issue #8.

mod args;
pub mod remote;
pub mod store;

pub use args::Args;

/// Validates the configuration, then runs the component.
pub fn run(args: Args) -> Result<(), cli_support::StartError> {
    args.validate().map_err(cli_support::StartError::Config)?;
    Err(cli_support::NotInThisBuild {
        component: "kvgate-kvbm",
        capability: "the KV block manager daemon",
        issue: 8,
    }
    .into())
}
