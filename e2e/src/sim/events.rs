//! Engine-model cache events → vLLM `KVEventBatch` payloads, byte for byte as vLLM 0.32 (maps) or
//! ≤ 0.23 (positional arrays) publishes them. Each event comes from [`replay::engine_event`], the
//! conversion the discrete-event replay feeds to the sidecar's normaliser.

use engine_model::CacheEvent;
use kv_events::engine::{EventBatch, WireFormat, encode_batch};

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
        let events = events
            .iter()
            .map(|e| {
                let salt = match e {
                    CacheEvent::Stored {
                        request,
                        first_block_index: 0,
                        ..
                    } => salt_of(*request),
                    _ => None,
                };
                replay::engine_event(e, self.block_size, salt.as_deref())
            })
            .collect();
        let batch = EventBatch {
            ts,
            events,
            dp_rank: Some(self.dp_rank),
        };
        Some(encode_batch(&batch, self.format))
    }
}
