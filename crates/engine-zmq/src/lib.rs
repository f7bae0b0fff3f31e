//! Subscribing to one engine's (one data-parallel rank's) ZMQ KV-event stream.
//!
//! - [`seq`]: the pure sequence checker: in order, gap, restart, duplicate.
//! - [`stream`]: the blocking receive loop over a ZMQ SUB socket that repairs gaps through the
//!   engine's replay ROUTER (both reply layouts) and hands in-sequence frames to a
//!   [`FrameSink`]; what the frames mean (decoding, normalising, indexing or publishing) is the
//!   sink's business, so the EPP's direct mode and the sidecar share it.
//! - [`endpoint`]: per-rank endpoints (rank `r` listens on the base port + `r`).
//!
//! Blocking threads, not async: the `zmq` crate's sockets are blocking and one thread per rank
//! keeps receive latency out of any runtime's scheduling.

pub mod endpoint;
pub mod seq;
pub mod stream;

pub use endpoint::{EndpointError, rank_endpoint};
pub use seq::{SeqOutcome, Sequencer};
pub use stream::{Frame, FrameSink, StartFrom, StreamConfig, StreamError, run};
