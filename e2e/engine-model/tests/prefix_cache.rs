//! Prefix caching as vLLM v1 does it: hit length, Stored/Removed events, eviction order,
//! duplicates, reset, statistics.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;

use common::{Run, config, engine, hashes, request};
use engine_model::CacheEvent;

#[test]
fn a_hit_never_covers_the_last_prompt_token() {
    let mut e = engine(config(17, 4, 4, 64));
    let prompt: Vec<u32> = (0..8).collect();
    let mut run = Run::default();
    e.add_request(request(1, prompt.clone(), vec![100]))
        .unwrap();
    run.drain(&mut e);
    // Same 8-token prompt: (8 − 1) tokens may hit → one whole block.
    e.add_request(request(2, prompt.clone(), vec![100]))
        .unwrap();
    run.drain(&mut e);
    // One more token: both blocks hit.
    let mut longer = prompt.clone();
    longer.push(8);
    e.add_request(request(3, longer, vec![100])).unwrap();
    run.drain(&mut e);

    assert_eq!(run.cached_tokens[&1], 0);
    assert_eq!(run.cached_tokens[&2], 4);
    assert_eq!(run.cached_tokens[&3], 8);
    let s = e.stats();
    assert_eq!(s.prefix_cache_queries, 8 + 8 + 9);
    assert_eq!(s.prefix_cache_hits, 4 + 8);
    // The second request computed only its uncached tokens.
    let prefills: Vec<u64> = run
        .steps
        .iter()
        .map(|s| s.shape.num_prefill_tokens)
        .collect();
    assert_eq!(prefills, vec![8, 4, 1]);
}

#[test]
fn stored_events_name_parent_tokens_and_block_index_including_decoded_blocks() {
    let mut e = engine(config(17, 4, 4, 64));
    let prompt: Vec<u32> = (10..16).collect(); // 6 tokens: one full block
    let output = vec![20, 21, 22, 23];
    e.add_request(request(1, prompt.clone(), output.clone()))
        .unwrap();
    let mut run = Run::default();
    run.drain(&mut e);

    let all: Vec<u32> = prompt.iter().chain(&output).copied().collect();
    let h = hashes(&all, 4);
    // Block 0 at the prefill; block 1 (prompt 14, 15 + outputs 20, 21) once the step that
    // computes token 21 is scheduled. Token 23 is never computed, so no third block.
    assert_eq!(
        run.events,
        vec![
            CacheEvent::Stored {
                hashes: vec![h[0]],
                parent: None,
                token_ids: all[0..4].to_vec(),
                request: 1,
                first_block_index: 0,
            },
            CacheEvent::Stored {
                hashes: vec![h[1]],
                parent: Some(h[0]),
                token_ids: all[4..8].to_vec(),
                request: 1,
                first_block_index: 1,
            },
        ]
    );
    assert_eq!(run.tokens[&1], output);
}

#[test]
fn eviction_takes_the_tail_of_a_freed_request_first_one_removed_per_block() {
    // 4 usable blocks of 2 tokens.
    let mut e = engine(config(5, 2, 4, 64));
    let mut run = Run::default();
    let a: Vec<u32> = (0..6).collect(); // 3 full blocks, all cached
    e.add_request(request(1, a.clone(), vec![50])).unwrap();
    run.drain(&mut e);
    let ha = hashes(&a, 2);
    assert_eq!(e.cached_hashes().len(), 3);

    // Needs 2 blocks: the never-used block, then A's tail block.
    e.add_request(request(2, vec![90, 91, 92, 93], vec![51]))
        .unwrap();
    run.drain(&mut e);
    assert_eq!(run.removed_hashes(), vec![ha[2]]);

    // A's prompt plus one token could hit 3 blocks; the tail one is gone.
    let mut a2 = a.clone();
    a2.push(6);
    e.add_request(request(3, a2, vec![52])).unwrap();
    run.drain(&mut e);
    assert_eq!(run.cached_tokens[&3], 4);
}

#[test]
fn identical_blocks_computed_concurrently_are_cached_and_stored_twice() {
    // vLLM does not de-duplicate the cache (block tables are append-only). With 2-token chunks,
    // B arrives while A is mid-prefill, hits A's first two blocks and computes block 2 in the
    // same step; A computes its own block 2 one step later, with the same content.
    let mut cfg = config(17, 2, 4, 64);
    cfg.long_prefill_token_threshold = 2;
    let mut e = engine(cfg);
    let prompt: Vec<u32> = (0..6).collect();
    e.add_request(request(1, prompt.clone(), vec![7])).unwrap();
    let mut run = Run::default();
    run.step(&mut e).unwrap(); // A: tokens 0..2
    e.add_request(request(2, prompt.clone(), vec![7])).unwrap();
    run.drain(&mut e);

    let h = hashes(&prompt, 2);
    let stored_h2: Vec<u64> = run
        .stored()
        .iter()
        .filter_map(|ev| match ev {
            CacheEvent::Stored {
                hashes, request, ..
            } if hashes.contains(&h[2]) => Some(*request),
            _ => None,
        })
        .collect();
    assert_eq!(
        stored_h2,
        vec![2, 1],
        "B stores block 2 first, then A stores its copy"
    );
    assert_eq!(e.cached_hashes().iter().filter(|&&x| x == h[2]).count(), 2);
    assert_eq!(e.stats().cached_blocks, 4);
    assert_eq!(run.cached_tokens[&2], 4);
}

#[test]
fn reset_succeeds_only_when_no_block_is_in_use() {
    let mut e = engine(config(17, 4, 4, 64));
    let prompt: Vec<u32> = (0..9).collect();
    e.add_request(request(1, prompt.clone(), vec![1, 2, 3]))
        .unwrap();
    let mut run = Run::default();
    run.step(&mut e).unwrap();
    assert!(!e.reset_prefix_cache());
    assert!(e.take_events().is_empty());
    assert!(!e.cached_hashes().is_empty());
    run.drain(&mut e);

    assert!(e.reset_prefix_cache());
    assert_eq!(e.take_events(), vec![CacheEvent::Cleared]);
    assert!(e.cached_hashes().is_empty());
    assert_eq!(e.stats().cached_blocks, 0);
    e.add_request(request(2, prompt, vec![1])).unwrap();
    run.drain(&mut e);
    assert_eq!(run.cached_tokens[&2], 0);
}

#[test]
fn with_caching_off_there_are_no_events_lookups_or_hits() {
    let mut cfg = config(17, 4, 4, 64);
    cfg.enable_prefix_caching = false;
    let mut e = engine(cfg);
    let mut run = Run::default();
    for id in 1..=2 {
        e.add_request(request(id, (0..9).collect(), vec![1, 2]))
            .unwrap();
        run.drain(&mut e);
    }
    assert!(run.events.is_empty());
    assert_eq!(run.cached_tokens[&2], 0);
    let s = e.stats();
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (0, 0));
}

#[test]
fn a_full_prompt_hit_still_computes_one_token() {
    let mut e = engine(config(17, 4, 4, 64));
    let prompt: Vec<u32> = (0..8).collect();
    let mut run = Run::default();
    e.add_request(request(1, prompt.clone(), vec![5, 6]))
        .unwrap();
    run.drain(&mut e);
    // The first request decoded token 5 into block 2 but never filled it: 8 + 1 tokens.
    let mut p2 = prompt.clone();
    p2.push(5);
    e.add_request(request(2, p2, vec![9])).unwrap();
    run.drain(&mut e);
    assert_eq!(run.cached_tokens[&2], 8);
    assert_eq!(run.steps.last().unwrap().shape.num_prefill_tokens, 1);
}
