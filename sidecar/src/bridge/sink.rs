//! The I/O edge of one rank's bridge: `engine_zmq` hands it in-sequence frames on the rank's
//! receive thread; it feeds the [`RankBridge`], encodes sealed envelopes and queues them for the
//! NATS publisher without ever blocking. A full queue (NATS slow or away) drops the envelope and
//! starts a new epoch, so memory stays bounded and receivers resynchronise from a snapshot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use bytes::Bytes;
use engine_zmq::{Frame, FrameSink};
use kv_events::frame::FrameError;
use tokio::sync::mpsc;

use super::epoch::random_epoch;
use super::rank::{RankBridge, Sealed};
use crate::metrics::Metrics;

/// One encoded envelope on its way to NATS.
#[derive(Debug)]
pub struct Outgoing {
    /// The encoded envelope.
    pub payload: Bytes,
    /// When its oldest event was received from the engine.
    pub oldest: Option<Instant>,
    /// The envelope's rank (for logs).
    pub dp_rank: u32,
}

/// A rank's bridge shared between its receive thread and the snapshot responder.
pub type SharedRank = Arc<Mutex<RankBridge>>;

/// Locks a rank, recovering from a poisoned lock (the state is updated atomically per call).
pub fn lock(rank: &SharedRank) -> MutexGuard<'_, RankBridge> {
    rank.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The frame sink of one rank.
#[derive(Debug)]
pub struct BridgeSink {
    rank: SharedRank,
    dp_rank: u32,
    tx: mpsc::Sender<Outgoing>,
    metrics: Arc<Metrics>,
    /// Bumped by the NATS watcher on each reconnect; a change starts a new epoch.
    resync: Arc<AtomicU64>,
    resync_seen: u64,
    dropping: bool,
    sealed: Vec<Sealed>,
}

impl BridgeSink {
    /// A sink feeding `rank` and queueing on `tx`.
    pub fn new(
        rank: SharedRank,
        tx: mpsc::Sender<Outgoing>,
        metrics: Arc<Metrics>,
        resync: Arc<AtomicU64>,
    ) -> Self {
        let dp_rank = lock(&rank).source().dp_rank;
        let resync_seen = resync.load(Ordering::Relaxed);
        Self {
            rank,
            dp_rank,
            tx,
            metrics,
            resync,
            resync_seen,
            dropping: false,
            sealed: Vec::new(),
        }
    }

    /// Runs `f` on the locked bridge, counts what its counters gained (sealing included: the
    /// events out are counted when an envelope is sealed), then queues whatever it sealed.
    fn with_rank(&mut self, f: impl FnOnce(&mut RankBridge)) {
        {
            let mut rank = lock(&self.rank);
            let before = rank.stats();
            let generation = self.resync.load(Ordering::Relaxed);
            if generation != self.resync_seen {
                self.resync_seen = generation;
                rank.seal();
                rank.new_epoch(random_epoch());
                self.metrics.resyncs.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    dp_rank = self.dp_rank,
                    epoch = rank.epoch(),
                    "NATS reconnected: new epoch"
                );
            }
            f(&mut rank);
            self.metrics.add_rank_delta(&before, &rank.stats());
            rank.take_sealed(&mut self.sealed);
        }
        self.send_sealed();
    }

    fn send_sealed(&mut self) {
        let mut drop_from = None;
        for sealed in self.sealed.drain(..) {
            if drop_from.is_some() {
                self.metrics.drops.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let payload = match sealed.envelope.encode() {
                Ok(p) => Bytes::from(p),
                Err(e) => {
                    tracing::error!(error = %e, "envelope encoding failed");
                    drop_from = Some(sealed.envelope.seq);
                    self.metrics.drops.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let out = Outgoing {
                payload,
                oldest: sealed.oldest,
                dp_rank: self.dp_rank,
            };
            match self.tx.try_send(out) {
                Ok(()) => {
                    self.metrics
                        .envelopes_queued
                        .fetch_add(1, Ordering::Relaxed);
                    if self.dropping {
                        self.dropping = false;
                        tracing::info!(dp_rank = self.dp_rank, "NATS publish queue has room again");
                    }
                }
                Err(_) => {
                    self.metrics.drops.fetch_add(1, Ordering::Relaxed);
                    drop_from = Some(sealed.envelope.seq);
                }
            }
        }
        if let Some(seq) = drop_from {
            let epoch = random_epoch();
            lock(&self.rank).new_epoch(epoch);
            self.metrics.resyncs.fetch_add(1, Ordering::Relaxed);
            if !self.dropping {
                self.dropping = true;
                tracing::warn!(
                    dp_rank = self.dp_rank,
                    seq,
                    new_epoch = epoch,
                    "NATS publish queue full: envelopes dropped, receivers will resynchronise on a new epoch"
                );
            }
        }
    }
}

impl FrameSink for BridgeSink {
    fn frame(&mut self, frame: Frame<'_>) {
        self.metrics.frames_in.fetch_add(1, Ordering::Relaxed);
        self.with_rank(|rank| {
            match rank.ingest(frame.payload, frame.received) {
                Ok(Some(e)) => tracing::debug!(seq = frame.seq, error = %e, "engine event not normalised"),
                Ok(None) => {}
                Err(e) => tracing::warn!(seq = frame.seq, error = %e, "undecodable KV-event batch skipped"),
            }
            if rank.due(Instant::now()) {
                rank.seal();
            }
        });
    }

    fn gap(&mut self, _from: u64, _got: u64) {
        self.metrics.gaps.fetch_add(1, Ordering::Relaxed);
    }

    fn repaired(&mut self, _from: u64, _got: u64) {
        self.metrics.replays.fetch_add(1, Ordering::Relaxed);
    }

    fn lost(&mut self, from: u64, got: u64) {
        self.metrics.lost.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            dp_rank = self.dp_rank,
            from,
            got,
            "engine frames lost: publishing Cleared"
        );
        self.with_rank(|rank| {
            rank.lose(Instant::now());
            rank.seal();
        });
    }

    fn restarted(&mut self) {
        self.metrics.restarts.fetch_add(1, Ordering::Relaxed);
        self.with_rank(|rank| {
            rank.lose(Instant::now());
            rank.seal();
        });
    }

    fn malformed(&mut self, error: &FrameError) {
        self.metrics.malformed.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(error = %error, "malformed KV-event message skipped");
    }

    fn drained(&mut self) {
        self.with_rank(RankBridge::seal);
    }
}
