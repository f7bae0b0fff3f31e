//! Fake engines over real ZMQ sockets. An engine that restarts behind a running subscriber: the new
//! engine's first frames go out before the subscriber has reconnected and are lost, so the
//! restart is only visible in the sequence going back. The subscriber must report it and
//! rebuild the new stream from its start (through the new engine's replay socket, when it has
//! one), not drop the new engine's frames as duplicates of the old one's. And a catch-up replay
//! longer than the engine's replay socket can queue, which arrives with holes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use engine_zmq::{Frame, FrameSink, StartFrom, StreamConfig};
use kv_events::frame::{KvFrame, ReplayLayout, ReplayReply};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Frame { seq: u64, payload: Vec<u8> },
    Gap,
    Repaired,
    Lost,
    Restarted,
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Call>>>);

impl Recorder {
    fn calls(&self) -> Vec<Call> {
        self.0.lock().unwrap().clone()
    }
    fn push(&self, c: Call) {
        self.0.lock().unwrap().push(c);
    }
}

impl FrameSink for Recorder {
    fn frame(&mut self, frame: Frame<'_>) {
        self.push(Call::Frame {
            seq: frame.seq,
            payload: frame.payload.to_vec(),
        });
    }
    fn gap(&mut self, _from: u64, _got: u64) {
        self.push(Call::Gap);
    }
    fn repaired(&mut self, _from: u64, _got: u64) {
        self.push(Call::Repaired);
    }
    fn lost(&mut self, _from: u64, _got: u64) {
        self.push(Call::Lost);
    }
    fn restarted(&mut self) {
        self.push(Call::Restarted);
    }
}

/// What a fake engine has published: seq and payload.
type Sent = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A fake engine: a PUB socket, and optionally a replay ROUTER answering from what it sent as
/// vLLM does (every kept batch at once, blocking sends on a ROUTER with ZMQ's defaults, which
/// drop what does not fit the send queue).
struct Engine {
    publisher: zmq::Socket,
    sent: Sent,
    stop: Arc<AtomicBool>,
    replay: Option<thread::JoinHandle<()>>,
    requests: Arc<std::sync::atomic::AtomicUsize>,
    /// Batches the next answer leaves out just before its end marker, as when the send queue
    /// was full for the last batches and had drained by the time the marker went out.
    drop_tail: Arc<std::sync::atomic::AtomicUsize>,
}

impl Engine {
    fn start(ctx: &zmq::Context, pub_ep: &str, replay_ep: Option<&str>) -> Self {
        let publisher = ctx.socket(zmq::PUB).unwrap();
        publisher.set_linger(0).unwrap();
        bind_retrying(&publisher, pub_ep);
        let sent: Sent = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let drop_tail = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let replay = replay_ep.map(|ep| {
            let router = ctx.socket(zmq::ROUTER).unwrap();
            router.set_linger(0).unwrap();
            router.set_rcvtimeo(20).unwrap();
            bind_retrying(&router, ep);
            let (sent, stop) = (Arc::clone(&sent), Arc::clone(&stop));
            let (requests, drop_tail) = (Arc::clone(&requests), Arc::clone(&drop_tail));
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(parts) = router.recv_multipart(0) else {
                        continue;
                    };
                    requests.fetch_add(1, Ordering::Relaxed);
                    let identity = parts[0].clone();
                    let from = u64::from_be_bytes(parts[2].as_slice().try_into().unwrap());
                    let mut kept: Vec<_> = sent.lock().unwrap().clone();
                    let dropped = drop_tail.swap(0, Ordering::Relaxed);
                    kept.truncate(kept.len().saturating_sub(dropped));
                    let replies = kept
                        .iter()
                        .filter(|(seq, _)| *seq >= from)
                        .map(|(seq, payload)| ReplayReply::Batch {
                            layout: ReplayLayout::WithTopic,
                            frame: KvFrame {
                                topic: "kv",
                                seq: *seq,
                                payload,
                            },
                        })
                        .chain([ReplayReply::End]);
                    for reply in replies {
                        let mut msg = vec![identity.clone()];
                        msg.extend(reply.to_parts(ReplayLayout::WithTopic));
                        router.send_multipart(msg, 0).unwrap();
                    }
                }
            })
        });
        Self {
            publisher,
            sent,
            stop,
            replay,
            requests,
            drop_tail,
        }
    }

    fn publish(&self, seq: u64, payload: &[u8]) {
        self.sent.lock().unwrap().push((seq, payload.to_vec()));
        let frame = KvFrame {
            topic: "kv",
            seq,
            payload,
        };
        self.publisher.send_multipart(frame.to_parts(), 0).unwrap();
    }

    fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.replay.take() {
            h.join().unwrap();
        }
    }
}

/// Binds, retrying while the previous engine's port is being released.
fn bind_retrying(socket: &zmq::Socket, ep: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match socket.bind(ep) {
            Ok(()) => return,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("bind {ep}: {e}"),
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Publishes `payload(seq)` for rising seqs until the recorder holds `want` calls matching
/// `done`, or panics after 15 s.
fn publish_until(
    engine: &Engine,
    seqs: &mut std::ops::RangeFrom<u64>,
    life: u8,
    rec: &Recorder,
    done: impl Fn(&[Call]) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !done(&rec.calls()) {
        assert!(Instant::now() < deadline, "timed out: {:?}", rec.calls());
        let seq = seqs.next().unwrap();
        engine.publish(seq, &[life, seq as u8]);
        thread::sleep(Duration::from_millis(30));
    }
}

fn frames_of(calls: &[Call], life: u8) -> Vec<u64> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Frame { seq, payload } if payload[0] == life => Some(*seq),
            _ => None,
        })
        .collect()
}

/// The first engine publishes until the subscriber has taken `old` frames; the restarted one
/// sends `missed` frames before the subscriber reconnects, then more until it has taken six.
fn run_restart(with_replay: bool, old: usize, missed: u64) -> Vec<Call> {
    let ctx = zmq::Context::new();
    let pub_ep = format!("tcp://127.0.0.1:{}", free_port());
    let replay_ep = with_replay.then(|| format!("tcp://127.0.0.1:{}", free_port()));
    let rec = Recorder::default();
    let stop = Arc::new(AtomicBool::new(false));
    let subscriber = {
        let (ctx, mut sink, stop) = (ctx.clone(), rec.clone(), Arc::clone(&stop));
        let mut cfg = StreamConfig::new(pub_ep.clone(), replay_ep.clone(), StartFrom::Live);
        cfg.poll = Duration::from_millis(20);
        thread::spawn(move || engine_zmq::run(&ctx, &cfg, &stop, &mut sink).unwrap())
    };

    let first = Engine::start(&ctx, &pub_ep, replay_ep.as_deref());
    let mut seqs = 0..;
    publish_until(&first, &mut seqs, 1, &rec, |c| frames_of(c, 1).len() >= old);
    first.stop();

    // The restarted engine: its first frames go out before anyone listens again.
    let second = Engine::start(&ctx, &pub_ep, replay_ep.as_deref());
    for seq in 0..missed {
        second.publish(seq, &[2, seq as u8]);
    }
    let mut seqs = missed..;
    publish_until(&second, &mut seqs, 2, &rec, |c| frames_of(c, 2).len() >= 6);
    stop.store(true, Ordering::Relaxed);
    subscriber.join().unwrap();
    second.stop();
    rec.calls()
}

/// The old stream is well ahead of the new one when the subscriber reconnects: the sequence
/// goes back.
#[test]
fn a_restarted_engine_is_noticed_and_its_missed_frames_replayed() {
    assert_rebuilt_from_the_new_start(&run_restart(true, 30, 3));
}

/// The new stream has passed the old one when the subscriber reconnects: it looks like a gap,
/// and the replay of the last seq delivered, answered with another payload, shows the restart.
#[test]
fn a_restart_whose_sequence_passed_the_old_one_is_noticed_through_the_replay() {
    assert_rebuilt_from_the_new_start(&run_restart(true, 3, 40));
}

fn assert_rebuilt_from_the_new_start(calls: &[Call]) {
    let restart = calls
        .iter()
        .position(|c| *c == Call::Restarted)
        .unwrap_or_else(|| panic!("no restart reported: {calls:?}"));
    assert_eq!(
        calls.iter().filter(|c| **c == Call::Restarted).count(),
        1,
        "{calls:?}"
    );
    assert!(
        frames_of(&calls[..restart], 2).is_empty(),
        "new frames before the restart: {calls:?}"
    );
    let after = &calls[restart + 1..];
    assert!(after.contains(&Call::Repaired), "{calls:?}");
    assert!(!after.contains(&Call::Lost), "{calls:?}");
    let new = frames_of(after, 2);
    let want: Vec<u64> = (0..new.len() as u64).collect();
    assert_eq!(
        new, want,
        "the new stream from its start, in order: {calls:?}"
    );
    assert!(frames_of(after, 1).is_empty(), "{calls:?}");
}

#[test]
fn without_a_replay_socket_a_restart_is_reported_and_the_gap_lost() {
    let calls = run_restart(false, 30, 3);
    let restart = calls
        .iter()
        .position(|c| *c == Call::Restarted)
        .unwrap_or_else(|| panic!("no restart reported: {calls:?}"));
    let after = &calls[restart + 1..];
    assert_eq!(after.first(), Some(&Call::Gap), "{calls:?}");
    assert_eq!(after.get(1), Some(&Call::Lost), "{calls:?}");
    let new = frames_of(after, 2);
    assert!(new.len() >= 6, "{calls:?}");
    assert!(
        new.windows(2).all(|w| w[1] == w[0] + 1),
        "contiguous after the restart: {new:?}"
    );
}

/// A sidecar starting beside an engine that keeps 10,000 batches: the engine's replay drops
/// what does not fit ZMQ's send queue (as vLLM's does), so the answer has holes and no end
/// marker; the subscriber asks again from where it stopped until it has every batch.
#[test]
fn a_catch_up_replay_longer_than_the_send_queue_is_resumed_until_complete() {
    const KEPT: u64 = 10_000;
    let ctx = zmq::Context::new();
    let pub_ep = format!("tcp://127.0.0.1:{}", free_port());
    let replay_ep = format!("tcp://127.0.0.1:{}", free_port());
    let engine = Engine::start(&ctx, &pub_ep, Some(&replay_ep));
    for seq in 0..KEPT {
        let mut payload = vec![1u8; 4096];
        payload[1..9].copy_from_slice(&seq.to_be_bytes());
        engine.publish(seq, &payload);
    }
    let (rec, stop, subscriber) = catch_up(&ctx, pub_ep, replay_ep);
    let deadline = Instant::now() + Duration::from_secs(60);
    while (frames_of(&rec.calls(), 1).len() as u64) < KEPT && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    subscriber.join().unwrap();
    let calls = rec.calls();
    let seqs = frames_of(&calls, 1);
    assert_eq!(
        seqs.len() as u64,
        KEPT,
        "caught up {} of {KEPT}",
        seqs.len()
    );
    assert!(seqs.iter().copied().eq(0..KEPT), "in order, each once");
    let requests = engine.requests.load(Ordering::Relaxed);
    assert!(
        requests > 1,
        "the engine dropped nothing, so nothing was resumed: {requests} request"
    );
    assert!(!calls.contains(&Call::Lost) && !calls.contains(&Call::Restarted));
    engine.stop();
}

/// The first answer to a catch-up replay loses its last batches but still ends with the marker
/// (the send queue overflowed, then drained before the marker): the subscriber cannot see a
/// hole, so it asks again from where it stopped and takes an answer that brings nothing new as
/// the end.
#[test]
fn a_catch_up_replay_whose_tail_was_dropped_before_the_end_marker_is_completed() {
    const KEPT: u64 = 300;
    const DROPPED: usize = 40;
    let ctx = zmq::Context::new();
    let pub_ep = format!("tcp://127.0.0.1:{}", free_port());
    let replay_ep = format!("tcp://127.0.0.1:{}", free_port());
    let engine = Engine::start(&ctx, &pub_ep, Some(&replay_ep));
    for seq in 0..KEPT {
        engine.publish(seq, &[1, seq as u8]);
    }
    engine.drop_tail.store(DROPPED, Ordering::Relaxed);
    let (rec, stop, subscriber) = catch_up(&ctx, pub_ep, replay_ep);
    let deadline = Instant::now() + Duration::from_secs(20);
    while engine.requests.load(Ordering::Relaxed) < 3 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    // Give a fourth request, which must not come, the time to arrive.
    thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    subscriber.join().unwrap();
    let calls = rec.calls();
    let seqs = frames_of(&calls, 1);
    assert!(
        seqs.iter().copied().eq(0..KEPT),
        "caught up {} of {KEPT}",
        seqs.len()
    );
    // The lossy answer, the one that brought the tail, and the one that confirmed the end.
    assert_eq!(engine.requests.load(Ordering::Relaxed), 3);
    assert!(!calls.contains(&Call::Lost) && !calls.contains(&Call::Gap));
    engine.stop();
}

/// A subscriber that starts with a catch-up replay (as a starting sidecar does), recording what
/// it hears; it runs until `stop` is set.
fn catch_up(
    ctx: &zmq::Context,
    pub_ep: String,
    replay_ep: String,
) -> (Recorder, Arc<AtomicBool>, thread::JoinHandle<()>) {
    let rec = Recorder::default();
    let stop = Arc::new(AtomicBool::new(false));
    let subscriber = {
        let (ctx, mut sink, stop) = (ctx.clone(), rec.clone(), Arc::clone(&stop));
        let cfg = StreamConfig::new(pub_ep, Some(replay_ep), StartFrom::ReplayNow);
        thread::spawn(move || engine_zmq::run(&ctx, &cfg, &stop, &mut sink).unwrap())
    };
    (rec, stop, subscriber)
}
