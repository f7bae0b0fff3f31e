//! Both ends of one answer: its `blocks` header, then its bytes over the connection or, when
//! both ends have the same fabric, read from there (falling back to the connection).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

use super::conn::{self, ConnError};
use super::fabric::{Exposure, Fabric};
use super::metrics::{FabricRead, FabricServe, PeerMetrics};
use super::wire::{self, Frame, Offer};

/// An answer to a pull.
#[derive(Debug, Clone, Copy)]
pub struct Answer<'a> {
    /// The layout's block size.
    pub block_bytes: u64,
    /// The key before the first block in the server's chain.
    pub parent: Option<u64>,
    /// The leading blocks the server holds.
    pub blocks: &'a [Bytes],
}

/// The server's side: sends `answer` (with each block's sum) to a client that named
/// `fabrics`. Every step within `io`.
pub async fn send(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    answer: Answer<'_>,
    fabric: Option<&Arc<dyn Fabric>>,
    fabrics: &[String],
    io: Duration,
    metrics: &PeerMetrics,
) -> Result<(), ConnError> {
    let Answer {
        block_bytes,
        parent,
        blocks,
    } = answer;
    let fabric = fabric.filter(|f| !blocks.is_empty() && fabrics.iter().any(|n| n == f.name()));
    let exposure = match fabric {
        Some(fabric) => expose(fabric, blocks, metrics).await,
        None => None,
    };
    let header = Frame::Blocks {
        block_bytes,
        sums: blocks.iter().map(|b| wire::sum(b)).collect(),
        parent,
        via: exposure.as_ref().map(|e| e.offer.clone()),
    };
    let sent = conn::within(io, conn::send(stream, &header)).await;
    if let Some(exposure) = exposure {
        // The client reads within its own pull deadline; this end waits at most `io`.
        let fetched = match sent {
            Ok(()) => conn::within(io, conn::recv(stream)).await,
            Err(e) => Err(e),
        };
        match fetched {
            Ok(Frame::Fetched { ok: true }) => {
                drop(exposure);
                metrics.fabric_served(FabricServe::Read);
                return Ok(());
            }
            // The client gave up on the fabric. Its read, if one still runs, only reads this
            // buffer, and it has stopped waiting for those bytes: the buffer is reused at once.
            Ok(Frame::Fetched { ok: false }) => {
                drop(exposure);
                metrics.fabric_served(FabricServe::FellBack);
            }
            other => {
                exposure.abandon();
                metrics.fabric_served(FabricServe::Abandoned);
                return match other {
                    Err(e) => Err(e),
                    Ok(_) => Err(ConnError::Protocol("expected fetched".into())),
                };
            }
        }
    } else {
        sent?;
    }
    conn::within(io, async {
        for block in blocks {
            stream.write_all(block).await?;
        }
        Ok(())
    })
    .await
}

/// Exposes `blocks` as one buffer on `fabric`, or says why not (the answer then goes over
/// the connection).
async fn expose(
    fabric: &Arc<dyn Fabric>,
    blocks: &[Bytes],
    metrics: &PeerMetrics,
) -> Option<Exposure> {
    let fabric = Arc::clone(fabric);
    // Clones of `Bytes` share their bytes.
    let blocks = blocks.to_vec();
    match tokio::task::spawn_blocking(move || fabric.expose(&blocks)).await {
        Ok(Ok(exposure)) => Some(exposure),
        Ok(Err(e)) => {
            metrics.fabric_served(FabricServe::Failed);
            tracing::warn!(error = %e, "answer not exposed on the fabric; sent on the connection");
            None
        }
        Err(e) => {
            metrics.fabric_served(FabricServe::Failed);
            tracing::warn!(error = %e, "exposing an answer panicked; sent on the connection");
            None
        }
    }
}

/// The client's side, after reading an answer's `blocks` header: the blocks, each checked
/// against its sum. An offer on `fabric` is read within half the time left before `deadline`
/// (the other half is the fallback's); if that fails, or a block read there fails its sum, or
/// less than [`MIN_FABRIC_TIME`] is left, the client says so and takes the bytes from the
/// connection. `node` is the server's (authenticated) node.
#[allow(clippy::too_many_arguments)]
pub async fn receive(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    node: &str,
    block_bytes: usize,
    sums: &[u64],
    via: Option<Offer>,
    fabric: Option<&Arc<dyn Fabric>>,
    deadline: Instant,
    metrics: &PeerMetrics,
) -> Result<Vec<Bytes>, ConnError> {
    let total = block_bytes
        .checked_mul(sums.len())
        .ok_or_else(|| ConnError::Protocol("answer size out of range".into()))?;
    if let Some(offer) = via {
        let left = deadline.saturating_duration_since(Instant::now());
        let read = match fabric.filter(|f| f.name() == offer.fabric) {
            Some(_) if left < MIN_FABRIC_TIME => Err(format!("only {left:?} left for the pull")),
            Some(fabric) => read(fabric, node, offer, total, Instant::now() + left / 2).await,
            None => Err(format!(
                "offered fabric {:?}, which this node did not ask for",
                offer.fabric
            )),
        };
        let checked = read.and_then(|bytes| {
            split(Bytes::from(bytes), block_bytes, sums)
                .map_err(|i| format!("block {i} read from the fabric failed its checksum"))
        });
        match checked {
            Ok(blocks) => {
                conn::send(stream, &Frame::Fetched { ok: true }).await?;
                metrics.fabric_read(FabricRead::Ok);
                return Ok(blocks);
            }
            Err(why) => {
                metrics.fabric_read(FabricRead::FellBack);
                tracing::warn!(error = %why, "answer not read from the fabric; taken from the connection");
                conn::send(stream, &Frame::Fetched { ok: false }).await?;
            }
        }
    }
    let mut all = BytesMut::zeroed(total);
    stream.read_exact(&mut all).await?;
    split(all.freeze(), block_bytes, sums)
        .map_err(|i| ConnError::Protocol(format!("block {i} failed its checksum")))
}

/// Less time than this left for a pull, and an offer on a fabric is not tried.
pub const MIN_FABRIC_TIME: Duration = Duration::from_millis(20);

async fn read(
    fabric: &Arc<dyn Fabric>,
    node: &str,
    offer: Offer,
    total: usize,
    deadline: Instant,
) -> Result<Vec<u8>, String> {
    let fabric = Arc::clone(fabric);
    let len = total as u64;
    let node = node.to_owned();
    match tokio::task::spawn_blocking(move || fabric.read(&node, &offer, len, deadline)).await {
        Ok(Ok(bytes)) if bytes.len() == total => Ok(bytes),
        Ok(Ok(bytes)) => Err(format!("read {} bytes of {total}", bytes.len())),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(format!("the read panicked: {e}")),
    }
}

/// `all` cut into blocks of `len`, each checked against its sum; or the first that fails.
fn split(mut all: Bytes, len: usize, sums: &[u64]) -> Result<Vec<Bytes>, usize> {
    let mut blocks = Vec::with_capacity(sums.len());
    for (i, sum) in sums.iter().enumerate() {
        if all.len() < len {
            return Err(i);
        }
        let block = all.split_to(len);
        if wire::sum(&block) != *sum {
            return Err(i);
        }
        blocks.push(block);
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;
    use crate::peers::fabric::{FabricError, Held};

    /// A fabric within one process: exposed buffers in a map shared by both ends; `corrupt`
    /// flips a byte of what it reads, `broken` fails every read, `refuse` every exposure.
    #[derive(Debug, Default)]
    struct Fake {
        exposed: Arc<Mutex<HashMap<u64, Vec<u8>>>>,
        next: Mutex<u64>,
        corrupt: bool,
        broken: bool,
        refuse: bool,
        reads: std::sync::atomic::AtomicUsize,
    }

    #[derive(Debug)]
    struct Gone(Arc<Mutex<HashMap<u64, Vec<u8>>>>, u64);

    impl Held for Gone {
        fn abandon(self: Box<Self>) {
            // Abandoned buffers are kept (a real fabric quarantines them).
            std::mem::forget(self);
        }
    }

    impl Drop for Gone {
        fn drop(&mut self) {
            self.0.lock().unwrap().remove(&self.1);
        }
    }

    fn failure(why: &str) -> FabricError {
        FabricError {
            fabric: "fake",
            source: why.into(),
        }
    }

    impl Fabric for Fake {
        fn name(&self) -> &'static str {
            "fake"
        }

        fn expose(&self, blocks: &[Bytes]) -> Result<Exposure, FabricError> {
            if self.refuse {
                return Err(failure("refused"));
            }
            let bytes = blocks.concat();
            let mut next = self.next.lock().unwrap();
            *next += 1;
            self.exposed.lock().unwrap().insert(*next, bytes);
            Ok(Exposure {
                offer: Offer {
                    fabric: "fake".into(),
                    metadata: b"md".to_vec(),
                    addr: *next,
                },
                held: Box::new(Gone(Arc::clone(&self.exposed), *next)),
            })
        }

        fn read(
            &self,
            _: &str,
            offer: &Offer,
            len: u64,
            _: Instant,
        ) -> Result<Vec<u8>, FabricError> {
            self.reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if self.broken {
                return Err(failure("broken"));
            }
            let exposed = self.exposed.lock().unwrap();
            let mut bytes = exposed
                .get(&offer.addr)
                .cloned()
                .ok_or_else(|| failure("not exposed"))?;
            assert_eq!(bytes.len() as u64, len);
            if self.corrupt {
                bytes[0] ^= 1;
            }
            Ok(bytes)
        }
    }

    fn blocks() -> Vec<Bytes> {
        (0..3u8).map(|i| Bytes::from(vec![i; 64])).collect()
    }

    /// One answer from a server with `server`'s fabric to a client with `client`'s, which names
    /// its fabric when it has one. Returns what the client got, the bytes that crossed the
    /// connection after the header, and both ends' metrics.
    async fn exchange(
        server: Option<Fake>,
        client: Option<Fake>,
    ) -> (Vec<Bytes>, PeerMetrics, PeerMetrics) {
        type Shared = Option<Arc<dyn Fabric>>;
        let (server, client): (Shared, Shared) = (
            server.map(|f| Arc::new(f) as _),
            client.map(|f| Arc::new(f) as _),
        );
        let (mut near, mut far) = tokio::io::duplex(1 << 20);
        let (served, pulled) = (PeerMetrics::default(), PeerMetrics::default());
        let fabrics: Vec<String> = client.iter().map(|f| f.name().to_owned()).collect();
        let blocks = blocks();
        let io = Duration::from_secs(5);
        let answer = Answer {
            block_bytes: 64,
            parent: None,
            blocks: &blocks,
        };
        let serve = send(&mut near, answer, server.as_ref(), &fabrics, io, &served);
        let take = async {
            let Frame::Blocks { sums, via, .. } = conn::recv(&mut far).await.unwrap() else {
                panic!("expected blocks");
            };
            let deadline = Instant::now() + io;
            receive(
                &mut far,
                "server",
                64,
                &sums,
                via,
                client.as_ref(),
                deadline,
                &pulled,
            )
            .await
        };
        let (sent, got) = tokio::join!(serve, take);
        sent.unwrap();
        (got.unwrap(), served, pulled)
    }

    fn shared() -> (Fake, Fake) {
        let exposed = Arc::new(Mutex::new(HashMap::new()));
        (
            Fake {
                exposed: Arc::clone(&exposed),
                ..Fake::default()
            },
            Fake {
                exposed,
                ..Fake::default()
            },
        )
    }

    fn counts(m: &PeerMetrics) -> String {
        let mut e = telemetry::Exposition::new();
        m.render(&mut e);
        e.finish()
            .lines()
            .filter(|l| l.starts_with("kvgate_kvbm_peer_fabric_") && !l.ends_with(" 0"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[tokio::test]
    async fn an_answer_travels_on_the_fabric_when_both_ends_have_it() {
        let (server, client) = shared();
        let exposed = Arc::clone(&server.exposed);
        let (got, served, pulled) = exchange(Some(server), Some(client)).await;
        assert_eq!(got, blocks());
        assert_eq!(
            counts(&served),
            r#"kvgate_kvbm_peer_fabric_served_total{outcome="read"} 1"#
        );
        assert_eq!(
            counts(&pulled),
            r#"kvgate_kvbm_peer_fabric_reads_total{outcome="ok"} 1"#
        );
        assert!(
            exposed.lock().unwrap().is_empty(),
            "withdrawn after the read"
        );
    }

    #[tokio::test]
    async fn a_failed_read_or_a_wrong_sum_falls_back_to_the_connection() {
        for (corrupt, broken) in [(true, false), (false, true)] {
            let (server, client) = shared();
            let client = Fake {
                corrupt,
                broken,
                ..client
            };
            let (got, served, pulled) = exchange(Some(server), Some(client)).await;
            assert_eq!(got, blocks(), "corrupt {corrupt}, broken {broken}");
            assert_eq!(
                counts(&served),
                r#"kvgate_kvbm_peer_fabric_served_total{outcome="fell_back"} 1"#
            );
            assert_eq!(
                counts(&pulled),
                r#"kvgate_kvbm_peer_fabric_reads_total{outcome="fell_back"} 1"#
            );
        }
    }

    #[tokio::test]
    async fn without_the_fabric_on_either_end_the_connection_carries_the_answer() {
        // The client has none: the server never exposes.
        let (server, _) = shared();
        let exposed = Arc::clone(&server.exposed);
        let (got, served, _) = exchange(Some(server), None).await;
        assert_eq!(got, blocks());
        assert_eq!(counts(&served), "");
        assert!(exposed.lock().unwrap().is_empty());
        // The server has none: the client's word is ignored.
        let (_, client) = shared();
        let (got, _, pulled) = exchange(None, Some(client)).await;
        assert_eq!(got, blocks());
        assert_eq!(counts(&pulled), "");
        // The server cannot expose: it says so in its metrics and uses the connection.
        let (server, client) = shared();
        let server = Fake {
            refuse: true,
            ..server
        };
        let (got, served, pulled) = exchange(Some(server), Some(client)).await;
        assert_eq!(got, blocks());
        assert_eq!(
            counts(&served),
            r#"kvgate_kvbm_peer_fabric_served_total{outcome="not_exposed"} 1"#
        );
        assert_eq!(counts(&pulled), "");
    }

    #[tokio::test]
    async fn an_offer_on_a_fabric_the_client_lacks_falls_back() {
        // A server that offers a fabric the client never named (another build, say).
        let (mut near, mut far) = tokio::io::duplex(1 << 20);
        let pulled = PeerMetrics::default();
        let blocks = blocks();
        let sums: Vec<u64> = blocks.iter().map(|b| wire::sum(b)).collect();
        let offer = Offer {
            fabric: "rdma-of-the-future".into(),
            metadata: Vec::new(),
            addr: 0,
        };
        let server = async {
            let fetched = conn::recv(&mut near).await.unwrap();
            assert_eq!(fetched, Frame::Fetched { ok: false });
            for b in &blocks {
                near.write_all(b).await.unwrap();
            }
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        let client = receive(
            &mut far,
            "server",
            64,
            &sums,
            Some(offer),
            None,
            deadline,
            &pulled,
        );
        let ((), got) = tokio::join!(server, client);
        assert_eq!(got.unwrap(), blocks);
        assert_eq!(
            counts(&pulled),
            r#"kvgate_kvbm_peer_fabric_reads_total{outcome="fell_back"} 1"#
        );
    }

    #[tokio::test]
    async fn a_client_gone_before_saying_fetched_leaves_the_buffer_abandoned() {
        let (server, _) = shared();
        let exposed = Arc::clone(&server.exposed);
        let server: Arc<dyn Fabric> = Arc::new(server);
        let (mut near, mut far) = tokio::io::duplex(1 << 20);
        let served = PeerMetrics::default();
        let blocks = blocks();
        let answer = Answer {
            block_bytes: 64,
            parent: None,
            blocks: &blocks,
        };
        let fabrics = vec!["fake".to_owned()];
        let serve = send(
            &mut near,
            answer,
            Some(&server),
            &fabrics,
            Duration::from_secs(5),
            &served,
        );
        let client = async {
            let header = conn::recv(&mut far).await.unwrap();
            assert!(matches!(header, Frame::Blocks { via: Some(_), .. }));
            drop(far);
        };
        let (sent, ()) = tokio::join!(serve, client);
        assert!(sent.is_err());
        assert_eq!(
            counts(&served),
            r#"kvgate_kvbm_peer_fabric_served_total{outcome="abandoned"} 1"#
        );
        // Not given back for reuse at once: the client may still be reading it.
        assert_eq!(exposed.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn with_too_little_time_left_the_fabric_is_not_tried() {
        let (mut near, mut far) = tokio::io::duplex(1 << 20);
        let (server, client) = shared();
        let blocks = blocks();
        let exposure = server.expose(&blocks).unwrap();
        let sums: Vec<u64> = blocks.iter().map(|b| wire::sum(b)).collect();
        let client = Arc::new(client);
        let fabric: Arc<dyn Fabric> = Arc::clone(&client) as _;
        let pulled = PeerMetrics::default();
        let server_side = async {
            assert_eq!(
                conn::recv(&mut near).await.unwrap(),
                Frame::Fetched { ok: false }
            );
            for b in &blocks {
                near.write_all(b).await.unwrap();
            }
        };
        let deadline = Instant::now() + MIN_FABRIC_TIME / 2;
        let offer = Some(exposure.offer.clone());
        let take = receive(
            &mut far,
            "server",
            64,
            &sums,
            offer,
            Some(&fabric),
            deadline,
            &pulled,
        );
        let ((), got) = tokio::join!(server_side, take);
        assert_eq!(got.unwrap(), blocks);
        assert_eq!(
            counts(&pulled),
            r#"kvgate_kvbm_peer_fabric_reads_total{outcome="fell_back"} 1"#
        );
        assert_eq!(client.reads.load(std::sync::atomic::Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn bytes_that_fail_their_sum_on_the_connection_are_refused() {
        let (mut near, mut far) = tokio::io::duplex(1 << 20);
        let blocks = blocks();
        let sums: Vec<u64> = blocks.iter().map(|b| wire::sum(b)).collect();
        near.write_all(&[0xff; 64 * 3]).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let got = receive(
            &mut far,
            "server",
            64,
            &sums,
            None,
            None,
            deadline,
            &PeerMetrics::default(),
        )
        .await;
        assert!(matches!(got, Err(ConnError::Protocol(m)) if m.contains("block 0")));
    }
}
