//! `kvgate-kvbm` is the per-node KV block manager: G2 host memory, G3 NVMe (O_DIRECT, GDS when
//! present) and G4 remote (Redis or S3) tiers, an offload/onboard API for engine connectors
//! over a Unix socket with shared-memory block data, and tier residency published on NATS.
//!
//! The pure core and its edges:
//!
//! - [`store`]: the block store — host (G2) and remote (G4) tiers, byte-budgeted LRU,
//!   demotion of host evictions to remote, promotion on onboard, every residency change as an
//!   ordered kvgate event (property-tested against a naive model and an event receiver);
//! - [`outbox`]: those events sealed into per-layout envelopes from a node source, and
//!   snapshots consistent with them (pure);
//! - [`protocol`]: the connector protocol's messages and framing (pure, bounded);
//! - [`ratelimit`]: a connection's offload budget in bytes per second (pure);
//! - [`service`]: the store and outbox under one mutex, the queued remote writes, onboard's
//!   remote fetches;
//! - edges: [`server`] (the Unix socket; [`fdpass`] and [`segment`] for the shared-memory
//!   data path), [`remote`] (Redis or S3), [`nats`] (envelopes, snapshots), metrics and health;
//! - [`client`]: the reference connector.
//!
//! `docs/kvbm.md` documents the protocol, flags, metrics and what is not in this build (the
//! disk tier, GDS, S3, pinning, NIXL, engine connectors).

mod app;
mod args;
pub mod client;
pub mod disk;
pub mod fdpass;
mod held;
pub mod metrics;
pub mod nats;
pub mod outbox;
pub mod protocol;
pub mod ratelimit;
pub mod remote;
pub mod segment;
pub mod server;
pub mod service;
pub mod store;

pub use app::AppError;
pub use args::Args;

/// Validates the configuration, then runs the daemon until SIGTERM or SIGINT.
pub fn run(args: Args) -> Result<(), AppError> {
    cli_support::init_tracing();
    app::run(args)
}
