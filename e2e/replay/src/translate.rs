//! Engine-model cache events → the engine wire events the sidecar's normaliser reads.
//!
//! The live path is engine model → `kvgate-sim`'s ZMQ `KVEventBatch` → sidecar
//! [`Normalizer`](kv_events::Normalizer) → kvgate events on NATS → the EPP's index. The replay
//! skips only the encoding and the transports: it builds the same [`EngineEvent`]s the sim
//! encodes (GPU medium, the engine's own hashes and parent, the blocks' token ids; requests carry
//! no cache salt) and feeds them to the same normaliser.

use engine_model::CacheEvent;
use kv_events::engine::{BlockRemoved, BlockStored, EngineEvent, EngineHash};
use kv_events::tier::Medium;

/// The engine event the simulator would publish for `event`, blocks of `block_size` tokens.
pub fn engine_event(event: CacheEvent, block_size: u32) -> EngineEvent {
    match event {
        CacheEvent::Stored {
            hashes,
            parent,
            token_ids,
            ..
        } => EngineEvent::BlockStored(BlockStored {
            block_hashes: hashes.into_iter().map(EngineHash).collect(),
            parent_block_hash: parent.map(EngineHash),
            token_ids,
            block_size,
            medium: Some(Medium::Gpu),
            group_idx: Some(0),
            ..BlockStored::default()
        }),
        CacheEvent::Removed { hashes } => EngineEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes.into_iter().map(EngineHash).collect(),
            medium: Some(Medium::Gpu),
            group_idx: Some(0),
        }),
        CacheEvent::Cleared => EngineEvent::AllBlocksCleared,
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]
    use super::*;
    use kv_events::key::{SaltStyle, request_block_keys};
    use kv_events::{KvEvent, Normalizer, NormalizerConfig};

    #[test]
    fn normalised_stores_carry_the_keys_the_router_computes() {
        let tokens: Vec<u32> = (100..164).collect();
        let mut norm = Normalizer::new(NormalizerConfig::new("m", 16));
        let mut out = Vec::new();
        let first = CacheEvent::Stored {
            hashes: vec![11, 12],
            parent: None,
            token_ids: tokens[..32].to_vec(),
            request: 1,
            first_block_index: 0,
        };
        let second = CacheEvent::Stored {
            hashes: vec![13, 14],
            parent: Some(12),
            token_ids: tokens[32..].to_vec(),
            request: 1,
            first_block_index: 2,
        };
        for e in [first, second] {
            norm.apply(&engine_event(e, 16), &mut out).unwrap();
        }
        let keys: Vec<_> = out
            .iter()
            .flat_map(|e| match e {
                KvEvent::Stored { keys, .. } => keys.clone(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(
            keys,
            request_block_keys("m", None, SaltStyle::VllmExtraKey, &tokens, 16)
        );
        out.clear();
        norm.apply(
            &engine_event(CacheEvent::Removed { hashes: vec![14] }, 16),
            &mut out,
        )
        .unwrap();
        assert!(
            matches!(&out[..], [KvEvent::Removed { keys, .. }] if keys[0] == keys_last(&tokens))
        );
        out.clear();
        norm.apply(&engine_event(CacheEvent::Cleared, 16), &mut out)
            .unwrap();
        assert!(matches!(&out[..], [KvEvent::Cleared { tier: None }]));
    }

    fn keys_last(tokens: &[u32]) -> kv_events::BlockKey {
        *request_block_keys("m", None, SaltStyle::VllmExtraKey, tokens, 16)
            .last()
            .unwrap()
    }
}
