//! The KV-event publisher: a ZMQ PUB socket and a replay ROUTER, on their own thread, exactly as
//! vLLM's `ZmqEventPublisher` behaves on the wire.
//!
//! Live messages are `[topic, seq as 8-byte big-endian, payload]` with `seq` counting from 0.
//! The last `buffer_steps` payloads are kept; a DEALER sending `[b"", start_seq]` to the ROUTER
//! gets every kept batch with `seq ≥ start_seq` and then the end marker (seq −1), in the layout
//! of vLLM ≥ 0.26 (`[b"", topic, seq, payload]`) or ≤ 0.25 (`[b"", seq, payload]`).
//!
//! The engine loop never blocks on the publisher: batches go through a bounded queue and are
//! dropped (and counted) when it is full, as a slow consumer must not stall generation.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::Duration;

use kv_events::frame::{KvFrame, ReplayLayout, ReplayReply};

/// How often the thread looks for replay requests while no batch arrives.
const POLL: Duration = Duration::from_millis(5);

/// Where and how to publish.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// PUB endpoint (bound or connected, see [`super::kv_config::KvEventsConfig::binds`]).
    pub endpoint: String,
    /// Replay ROUTER endpoint, bound.
    pub replay_endpoint: Option<String>,
    /// What a wildcard bind (`tcp://*:port`) binds on instead of every interface.
    pub wildcard_address: Option<std::net::IpAddr>,
    /// The topic frame.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// PUB send high-water mark.
    pub hwm: i32,
    /// Queue length between the engine loop and the thread.
    pub max_queue_size: usize,
    /// Replay reply layout.
    pub replay_layout: ReplayLayout,
}

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    /// A socket could not be created, configured, bound or connected.
    #[error("KV-event socket {endpoint}: {source}")]
    Socket {
        /// The endpoint concerned.
        endpoint: String,
        /// The ZMQ error.
        source: zmq::Error,
    },
    /// The thread could not be spawned.
    #[error("cannot start the KV-event publisher thread: {0}")]
    Thread(std::io::Error),
}

/// Counters the publisher keeps, shared with the metrics endpoint.
#[derive(Debug, Default)]
pub struct PublisherStats {
    /// Batches sent on the PUB socket.
    pub published: AtomicU64,
    /// Batches dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Replay requests answered.
    pub replays: AtomicU64,
    /// Malformed replay requests ignored.
    pub bad_replay_requests: AtomicU64,
}

/// A running publisher. Dropping it stops the thread after the queued batches are sent.
#[derive(Debug)]
pub struct Publisher {
    tx: Option<SyncSender<Vec<u8>>>,
    stats: Arc<PublisherStats>,
    thread: Option<JoinHandle<()>>,
}

impl Publisher {
    /// Creates and binds the sockets (so a port clash fails here), then starts the thread.
    pub fn start(config: PublisherConfig) -> Result<Self, PublisherError> {
        let ctx = zmq::Context::new();
        let wildcard = config.wildcard_address;
        let pub_socket = open(&ctx, zmq::PUB, &config.endpoint, wildcard, |s| {
            s.set_sndhwm(config.hwm)?;
            s.set_linger(500)
        })?;
        let router = match &config.replay_endpoint {
            Some(ep) => Some(open(&ctx, zmq::ROUTER, ep, wildcard, |s| s.set_linger(0))?),
            None => None,
        };
        let (tx, rx) = mpsc::sync_channel(config.max_queue_size);
        let stats = Arc::new(PublisherStats::default());
        let mut worker = Worker {
            pub_socket,
            router,
            topic: config.topic,
            layout: config.replay_layout,
            buffer: VecDeque::with_capacity(config.buffer_steps.min(1 << 14)),
            buffer_steps: config.buffer_steps,
            next_seq: 0,
            stats: Arc::clone(&stats),
        };
        let thread = std::thread::Builder::new()
            .name("kv-events-pub".into())
            .spawn(move || {
                loop {
                    match rx.recv_timeout(POLL) {
                        Ok(payload) => {
                            worker.send(payload);
                            while let Ok(more) = rx.try_recv() {
                                worker.send(more);
                            }
                        }
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                    worker.serve_replays();
                }
            })
            .map_err(PublisherError::Thread)?;
        Ok(Self {
            tx: Some(tx),
            stats,
            thread: Some(thread),
        })
    }

    /// Queues one encoded batch; returns false (and counts it) when the queue is full.
    pub fn publish(&self, payload: Vec<u8>) -> bool {
        let Some(tx) = &self.tx else { return false };
        match tx.try_send(payload) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// The publisher's counters.
    pub fn stats(&self) -> Arc<PublisherStats> {
        Arc::clone(&self.stats)
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn open(
    ctx: &zmq::Context,
    kind: zmq::SocketType,
    endpoint: &str,
    wildcard: Option<std::net::IpAddr>,
    configure: impl FnOnce(&zmq::Socket) -> zmq::Result<()>,
) -> Result<zmq::Socket, PublisherError> {
    let err = |source| PublisherError::Socket {
        endpoint: endpoint.to_owned(),
        source,
    };
    let socket = ctx.socket(kind).map_err(err)?;
    configure(&socket).map_err(err)?;
    if kind == zmq::ROUTER || super::kv_config::KvEventsConfig::binds(endpoint) {
        let bound = match wildcard {
            Some(ip) => endpoint.replace("tcp://*:", &format!("tcp://{ip}:")),
            None => endpoint.to_owned(),
        };
        socket.bind(&bound).map_err(err)?;
    } else {
        socket.connect(endpoint).map_err(err)?;
    }
    Ok(socket)
}

struct Worker {
    pub_socket: zmq::Socket,
    router: Option<zmq::Socket>,
    topic: String,
    layout: ReplayLayout,
    buffer: VecDeque<(u64, Vec<u8>)>,
    buffer_steps: usize,
    next_seq: u64,
    stats: Arc<PublisherStats>,
}

impl Worker {
    fn send(&mut self, payload: Vec<u8>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let frame = KvFrame {
            topic: &self.topic,
            seq,
            payload: &payload,
        };
        match self.pub_socket.send_multipart(frame.to_parts(), 0) {
            Ok(()) => {
                self.stats.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(seq, error = %e, "KV-event batch not sent"),
        }
        if self.buffer_steps > 0 {
            if self.buffer.len() == self.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer.push_back((seq, payload));
        }
    }

    fn serve_replays(&mut self) {
        let Some(router) = &self.router else { return };
        while let Ok(parts) = router.recv_multipart(zmq::DONTWAIT) {
            let (identity, request) = match parts.split_first() {
                Some(split) => split,
                None => continue,
            };
            let start = match request {
                [delim, seq] if delim.is_empty() && seq.len() == 8 => {
                    let mut be = [0u8; 8];
                    be.copy_from_slice(seq);
                    u64::from_be_bytes(be)
                }
                _ => {
                    self.stats
                        .bad_replay_requests
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        parts = parts.len(),
                        "malformed KV-event replay request ignored"
                    );
                    continue;
                }
            };
            self.stats.replays.fetch_add(1, Ordering::Relaxed);
            tracing::info!(start_seq = start, "serving KV-event replay");
            for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                let reply = ReplayReply::Batch {
                    layout: self.layout,
                    frame: KvFrame {
                        topic: &self.topic,
                        seq: *seq,
                        payload,
                    },
                };
                if reply_to(router, identity, reply.to_parts(self.layout)).is_err() {
                    break;
                }
            }
            let _ = reply_to(router, identity, ReplayReply::End.to_parts(self.layout));
        }
    }
}

fn reply_to(router: &zmq::Socket, identity: &[u8], parts: Vec<Vec<u8>>) -> zmq::Result<()> {
    let mut msg = Vec::with_capacity(parts.len() + 1);
    msg.push(identity.to_vec());
    msg.extend(parts);
    router.send_multipart(msg, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn publishes_with_seq_and_replays_with_end_marker() {
        let (p, r) = (free_port(), free_port());
        let publisher = Publisher::start(PublisherConfig {
            wildcard_address: None,
            endpoint: format!("tcp://*:{p}"),
            replay_endpoint: Some(format!("tcp://*:{r}")),
            topic: "kv@127.0.0.1:1@m".into(),
            buffer_steps: 2,
            hwm: 1000,
            max_queue_size: 16,
            replay_layout: ReplayLayout::WithTopic,
        })
        .unwrap();
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(5000).unwrap();
        sub.connect(&format!("tcp://127.0.0.1:{p}")).unwrap();
        // A SUB misses what is sent before its subscription lands; publish until one arrives.
        let mut first = None;
        for _ in 0..200 {
            publisher.publish(b"warm".to_vec());
            sub.set_rcvtimeo(20).unwrap();
            if let Ok(parts) = sub.recv_multipart(0) {
                first = Some(parts);
                break;
            }
        }
        let first = first.expect("no message reached the subscriber");
        let frame = KvFrame::from_parts(&first).unwrap();
        assert_eq!(frame.topic, "kv@127.0.0.1:1@m");
        sub.set_rcvtimeo(5000).unwrap();
        publisher.publish(b"a".to_vec());
        publisher.publish(b"b".to_vec());
        let mut last = frame.seq;
        loop {
            let parts = sub.recv_multipart(0).unwrap();
            let f = KvFrame::from_parts(&parts).unwrap();
            assert_eq!(f.seq, last + 1, "seq must be contiguous");
            last = f.seq;
            if f.payload == b"b" {
                break;
            }
        }
        // Replay from 0: only the last two (buffer_steps) are kept.
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.set_rcvtimeo(5000).unwrap();
        dealer.connect(&format!("tcp://127.0.0.1:{r}")).unwrap();
        dealer
            .send_multipart(kv_events::frame::replay_request(0), 0)
            .unwrap();
        let mut got = Vec::new();
        loop {
            let parts = dealer.recv_multipart(0).unwrap();
            match ReplayReply::from_parts(&parts).unwrap() {
                ReplayReply::Batch { layout, frame } => {
                    assert_eq!(layout, ReplayLayout::WithTopic);
                    got.push((frame.seq, frame.payload.to_vec()));
                }
                ReplayReply::End => break,
            }
        }
        assert_eq!(got, vec![(last - 1, b"a".to_vec()), (last, b"b".to_vec())]);
        assert_eq!(publisher.stats().replays.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn connects_to_a_bound_subscriber_when_the_endpoint_names_a_host() {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = sub.get_last_endpoint().unwrap().unwrap();
        let publisher = Publisher::start(PublisherConfig {
            wildcard_address: None,
            endpoint,
            replay_endpoint: None,
            topic: "t".into(),
            buffer_steps: 0,
            hwm: 1000,
            max_queue_size: 16,
            replay_layout: ReplayLayout::WithTopic,
        })
        .unwrap();
        sub.set_rcvtimeo(20).unwrap();
        let mut got = None;
        for _ in 0..250 {
            publisher.publish(b"x".to_vec());
            if let Ok(parts) = sub.recv_multipart(0) {
                got = Some(parts);
                break;
            }
        }
        let parts = got.expect("nothing arrived over the connected PUB socket");
        assert_eq!(KvFrame::from_parts(&parts).unwrap().topic, "t");
    }

    #[test]
    fn port_clash_is_a_startup_error() {
        let held = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = held.local_addr().unwrap().port();
        let err = Publisher::start(PublisherConfig {
            wildcard_address: None,
            endpoint: format!("tcp://*:{port}"),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 1,
            hwm: 1,
            max_queue_size: 1,
            replay_layout: ReplayLayout::Legacy,
        })
        .unwrap_err();
        assert!(err.to_string().contains(&port.to_string()), "{err}");
    }
}
