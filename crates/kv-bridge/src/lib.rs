//! The sidecar's event-bridge core, pure (no I/O, no async runtime):
//!
//! - [`rank`]: one DP rank's bridge: decode, normalise, batch, seal into envelopes stamped
//!   (epoch, seq), new epochs after drops, snapshots.
//! - [`resident`]: the resident set a receiver of the envelopes holds; snapshots come from it.
//! - [`epoch`]: random epochs.
//!
//! The sidecar (`kvgate-sidecar`) runs it on its receive threads and owns the sockets.

pub mod epoch;
pub mod rank;
pub mod resident;
