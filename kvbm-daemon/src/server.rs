//! The connector socket: accepts connections (bounded), runs the handshake and serves each
//! connection's requests in order (see [`crate::protocol`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_events::BlockKey;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{UnixListener, UnixStream};

use crate::fdpass;
use crate::held::HeldPins;
use crate::protocol::{self, ErrorCode, Request, Response, Slot};
use crate::ratelimit::ByteBucket;
use crate::segment::Segment;
use crate::service::{Origin, Service, ServiceError};
use crate::store::{Layout, LayoutId, StoreError};

/// The socket's limits.
#[derive(Debug, Clone, Copy)]
pub struct ServerConfig {
    /// Connections served at once; more are closed at once.
    pub max_connections: u64,
    /// The largest segment a connector may declare.
    pub max_segment_bytes: u64,
    /// A connection idle this long (or a handshake slower than this) is closed.
    pub idle_timeout: Duration,
    /// Bytes one connection may offload per second (0: no bound).
    pub offload_bytes_per_s: u64,
}

/// Serves `listener` until `shutdown` completes.
pub async fn serve(
    listener: UnixListener,
    service: Arc<Service>,
    config: ServerConfig,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let metrics = Arc::clone(service.metrics());
        if metrics.connections.load(Ordering::Relaxed) >= config.max_connections {
            metrics.connections_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                limit = config.max_connections,
                "connector refused: too many connections"
            );
            continue;
        }
        metrics.connections.fetch_add(1, Ordering::Relaxed);
        metrics.connections_total.fetch_add(1, Ordering::Relaxed);
        let service = Arc::clone(&service);
        tokio::spawn(async move {
            match connection(stream, &service, config).await {
                Ok(()) => tracing::debug!("connector disconnected"),
                Err(e) => tracing::info!(error = %e, "connector connection closed"),
            }
            metrics.connections.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("handshake: {0}")]
    Handshake(std::io::Error),
    #[error("idle for {0:?}")]
    Idle(Duration),
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Protocol(String),
}

/// The registered part of a connection.
struct Session {
    layout: LayoutId,
    block_bytes: u64,
    segment: Segment,
    /// The pins this connection holds (released when it closes).
    pins: HeldPins,
    /// Its offload budget, if bounded.
    budget: Option<ByteBucket>,
}

async fn connection(
    mut stream: UnixStream,
    service: &Service,
    config: ServerConfig,
) -> Result<(), ConnError> {
    let fd = tokio::time::timeout(config.idle_timeout, fdpass::recv_fd(&stream))
        .await
        .map_err(|_| ConnError::Idle(config.idle_timeout))?
        .map_err(|e| {
            service
                .metrics()
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            ConnError::Handshake(e)
        })?;
    let mut session: Option<Session> = None;
    let result = requests(&mut stream, Some(fd), &mut session, service, config).await;
    // However the connection ended, the pins it still holds go with it.
    if let Some(s) = &mut session {
        let keys: Vec<BlockKey> = s
            .pins
            .drain(Instant::now())
            .into_iter()
            .map(BlockKey)
            .collect();
        if !keys.is_empty() {
            match service.unpin(s.layout, &keys) {
                Ok(n) => tracing::debug!(released = n, "a closed connection's pins released"),
                Err(e) => tracing::debug!(error = %e, "a closed connection's pins not released"),
            }
        }
    }
    result
}

/// Serves one connection's requests until it ends.
async fn requests(
    stream: &mut UnixStream,
    fd: Option<std::os::fd::OwnedFd>,
    session: &mut Option<Session>,
    service: &Service,
    config: ServerConfig,
) -> Result<(), ConnError> {
    let mut fd = fd;
    let mut out = Vec::new();
    loop {
        let mut header = [0u8; 4];
        match tokio::time::timeout(config.idle_timeout, stream.read_exact(&mut header)).await {
            Err(_) => return Err(ConnError::Idle(config.idle_timeout)),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(r) => {
                r?;
            }
        }
        let started = Instant::now();
        let request = match protocol::body_len(header) {
            Ok(len) => {
                let mut body = vec![0u8; len];
                tokio::time::timeout(config.idle_timeout, stream.read_exact(&mut body))
                    .await
                    .map_err(|_| ConnError::Idle(config.idle_timeout))??;
                protocol::decode_request(&body)
            }
            Err(e) => Err(e),
        };
        let (response, close) = match request {
            Err(e) => (error(ErrorCode::Malformed, e.to_string()), true),
            Ok(request) => {
                let op = request.op();
                let r = handle(request, session, &mut fd, service, config).await;
                service.metrics().request(op, started.elapsed());
                r
            }
        };
        if let Response::Error { code, message } = &response {
            service.metrics().error(*code);
            tracing::debug!(?code, %message, "connector request refused");
        }
        out.clear();
        protocol::encode(&response, &mut out);
        stream.write_all(&out).await?;
        if close {
            let why = match response {
                Response::Error { message, .. } => message,
                _ => String::new(),
            };
            return Err(ConnError::Protocol(why));
        }
    }
}

fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::Error {
        code,
        message: message.into(),
    }
}

fn service_error(e: &ServiceError) -> Response {
    let code = match e {
        ServiceError::Store(StoreError::BlockSize { .. }) => ErrorCode::Slot,
        ServiceError::Store(StoreError::UnknownLayout(_) | StoreError::Layout(_)) => {
            ErrorCode::Layout
        }
        ServiceError::Closing => ErrorCode::Unavailable,
    };
    error(code, e.to_string())
}

/// Runs blocking segment I/O without stalling the runtime's other tasks.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// Handles one request; the flag says whether to close the connection after answering.
async fn handle(
    request: Request,
    session: &mut Option<Session>,
    fd: &mut Option<std::os::fd::OwnedFd>,
    service: &Service,
    config: ServerConfig,
) -> (Response, bool) {
    let Some(s) = session.as_mut() else {
        return match request {
            Request::Register {
                layout,
                segment_bytes,
            } => {
                // A refused registration used the segment up: the connector starts over.
                let r = register(layout, segment_bytes, session, fd, service, config);
                let close = matches!(r, Response::Error { .. });
                (r, close)
            }
            _ => (
                error(ErrorCode::Sequence, "the first request must be register"),
                true,
            ),
        };
    };
    let response = match request {
        Request::Register { .. } => {
            return (error(ErrorCode::Sequence, "register sent twice"), true);
        }
        Request::Offload { parent, blocks } => offload(s, parent, &blocks, service),
        Request::Lookup { keys, pin_ms } => {
            let pin = Duration::from_millis(u64::from(pin_ms));
            // Taken before the service pins, so this connection's deadline is never later
            // than the store's.
            let until = Instant::now() + pin.min(service.max_pin());
            let block_keys: Vec<BlockKey> = keys.iter().copied().map(BlockKey).collect();
            match service.lookup(s.layout, &block_keys, pin) {
                Ok(held) => {
                    s.pins
                        .add(keys.get(..held.pinned as usize).unwrap_or_default(), until);
                    Response::Found {
                        host: held.host,
                        any: held.any,
                        pinned: held.pinned,
                        peer: held.peer,
                    }
                }
                Err(e) => service_error(&e),
            }
        }
        Request::Unpin { keys } => {
            // Only this connection's own, live pins.
            let mine: Vec<BlockKey> = s
                .pins
                .take(&keys, Instant::now())
                .into_iter()
                .map(BlockKey)
                .collect();
            match service.unpin(s.layout, &mine) {
                Ok(blocks) => Response::Unpinned { blocks },
                Err(e) => service_error(&e),
            }
        }
        Request::Onboard { blocks } => onboard(s, &blocks, service).await,
    };
    (response, false)
}

fn register(
    layout: Layout,
    segment_bytes: u64,
    session: &mut Option<Session>,
    fd: &mut Option<std::os::fd::OwnedFd>,
    service: &Service,
    config: ServerConfig,
) -> Response {
    let Some(descriptor) = fd.take() else {
        return error(ErrorCode::Sequence, "the segment was already used");
    };
    let segment = match Segment::new(descriptor, segment_bytes, config.max_segment_bytes) {
        Ok(s) => s,
        Err(e) => return error(ErrorCode::Segment, e.to_string()),
    };
    if segment_bytes < layout.block_bytes {
        return error(
            ErrorCode::Segment,
            format!(
                "the segment's {segment_bytes} bytes hold no block of {} bytes",
                layout.block_bytes
            ),
        );
    }
    let block_bytes = layout.block_bytes;
    let model = layout.model.clone();
    match service.register(layout) {
        Ok(id) => {
            tracing::info!(%model, block_bytes, segment_bytes, layout = id.0, "connector registered");
            *session = Some(Session {
                layout: id,
                block_bytes,
                segment,
                pins: HeldPins::default(),
                budget: (config.offload_bytes_per_s > 0).then(|| {
                    ByteBucket::new(config.offload_bytes_per_s, block_bytes, Instant::now())
                }),
            });
            Response::Registered { layout_id: id.0 }
        }
        Err(e) => service_error(&e),
    }
}

/// Block bytes one request holds in memory at once: larger offloads and onboards run in chunks
/// of whole blocks (a request may name 4,096 blocks of any size).
const CHUNK_BYTES: u64 = 64 << 20;

fn chunk_len(block_bytes: u64) -> usize {
    usize::try_from(CHUNK_BYTES / block_bytes.max(1))
        .unwrap_or(usize::MAX)
        .max(1)
}

/// Checks every slot against the segment, so a bad one refuses the request before anything
/// is read, stored or written.
fn check_slots(s: &Session, slots: &[Slot]) -> Result<(), Response> {
    for slot in slots {
        s.segment
            .check(slot.offset, s.block_bytes)
            .map_err(|e| error(ErrorCode::Slot, e.to_string()))?;
    }
    Ok(())
}

/// Stores the blocks of `slots`, as far as the connection's offload budget goes: past it, a
/// chain's tail is neither read nor stored, and counts as `skipped`.
fn offload(s: &mut Session, parent: Option<u64>, slots: &[Slot], service: &Service) -> Response {
    if let Err(r) = check_slots(s, slots) {
        return r;
    }
    let allowed = s.budget.as_mut().map_or(slots.len(), |b| {
        b.grant(Instant::now(), slots.len(), s.block_bytes)
    });
    let throttled = slots.len() - allowed;
    if throttled > 0 {
        service
            .metrics()
            .offload_throttled_blocks
            .fetch_add(throttled as u64, Ordering::Relaxed);
    }
    let slots = slots.get(..allowed).unwrap_or_default();
    let (mut stored, mut present) = (0u32, 0u32);
    let mut skipped = u32::try_from(throttled).unwrap_or(u32::MAX);
    let mut parent = parent.map(BlockKey);
    for chunk in slots.chunks(chunk_len(s.block_bytes)) {
        let read: Result<Vec<(BlockKey, Bytes)>, _> = blocking(|| {
            chunk
                .iter()
                .map(|slot| {
                    let data = s.segment.read(slot.offset, s.block_bytes)?;
                    Ok::<_, crate::segment::SegmentError>((BlockKey(slot.key), data))
                })
                .collect()
        });
        let blocks = match read {
            Ok(b) => b,
            Err(e) => return error(ErrorCode::Segment, e.to_string()),
        };
        match service.offload(s.layout, parent, &blocks) {
            Ok(done) => {
                stored += done.stored;
                present += done.present;
                skipped = skipped.saturating_add(done.skipped);
            }
            Err(e) => return service_error(&e),
        }
        parent = chunk.last().map(|slot| BlockKey(slot.key));
    }
    Response::Offloaded {
        stored,
        present,
        skipped,
    }
}

async fn onboard(s: &Session, slots: &[Slot], service: &Service) -> Response {
    if let Err(r) = check_slots(s, slots) {
        return r;
    }
    let (mut from_host, mut from_disk, mut from_remote, mut from_peer) = (0u32, 0u32, 0u32, 0u32);
    for chunk in slots.chunks(chunk_len(s.block_bytes)) {
        let keys: Vec<BlockKey> = chunk.iter().map(|s| BlockKey(s.key)).collect();
        let found = match service.onboard(s.layout, &keys).await {
            Ok(f) => f,
            Err(e) => return service_error(&e),
        };
        let written = blocking(|| {
            found
                .iter()
                .zip(chunk)
                .try_for_each(|((data, _), slot)| s.segment.write(slot.offset, data))
        });
        if let Err(e) = written {
            return error(ErrorCode::Segment, e.to_string());
        }
        for (_, origin) in &found {
            match origin {
                Origin::Host => from_host += 1,
                Origin::Disk => from_disk += 1,
                Origin::Remote => from_remote += 1,
                Origin::Peer => from_peer += 1,
            }
        }
        // The chain stops at the first block the node does not hold.
        if found.len() < chunk.len() {
            break;
        }
    }
    Response::Onboarded {
        blocks: from_host + from_disk + from_remote + from_peer,
        from_host,
        from_disk,
        from_remote,
        from_peer,
    }
}
