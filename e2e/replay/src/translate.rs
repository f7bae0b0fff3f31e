//! Engine-model cache events → the engine wire events vLLM publishes, one conversion for both
//! users: `kvgate-sim` encodes them into ZMQ `KVEventBatch`es (its `BatchEncoder`), and the
//! replay feeds them straight to the sidecar's [`Normalizer`](kv_events::Normalizer), skipping
//! only the encoding and the transports of the live path (engine model → sim → ZMQ → sidecar
//! → NATS → the EPP's index).

use engine_model::CacheEvent;
use kv_events::engine::{BlockRemoved, BlockStored, EngineEvent, EngineHash, RawValue};
use kv_events::tier::Medium;

/// The event vLLM 0.32 would publish for `event`, blocks of `block_size` tokens: GPU medium
/// (CPU for the offloading connector's host tier, whose stores carry hashes only), group 0,
/// full attention, the engine's own hashes and parent, the blocks' token ids. `salt` is
/// the request's cache salt; vLLM writes it as the first block's `extra_keys` entry when the
/// stored run starts at the request's block 0.
pub fn engine_event(event: &CacheEvent, block_size: u32, salt: Option<&str>) -> EngineEvent {
    match event {
        CacheEvent::Stored {
            hashes,
            parent,
            token_ids,
            first_block_index,
            ..
        } => {
            let salt = salt.filter(|_| *first_block_index == 0);
            let extra_keys = (0..hashes.len())
                .map(|i| match (salt, i) {
                    (Some(s), 0) => Some(RawValue(kv_events::key::vllm_salt_extra_key(s))),
                    _ => None,
                })
                .collect();
            EngineEvent::BlockStored(BlockStored {
                block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
                parent_block_hash: parent.map(EngineHash),
                token_ids: token_ids.clone(),
                block_size,
                lora_id: None,
                medium: Some(Medium::Gpu),
                lora_name: None,
                extra_keys: Some(extra_keys),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..BlockStored::default()
            })
        }
        CacheEvent::Removed { hashes } => removed(hashes, Medium::Gpu),
        // vLLM's offloading connector reports its CPU copies by hash, without token ids (the
        // normaliser resolves them through the GPU store that came first).
        CacheEvent::HostStored { hashes } => EngineEvent::BlockStored(BlockStored {
            block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
            block_size,
            medium: Some(Medium::Cpu),
            group_idx: Some(0),
            ..BlockStored::default()
        }),
        CacheEvent::HostRemoved { hashes } => removed(hashes, Medium::Cpu),
        CacheEvent::Cleared => EngineEvent::AllBlocksCleared,
    }
}

fn removed(hashes: &[u64], medium: Medium) -> EngineEvent {
    EngineEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
        medium: Some(medium),
        group_idx: Some(0),
    })
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
            norm.apply(&engine_event(&e, 16, None), &mut out).unwrap();
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
            &engine_event(&CacheEvent::Removed { hashes: vec![14] }, 16, None),
            &mut out,
        )
        .unwrap();
        assert!(
            matches!(&out[..], [KvEvent::Removed { keys, .. }] if keys[0] == keys_last(&tokens))
        );
        out.clear();
        norm.apply(&engine_event(&CacheEvent::Cleared, 16, None), &mut out)
            .unwrap();
        assert!(matches!(&out[..], [KvEvent::Cleared { tier: None }]));
    }

    #[test]
    fn host_copies_become_host_tier_residencies_of_the_same_keys() {
        use kv_events::Tier;
        let tokens: Vec<u32> = (100..132).collect();
        let keys = request_block_keys("m", None, SaltStyle::VllmExtraKey, &tokens, 16);
        let mut norm = Normalizer::new(NormalizerConfig::new("m", 16));
        let mut out = Vec::new();
        let events = [
            CacheEvent::Stored {
                hashes: vec![11, 12],
                parent: None,
                token_ids: tokens.clone(),
                request: 1,
                first_block_index: 0,
            },
            CacheEvent::HostStored {
                hashes: vec![11, 12],
            },
            // The GPU copy goes; the host copy still names the key.
            CacheEvent::Removed { hashes: vec![12] },
            CacheEvent::HostRemoved { hashes: vec![12] },
        ];
        for e in &events {
            norm.apply(&engine_event(e, 16, None), &mut out).unwrap();
        }
        assert!(
            matches!(&out[1], KvEvent::Stored { keys: k, tier: Tier::Host, token_count: 0, .. } if *k == keys),
            "{out:?}"
        );
        assert!(
            matches!(&out[2], KvEvent::Removed { keys: k, tier: Tier::Gpu } if k[..] == keys[1..]),
            "{out:?}"
        );
        assert!(
            matches!(&out[3], KvEvent::Removed { keys: k, tier: Tier::Host } if k[..] == keys[1..]),
            "{out:?}"
        );
        assert_eq!(out.len(), 4);
    }

    fn keys_last(tokens: &[u32]) -> kv_events::BlockKey {
        *request_block_keys("m", None, SaltStyle::VllmExtraKey, tokens, 16)
            .last()
            .unwrap()
    }
}
