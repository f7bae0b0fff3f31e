//! The blocking receive loop of one engine stream: SUB socket in, in-sequence frames out to a
//! [`FrameSink`], gaps repaired through the engine's replay ROUTER when it has one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kv_events::frame::{FrameError, KvFrame, ReplayReply, replay_request};

use crate::seq::{SeqOutcome, Sequencer};

/// Where a new subscription starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartFrom {
    /// With the first live frame, whatever its seq.
    Live,
    /// At seq 0: when the first live frame is later, the frames before it are replayed (if
    /// the engine has a replay socket; otherwise this is [`StartFrom::Live`]).
    Zero,
    /// Ask the replay socket at once for every batch the engine still keeps, before the first
    /// live frame (otherwise this is [`StartFrom::Live`]). A subscriber that restarts beside a
    /// running engine so learns what the engine cached before it.
    ReplayNow,
}

/// One engine stream to subscribe to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamConfig {
    /// The PUB endpoint, e.g. `tcp://127.0.0.1:5557`.
    pub publisher: String,
    /// The replay ROUTER endpoint, if the engine has one.
    pub replay: Option<String>,
    /// The topic prefix to subscribe to (empty: everything).
    pub topic: Vec<u8>,
    /// Where to start.
    pub start: StartFrom,
    /// How long a receive waits before the stop flag is checked (and the sink told it is idle).
    pub poll: Duration,
    /// How long one replay may take before it is abandoned.
    pub replay_timeout: Duration,
}

impl StreamConfig {
    /// A config with the default poll (100 ms) and replay timeout (2 s).
    pub fn new(publisher: impl Into<String>, replay: Option<String>, start: StartFrom) -> Self {
        Self {
            publisher: publisher.into(),
            replay,
            topic: Vec::new(),
            start,
            poll: Duration::from_millis(100),
            replay_timeout: Duration::from_secs(2),
        }
    }
}

/// One in-sequence frame.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    /// The engine's seq.
    pub seq: u64,
    /// The topic (empty from a legacy-layout replay).
    pub topic: &'a str,
    /// The MessagePack payload.
    pub payload: &'a [u8],
    /// When the message was taken off the socket.
    pub received: Instant,
    /// Whether it came through the replay socket.
    pub replayed: bool,
}

/// What the loop reports to its owner. Calls come from the loop's thread, in stream order.
pub trait FrameSink {
    /// A frame in sequence (live or replayed).
    fn frame(&mut self, frame: Frame<'_>);
    /// Frames `from..got` were found missing; a repair follows.
    fn gap(&mut self, _from: u64, _got: u64) {}
    /// The missing frames were replayed (already handed to [`FrameSink::frame`]).
    fn repaired(&mut self, _from: u64, _got: u64) {}
    /// The missing frames could not be replayed: whatever the sink derived from the stream is
    /// now unreliable. The stream continues with frame `got`.
    fn lost(&mut self, from: u64, got: u64);
    /// The engine restarted (its cache is empty): its sequence went back. The frames that
    /// follow are the new stream's, from seq 0 (replayed when the subscriber missed them).
    fn restarted(&mut self) {}
    /// A message that is not a KV-event frame was skipped.
    fn malformed(&mut self, _error: &FrameError) {}
    /// No frame is waiting right now: after a burst, and after each idle poll period.
    fn drained(&mut self) {}
}

/// Why the loop could not run.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The SUB socket could not be set up.
    #[error("subscribing to {endpoint}: {source}")]
    Subscribe {
        /// The PUB endpoint.
        endpoint: String,
        /// The ZMQ error.
        #[source]
        source: zmq::Error,
    },
}

/// Receives until `stop` is set. Returns an error only when the subscription cannot be set up;
/// receive errors are logged and retried.
pub fn run<S: FrameSink>(
    ctx: &zmq::Context,
    cfg: &StreamConfig,
    stop: &AtomicBool,
    sink: &mut S,
) -> Result<(), StreamError> {
    let sub = subscribe(ctx, cfg).map_err(|source| StreamError::Subscribe {
        endpoint: cfg.publisher.clone(),
        source,
    })?;
    tracing::info!(publisher = %cfg.publisher, replay = ?cfg.replay, "subscribed to KV events");
    let mut stream = Stream {
        ctx,
        cfg,
        stop,
        seq: Sequencer::new(),
        last: None,
    };
    if cfg.replay.is_some() {
        match cfg.start {
            StartFrom::Live => {}
            StartFrom::Zero => stream.seq.expect(0),
            StartFrom::ReplayNow => {
                let done = stream.replay(0, None, None, sink) == Replay::Complete;
                tracing::info!(caught_up = done, next = ?stream.seq.expected(), "KV-event catch-up replay");
            }
        }
    }
    let mut burst = false;
    while !stop.load(Ordering::Relaxed) {
        let flags = if burst { zmq::DONTWAIT } else { 0 };
        let parts = match sub.recv_multipart(flags) {
            Ok(p) => p,
            Err(zmq::Error::EAGAIN) => {
                burst = false;
                sink.drained();
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "KV-event receive failed");
                std::thread::sleep(cfg.poll);
                continue;
            }
        };
        let received = Instant::now();
        burst = true;
        let frame = match KvFrame::from_parts(&parts) {
            Ok(f) => f,
            Err(e) => {
                sink.malformed(&e);
                continue;
            }
        };
        stream.on_live(sink, frame, received);
    }
    Ok(())
}

/// The last frame delivered: its seq and a hash of its payload. A replay that repairs a gap
/// starts with it, and the engine must answer that seq with the same payload: otherwise the
/// engine restarted and its new sequence passed the old one while the subscriber was away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Last {
    seq: u64,
    hash: u64,
}

impl Last {
    fn of(seq: u64, payload: &[u8]) -> Self {
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hasher::write(&mut h, payload);
        Self {
            seq,
            hash: std::hash::Hasher::finish(&h),
        }
    }
}

/// How a replay went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replay {
    /// Every frame asked for was delivered (or, without an end seq, the end marker came).
    Complete,
    /// It stopped short: no answer, a gap in the answer, or the frame to check was no longer
    /// kept.
    Incomplete,
    /// The engine answered the last delivered seq with another payload: a new stream.
    Restarted,
}

/// One subscription's state.
struct Stream<'a> {
    ctx: &'a zmq::Context,
    cfg: &'a StreamConfig,
    stop: &'a AtomicBool,
    seq: Sequencer,
    last: Option<Last>,
}

impl Stream<'_> {
    fn deliver<S: FrameSink>(
        &mut self,
        sink: &mut S,
        frame: &KvFrame<'_>,
        received: Instant,
        replayed: bool,
    ) {
        self.last = Some(Last::of(frame.seq, frame.payload));
        sink.frame(Frame {
            seq: frame.seq,
            topic: frame.topic,
            payload: frame.payload,
            received,
            replayed,
        });
    }

    fn on_live<S: FrameSink>(&mut self, sink: &mut S, frame: KvFrame<'_>, received: Instant) {
        let mut outcome = self.seq.on_live(frame.seq);
        if outcome == SeqOutcome::Restarted {
            tracing::info!(
                publisher = %self.cfg.publisher,
                seq = frame.seq,
                "engine restarted (its sequence went back): starting over"
            );
            self.last = None;
            sink.restarted();
            // Seq 0 is delivered; a later one leaves the new stream's first frames as a gap.
            outcome = self.seq.on_live(frame.seq);
        }
        if let SeqOutcome::Gap { from, got } = outcome {
            sink.gap(from, got);
            if self.repair(sink, from, got) {
                tracing::info!(from, got, "KV-event gap repaired by replay");
                sink.repaired(from, got);
            } else {
                tracing::warn!(from, got, "KV-event gap not repairable: resynchronising");
                sink.lost(from, got);
                self.seq.reset();
            }
            outcome = self.seq.on_live(frame.seq);
        }
        if outcome != SeqOutcome::Deliver {
            return;
        }
        self.deliver(sink, &frame, received, false);
    }

    /// Replays `from..got`, first checking that the engine still has the stream the last
    /// delivered frame belongs to. True when the sequencer reached `got`.
    fn repair<S: FrameSink>(&mut self, sink: &mut S, from: u64, got: u64) -> bool {
        if self.cfg.replay.is_none() {
            return false;
        }
        let check = self.last.filter(|l| l.seq.checked_add(1) == Some(from));
        match self.replay(from, Some(got), check, sink) {
            Replay::Complete => true,
            Replay::Incomplete => false,
            Replay::Restarted => {
                tracing::info!(
                    publisher = %self.cfg.publisher,
                    from,
                    got,
                    "engine restarted (its replay of the last seq differs): starting over"
                );
                self.last = None;
                sink.restarted();
                self.seq.restart();
                got == 0 || self.replay(0, Some(got), None, sink) == Replay::Complete
            }
        }
    }

    /// Asks for every kept batch from `from` (from `check`'s seq when given, which the engine
    /// must answer with the same payload), delivering those the sequencer accepts and that lie
    /// below `until`. An engine's replay ROUTER drops what does not fit its send queue (vLLM
    /// keeps ZMQ's default of 1,000 messages), so a long replay arrives with holes and without
    /// its end marker: each time an answer stalls after progress, the rest is asked for again
    /// from the next seq expected. Without `until`, a replay is complete only once an answer
    /// brings nothing new.
    fn replay<S: FrameSink>(
        &mut self,
        from: u64,
        until: Option<u64>,
        check: Option<Last>,
        sink: &mut S,
    ) -> Replay {
        let Some(endpoint) = self.cfg.replay.as_deref() else {
            return Replay::Incomplete;
        };
        let mut check = check;
        let mut start = check.map_or(from, |c| c.seq);
        let mut rounds = 0u32;
        loop {
            rounds += 1;
            let before = (self.seq.expected(), check.is_some());
            let dealer = match self.request(endpoint, start) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(endpoint, error = %e, "KV-event replay request failed");
                    return Replay::Incomplete;
                }
            };
            match self.round(&dealer, until, &mut check, sink) {
                Round::Done(outcome) => {
                    if rounds > 1 {
                        tracing::info!(endpoint, from, rounds, ?outcome, "KV-event replay resumed");
                    }
                    return outcome;
                }
                // Progress: frames delivered, or the frame to check found as it should be.
                Round::Stalled | Round::Ended
                    if (self.seq.expected(), check.is_some()) != before =>
                {
                    start = self.seq.expected().unwrap_or(from);
                }
                // An answer with nothing new that still ends with the marker: nothing is left.
                Round::Ended => {
                    if rounds > 1 {
                        tracing::info!(
                            endpoint,
                            from,
                            rounds,
                            "KV-event replay resumed and confirmed"
                        );
                    }
                    return Replay::Complete;
                }
                Round::Stalled => {
                    tracing::warn!(endpoint, from, next = ?self.seq.expected(), "KV-event replay stalled");
                    return Replay::Incomplete;
                }
            }
        }
    }

    fn request(&self, endpoint: &str, start: u64) -> zmq::Result<zmq::Socket> {
        let d = self.ctx.socket(zmq::DEALER)?;
        d.set_rcvtimeo(millis(self.cfg.poll.min(Duration::from_millis(50))))?;
        d.set_linger(0)?;
        d.connect(endpoint)?;
        d.send_multipart(replay_request(start), 0)?;
        Ok(d)
    }

    /// Reads one request's answer.
    fn round<S: FrameSink>(
        &mut self,
        dealer: &zmq::Socket,
        until: Option<u64>,
        check: &mut Option<Last>,
        sink: &mut S,
    ) -> Round {
        let reached = |seq: &Sequencer| until.is_none_or(|u| seq.expected() == Some(u));
        // Silence this long after the last answer means the rest was dropped; the first
        // answer may take the whole timeout (an engine busy with a step).
        let idle = self.cfg.replay_timeout.min(Duration::from_millis(300));
        let started = Instant::now();
        let mut heard: Option<Instant> = None;
        while !self.stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            match heard {
                Some(at) if now.duration_since(at) > idle => return Round::Stalled,
                None if now.duration_since(started) > self.cfg.replay_timeout => {
                    tracing::warn!(from = ?self.seq.expected(), "KV-event replay timed out");
                    return Round::Done(Replay::Incomplete);
                }
                _ => {}
            }
            let Ok(parts) = dealer.recv_multipart(0) else {
                continue;
            };
            let received = Instant::now();
            heard = Some(received);
            match ReplayReply::from_parts(&parts) {
                Ok(ReplayReply::End) if check.is_some() => return Round::Done(Replay::Incomplete),
                // Without an end seq, the marker cannot tell the engine's last batch from a tail
                // the send queue dropped just before it: the caller asks once more.
                Ok(ReplayReply::End) if until.is_none() => return Round::Ended,
                Ok(ReplayReply::End) if reached(&self.seq) => return Round::Done(Replay::Complete),
                // The end marker with frames still missing: some were dropped on the way.
                Ok(ReplayReply::End) => return Round::Stalled,
                Ok(ReplayReply::Batch { frame, .. }) => {
                    if let Some(c) = check.take() {
                        if frame.seq != c.seq {
                            // The frame to check is no longer kept (or never was).
                            return Round::Done(Replay::Incomplete);
                        }
                        if Last::of(frame.seq, frame.payload) != c {
                            return Round::Done(Replay::Restarted);
                        }
                        continue;
                    }
                    if until.is_some_and(|u| frame.seq >= u) {
                        continue;
                    }
                    match self.seq.on_replay(frame.seq) {
                        SeqOutcome::Deliver => {
                            self.deliver(sink, &frame, received, true);
                            if until.is_some() && reached(&self.seq) {
                                return Round::Done(Replay::Complete);
                            }
                        }
                        SeqOutcome::Gap { .. } => return Round::Stalled,
                        SeqOutcome::Duplicate | SeqOutcome::Restarted => {}
                    }
                }
                Err(e) => sink.malformed(&e),
            }
        }
        Round::Done(Replay::Incomplete)
    }
}

/// How one replay request's answer ended.
enum Round {
    /// The replay is over.
    Done(Replay),
    /// The answer stopped short (a hole, or silence): ask again for the rest.
    Stalled,
    /// The end marker of an answer to a replay without an end seq. Complete when the answer
    /// brought nothing new; otherwise the rest is asked for, since a tail the send queue dropped
    /// leaves no hole before the marker.
    Ended,
}

fn subscribe(ctx: &zmq::Context, cfg: &StreamConfig) -> zmq::Result<zmq::Socket> {
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_subscribe(&cfg.topic)?;
    sub.set_rcvtimeo(millis(cfg.poll))?;
    sub.set_linger(0)?;
    sub.connect(&cfg.publisher)?;
    Ok(sub)
}

fn millis(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX).max(1)
}
