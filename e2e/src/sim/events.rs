//! Engine-model cache events → vLLM `KVEventBatch` payloads, byte for byte as vLLM 0.32 (maps) or
//! ≤ 0.23 (positional arrays) publishes them.

use engine_model::CacheEvent;
use kv_events::engine::{
    BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, RawValue, WireFormat,
    encode_batch,
};
use kv_events::tier::Medium;

/// Builds one step's payload.
#[derive(Debug, Clone)]
pub struct BatchEncoder {
    /// Tokens per block.
    pub block_size: u32,
    /// The data-parallel rank written as the batch's third element.
    pub dp_rank: i64,
    /// Wire layout.
    pub format: WireFormat,
}

impl BatchEncoder {
    /// Encodes `events` stamped with wall-clock `ts` (seconds). `salt_of` returns the cache salt
    /// of a request, for the first block's `extra_keys`. Returns `None` for an empty step.
    pub fn encode(
        &self,
        ts: f64,
        events: &[CacheEvent],
        salt_of: impl Fn(u64) -> Option<String>,
    ) -> Option<Vec<u8>> {
        if events.is_empty() {
            return None;
        }
        let events = events.iter().map(|e| self.convert(e, &salt_of)).collect();
        let batch = EventBatch {
            ts,
            events,
            dp_rank: Some(self.dp_rank),
        };
        Some(encode_batch(&batch, self.format))
    }

    fn convert(&self, event: &CacheEvent, salt_of: &impl Fn(u64) -> Option<String>) -> EngineEvent {
        match event {
            CacheEvent::Stored {
                hashes,
                parent,
                token_ids,
                request,
                first_block_index,
            } => {
                let salt = if *first_block_index == 0 {
                    salt_of(*request)
                } else {
                    None
                };
                let extra_keys = hashes
                    .iter()
                    .enumerate()
                    .map(|(i, _)| match (&salt, i) {
                        (Some(s), 0) => Some(RawValue(kv_events::key::vllm_salt_extra_key(s))),
                        _ => None,
                    })
                    .collect();
                EngineEvent::BlockStored(BlockStored {
                    block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
                    parent_block_hash: parent.map(EngineHash),
                    token_ids: token_ids.clone(),
                    block_size: self.block_size,
                    lora_id: None,
                    medium: Some(Medium::Gpu),
                    lora_name: None,
                    extra_keys: Some(extra_keys),
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                    ..BlockStored::default()
                })
            }
            CacheEvent::Removed { hashes } => EngineEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
                medium: Some(Medium::Gpu),
                group_idx: Some(0),
            }),
            CacheEvent::Cleared => EngineEvent::AllBlocksCleared,
        }
    }
}
