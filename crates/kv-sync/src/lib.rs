//! One KV-event source's synchronisation, as a pure state machine (no I/O, no clock of its own).
//!
//! Shared by the consumers of kvgate envelopes: the EPP runs one [`SourceSync`] per sidecar rank
//! or node block manager it follows over NATS; the caller owns the subscriptions, the snapshot
//! requests and the clock, and performs the [`Effect`]s it is handed.
//!
//! A source (one pod's data-parallel rank, or one node) publishes envelopes stamped with a
//! random `epoch` and a `seq` contiguous from 0 within it. The index holds, for that source, the
//! effect of a *prefix* of one epoch's stream: everything below `position = (epoch, next)`.
//!
//! - [`Phase::Live`]: envelopes at `next` are applied at once; older ones are duplicates.
//! - A gap, an unknown epoch, first sight or a reconnect makes the source *stale*: a snapshot is
//!   requested ([`Phase::Awaiting`]) and later envelopes are buffered (bounded). The reply
//!   replaces the source's entries; buffered envelopes below its `next_seq` are dropped, the rest
//!   applied contiguously. A gap left inside the buffer asks again; a failure or timeout waits
//!   ([`Phase::Backoff`], doubling up to a ceiling) and asks again.
//! - Stale is a flag, not a wipe: the cached entries keep routing (a prefix of the truth is a
//!   better guess than nothing), and the stale count is a metric. If the buffered stream connects
//!   to the position (nothing was lost, e.g. a reconnect with no envelope in between), the
//!   source goes live again without waiting for the snapshot.
//!
//! Replies are matched to the request they answer by id, so a late reply to an abandoned request
//! cannot be applied against a buffer that has moved on.

use std::collections::VecDeque;

use kv_events::KvEvent;
use kv_events::snapshot::Snapshot;
use kv_index::Millis;

/// Bounds and timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncConfig {
    /// Envelopes buffered while stale; more drops the buffer and asks again after a backoff.
    pub max_buffered: usize,
    /// How long a snapshot request may take.
    pub snapshot_timeout: Millis,
    /// The first retry delay after a failure.
    pub retry_initial: Millis,
    /// The longest retry delay.
    pub retry_max: Millis,
}

impl Default for SyncConfig {
    fn default() -> Self {
        Self {
            max_buffered: 4096,
            snapshot_timeout: Millis(2_000),
            retry_initial: Millis(100),
            retry_max: Millis(10_000),
        }
    }
}

/// Where a source stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// In step: envelopes are applied as they come.
    Live,
    /// Stale; waiting for the reply to request `id` until `deadline`.
    Awaiting {
        /// The request's id.
        id: u64,
        /// When it is given up.
        deadline: Millis,
    },
    /// Stale; the last request failed and the next goes out at `at`.
    Backoff {
        /// When to ask again.
        at: Millis,
    },
}

/// Why a snapshot attempt did not bring the source in step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No complete reply in time.
    Timeout,
    /// The request could not be sent or the reply was malformed.
    Error,
    /// A new epoch began after the request and the reply predates it.
    Superseded,
    /// The buffer overflowed while waiting.
    Overflow,
}

impl Failure {
    /// A bounded label for metrics.
    pub fn metric_label(self) -> &'static str {
        match self {
            Failure::Timeout => "timeout",
            Failure::Error => "error",
            Failure::Superseded => "superseded",
            Failure::Overflow => "overflow",
        }
    }
}

/// What the caller must do (or count) after an input.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Apply these events to the source's index entries.
    Apply(Vec<KvEvent>),
    /// Replace the source's index entries with this snapshot's.
    Replace(Snapshot),
    /// Send a snapshot request; its reply must be passed back with this id.
    Request {
        /// The request's id.
        id: u64,
    },
    /// An envelope arrived past a gap.
    Gap,
    /// An envelope of an epoch other than the position's arrived.
    NewEpoch,
    /// An attempt failed.
    Failed(Failure),
    /// A reply to a request no longer awaited was dropped.
    LateReply,
}

/// One source's synchronisation state.
#[derive(Debug, Clone)]
pub struct SourceSync {
    config: SyncConfig,
    /// The index holds the effect of this epoch's envelopes below `.1`.
    position: Option<(u64, u64)>,
    phase: Phase,
    /// The epoch of the latest envelope seen (what the publisher is on now).
    latest_epoch: Option<u64>,
    /// `latest_epoch` when the awaited request was sent.
    asked_epoch: Option<u64>,
    /// Envelopes of `latest_epoch` received while stale: (seq, events).
    buffer: VecDeque<(u64, Vec<KvEvent>)>,
    next_request: u64,
    delay: Millis,
}

impl SourceSync {
    /// A source seen for the first time: stale, with a snapshot request due now.
    pub fn new(config: SyncConfig, now: Millis, out: &mut Vec<Effect>) -> Self {
        let mut s = Self {
            config,
            position: None,
            phase: Phase::Backoff { at: now },
            latest_epoch: None,
            asked_epoch: None,
            buffer: VecDeque::new(),
            next_request: 0,
            delay: config.retry_initial,
        };
        s.request(now, out);
        s
    }

    /// The phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Whether the source is out of step (its entries may be behind).
    pub fn is_stale(&self) -> bool {
        self.phase != Phase::Live
    }

    /// `(epoch, next seq)` the index reflects, once a snapshot has been applied.
    pub fn position(&self) -> Option<(u64, u64)> {
        self.position
    }

    /// Envelopes held while stale.
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }

    /// Feeds an envelope.
    pub fn on_envelope(
        &mut self,
        epoch: u64,
        seq: u64,
        events: Vec<KvEvent>,
        now: Millis,
        out: &mut Vec<Effect>,
    ) {
        if self.latest_epoch != Some(epoch) {
            if self.latest_epoch.is_some() || self.position.is_some() {
                out.push(Effect::NewEpoch);
            }
            self.latest_epoch = Some(epoch);
            self.buffer.clear();
        }
        if self.phase == Phase::Live {
            match self.position {
                Some((e, next)) if e == epoch && seq == next => {
                    self.position = Some((e, next.saturating_add(1)));
                    out.push(Effect::Apply(events));
                    return;
                }
                Some((e, next)) if e == epoch && seq < next => return,
                Some((e, _)) if e == epoch => out.push(Effect::Gap),
                _ => {}
            }
            self.buffer.push_back((seq, events));
            self.request(now, out);
            return;
        }
        if self.buffer.len() >= self.config.max_buffered {
            self.buffer.clear();
            out.push(Effect::Failed(Failure::Overflow));
            self.back_off(now);
            return;
        }
        self.buffer.push_back((seq, events));
        if self.catch_up(out) {
            self.go_live();
        }
    }

    /// Feeds the reply to request `id`.
    pub fn on_snapshot(&mut self, id: u64, snapshot: Snapshot, now: Millis, out: &mut Vec<Effect>) {
        if !matches!(self.phase, Phase::Awaiting { id: want, .. } if want == id) {
            out.push(Effect::LateReply);
            return;
        }
        // The reply reflects the publisher when it answered, after the request. If a new epoch
        // began after the request and the reply is not of it, the reply is older than what is
        // now published. A reply of an epoch not seen yet is newer: the buffer is of the past.
        if self.latest_epoch != self.asked_epoch && self.latest_epoch != Some(snapshot.epoch) {
            out.push(Effect::Failed(Failure::Superseded));
            self.request(now, out);
            return;
        }
        if self.latest_epoch != Some(snapshot.epoch) {
            self.buffer.clear();
            self.latest_epoch = Some(snapshot.epoch);
        }
        self.position = Some((snapshot.epoch, snapshot.next_seq));
        out.push(Effect::Replace(snapshot));
        if self.catch_up(out) {
            self.go_live();
        } else {
            out.push(Effect::Gap);
            self.request(now, out);
        }
    }

    /// Request `id` failed (could not be sent, or a malformed reply).
    pub fn on_snapshot_failed(&mut self, id: u64, now: Millis, out: &mut Vec<Effect>) {
        if matches!(self.phase, Phase::Awaiting { id: want, .. } if want == id) {
            out.push(Effect::Failed(Failure::Error));
            self.back_off(now);
        }
    }

    /// Advances time: gives up an overdue request, sends one whose backoff has passed.
    pub fn tick(&mut self, now: Millis, out: &mut Vec<Effect>) {
        match self.phase {
            Phase::Awaiting { deadline, .. } if now >= deadline => {
                out.push(Effect::Failed(Failure::Timeout));
                self.back_off(now);
            }
            Phase::Backoff { at } if now >= at => self.request(now, out),
            _ => {}
        }
    }

    /// The connection was lost and is back: envelopes may have been missed, and an outstanding
    /// request may never be answered. Asks for a snapshot now.
    pub fn resync(&mut self, now: Millis, out: &mut Vec<Effect>) {
        self.buffer.clear();
        self.request(now, out);
    }

    fn request(&mut self, now: Millis, out: &mut Vec<Effect>) {
        let id = self.next_request;
        self.next_request = self.next_request.wrapping_add(1);
        self.asked_epoch = self.latest_epoch;
        self.phase = Phase::Awaiting {
            id,
            deadline: now.after(self.config.snapshot_timeout),
        };
        out.push(Effect::Request { id });
    }

    fn back_off(&mut self, now: Millis) {
        self.phase = Phase::Backoff {
            at: now.after(self.delay),
        };
        self.delay = Millis(self.delay.0.saturating_mul(2).min(self.config.retry_max.0));
    }

    fn go_live(&mut self) {
        self.phase = Phase::Live;
        self.delay = self.config.retry_initial;
    }

    /// Applies buffered envelopes that continue the position; true when the buffer is empty
    /// afterwards (nothing beyond a gap is left).
    fn catch_up(&mut self, out: &mut Vec<Effect>) -> bool {
        let Some((epoch, mut next)) = self.position else {
            return false;
        };
        if self.latest_epoch != Some(epoch) {
            return false;
        }
        self.buffer.make_contiguous().sort_by_key(|(seq, _)| *seq);
        while let Some((seq, _)) = self.buffer.front() {
            let seq = *seq;
            if seq > next {
                break;
            }
            let Some((_, events)) = self.buffer.pop_front() else {
                break;
            };
            if seq == next {
                next = next.saturating_add(1);
                out.push(Effect::Apply(events));
            }
        }
        self.position = Some((epoch, next));
        self.buffer.is_empty()
    }
}

#[cfg(test)]
mod tests;
