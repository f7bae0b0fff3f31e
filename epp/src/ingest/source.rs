//! One engine's event stream, as a pure state machine: sequence checking, decoding and
//! normalisation. The I/O loop feeds it frames and acts on what it reports (replay, reset).

use kv_events::KvEvent;
use kv_events::engine::{Limits, decode_batch_with};
use kv_events::normalize::{Normalizer, NormalizerConfig};

/// What a frame did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// In sequence; its events are in the output.
    Applied,
    /// Frames `from..got` were missed; this frame was NOT applied. Replay from `from`, or reset.
    Gap {
        /// First missing seq.
        from: u64,
        /// This frame's seq.
        got: u64,
    },
    /// The seq went backwards: the engine restarted (its cache is empty). The caller drops the
    /// source's index entries; this frame was then applied as the first of a new stream.
    Restarted,
    /// Already seen (a replay overlapping the live stream); ignored.
    Duplicate,
    /// The payload did not decode; skipped (and counted).
    Undecodable,
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceStats {
    /// Frames applied.
    pub frames: u64,
    /// Gaps detected.
    pub gaps: u64,
    /// Restarts detected.
    pub restarts: u64,
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
    next: Option<u64>,
    stats: SourceStats,
}

impl SourceState {
    /// A stream of an engine serving `model` with `block_size`.
    pub fn new(model: &str, block_size: u32) -> Self {
        Self {
            normalizer: Normalizer::new(NormalizerConfig::new(model, block_size)),
            limits: Limits::default(),
            next: None,
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
        self.next = None;
    }

    /// The seq expected next, once known.
    pub fn expected(&self) -> Option<u64> {
        self.next
    }

    /// Accepts the stream from `seq` on without a gap (after a failed replay and a reset).
    pub fn resync_at(&mut self, seq: u64) {
        self.next = Some(seq);
    }

    /// Feeds a live frame; normalised events are appended to `out` when it is applied.
    pub fn on_live(&mut self, seq: u64, payload: &[u8], out: &mut Vec<KvEvent>) -> Outcome {
        match self.next {
            Some(next) if seq > next => {
                self.stats.gaps += 1;
                return Outcome::Gap {
                    from: next,
                    got: seq,
                };
            }
            Some(next) if seq < next && seq == 0 => {
                self.stats.restarts += 1;
                self.reset();
                self.apply(seq, payload, out);
                return Outcome::Restarted;
            }
            Some(next) if seq < next => return Outcome::Duplicate,
            _ => {}
        }
        self.apply(seq, payload, out)
    }

    /// Feeds a replayed frame (older ones than expected are ignored).
    pub fn on_replay(&mut self, seq: u64, payload: &[u8], out: &mut Vec<KvEvent>) -> Outcome {
        match self.next {
            Some(next) if seq < next => Outcome::Duplicate,
            Some(next) if seq > next => Outcome::Gap {
                from: next,
                got: seq,
            },
            _ => self.apply(seq, payload, out),
        }
    }

    fn apply(&mut self, seq: u64, payload: &[u8], out: &mut Vec<KvEvent>) -> Outcome {
        self.next = Some(seq.saturating_add(1));
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
