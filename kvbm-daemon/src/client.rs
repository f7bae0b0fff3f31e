//! The reference connector: what an engine's KV connector does to use the daemon, over the
//! protocol of [`crate::protocol`]. The daemon's tests and `kvgate-bench` use it.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;

use crate::fdpass;
use crate::protocol::{self, Request, Response, Slot};
use crate::segment::{self, Segment, SegmentError};
use crate::store::Layout;

/// Why a connector call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket failed.
    #[error("kvbm socket: {0}")]
    Io(#[from] std::io::Error),
    /// The segment could not be created or accessed.
    #[error("segment: {0}")]
    Segment(#[from] SegmentError),
    /// A frame could not be read.
    #[error("kvbm frame: {0}")]
    Frame(#[from] protocol::FrameError),
    /// The daemon answered with an error.
    #[error("kvbm refused the request ({code:?}): {message}")]
    Refused {
        /// The code.
        code: protocol::ErrorCode,
        /// The message.
        message: String,
    },
    /// The daemon answered with the wrong response type.
    #[error("unexpected response {0:?}")]
    Unexpected(Box<Response>),
}

/// What an onboard wrote: the first `blocks` slots hold their blocks, from these tiers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Onboarded {
    /// Blocks written.
    pub blocks: u32,
    /// Of which from host memory.
    pub host: u32,
    /// Of which read from disk.
    pub disk: u32,
    /// Of which fetched from the remote store.
    pub remote: u32,
    /// Of which pulled from another node's block manager.
    pub peer: u32,
}

/// A connected, registered connector with its own segment.
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    segment: Segment,
    layout_id: u32,
    buf: Vec<u8>,
}

impl Client {
    /// Creates a segment of `segment_bytes`, connects to `socket`, passes the segment and
    /// registers `layout`.
    pub async fn connect(
        socket: &Path,
        layout: Layout,
        segment_bytes: u64,
    ) -> Result<Self, ClientError> {
        let fd: OwnedFd = segment::create("kvgate-connector", segment_bytes)?;
        let stream = UnixStream::connect(socket).await?;
        fdpass::send_fd(&stream, fd.as_fd()).await?;
        let mut client = Self {
            stream,
            segment: Segment::new(fd, segment_bytes, u64::MAX)?,
            layout_id: 0,
            buf: Vec::new(),
        };
        match client
            .call(&Request::Register {
                layout,
                segment_bytes,
            })
            .await?
        {
            Response::Registered { layout_id } => client.layout_id = layout_id,
            other => return Err(unexpected(other)),
        }
        Ok(client)
    }

    /// The layout's id in the daemon.
    pub const fn layout_id(&self) -> u32 {
        self.layout_id
    }

    /// The connector's side of the shared segment.
    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    /// Offloads the blocks in `slots` (written to the segment beforehand): (stored, present,
    /// skipped because pinned blocks filled their tier).
    pub async fn offload(
        &mut self,
        parent: Option<u64>,
        slots: Vec<Slot>,
    ) -> Result<(u32, u32, u32), ClientError> {
        match self
            .call(&Request::Offload {
                parent,
                blocks: slots,
            })
            .await?
        {
            Response::Offloaded {
                stored,
                present,
                skipped,
            } => Ok((stored, present, skipped)),
            other => Err(unexpected(other)),
        }
    }

    /// Leading blocks held: (host, any tier).
    pub async fn lookup(&mut self, keys: Vec<u64>) -> Result<(u32, u32), ClientError> {
        let (host, any, _) = self.lookup_and_pin(keys, 0).await?;
        Ok((host, any))
    }

    /// Leading blocks held, pinning them for `pin_ms` (bounded by the daemon) so they are
    /// still there at the onboard: (host, any tier, pinned).
    pub async fn lookup_and_pin(
        &mut self,
        keys: Vec<u64>,
        pin_ms: u32,
    ) -> Result<(u32, u32, u32), ClientError> {
        match self.call(&Request::Lookup { keys, pin_ms }).await? {
            Response::Found {
                host, any, pinned, ..
            } => Ok((host, any, pinned)),
            other => Err(unexpected(other)),
        }
    }

    /// Releases the pins of `keys`: how many there were.
    pub async fn unpin(&mut self, keys: Vec<u64>) -> Result<u32, ClientError> {
        match self.call(&Request::Unpin { keys }).await? {
            Response::Unpinned { blocks } => Ok(blocks),
            other => Err(unexpected(other)),
        }
    }

    /// Onboards into `slots`: how many blocks, and from which tier.
    pub async fn onboard(&mut self, slots: Vec<Slot>) -> Result<Onboarded, ClientError> {
        match self.call(&Request::Onboard { blocks: slots }).await? {
            Response::Onboarded {
                blocks,
                from_host,
                from_disk,
                from_remote,
                from_peer,
            } => Ok(Onboarded {
                blocks,
                host: from_host,
                disk: from_disk,
                remote: from_remote,
                peer: from_peer,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// Sends one request and reads its response; daemon errors become [`ClientError::Refused`].
    pub async fn call(&mut self, request: &Request) -> Result<Response, ClientError> {
        self.buf.clear();
        protocol::encode(request, &mut self.buf);
        self.stream.write_all(&self.buf).await?;
        let mut header = [0u8; 4];
        self.stream.read_exact(&mut header).await?;
        let mut body = vec![0u8; protocol::body_len(header)?];
        self.stream.read_exact(&mut body).await?;
        match protocol::decode_response(&body)? {
            Response::Error { code, message } => Err(ClientError::Refused { code, message }),
            r => Ok(r),
        }
    }
}

fn unexpected(r: Response) -> ClientError {
    ClientError::Unexpected(Box::new(r))
}
