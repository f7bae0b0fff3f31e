//! Step time never falls when the load grows: in the cost model for any batch, and in the
//! engine when one more request joins the same workload.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use engine_model::{BatchShape, Engine, NewRequest, Preset, XxhChain};
use proptest::prelude::*;

/// (cached context, new tokens, decode?) per sequence.
type Seq = (u64, u64, bool);

fn seqs() -> impl Strategy<Value = Vec<Seq>> {
    prop::collection::vec((0..200_000u64, 1..20_000u64, any::<bool>()), 0..64)
}

fn shape(seqs: &[Seq]) -> BatchShape {
    let mut s = BatchShape::default();
    for &(cached, new, decode) in seqs {
        let new = if decode { 1 } else { new };
        s.add_seq(cached, new, decode, true);
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn adding_a_sequence_never_shortens_a_step(base in seqs(), extra in seqs()) {
        for p in Preset::ALL {
            let c = p.config();
            let small = c.cost.duration(&shape(&base), c.kv_bytes_per_token);
            let mut all = base.clone();
            all.extend(&extra);
            let big = c.cost.duration(&shape(&all), c.kv_bytes_per_token);
            prop_assert!(big >= small, "{p}: {big} < {small}");
        }
    }

    #[test]
    fn more_tokens_or_context_never_shorten_a_step(
        base in seqs(),
        i in any::<prop::sample::Index>(),
        more_new in 0..5_000u64,
        more_cached in 0..50_000u64,
    ) {
        prop_assume!(!base.is_empty());
        let mut grown = base.clone();
        let seq = &mut grown[i.index(base.len())];
        seq.1 += more_new;
        seq.0 += more_cached;
        for p in Preset::ALL {
            let c = p.config();
            let before = c.cost.duration(&shape(&base), c.kv_bytes_per_token);
            let after = c.cost.duration(&shape(&grown), c.kv_bytes_per_token);
            prop_assert!(after >= before, "{p}: {after} < {before}");
        }
    }

}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// The same requests plus one more, on fresh engines: the extra request (FCFS, last) only
    /// adds work to the first step.
    #[test]
    fn one_more_request_never_makes_the_first_step_faster(
        prompts in prop::collection::vec(1..3_000usize, 1..40),
        extra in 1..3_000usize,
        preset in prop::sample::select(Preset::ALL.to_vec()),
    ) {
        let first_step = |n: &[usize]| {
            let mut e = Engine::new(preset.config()).unwrap();
            for (id, &len) in n.iter().enumerate() {
                e.add_request(NewRequest {
                    id: id as u64,
                    prompt: (0..len as u32).map(|t| t + 10 * id as u32).collect(),
                    output: vec![1],
                    hasher: Box::new(XxhChain::new(id as u64)),
                    arrival: 0,
                    kv_transfer: None,
                })
                .unwrap();
            }
            e.step(0).unwrap().duration
        };
        let mut more = prompts.clone();
        more.push(extra);
        prop_assert!(first_step(&more) >= first_step(&prompts));
    }
}

#[test]
fn an_empty_batch_costs_nothing_and_any_batch_costs_the_overhead() {
    for p in Preset::ALL {
        let c = p.config();
        assert_eq!(
            c.cost
                .duration(&BatchShape::default(), c.kv_bytes_per_token),
            0
        );
        let one = shape(&[(0, 1, true)]);
        assert!(c.cost.duration(&one, c.kv_bytes_per_token) > c.cost.step_overhead_ns);
    }
}

/// The `free_prefill` analysis knob: a prompt's chunk costs nothing beyond the step itself, and
/// decode steps cost what they always do.
#[test]
fn free_prefill_costs_prompts_nothing_and_leaves_decode_alone() {
    for p in Preset::ALL {
        // (first step, second step) of one request of `len` prompt tokens and two outputs.
        let steps = |free: bool, len: u32| {
            let mut config = p.config();
            config.free_prefill = free;
            let mut e = Engine::new(config).unwrap();
            e.add_request(NewRequest {
                id: 1,
                prompt: (0..len).map(|t| t + 10).collect(),
                output: vec![1, 2],
                hasher: Box::new(XxhChain::new(1)),
                arrival: 0,
                kv_transfer: None,
            })
            .unwrap();
            let first = e.step(0).unwrap().duration;
            let second = e.step(first).unwrap().duration;
            (first, second)
        };
        let (long, long_decode) = steps(false, 512);
        let (short, _) = steps(false, 16);
        assert!(
            long > short,
            "{p}: a long prompt costs more ({long} vs {short})"
        );
        let (free_long, free_decode) = steps(true, 512);
        let (free_short, _) = steps(true, 16);
        assert_eq!(free_long, free_short, "{p}");
        assert!(free_long <= short, "{p}");
        assert_eq!(free_decode, long_decode, "{p}: decode is unchanged");
    }
}
