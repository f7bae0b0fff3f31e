//! The event bridge: engine ZMQ KV events in, kvgate envelopes on NATS out.
//!
//! - [`rank`]: one DP rank's pure core (decode, normalise, batch, seal, epoch, resident set).
//! - [`resident`]: the resident set a receiver of the envelopes holds (snapshots come from it).
//! - [`sink`]: the I/O edge on the rank's receive thread, queueing envelopes for NATS.
//! - [`epoch`]: random epochs.

pub mod epoch;
pub mod rank;
pub mod resident;
pub mod sink;
