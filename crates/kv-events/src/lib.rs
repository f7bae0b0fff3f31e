//! KV-event wire formats and hashing for kvgate. Pure: no I/O, no async runtime.
//!
//! What it is:
//! - [`engine`]: the KV events vLLM and SGLang publish over ZMQ, decoded from both encodings
//!   (positional arrays of vLLM ≤ 0.23, tagged maps of vLLM ≥ 0.24 and SGLang) and encoded
//!   byte for byte as each engine does; [`frame`]: the ZMQ live and replay message layouts.
//! - [`key`]: kvgate block keys, a chained xxh3 over full token blocks that the EPP computes
//!   from a request and the sidecar from an engine's events.
//! - [`normalize`]: the per-pod normaliser turning engine events into kvgate [`event`]s.
//! - [`engine_hash`]: vLLM's `sha256_cbor` and SGLang's page hash, to verify engines' hashes.
//! - [`envelope`] and [`subject`]: the NATS envelope and subjects; [`snapshot`]: the
//!   resident-set request/reply after a gap; [`load`]: relayed engine load samples.
//!
//! What it is not: a transport (the sidecar and EPP own the sockets) or an index (`kv-index`).
//! Every malformed input yields a typed error; nothing here panics on wire data.

pub mod engine;
pub mod engine_hash;
pub mod envelope;
pub mod event;
pub mod fasthash;
pub mod frame;
pub mod key;
pub mod load;
pub mod msgpack;
pub mod normalize;
pub mod snapshot;
pub mod subject;
pub mod tier;

pub use engine::{EngineEvent, EngineHash, EventBatch};
pub use envelope::{Envelope, Source};
pub use event::KvEvent;
pub use key::{BlockKey, KeyChain, KeyHasher, KeySeed};
pub use normalize::{Normalizer, NormalizerConfig};
pub use tier::Tier;
