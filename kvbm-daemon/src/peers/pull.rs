//! Pulling blocks from a peer: connect, authenticate both ways, ask, read and check.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use kv_events::BlockKey;
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;

use super::auth::{self, Role, Secret};
use super::conn::{self, ConnError};
use super::wire::{self, Frame};
use crate::store::Layout;

/// Who pulls, and how long a pull may take.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// This node.
    pub node: String,
    /// The mesh's secret.
    pub secret: Arc<Secret>,
    /// The whole exchange's deadline (connecting, both proofs, the blocks).
    pub timeout: Duration,
}

/// The leading blocks of `keys` (under `layout`) the peer at `addr` holds, at most one
/// answer's worth; each checked against its sum and size.
pub async fn pull(
    config: &PullConfig,
    addr: SocketAddr,
    layout: &Layout,
    keys: &[BlockKey],
) -> Result<Vec<Bytes>, ConnError> {
    conn::within(config.timeout, exchange(config, addr, layout, keys)).await
}

async fn exchange(
    config: &PullConfig,
    addr: SocketAddr,
    layout: &Layout,
    keys: &[BlockKey],
) -> Result<Vec<Bytes>, ConnError> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let Frame::Hello {
        node: server,
        nonce,
    } = conn::recv(&mut stream).await?
    else {
        return Err(ConnError::Protocol("expected hello".into()));
    };
    let mine =
        auth::nonce().ok_or_else(|| ConnError::Protocol("no random nonce available".into()))?;
    let mac = config.secret.mac(Role::Client, &nonce, &config.node);
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
        Frame::Welcome { mac } if config.secret.verify(Role::Server, &mine, &server, &mac) => {}
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
        },
    )
    .await?;
    let (block_bytes, sums) = match conn::recv(&mut stream).await? {
        Frame::Blocks { block_bytes, sums } => (block_bytes, sums),
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
    let mut all = BytesMut::zeroed(len * sums.len());
    stream.read_exact(&mut all).await?;
    let mut all = all.freeze();
    let mut blocks = Vec::with_capacity(sums.len());
    for (i, sum) in sums.iter().enumerate() {
        let block = all.split_to(len);
        if wire::sum(&block) != *sum {
            return Err(ConnError::Protocol(format!(
                "block {i} from {server} failed its checksum"
            )));
        }
        blocks.push(block);
    }
    Ok(blocks)
}
