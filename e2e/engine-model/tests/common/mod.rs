//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;

use engine_model::{
    CacheEvent, Engine, EngineConfig, KvTransfer, Nanos, NewRequest, Preset, RequestId, StepOutput,
    XxhChain,
};

/// A tiny engine: `blocks` blocks (null block included) of `block_size` tokens, the `small`
/// preset's cost model.
pub(crate) fn config(blocks: u32, block_size: u32, max_num_seqs: u32, budget: u32) -> EngineConfig {
    let mut c = Preset::Small.config();
    c.num_gpu_blocks = blocks;
    c.block_size = block_size;
    c.max_num_seqs = max_num_seqs;
    c.max_num_batched_tokens = budget;
    c.max_model_len = (blocks - 1) * block_size;
    c
}

pub(crate) fn engine(config: EngineConfig) -> Engine {
    Engine::new(config).expect("valid config")
}

pub(crate) fn request(id: RequestId, prompt: Vec<u32>, output: Vec<u32>) -> NewRequest {
    NewRequest {
        id,
        prompt,
        output,
        hasher: Box::new(XxhChain::new(0)),
        arrival: 0,
        kv_transfer: None,
    }
}

pub(crate) fn with_transfer(mut req: NewRequest, t: KvTransfer) -> NewRequest {
    req.kv_transfer = Some(t);
    req
}

/// The hashes XxhChain(0) gives the full blocks of `tokens`.
pub(crate) fn hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    use engine_model::BlockHashChain;
    let mut c = XxhChain::new(0);
    tokens
        .chunks_exact(block_size)
        .map(|b| c.next_block(b))
        .collect()
}

/// Everything a run produced.
#[derive(Debug, Default)]
pub(crate) struct Run {
    pub(crate) now: Nanos,
    pub(crate) steps: Vec<StepOutput>,
    pub(crate) tokens: HashMap<RequestId, Vec<u32>>,
    pub(crate) cached_tokens: HashMap<RequestId, u32>,
    pub(crate) events: Vec<CacheEvent>,
}

impl Run {
    /// Steps once at the current time; records what came out.
    pub(crate) fn step(&mut self, engine: &mut Engine) -> Option<StepOutput> {
        let out = engine.step(self.now)?;
        self.now += out.duration;
        self.record(&out);
        self.steps.push(out.clone());
        Some(out)
    }

    pub(crate) fn record(&mut self, out: &StepOutput) {
        for o in &out.outputs {
            self.tokens
                .entry(o.id)
                .or_default()
                .extend(o.new_tokens.iter().copied());
            if let Some(n) = o.num_cached_tokens {
                assert!(
                    self.cached_tokens.insert(o.id, n).is_none(),
                    "request {} reported num_cached_tokens twice",
                    o.id
                );
            }
        }
        self.events.extend(out.events.iter().cloned());
    }

    /// Steps (waking for transfers and arrivals) until nothing is unfinished.
    pub(crate) fn drain(&mut self, engine: &mut Engine) {
        for _ in 0..100_000 {
            if self.step(engine).is_some() {
                continue;
            }
            self.events.extend(engine.take_events());
            match engine.next_wakeup() {
                Some(t) => self.now = self.now.max(t),
                None => break,
            }
        }
        assert!(
            !engine.has_unfinished(),
            "engine stalled with unfinished requests"
        );
        engine.check_invariants().expect("invariants");
    }

    pub(crate) fn stored(&self) -> Vec<&CacheEvent> {
        self.events
            .iter()
            .filter(|e| matches!(e, CacheEvent::Stored { .. }))
            .collect()
    }

    pub(crate) fn removed_hashes(&self) -> Vec<u64> {
        self.events
            .iter()
            .filter_map(|e| match e {
                CacheEvent::Removed { hashes } => {
                    assert_eq!(hashes.len(), 1, "one Removed per evicted block");
                    hashes.first().copied()
                }
                _ => None,
            })
            .collect()
    }
}
