//! Pulling blocks from a peer: connect, authenticate both ways, ask, read (from the
//! connection or a fabric) and check.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_events::BlockKey;
use tokio::net::TcpStream;

use super::answer;
use super::auth::{self, Role, Secret};
use super::conn::{self, ConnError};
use super::fabric::Fabric;
use super::wire::{self, Frame};
use crate::store::Layout;

/// The longest a connection attempt may take (within the pull's deadline): a peer that died
/// leaves an address that answers nothing, and the pull should give up long before the
/// connector's own call times out.
const MAX_CONNECT: Duration = Duration::from_millis(500);

/// Who pulls, and how long a pull may take.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// This node.
    pub node: String,
    /// The mesh's secret.
    pub secret: Arc<Secret>,
    /// The whole exchange's deadline (connecting, both proofs, the blocks).
    pub timeout: Duration,
    /// The fabric answers may be read from (besides the connection).
    pub fabric: Option<Arc<dyn Fabric>>,
    /// Where fabric outcomes are counted.
    pub metrics: Arc<crate::metrics::Metrics>,
}

/// What a pull brought: the key before the first block in the holder's chain, and the
/// leading blocks of the keys asked (perhaps none).
pub type Pulled = (Option<BlockKey>, Vec<Bytes>);

/// The leading blocks of `keys` (under `layout`) that the peer `node` at `addr` holds, at
/// most one answer's worth; each checked against its sum and size.
pub async fn pull(
    config: &PullConfig,
    node: &str,
    addr: SocketAddr,
    layout: &Layout,
    keys: &[BlockKey],
) -> Result<Pulled, ConnError> {
    let deadline = Instant::now() + config.timeout;
    conn::within(
        config.timeout,
        exchange(config, node, addr, layout, keys, deadline),
    )
    .await
}

async fn exchange(
    config: &PullConfig,
    node: &str,
    addr: SocketAddr,
    layout: &Layout,
    keys: &[BlockKey],
    deadline: Instant,
) -> Result<Pulled, ConnError> {
    let connect = config.timeout.min(MAX_CONNECT);
    let mut stream = conn::within(connect, async { Ok(TcpStream::connect(addr).await?) }).await?;
    stream.set_nodelay(true)?;
    let Frame::Hello {
        node: server,
        nonce,
    } = conn::recv(&mut stream).await?
    else {
        return Err(ConnError::Protocol("expected hello".into()));
    };
    if server != node || nonce.len() != auth::NONCE_BYTES {
        return Err(ConnError::Protocol(format!(
            "{addr} answered as {server:?}, not the peer {node:?} that announced it"
        )));
    }
    let at = addr.to_string();
    let mine =
        auth::nonce().ok_or_else(|| ConnError::Protocol("no random nonce available".into()))?;
    let mac = config.secret.mac(Role::Client, &nonce, &config.node, &at);
    conn::send(
        &mut stream,
        &Frame::Auth {
            node: config.node.clone(),
            nonce: mine.clone(),
            mac,
        },
    )
    .await?;
    match conn::recv(&mut stream).await? {
        Frame::Welcome { mac }
            if config
                .secret
                .verify(Role::Server, &mine, &server, &at, &mac) => {}
        Frame::Welcome { .. } => {
            return Err(ConnError::Protocol(format!(
                "peer {server} at {addr} did not prove it holds the secret"
            )));
        }
        Frame::Refused { message } => return Err(ConnError::Protocol(message)),
        _ => return Err(ConnError::Protocol("expected welcome".into())),
    }
    let want = keys.len().min(wire::answer_blocks(layout.block_bytes));
    conn::send(
        &mut stream,
        &Frame::Pull {
            layout: layout.clone(),
            keys: keys.iter().take(want).map(|k| k.0).collect(),
            fabrics: config.fabric.iter().map(|f| f.name().to_owned()).collect(),
        },
    )
    .await?;
    let (block_bytes, sums, parent, via) = match conn::recv(&mut stream).await? {
        Frame::Blocks {
            block_bytes,
            sums,
            parent,
            via,
        } => (block_bytes, sums, parent, via),
        Frame::Refused { message } => return Err(ConnError::Protocol(message)),
        _ => return Err(ConnError::Protocol("expected blocks".into())),
    };
    if block_bytes != layout.block_bytes || sums.len() > want {
        return Err(ConnError::Protocol(format!(
            "asked {want} blocks of {} bytes, answered {} of {block_bytes}",
            layout.block_bytes,
            sums.len()
        )));
    }
    let len = usize::try_from(block_bytes)
        .map_err(|_| ConnError::Protocol("block size out of range".into()))?;
    let blocks = answer::receive(
        &mut stream,
        &server,
        len,
        &sums,
        via,
        config.fabric.as_ref(),
        deadline,
        &config.metrics.peer,
    )
    .await
    .map_err(|e| match e {
        ConnError::Protocol(m) => ConnError::Protocol(format!("{server}: {m}")),
        other => other,
    })?;
    Ok((parent.map(BlockKey), blocks))
}
