//! KV-cache events, as vLLM's `KVEventBatch` carries them (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`; GPU or, with offloading, CPU medium), before any wire encoding.

use crate::RequestId;

/// One change to the set of cached (hashed) blocks on the GPU or in the host tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Full blocks of one request became cached (vLLM `BlockStored`): emitted when a scheduling
    /// decision covers them, once per request per cache update, with the newly cached hashes in
    /// block order.
    Stored {
        /// The newly cached block hashes, in order.
        hashes: Vec<u64>,
        /// Hash of the request's block just before the first of these (`None` for block 0).
        parent: Option<u64>,
        /// The tokens of these blocks, concatenated (`hashes.len() × block_size` tokens).
        token_ids: Vec<u32>,
        /// The request whose blocks these are.
        request: RequestId,
        /// Index of the first of these blocks in the request's block table.
        first_block_index: u32,
    },
    /// A cached block was evicted (vLLM emits one `BlockRemoved` per block, so `hashes` holds
    /// exactly one hash).
    Removed {
        /// The evicted block's hash.
        hashes: Vec<u64>,
    },
    /// Blocks were copied to the host (CPU) tier of the offloading connector (vLLM publishes a
    /// `BlockStored` with the `CPU` medium and no token ids), in block order.
    HostStored {
        /// The blocks' hashes (the same hashes as on the GPU).
        hashes: Vec<u64>,
    },
    /// A block was dropped from the host tier (`BlockRemoved`, `CPU` medium; one hash).
    HostRemoved {
        /// The dropped block's hash.
        hashes: Vec<u64>,
    },
    /// The whole prefix cache was dropped, host tier included (`/reset_prefix_cache`; vLLM
    /// `AllBlocksCleared`).
    Cleared,
}
