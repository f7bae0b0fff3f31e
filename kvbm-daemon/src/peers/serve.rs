//! Serving pulls: each connection proves it holds the mesh's secret, then asks for runs of
//! blocks, which are read from this node's tiers (never from its own peers).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use super::answer::{self, Answer};
use super::auth::{self, Role, Secret};
use super::conn::{self, ConnError};
use super::fabric::Fabric;
use super::wire::Frame;
use crate::service::Service;

/// How the pull server runs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// This node.
    pub node: String,
    /// The address this node advertises (what a client proves it dialed).
    pub advertise: std::net::SocketAddr,
    /// The mesh's secret.
    pub secret: Arc<Secret>,
    /// Connections served at once; more are closed at once.
    pub max_connections: u64,
    /// Each handshake step, and sending an answer, must finish within this.
    pub io_timeout: Duration,
    /// A connection with no request for this long is closed.
    pub idle_timeout: Duration,
    /// The fabric answers are exposed on, for clients that name it.
    pub fabric: Option<Arc<dyn Fabric>>,
}

/// The longest each handshake step may take: a connection that has not proved itself holds
/// one of the connection slots only this long.
const MAX_HANDSHAKE_STEP: Duration = Duration::from_secs(1);

/// Counts a connection while it lives (also when its task panics).
struct Slot(Arc<crate::metrics::Metrics>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.peer.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts peer connections on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    service: Arc<Service>,
    config: ServeConfig,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let metrics = Arc::clone(service.metrics());
    loop {
        let (stream, from) = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "peer accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let peer = &metrics.peer;
        if peer.connections.load(Ordering::Relaxed) >= config.max_connections {
            peer.connections_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%from, "peer connection refused: at the connection limit");
            continue;
        }
        peer.connections.fetch_add(1, Ordering::Relaxed);
        let slot = Slot(Arc::clone(&metrics));
        let (service, config) = (Arc::clone(&service), config.clone());
        tokio::spawn(async move {
            let _slot = slot;
            match connection(stream, &service, &config).await {
                Ok(()) => tracing::debug!(%from, "peer connection closed"),
                Err(e) => tracing::info!(%from, error = %e, "peer connection ended"),
            }
        });
    }
}

async fn connection(
    mut stream: TcpStream,
    service: &Service,
    config: &ServeConfig,
) -> Result<(), ConnError> {
    stream.set_nodelay(true)?;
    let peer = &service.metrics().peer;
    let io = config.io_timeout;
    let step = io.min(MAX_HANDSHAKE_STEP);
    let at = config.advertise.to_string();
    let nonce = auth::nonce().ok_or_else(|| ConnError::Protocol("no random nonce".into()))?;
    let hello = Frame::Hello {
        node: config.node.clone(),
        nonce: nonce.clone(),
    };
    conn::within(step, conn::send(&mut stream, &hello)).await?;
    let (client, theirs, mac) = match conn::within(step, conn::recv(&mut stream)).await? {
        Frame::Auth { node, nonce, mac } => (node, nonce, mac),
        _ => return Err(ConnError::Protocol("expected auth".into())),
    };
    if theirs.len() != auth::NONCE_BYTES
        || !config
            .secret
            .verify(Role::Client, &nonce, &client, &at, &mac)
    {
        peer.auth_failures.fetch_add(1, Ordering::Relaxed);
        let refused = Frame::Refused {
            message: "authentication failed".into(),
        };
        let _ = conn::within(step, conn::send(&mut stream, &refused)).await;
        return Err(ConnError::Protocol(format!(
            "{client:?} failed authentication (another secret, or it dialed another address than {at})"
        )));
    }
    let welcome = Frame::Welcome {
        mac: config.secret.mac(Role::Server, &theirs, &config.node, &at),
    };
    conn::within(step, conn::send(&mut stream, &welcome)).await?;
    loop {
        let frame = match tokio::time::timeout(config.idle_timeout, conn::recv(&mut stream)).await {
            Err(_) => return Ok(()),
            Ok(Err(ConnError::Io(e))) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(());
            }
            Ok(other) => other?,
        };
        let Frame::Pull {
            layout,
            keys,
            fabrics,
        } = frame
        else {
            return Err(ConnError::Protocol("expected pull".into()));
        };
        let keys: Vec<kv_events::BlockKey> = keys.into_iter().map(kv_events::BlockKey).collect();
        let (parent, blocks) = match service.serve_pull(&layout, &keys).await {
            Ok(b) => b,
            Err(e) => {
                let refused = Frame::Refused {
                    message: e.to_string(),
                };
                let _ = conn::within(io, conn::send(&mut stream, &refused)).await;
                return Err(ConnError::Protocol(e.to_string()));
            }
        };
        let bytes: u64 = blocks.iter().map(|b| b.len() as u64).sum();
        let answer = Answer {
            block_bytes: layout.block_bytes,
            parent: parent.map(|k| k.0),
            blocks: &blocks,
        };
        answer::send(
            &mut stream,
            answer,
            config.fabric.as_ref(),
            &fabrics,
            io,
            peer,
        )
        .await?;
        peer.served_pulls.fetch_add(1, Ordering::Relaxed);
        peer.served_blocks
            .fetch_add(blocks.len() as u64, Ordering::Relaxed);
        peer.served_bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}
