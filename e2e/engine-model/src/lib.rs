//! The engine model of kvgate's vLLM-compatible simulator.
//!
//! A pure, single-threaded model of one vLLM v1 engine in virtual time: the scheduler
//! (continuous batching, chunked prefill, FCFS admission, preemption by recomputation), the
//! paged KV cache with automatic prefix caching (block hashes, reference counts, LRU eviction,
//! no de-duplication), the KV events a real engine publishes (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`), the NIXL prefill/decode roles, and a roofline model of how long each
//! step takes, with presets calibrated on published measurements.
//!
//! It is driven by the live HTTP simulator (`kvgate-sim`, which sleeps each step's duration and
//! serves the OpenAI API, ZMQ events and `/metrics` around it) and by discrete-event replays.
//! It is **not** an HTTP server, a tokenizer or an event encoder, and it has no clock, threads
//! or I/O: time is a number the caller passes in.
//!
//! ```
//! use engine_model::{Engine, NewRequest, Preset, XxhChain};
//!
//! let mut engine = Engine::new(Preset::Small.config()).unwrap();
//! engine
//!     .add_request(NewRequest {
//!         id: 1,
//!         prompt: (0..100).collect(),
//!         output: vec![7, 8, 9],
//!         hasher: Box::new(XxhChain::new(0)),
//!         arrival: 0,
//!         kv_transfer: None,
//!     })
//!     .unwrap();
//! let mut now = 0;
//! let mut tokens = Vec::new();
//! while let Some(step) = engine.step(now) {
//!     now += step.duration;
//!     for out in step.outputs {
//!         tokens.extend(out.new_tokens);
//!     }
//! }
//! assert_eq!(tokens, [7, 8, 9]);
//! assert!(!engine.has_unfinished());
//! ```
//!
//! The crate's README describes the reproduced vLLM semantics, the cost model and the presets
//! with their sources and arithmetic.

mod block_pool;
mod config;
mod cost;
mod engine;
mod events;
mod free_queue;
mod hash;
mod host_cache;
mod offload;
mod output;
mod preset;
mod request;
mod scheduler;
pub mod spec;

pub use config::{ConfigError, EngineConfig};
pub use cost::{BatchShape, CostError, CostModel, StepCost};
pub use engine::Engine;
pub use events::CacheEvent;
pub use hash::{BlockHashChain, XxhChain};
pub use offload::{Lookup, LookupRequest, Offload, OffloadTier, Sources};
pub use output::{EngineStats, FinishReason, RequestOutput, StepOutput, TransferParams};
pub use preset::{Preset, UnknownPreset};
pub use request::{AdmitError, KvTransfer, NewRequest};

/// A request's identity, chosen by the caller.
pub type RequestId = u64;

/// Virtual time in nanoseconds since an arbitrary origin.
pub type Nanos = u64;

/// A KV block's index in the GPU cache (block 0 is vLLM's reserved null block).
pub type BlockId = u32;
