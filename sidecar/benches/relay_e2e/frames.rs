//! vLLM-format KV-event frames for the end-to-end relay bench: each frame is one engine step
//! (`requests` new requests of `blocks` blocks each, as one `BlockStored` per request with no
//! parent) plus, once the cache holds `cache_blocks`, the removal of the oldest step's blocks, so
//! the sidecar's resident set stays bounded as in a steady-state engine.
//!
//! Token ids are unique per (frame, request), so the key of a request's first block identifies
//! its frame: [`Frames::next`] returns it for the latency probe.
#![allow(unreachable_pub)]

use std::collections::VecDeque;

use kv_events::BlockKey;
use kv_events::engine::{
    BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, WireFormat, encode_batch,
};
use kv_events::key::{SaltStyle, request_block_keys};
use kv_events::tier::Medium;

/// Block size of the frames (tokens per block).
pub const BLOCK_SIZE: u32 = 16;

/// Generates frames.
pub struct Frames {
    model: String,
    requests: u32,
    blocks: u32,
    cache_blocks: usize,
    frame: u64,
    next_hash: u64,
    live: VecDeque<Vec<EngineHash>>,
    live_blocks: usize,
}

/// One encoded frame.
pub struct Frame {
    /// The msgpack `EventBatch` payload (the third ZMQ frame).
    pub payload: Vec<u8>,
    /// Block events in it: stored blocks plus removed blocks.
    pub block_events: u64,
    /// The kvgate key of the frame's first stored block (what the sidecar will publish).
    pub probe: BlockKey,
}

impl Frames {
    pub fn new(model: &str, requests: u32, blocks: u32, cache_blocks: usize) -> Frames {
        Frames {
            model: model.to_owned(),
            requests,
            blocks,
            cache_blocks,
            frame: 0,
            next_hash: 1,
            live: VecDeque::new(),
            live_blocks: 0,
        }
    }

    /// Block events a steady-state frame carries (stores and removals).
    pub fn steady_block_events(&self) -> u64 {
        2 * u64::from(self.requests * self.blocks)
    }

    /// The next frame.
    pub fn next(&mut self) -> Frame {
        let f = self.frame;
        self.frame += 1;
        let mut events = Vec::with_capacity(self.requests as usize + 1);
        let mut step_hashes = Vec::with_capacity((self.requests * self.blocks) as usize);
        let mut probe = None;
        let mut block_events = 0;
        for r in 0..self.requests {
            let tokens: Vec<u32> = (0..self.blocks * BLOCK_SIZE)
                .map(|i| match i {
                    0 => (f % 150_000) as u32,
                    1 => ((f / 150_000) % 150_000) as u32,
                    2 => r,
                    _ => (i * 7 + r * 13) % 150_000,
                })
                .collect();
            if probe.is_none() {
                probe = request_block_keys(
                    &self.model,
                    None,
                    SaltStyle::VllmExtraKey,
                    &tokens[..BLOCK_SIZE as usize],
                    BLOCK_SIZE as usize,
                )
                .first()
                .copied();
            }
            let hashes: Vec<EngineHash> = (0..self.blocks)
                .map(|_| {
                    self.next_hash += 1;
                    EngineHash(self.next_hash.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                })
                .collect();
            step_hashes.extend(hashes.iter().copied());
            block_events += u64::from(self.blocks);
            events.push(EngineEvent::BlockStored(BlockStored {
                block_hashes: hashes,
                token_ids: tokens,
                block_size: BLOCK_SIZE,
                medium: Some(Medium::Gpu),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..BlockStored::default()
            }));
        }
        self.live_blocks += step_hashes.len();
        self.live.push_back(step_hashes);
        while self.live_blocks > self.cache_blocks {
            let Some(old) = self.live.pop_front() else {
                break;
            };
            self.live_blocks -= old.len();
            block_events += old.len() as u64;
            events.push(EngineEvent::BlockRemoved(BlockRemoved {
                block_hashes: old,
                medium: Some(Medium::Gpu),
                group_idx: Some(0),
            }));
        }
        let payload = encode_batch(
            &EventBatch {
                ts: 1.7e9,
                events,
                dp_rank: Some(0),
            },
            WireFormat::VllmMap,
        );
        Frame {
            payload,
            block_events,
            probe: probe.unwrap_or(BlockKey(0)),
        }
    }
}
