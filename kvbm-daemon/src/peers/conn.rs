//! Frames on a peer connection (a TCP stream), and deadlines.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

use super::wire::{self, Frame, WireError};

/// Why a peer exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The socket failed or closed.
    #[error("peer connection: {0}")]
    Io(#[from] std::io::Error),
    /// The deadline passed.
    #[error("peer connection: no answer within {0:?}")]
    Timeout(Duration),
    /// A frame could not be read.
    #[error("peer connection: {0}")]
    Wire(#[from] WireError),
    /// A frame above the bound.
    #[error("peer connection: {0}")]
    Frame(#[from] crate::protocol::FrameError),
    /// The other end broke the protocol (or refused).
    #[error("peer protocol: {0}")]
    Protocol(String),
}

impl ConnError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ConnError::Io(_) => "io",
            ConnError::Timeout(_) => "timeout",
            ConnError::Wire(_) | ConnError::Frame(_) | ConnError::Protocol(_) => "protocol",
        }
    }
}

/// `f` under `deadline`.
pub async fn within<T>(
    deadline: Duration,
    f: impl std::future::Future<Output = Result<T, ConnError>>,
) -> Result<T, ConnError> {
    tokio::time::timeout(deadline, f)
        .await
        .map_err(|_| ConnError::Timeout(deadline))?
}

/// Writes one frame.
pub async fn send(stream: &mut (impl AsyncWrite + Unpin), frame: &Frame) -> Result<(), ConnError> {
    let mut out = Vec::new();
    wire::encode(frame, &mut out);
    stream.write_all(&out).await?;
    Ok(())
}

/// Reads one frame.
pub async fn recv(stream: &mut (impl AsyncRead + Unpin)) -> Result<Frame, ConnError> {
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).await?;
    let len = wire::body_len(header)?;
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    Ok(wire::decode(&body)?)
}
