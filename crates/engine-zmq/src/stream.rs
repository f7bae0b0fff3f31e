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
    /// The engine restarted (its cache is empty); the next frame starts the new stream.
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
    let mut seq = Sequencer::new();
    if let Some(endpoint) = &cfg.replay {
        match cfg.start {
            StartFrom::Live => {}
            StartFrom::Zero => seq.expect(0),
            StartFrom::ReplayNow => {
                let mut replayer = Replayer {
                    ctx,
                    cfg,
                    endpoint,
                    stop,
                };
                let done = replayer.run(0, None, &mut seq, sink);
                tracing::info!(caught_up = done, next = ?seq.expected(), "KV-event catch-up replay");
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
        on_live(ctx, cfg, stop, &mut seq, sink, frame, received);
    }
    Ok(())
}

fn on_live<S: FrameSink>(
    ctx: &zmq::Context,
    cfg: &StreamConfig,
    stop: &AtomicBool,
    seq: &mut Sequencer,
    sink: &mut S,
    frame: KvFrame<'_>,
    received: Instant,
) {
    let mut outcome = seq.on_live(frame.seq);
    if let SeqOutcome::Gap { from, got } = outcome {
        sink.gap(from, got);
        let repaired = cfg.replay.as_deref().is_some_and(|endpoint| {
            let mut replayer = Replayer {
                ctx,
                cfg,
                endpoint,
                stop,
            };
            replayer.run(from, Some(got), seq, sink)
        });
        if repaired {
            tracing::info!(from, got, "KV-event gap repaired by replay");
            sink.repaired(from, got);
        } else {
            tracing::warn!(from, got, "KV-event gap not repairable: resynchronising");
            sink.lost(from, got);
            seq.reset();
        }
        outcome = seq.on_live(frame.seq);
    }
    match outcome {
        SeqOutcome::Deliver => {}
        SeqOutcome::Restarted => {
            tracing::info!(publisher = %cfg.publisher, "engine restarted (seq back to 0)");
            sink.restarted();
        }
        SeqOutcome::Duplicate | SeqOutcome::Gap { .. } => return,
    }
    sink.frame(Frame {
        seq: frame.seq,
        topic: frame.topic,
        payload: frame.payload,
        received,
        replayed: false,
    });
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

/// One replay request's exchange.
struct Replayer<'a> {
    ctx: &'a zmq::Context,
    cfg: &'a StreamConfig,
    endpoint: &'a str,
    stop: &'a AtomicBool,
}

impl Replayer<'_> {
    /// Asks for every kept batch from `from`, delivering those the sequencer accepts and that
    /// lie below `until`. True when the sequencer reached `until` (or, without one, when the
    /// end marker arrived).
    fn run<S: FrameSink>(
        &mut self,
        from: u64,
        until: Option<u64>,
        seq: &mut Sequencer,
        sink: &mut S,
    ) -> bool {
        let dealer = match self.ctx.socket(zmq::DEALER).and_then(|d| {
            d.set_rcvtimeo(millis(self.cfg.poll.min(Duration::from_millis(50))))?;
            d.set_linger(0)?;
            d.connect(self.endpoint)?;
            d.send_multipart(replay_request(from), 0)?;
            Ok(d)
        }) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(endpoint = %self.endpoint, error = %e, "KV-event replay request failed");
                return false;
            }
        };
        let deadline = Instant::now() + self.cfg.replay_timeout;
        while Instant::now() < deadline && !self.stop.load(Ordering::Relaxed) {
            let Ok(parts) = dealer.recv_multipart(0) else {
                continue;
            };
            let received = Instant::now();
            match ReplayReply::from_parts(&parts) {
                Ok(ReplayReply::End) => return until.is_none_or(|u| seq.expected() == Some(u)),
                Ok(ReplayReply::Batch { frame, .. }) => {
                    if until.is_some_and(|u| frame.seq >= u) {
                        continue;
                    }
                    match seq.on_replay(frame.seq) {
                        SeqOutcome::Deliver => {
                            sink.frame(Frame {
                                seq: frame.seq,
                                topic: frame.topic,
                                payload: frame.payload,
                                received,
                                replayed: true,
                            });
                            if until.is_some() && seq.expected() == until {
                                return true;
                            }
                        }
                        SeqOutcome::Gap { .. } => return false,
                        SeqOutcome::Duplicate | SeqOutcome::Restarted => {}
                    }
                }
                Err(e) => sink.malformed(&e),
            }
        }
        tracing::warn!(endpoint = %self.endpoint, from, "KV-event replay timed out");
        until.is_some_and(|u| seq.expected() == Some(u))
    }
}
