//! The event bridge: engine ZMQ KV events in, kvgate envelopes on NATS out.
//!
//! - [`rank`], [`resident`], [`epoch`]: the pure per-rank core (crate `kvgate-kv-bridge`).
//! - [`sink`]: the I/O edge on the rank's receive thread, queueing envelopes for NATS.
//! - [`liveness`]: whether the stream is live, for readiness.

pub use kv_bridge::{epoch, rank, resident};

pub mod liveness;
pub mod sink;
