//! `kvgate-kvbm` is the per-node KV block manager: G2 host memory, G3 local disk (a file per
//! block, `O_DIRECT` where the file system takes it) and G4 remote (Redis or S3) tiers, an
//! offload/onboard API for engine connectors over a Unix socket with shared-memory block data,
//! and tier residency published on NATS.
//!
//! The pure core and its edges:
//!
//! - [`store`]: the block store — host, disk and remote tiers, byte-budgeted LRU, demotion of
//!   host evictions to the lower tiers, promotion on onboard, pins with a deadline, every
//!   residency change as an ordered kvgate event (property-tested against a naive model and an
//!   event receiver);
//! - [`outbox`]: those events sealed into per-layout envelopes from a node source, and
//!   snapshots consistent with them (pure);
//! - [`protocol`]: the connector protocol's messages and framing (pure, bounded);
//! - [`ratelimit`]: a connection's offload budget in bytes per second (pure);
//! - [`service`]: the store and outbox under one mutex, the queued lower-tier writes,
//!   onboard's disk and remote reads;
//! - edges: [`server`] (the Unix socket; [`fdpass`] and [`segment`] for the shared-memory
//!   data path), [`disk`], [`remote`] (Redis or S3), [`nats`] (envelopes, snapshots), metrics
//!   and health;
//! - [`peers`]: pulls between nodes' daemons over TCP (a directory of what each peer holds,
//!   from their NATS streams; a shared-secret handshake; the pull client and server);
//! - [`client`]: the Rust reference connector (vLLM's is `connectors/vllm`, in Python).
//!
//! `docs/kvbm.md` documents the protocol, flags, metrics and what is not in this build
//! (GPUDirect Storage, a page-locked host pool, NIXL, an SGLang connector).

mod app;
mod args;
pub mod client;
pub mod disk;
pub mod fdpass;
mod held;
pub mod metrics;
pub mod nats;
pub mod outbox;
pub mod peers;
mod pending;
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
