//! `kvgate-kvbm` is the per-node KV block manager: G2 host memory, G3 NVMe (O_DIRECT, GDS when
//! present) and G4 remote (Redis or S3) tiers, an offload/onboard API for engine connectors
//! over a Unix socket with shared-memory block data, and tier residency published on NATS.
//!
//! What this build has, each part pure or at a single edge and tested on its own:
//!
//! - [`store`]: the block store core — host (G2) and remote (G4) tiers, byte-budgeted LRU,
//!   demotion of host evictions to remote, promotion on onboard, every residency change as an
//!   ordered kvgate event (property-tested against a naive model and an event receiver);
//! - [`remote`]: the Redis client of the remote tier (bounded RESP2 codec, per-command
//!   deadline, reconnect after failure), tested against a real `redis-server`;
//! - [`outbox`]: the store's events sealed into per-layout envelopes from a node source, and
//!   snapshots consistent with them.
//!
//! Not yet: the connector socket and its shared-memory data path, the NATS and metrics edges,
//! the disk tier (G3) and the daemon's main loop. Until they land (issue #8) the binary
//! validates its configuration and exits with a message saying so.

mod app;
mod args;
pub mod client;
pub mod fdpass;
pub mod metrics;
pub mod nats;
pub mod outbox;
pub mod protocol;
pub mod remote;
pub mod segment;
pub mod server;
pub mod service;
pub mod store;

pub use app::AppError;
pub use args::Args;

/// Validates the configuration, then runs the daemon until SIGTERM or SIGINT.
pub fn run(args: Args) -> Result<(), AppError> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    app::run(args)
}
