//! One engine's event stream after sequencing: decoding and normalisation, as a pure state
//! machine. Sequence checking and gap repair are `engine_zmq`'s; the I/O loop feeds this the
//! frames that are in sequence and tells it when the stream was lost or restarted.

use kv_events::KvEvent;
use kv_events::engine::{Limits, decode_batch_with};
use kv_events::normalize::{Normalizer, NormalizerConfig};

/// What a frame did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Decoded; its normalised events are in the output.
    Applied,
    /// The payload did not decode; skipped (and counted).
    Undecodable,
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceStats {
    /// Frames applied.
    pub frames: u64,
    /// Payloads that failed to decode.
    pub undecodable: u64,
    /// Events the normaliser refused.
    pub rejected_events: u64,
}

/// One engine stream's state.
#[derive(Debug)]
pub struct SourceState {
    normalizer: Normalizer,
    limits: Limits,
    stats: SourceStats,
}

impl SourceState {
    /// A stream of an engine serving `model` with `block_size`.
    pub fn new(model: &str, block_size: u32) -> Self {
        Self {
            normalizer: Normalizer::new(NormalizerConfig::new(model, block_size)),
            limits: Limits::default(),
            stats: SourceStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> SourceStats {
        self.stats
    }

    /// Forgets everything (after the caller dropped the source's index entries).
    pub fn reset(&mut self) {
        self.normalizer.reset();
    }

    /// Decodes and normalises an in-sequence frame; events are appended to `out`.
    pub fn apply(&mut self, seq: u64, payload: &[u8], out: &mut Vec<KvEvent>) -> Outcome {
        let batch = match decode_batch_with(payload, &self.limits) {
            Ok(b) => b,
            Err(e) => {
                self.stats.undecodable += 1;
                tracing::warn!(seq, error = %e, "undecodable KV-event batch skipped");
                return Outcome::Undecodable;
            }
        };
        for event in &batch.events {
            if let Err(e) = self.normalizer.apply(event, out) {
                self.stats.rejected_events += 1;
                tracing::debug!(seq, error = %e, "KV event not applied");
            }
        }
        self.stats.frames += 1;
        Outcome::Applied
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kv_events::engine::{BlockStored, EngineEvent, EngineHash, EventBatch, WireFormat};

    #[test]
    fn applies_decodable_frames_and_counts_the_rest() {
        let mut s = SourceState::new("m", 2);
        let batch = EventBatch {
            ts: 0.0,
            events: vec![EngineEvent::BlockStored(BlockStored {
                block_hashes: vec![EngineHash(1)],
                token_ids: vec![1, 2],
                block_size: 2,
                ..BlockStored::default()
            })],
            dp_rank: None,
        };
        let payload = kv_events::engine::encode_batch(&batch, WireFormat::VllmMap);
        let mut out = Vec::new();
        assert_eq!(s.apply(0, &payload, &mut out), Outcome::Applied);
        assert_eq!(out.len(), 1);
        assert_eq!(s.apply(1, b"\xc1", &mut out), Outcome::Undecodable);
        assert_eq!(s.stats().undecodable, 1);
        assert_eq!(s.stats().frames, 1);
    }
}
