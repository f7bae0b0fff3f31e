//! The v1 scheduler: chunked prefill, the token budget, max_num_seqs, preemption by
//! recomputation, admission, abort, arrivals.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;

use common::{Run, config, engine, request};
use engine_model::{AdmitError, FinishReason, KvTransfer};

#[test]
fn a_long_prompt_is_prefilled_in_budget_sized_chunks_and_only_the_last_emits() {
    let mut e = engine(config(65, 4, 4, 8));
    e.add_request(request(1, (0..20).collect(), vec![1, 2]))
        .unwrap();
    let mut run = Run::default();
    run.drain(&mut e);
    let chunks: Vec<u64> = run
        .steps
        .iter()
        .map(|s| s.shape.num_prefill_tokens)
        .collect();
    assert_eq!(chunks, vec![8, 8, 4, 0]);
    assert_eq!(run.steps[3].shape.num_decode_tokens, 1);
    assert!(run.steps[0].outputs.is_empty() && run.steps[1].outputs.is_empty());
    let first = &run.steps[2].outputs[0];
    assert_eq!(
        (first.new_tokens.clone(), first.num_cached_tokens),
        (vec![1], Some(0))
    );
    let last = &run.steps[3].outputs[0];
    assert_eq!(last.finished, Some(FinishReason::Length));
    assert_eq!(last.num_cached_tokens, None);
}

#[test]
fn long_prefill_token_threshold_caps_each_chunk() {
    let mut cfg = config(65, 4, 4, 64);
    cfg.long_prefill_token_threshold = 5;
    let mut e = engine(cfg);
    e.add_request(request(1, (0..20).collect(), vec![1]))
        .unwrap();
    let mut run = Run::default();
    run.drain(&mut e);
    let chunks: Vec<u64> = run
        .steps
        .iter()
        .map(|s| s.shape.num_prefill_tokens)
        .collect();
    assert_eq!(chunks, vec![5, 5, 5, 5]);
}

#[test]
fn running_decodes_go_first_and_new_prefills_take_what_is_left() {
    let mut e = engine(config(65, 4, 4, 8));
    e.add_request(request(1, vec![1, 2, 3], vec![10, 11, 12]))
        .unwrap();
    let mut run = Run::default();
    run.step(&mut e).unwrap();
    e.add_request(request(2, (0..20).collect(), vec![20]))
        .unwrap();
    let s = run.step(&mut e).unwrap().shape;
    assert_eq!((s.num_decode_tokens, s.num_prefill_tokens), (1, 7));
    assert_eq!(
        (s.num_decode_seqs, s.num_prefill_seqs, s.num_sampled),
        (1, 1, 1)
    );
    run.drain(&mut e);
    assert_eq!(run.tokens[&1], vec![10, 11, 12]);
    assert_eq!(run.tokens[&2], vec![20]);
}

#[test]
fn max_num_seqs_caps_the_running_set() {
    let mut e = engine(config(65, 4, 2, 64));
    for id in 1..=3 {
        e.add_request(request(id, vec![id as u32; 5], vec![1, 2, 3]))
            .unwrap();
    }
    let mut run = Run::default();
    run.step(&mut e).unwrap();
    let s = e.stats();
    assert_eq!((s.running, s.waiting), (2, 1));
    run.drain(&mut e);
    for id in 1..=3 {
        assert_eq!(run.tokens[&id], vec![1, 2, 3]);
    }
}

#[test]
fn out_of_blocks_the_last_running_request_is_preempted_and_recomputed() {
    // 4 usable blocks of 2 tokens; each request grows to 3 blocks.
    let mut e = engine(config(5, 2, 4, 64));
    e.add_request(request(1, vec![1, 2, 3], vec![11, 12, 13, 14]))
        .unwrap();
    e.add_request(request(2, vec![4, 5, 6], vec![21, 22, 23, 24]))
        .unwrap();
    let mut run = Run::default();
    run.step(&mut e).unwrap();
    run.step(&mut e).unwrap();
    let third = run.step(&mut e).unwrap();
    // Request 1 needs a third block: request 2, last in the running list, is preempted.
    let preempted: Vec<_> = third.outputs.iter().filter(|o| o.preempted).collect();
    assert_eq!(preempted.len(), 1);
    assert_eq!(preempted[0].id, 2);
    assert!(preempted[0].new_tokens.is_empty());
    assert_eq!(third.outputs[0].id, 2, "preemptions are reported first");
    assert_eq!(third.shape.num_seqs, 1);
    let s = e.stats();
    assert_eq!((s.num_preemptions, s.running, s.waiting), (1, 1, 1));

    run.drain(&mut e);
    assert_eq!(run.tokens[&1], vec![11, 12, 13, 14]);
    assert_eq!(
        run.tokens[&2],
        vec![21, 22, 23, 24],
        "no token lost or repeated"
    );
    let s = e.stats();
    // First lookups only; the preempted request's two later lookups (blocked once, then
    // admitted; none in the step that preempted it) are counted apart, as vLLM ≥ 0.11 does.
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (6, 0));
    assert_eq!(
        (
            s.preempted_prefix_cache_queries,
            s.preempted_prefix_cache_hits
        ),
        (10, 4)
    );
    assert_eq!(s.generation_tokens, 8);
    assert_eq!(s.prompt_tokens, 6);
}

#[test]
fn admission_errors_are_typed_and_change_nothing() {
    let mut e = engine(config(17, 4, 4, 64)); // max_model_len 64
    assert_eq!(
        e.add_request(request(1, vec![], vec![1])),
        Err(AdmitError::EmptyPrompt(1))
    );
    assert_eq!(
        e.add_request(request(1, vec![1], vec![])),
        Err(AdmitError::EmptyOutput(1))
    );
    let too_long = e
        .add_request(request(1, vec![0; 60], vec![0; 5]))
        .unwrap_err();
    assert_eq!(too_long.metric_label(), "too_long");
    assert_eq!(e.stats().waiting, 0);
    assert!(!e.has_unfinished());
    // A prefill-only request generates one token whatever its output.
    let mut r = request(1, vec![0; 63], vec![0; 5]);
    r.kv_transfer = Some(KvTransfer::PrefillOnly);
    e.add_request(r).unwrap();
    assert_eq!(
        e.add_request(request(1, vec![1], vec![1])),
        Err(AdmitError::Duplicate(1))
    );
    assert_eq!(e.stats().waiting, 1);
}

#[test]
fn abort_frees_blocks_keeps_full_blocks_cached_and_silences_the_request() {
    let mut e = engine(config(17, 4, 4, 64));
    e.add_request(request(1, (0..9).collect(), vec![1, 2, 3]))
        .unwrap();
    e.add_request(request(2, (100..105).collect(), vec![1, 2]))
        .unwrap();
    e.add_request(request(3, (200..205).collect(), vec![1]))
        .unwrap();
    let mut run = Run::default();
    run.step(&mut e).unwrap();
    assert!(e.stats().used_blocks > 0);
    assert!(e.abort(1));
    assert!(!e.abort(1));
    assert!(!e.abort(99));
    e.check_invariants().unwrap();
    // Request 1's two full blocks stay cached; requests 2 and 3 hold one each.
    assert_eq!(e.stats().cached_blocks, 4);
    run.drain(&mut e);
    assert!(
        run.steps
            .iter()
            .skip(1)
            .all(|s| s.outputs.iter().all(|o| o.id != 1))
    );
    assert_eq!(run.tokens[&2], vec![1, 2]);
    let s = e.stats();
    assert_eq!((s.used_blocks, s.free_blocks, s.total_blocks), (0, 16, 16));
    assert_eq!(s.kv_usage, 0.0);
}

#[test]
fn idle_engine_steps_to_none_and_future_arrivals_wake_it() {
    let mut e = engine(config(17, 4, 4, 64));
    assert!(e.step(0).is_none());
    assert_eq!(e.next_wakeup(), None);
    let mut r = request(1, vec![1, 2, 3], vec![4]);
    r.arrival = 5_000_000;
    e.add_request(r).unwrap();
    assert!(e.step(1_000_000).is_none());
    assert_eq!(e.next_wakeup(), Some(5_000_000));
    let out = e.step(5_000_000).unwrap();
    assert_eq!(out.outputs[0].new_tokens, vec![4]);
    assert!(out.duration > 0);
    assert!(!e.has_unfinished());
}

#[test]
fn kv_usage_counts_blocks_held_by_requests_only() {
    let mut e = engine(config(11, 4, 4, 64)); // 10 usable blocks
    e.add_request(request(1, (0..10).collect(), vec![1, 2]))
        .unwrap();
    let mut run = Run::default();
    run.step(&mut e).unwrap();
    let s = e.stats();
    assert_eq!(s.used_blocks, 3);
    assert!((s.kv_usage - 0.3).abs() < 1e-9);
    run.drain(&mut e);
    let s = e.stats();
    assert_eq!((s.kv_usage, s.cached_blocks), (0.0, 2));
}
