//! One data-parallel rank's bridge, as a pure state machine: engine payloads in, sealed kvgate
//! envelopes out, and the resident set those envelopes add up to.
//!
//! - Payloads are decoded and normalised into a pending batch; [`RankBridge::due`] says when
//!   the batch must be sealed (size or age), the I/O edge also seals whenever the engine socket
//!   has nothing more waiting, so an idle stream never holds events back.
//! - Sealing stamps the batch with the epoch and the next seq (contiguous from 0) and applies
//!   it to the resident set, so a snapshot taken at any time is exactly the effect of the
//!   envelopes with `seq < next_seq`.
//! - A lost stream (a gap replay could not cover, or an engine restart) publishes `Cleared`;
//!   an envelope that could not be queued for NATS starts a new epoch, which receivers answer
//!   with a snapshot request; its first envelope (empty if need be) announces it.

use std::time::{Duration, Instant};

use kv_events::engine::{DecodeError, Limits, decode_batch_with};
use kv_events::envelope::ENVELOPE_VERSION;
use kv_events::normalize::{NormalizeError, NormalizeStats};
use kv_events::snapshot::Snapshot;
use kv_events::{Envelope, KvEvent, Normalizer, NormalizerConfig, Source};

use super::resident::ResidentSet;

/// When a pending batch is sealed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Most block keys in one envelope (a larger event is split).
    pub max_keys: usize,
    /// Most events in one envelope.
    pub max_events: usize,
    /// Longest a received event waits in the batch.
    pub max_delay: Duration,
}

impl Default for BatchLimits {
    fn default() -> Self {
        Self {
            max_keys: 4096,
            max_events: 1024,
            max_delay: Duration::from_millis(5),
        }
    }
}

/// Counters, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankStats {
    /// Engine events decoded.
    pub engine_events: u64,
    /// Engine blocks those events concerned.
    pub engine_blocks: u64,
    /// kvgate events sealed into envelopes.
    pub kv_events: u64,
    /// Envelopes sealed.
    pub envelopes: u64,
    /// Payloads that did not decode.
    pub undecodable: u64,
    /// Engine events the normaliser refused.
    pub rejected: u64,
    /// Epochs started after the first (drops and NATS reconnects).
    pub new_epochs: u64,
    /// Streams lost (unrepairable gaps and engine restarts).
    pub lost: u64,
}

/// An envelope ready to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    /// The envelope.
    pub envelope: Envelope,
    /// When the oldest of its events was received (for relay latency).
    pub oldest: Option<Instant>,
}

/// One rank's bridge state.
#[derive(Debug)]
pub struct RankBridge {
    source: Source,
    epoch: u64,
    next_seq: u64,
    normalizer: Normalizer,
    decode_limits: Limits,
    limits: BatchLimits,
    resident: ResidentSet,
    pending: Vec<KvEvent>,
    pending_keys: usize,
    oldest: Option<Instant>,
    announce: bool,
    scratch: Vec<KvEvent>,
    ready: Vec<Sealed>,
    stats: RankStats,
}

impl RankBridge {
    /// A bridge for `source` starting at `epoch`, seq 0.
    pub fn new(
        source: Source,
        normalizer: NormalizerConfig,
        limits: BatchLimits,
        epoch: u64,
    ) -> Self {
        Self {
            source,
            epoch,
            next_seq: 0,
            normalizer: Normalizer::new(normalizer),
            decode_limits: Limits::default(),
            limits: BatchLimits {
                max_keys: limits.max_keys.max(1),
                max_events: limits.max_events.max(1),
                ..limits
            },
            resident: ResidentSet::new(),
            pending: Vec::new(),
            pending_keys: 0,
            oldest: None,
            announce: false,
            scratch: Vec::new(),
            ready: Vec::new(),
            stats: RankStats::default(),
        }
    }

    /// The source envelopes are stamped with.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The seq the next envelope gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Counters.
    pub fn stats(&self) -> RankStats {
        self.stats
    }

    /// The normaliser's counters.
    pub fn normalize_stats(&self) -> NormalizeStats {
        self.normalizer.stats()
    }

    /// The resident set of the envelopes sealed so far.
    pub fn resident(&self) -> &ResidentSet {
        &self.resident
    }

    /// kvgate events waiting to be sealed.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Decodes and normalises one engine payload received at `received` into the batch.
    /// Events the normaliser refuses are skipped and counted (the rest still apply); the last
    /// refusal is returned for logging.
    pub fn ingest(
        &mut self,
        payload: &[u8],
        received: Instant,
    ) -> Result<Option<NormalizeError>, DecodeError> {
        let batch = match decode_batch_with(payload, &self.decode_limits) {
            Ok(b) => b,
            Err(e) => {
                self.stats.undecodable += 1;
                return Err(e);
            }
        };
        let mut refused = None;
        let mut out = std::mem::take(&mut self.scratch);
        for event in &batch.events {
            self.stats.engine_events += 1;
            self.stats.engine_blocks += event.block_count() as u64;
            out.clear();
            if let Err(e) = self.normalizer.apply(event, &mut out) {
                self.stats.rejected += 1;
                refused = Some(e);
            }
            for ev in out.drain(..) {
                self.push(ev, received);
            }
        }
        self.scratch = out;
        Ok(refused)
    }

    /// The stream lost frames that cannot be recovered, or the engine restarted: forget the
    /// engine's hashes and tell receivers every tier is empty.
    pub fn lose(&mut self, now: Instant) {
        self.stats.lost += 1;
        self.normalizer.reset();
        self.push(KvEvent::Cleared { tier: None }, now);
    }

    /// Whether the batch must be sealed now (its oldest event has waited long enough, or it
    /// is full).
    pub fn due(&self, now: Instant) -> bool {
        self.pending_keys >= self.limits.max_keys
            || self.pending.len() >= self.limits.max_events
            || self
                .oldest
                .is_some_and(|t| now.saturating_duration_since(t) >= self.limits.max_delay)
    }

    /// Seals the batch (or an empty announcement of a new epoch) into an envelope, applying it
    /// to the resident set; [`RankBridge::take_sealed`] hands it out. Batches that would
    /// overflow [`BatchLimits`] are sealed as events arrive.
    pub fn seal(&mut self) {
        if self.pending.is_empty() && !self.announce {
            return;
        }
        let events = std::mem::take(&mut self.pending);
        for ev in &events {
            self.resident.apply(ev);
        }
        let envelope = Envelope {
            v: ENVELOPE_VERSION,
            source: self.source.clone(),
            epoch: self.epoch,
            seq: self.next_seq,
            events,
        };
        self.next_seq += 1;
        self.announce = false;
        self.pending_keys = 0;
        self.stats.envelopes += 1;
        self.stats.kv_events += envelope.events.len() as u64;
        self.ready.push(Sealed {
            envelope,
            oldest: self.oldest.take(),
        });
    }

    /// Starts epoch `epoch` at seq 0 (a sealed envelope could not be sent, or NATS came back):
    /// the resident set stays, receivers fetch it as a snapshot, and the next seal announces
    /// the epoch even if no event is pending.
    pub fn new_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.next_seq = 0;
        self.announce = true;
        self.stats.new_epochs += 1;
    }

    /// The resident set as of the envelopes sealed so far, stamped with (epoch, next_seq).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            source: self.source.clone(),
            epoch: self.epoch,
            next_seq: self.next_seq,
            tiers: self.resident.to_tier_keys(),
        }
    }

    /// Adds an event to the batch, splitting one larger than an envelope's key bound.
    fn push(&mut self, event: KvEvent, received: Instant) {
        self.oldest.get_or_insert(received);
        let max = self.limits.max_keys;
        match event {
            KvEvent::Stored {
                keys,
                parent,
                tier,
                lora,
                token_count,
            } if keys.len() > max => {
                let blocks = keys.len();
                let mut parent = parent;
                for part in keys.chunks(max) {
                    let share = u64::from(token_count) * part.len() as u64 / blocks as u64;
                    self.push_one(KvEvent::Stored {
                        keys: part.to_vec(),
                        parent,
                        tier,
                        lora: lora.clone(),
                        token_count: u32::try_from(share).unwrap_or(u32::MAX),
                    });
                    parent = part.last().copied().or(parent);
                }
            }
            KvEvent::Removed { keys, tier } if keys.len() > max => {
                for part in keys.chunks(max) {
                    self.push_one(KvEvent::Removed {
                        keys: part.to_vec(),
                        tier,
                    });
                }
            }
            other => self.push_one(other),
        }
    }

    /// Adds one event, first sealing the batch if the event would overflow it.
    fn push_one(&mut self, event: KvEvent) {
        let keys = event.key_count();
        if !self.pending.is_empty()
            && (self.pending_keys + keys > self.limits.max_keys
                || self.pending.len() >= self.limits.max_events)
        {
            let oldest = self.oldest;
            self.seal();
            self.oldest = oldest;
        }
        self.pending_keys += keys;
        self.pending.push(event);
    }

    /// Moves the envelopes sealed so far into `out`, in seq order.
    pub fn take_sealed(&mut self, out: &mut Vec<Sealed>) {
        out.append(&mut self.ready);
    }
}
