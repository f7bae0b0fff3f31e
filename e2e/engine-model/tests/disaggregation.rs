//! vLLM NIXL prefill/decode roles: prefill-only requests and remote prefills.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;

use common::{Run, config, engine, hashes, request, with_transfer};
use engine_model::{CacheEvent, FinishReason, KvTransfer};

#[test]
fn prefill_only_emits_one_token_and_the_blocks_to_pull() {
    let mut e = engine(config(17, 4, 4, 64));
    let prompt: Vec<u32> = (0..10).collect();
    e.add_request(with_transfer(
        request(1, prompt.clone(), vec![5, 6, 7]),
        KvTransfer::PrefillOnly,
    ))
    .unwrap();
    let mut run = Run::default();
    let out = run.step(&mut e).unwrap();
    assert!(!e.has_unfinished());
    let o = &out.outputs[0];
    assert_eq!(o.new_tokens, vec![5]);
    assert_eq!(o.finished, Some(FinishReason::Length));
    let p = o.kv_transfer_params.clone().unwrap();
    assert_eq!(p.block_ids.len(), 2);
    assert_eq!(p.block_hashes, hashes(&prompt, 4));
    assert_eq!((p.num_tokens, p.prompt_tokens), (8, 10));
    // Its blocks are free but stay cached, so a decode engine (or a retry) can hit them.
    let s = e.stats();
    assert_eq!((s.used_blocks, s.cached_blocks), (0, 2));
    assert_eq!(s.generation_tokens, 1);
}

#[test]
fn remote_prefill_waits_without_blocking_the_batch_then_counts_as_cached() {
    let mut cfg = config(17, 4, 4, 64);
    cfg.kv_bytes_per_token = 1_000;
    cfg.kv_transfer_bandwidth = 1_000_000; // 8 tokens → 8 ms
    let mut e = engine(cfg);
    e.add_request(request(1, vec![90, 91, 92], vec![1, 2, 3, 4, 5, 6, 7, 8]))
        .unwrap();
    let mut run = Run::default();
    run.step(&mut e).unwrap();

    let prompt: Vec<u32> = (0..10).collect();
    // 100 requested → at most prompt − 1 = 9 → 8 in whole blocks.
    e.add_request(with_transfer(
        request(2, prompt.clone(), vec![40, 41]),
        KvTransfer::RemotePrefill { num_tokens: 100 },
    ))
    .unwrap();
    let started = run.now;
    let out = run.step(&mut e).unwrap();
    assert_eq!(
        out.shape.num_seqs, 1,
        "the transfer does not join the batch"
    );
    let s = e.stats();
    assert_eq!((s.running, s.waiting, s.transferring), (1, 1, 1));
    assert_eq!(
        s.used_blocks,
        1 + 2,
        "the pulled blocks are allocated up front"
    );
    assert_eq!(e.next_wakeup(), Some(started + 8_000_000));
    assert!(
        out.events
            .iter()
            .all(|ev| !matches!(ev, CacheEvent::Stored { request: 2, .. })),
        "not cached before the KV arrived"
    );

    // Request 1 keeps decoding meanwhile; request 2 starts once the transfer is done.
    let mut first_step_of_2 = None;
    while e.has_unfinished() {
        let Some(out) = run.step(&mut e) else {
            run.now = e.next_wakeup().unwrap();
            continue;
        };
        if first_step_of_2.is_none() && out.outputs.iter().any(|o| o.id == 2) {
            first_step_of_2 = Some((run.now - out.duration, out));
        }
    }
    let (at, out) = first_step_of_2.unwrap();
    assert!(at >= started + 8_000_000);
    let h = hashes(&prompt, 4);
    assert!(out.events.contains(&CacheEvent::Stored {
        hashes: h.clone(),
        parent: None,
        token_ids: prompt[..8].to_vec(),
        request: 2,
        first_block_index: 0,
    }));
    assert_eq!(
        out.shape.num_prefill_tokens, 2,
        "only the last 2 prompt tokens computed"
    );
    assert_eq!(run.cached_tokens[&2], 8, "pulled tokens count as cached");
    assert_eq!(run.tokens[&2], vec![40, 41]);
    assert_eq!(run.tokens[&1], vec![1, 2, 3, 4, 5, 6, 7, 8]);
    let s = e.stats();
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (3 + 10, 0));
}

#[test]
fn remote_prefill_pulls_only_what_the_local_cache_lacks() {
    let mut cfg = config(17, 4, 4, 64);
    cfg.kv_bytes_per_token = 1_000;
    cfg.kv_transfer_bandwidth = 1_000_000;
    let mut e = engine(cfg);
    let prompt: Vec<u32> = (0..13).collect();
    let mut run = Run::default();
    e.add_request(request(1, prompt[..5].to_vec(), vec![1]))
        .unwrap();
    run.drain(&mut e); // caches block 0
    e.add_request(with_transfer(
        request(2, prompt.clone(), vec![7]),
        KvTransfer::RemotePrefill { num_tokens: 12 },
    ))
    .unwrap();
    let t0 = run.now;
    assert!(run.step(&mut e).is_none(), "only a transfer in flight");
    // One local block hit; blocks 1 and 2 (8 tokens) come from the remote engine.
    assert_eq!(e.next_wakeup(), Some(t0 + 8_000_000));
    run.drain(&mut e);
    assert_eq!(run.cached_tokens[&2], 12);
    assert_eq!(run.tokens[&2], vec![7]);
    assert_eq!(e.stats().prefix_cache_hits, 4);
}

#[test]
fn a_remote_prefill_shorter_than_a_block_is_computed_locally() {
    let mut e = engine(config(17, 4, 4, 64));
    e.add_request(with_transfer(
        request(1, (0..6).collect(), vec![9]),
        KvTransfer::RemotePrefill { num_tokens: 3 },
    ))
    .unwrap();
    let out = e.step(0).unwrap();
    assert_eq!(out.shape.num_prefill_tokens, 6);
    assert_eq!(out.outputs[0].num_cached_tokens, Some(0));
}

/// Liveness: a preempted request queues behind a request holding received remote KV (vLLM
/// would put it first and, needing those blocks, never reach the holder).
#[test]
fn a_preempted_request_queues_behind_a_remote_kv_holder() {
    let mut cfg = config(7, 2, 1, 8); // 6 usable blocks, one running request at a time
    cfg.kv_bytes_per_token = 1_000;
    cfg.kv_transfer_bandwidth = 1_000_000_000;
    let mut e = engine(cfg);
    // Pulls 8 tokens (4 blocks), then needs a 5th block for its last prompt token.
    e.add_request(with_transfer(
        request(1, (0..9).collect(), vec![70]),
        KvTransfer::RemotePrefill { num_tokens: 8 },
    ))
    .unwrap();
    // Grows to 4 blocks: runs out while request 1 holds 4.
    e.add_request(request(2, vec![50, 51, 52], (60..66).collect()))
        .unwrap();
    let mut run = Run::default();
    run.drain(&mut e);
    let preempted: Vec<_> = run
        .steps
        .iter()
        .flat_map(|s| &s.outputs)
        .filter(|o| o.preempted)
        .map(|o| o.id)
        .collect();
    assert_eq!(
        preempted,
        vec![2],
        "only the growing request is preempted, once"
    );
    assert_eq!(run.cached_tokens[&1], 8);
    assert_eq!(run.tokens[&2], (60..66).collect::<Vec<_>>());
}

/// Liveness: when waiting requests hold received remote KV that none of them can complete
/// with, and nothing runs, they are preempted by recomputation; their blocks stay cached.
#[test]
fn remote_kv_holders_that_block_each_other_are_released() {
    let mut cfg = config(10, 2, 4, 64); // 9 usable blocks
    cfg.kv_bytes_per_token = 1_000;
    cfg.kv_transfer_bandwidth = 1_000_000_000;
    let mut e = engine(cfg);
    for id in 1..=2u64 {
        // Each pulls 4 blocks and needs 6 in all: 8 held, 1 free.
        let base = 100 * id as u32;
        e.add_request(with_transfer(
            request(id, (base..base + 12).collect(), vec![7]),
            KvTransfer::RemotePrefill { num_tokens: 8 },
        ))
        .unwrap();
    }
    assert!(e.step(0).is_none());
    assert_eq!(e.stats().used_blocks, 8);
    let mut run = Run {
        now: e.next_wakeup().unwrap(),
        ..Run::default()
    };
    let out = run.step(&mut e).unwrap();
    let released: Vec<_> = out
        .outputs
        .iter()
        .filter(|o| o.preempted)
        .map(|o| o.id)
        .collect();
    assert_eq!(released, vec![1, 2]);
    run.drain(&mut e);
    assert_eq!(e.stats().num_preemptions, 2);
    // Request 1 finds its pulled blocks in the cache again; making room for it evicted the
    // last-freed block of request 2, which finds 3 of its 4.
    assert_eq!(run.cached_tokens[&1], 8);
    assert_eq!(run.cached_tokens[&2], 6);
}

/// A remote prefill whose blocks cannot be allocated yet waits in the queue and still pulls
/// once they can be: being blocked does not turn it into a local prefill.
#[test]
fn a_remote_prefill_blocked_for_blocks_still_pulls_later() {
    // 8 usable blocks of 4 tokens; request 1 (28 + 4 tokens) ends up holding all of them.
    let mut e = engine(config(9, 4, 4, 64));
    e.add_request(request(1, (100..128).collect(), vec![1, 2, 3, 4]))
        .unwrap();
    let mut run = Run::default();
    run.step(&mut e).unwrap();
    e.add_request(with_transfer(
        request(2, (0..10).collect(), vec![40, 41]),
        KvTransfer::RemotePrefill { num_tokens: 100 },
    ))
    .unwrap();
    run.step(&mut e).unwrap();
    assert_eq!(e.stats().transferring, 0, "no blocks for the pull yet");
    run.drain(&mut e);
    assert_eq!(
        run.cached_tokens.get(&2),
        Some(&8),
        "the pulled 8 tokens count as cached"
    );
    assert_eq!(run.tokens[&2], vec![40, 41]);
}
