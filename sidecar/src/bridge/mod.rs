//! The event bridge: engine ZMQ KV events in, kvgate envelopes on NATS out.
//!
//! - [`rank`], [`resident`], [`epoch`]: the pure per-rank core (crate `kvgate-kv-bridge`).
//! - [`sink`]: the I/O edge on the rank's receive thread, queueing envelopes for NATS.

pub use kv_bridge::{epoch, rank, resident};

pub mod sink;
