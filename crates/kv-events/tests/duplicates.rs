#![allow(clippy::unwrap_used, clippy::indexing_slicing)]
//! vLLM caches duplicate GPU blocks: two blocks computed with the same content are both cached
//! under one hash, each stored and removed on its own. The normaliser keeps the hash until its
//! last copy goes, so a chain continued from the surviving copy still resolves.

use kv_events::engine::{BlockRemoved, BlockStored, EngineEvent, EngineHash};
use kv_events::tier::{Medium, Tier};
use kv_events::{KvEvent, Normalizer, NormalizerConfig};

const BS: u32 = 2;

fn stored(hashes: &[u64], parent: Option<u64>, medium: Medium, tokens: bool) -> EngineEvent {
    EngineEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().copied().map(EngineHash).collect(),
        parent_block_hash: parent.map(EngineHash),
        token_ids: if tokens {
            (0..hashes.len() as u32 * BS).collect()
        } else {
            Vec::new()
        },
        block_size: BS,
        medium: Some(medium),
        ..BlockStored::default()
    })
}

fn removed(hash: u64, medium: Medium) -> EngineEvent {
    EngineEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![EngineHash(hash)],
        medium: Some(medium),
        ..BlockRemoved::default()
    })
}

fn apply(n: &mut Normalizer, e: &EngineEvent) -> Vec<KvEvent> {
    let mut out = Vec::new();
    n.apply(e, &mut out).unwrap();
    out
}

fn removals(events: &[KvEvent]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, KvEvent::Removed { .. }))
        .count()
}

#[test]
fn a_duplicate_gpu_block_stays_until_its_last_copy_is_evicted() {
    let mut n = Normalizer::new(NormalizerConfig::new("m", BS));
    // Two requests computed block 1 at once: two copies.
    apply(&mut n, &stored(&[1], None, Medium::Gpu, true));
    apply(&mut n, &stored(&[1], None, Medium::Gpu, true));
    // One copy is evicted: nothing leaves the index, and a chain continued from the other
    // copy still resolves its parent.
    assert_eq!(removals(&apply(&mut n, &removed(1, Medium::Gpu))), 0);
    let key = n.key_of(EngineHash(1)).expect("still resident");
    let child = apply(&mut n, &stored(&[2], Some(1), Medium::Gpu, true));
    assert!(matches!(&child[0], KvEvent::Stored { parent: Some(p), .. } if *p == key));
    // The last copy goes: now it is removed.
    let last = apply(&mut n, &removed(1, Medium::Gpu));
    assert_eq!(
        last,
        [KvEvent::Removed {
            keys: vec![key],
            tier: Tier::Gpu
        }]
    );
    // A removal past the last copy is unknown, as before.
    apply(&mut n, &removed(1, Medium::Gpu));
    assert_eq!(n.stats().unknown_removed, 1);
}

#[test]
fn a_lower_tier_holds_one_copy_however_often_it_is_stored() {
    let mut n = Normalizer::new(NormalizerConfig::new("m", BS));
    apply(&mut n, &stored(&[1], None, Medium::Gpu, true));
    // The offloading connector reports its CPU copy twice (by hash, without tokens).
    apply(&mut n, &stored(&[1], None, Medium::Cpu, false));
    apply(&mut n, &stored(&[1], None, Medium::Cpu, false));
    assert_eq!(removals(&apply(&mut n, &removed(1, Medium::Cpu))), 1);
    let left: Vec<_> = n.resident().collect();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].1, Tier::Gpu);
}
