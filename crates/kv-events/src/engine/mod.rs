//! Engine KV events: the types vLLM and SGLang publish, and their MessagePack codecs.
//!
//! A payload is a batch `[ts, events, dp_rank?]`. Events are positional arrays tagged by their
//! first element (vLLM ≤ 0.23) or maps with a `"type"` key (vLLM ≥ 0.24, SGLang). Decoding
//! accepts both, any field order in maps, missing trailing fields in arrays, and ignores fields
//! it does not know. Encoding reproduces each engine's exact bytes (see [`WireFormat`]).

mod decode;
mod encode;

pub use decode::{DecodeError, Limits, decode_batch, decode_batch_with};
pub use encode::{WireFormat, encode_batch};

use crate::tier::Medium;

/// A block hash as the engine published it, reduced to 64 bits.
///
/// vLLM publishes u64 values (the last 8 bytes of its SHA-256 digest, big-endian), SGLang
/// signed i64 values (stored here by their bit pattern), and either may publish the raw
/// digest as binary, of which the last 8 bytes are kept, big-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

impl EngineHash {
    /// The value as a signed integer (SGLang's view).
    pub const fn as_i64(self) -> i64 {
        self.0 as i64
    }
}

/// One MessagePack value kept as its raw bytes (used for opaque fields such as `extra_keys`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RawValue(pub Vec<u8>);

/// A decoded payload: one engine step's events.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The engine's wall-clock timestamp, in seconds.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank (vLLM) or attention DP rank (SGLang); absent in old releases.
    pub dp_rank: Option<i64>,
}

/// One engine KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Blocks became cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was reset.
    AllBlocksCleared,
    /// An event type this decoder does not know; kept so callers can count it.
    Unknown {
        /// The tag on the wire.
        type_name: String,
    },
}

/// `BlockStored`: one or more full blocks chained through `parent_block_hash`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// The blocks' hashes, in chain order.
    pub block_hashes: Vec<EngineHash>,
    /// The hash of the block before the first one, if any.
    pub parent_block_hash: Option<EngineHash>,
    /// The tokens of all blocks (`block_hashes.len() × block_size`); empty for stores into a
    /// lower tier of blocks whose tokens were published before.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter id, if any.
    pub lora_id: Option<i64>,
    /// Where the blocks were stored; absent means GPU.
    pub medium: Option<Medium>,
    /// The LoRA adapter name, if any.
    pub lora_name: Option<String>,
    /// Per block, the extra hash inputs (multimodal hashes, LoRA, cache salt) or `None`.
    pub extra_keys: Option<Vec<Option<RawValue>>>,
    /// vLLM's KV-cache group index.
    pub group_idx: Option<i64>,
    /// vLLM's KV-cache spec kind (e.g. `full_attention`).
    pub kv_cache_spec_kind: Option<String>,
    /// vLLM's sliding window, for sliding-window groups.
    pub kv_cache_spec_sliding_window: Option<i64>,
    /// SGLang's per-request cache salt.
    pub cache_salt: Option<String>,
}

/// `BlockRemoved`: blocks evicted from one medium.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// The evicted blocks' hashes.
    pub block_hashes: Vec<EngineHash>,
    /// Where they were evicted from; absent means GPU.
    pub medium: Option<Medium>,
    /// vLLM's KV-cache group index.
    pub group_idx: Option<i64>,
}

impl EngineEvent {
    /// How many blocks the event concerns (0 for a reset).
    pub fn block_count(&self) -> usize {
        match self {
            EngineEvent::BlockStored(s) => s.block_hashes.len(),
            EngineEvent::BlockRemoved(r) => r.block_hashes.len(),
            EngineEvent::AllBlocksCleared | EngineEvent::Unknown { .. } => 0,
        }
    }
}
