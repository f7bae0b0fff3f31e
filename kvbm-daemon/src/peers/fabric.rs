//! Fabrics an answer's blocks may travel on instead of the pull connection.
//!
//! The server exposes the answer (one buffer) and sends an [`Offer`] in its `blocks` frame;
//! the client reads it and checks every block's sum; anything short of that and the bytes come
//! over the connection after all. [`NixlFabric`] is the one real fabric (NIXL READs over UCX:
//! RDMA where the nodes have it); `--peer-fabric nixl` turns it on.

use std::fmt;
use std::time::Instant;

use bytes::Bytes;

use super::wire::Offer;

/// A way to move an answer's bytes from server to client besides the pull connection.
pub trait Fabric: Send + Sync + fmt::Debug {
    /// Its name on the wire (`fabrics` in `pull`, `fabric` in an offer).
    fn name(&self) -> &'static str;

    /// Puts `blocks`, one after another, where the client can read them, and says where.
    /// Dropping the exposure lets its buffer be reused at once (the client has read it);
    /// [`Exposure::abandon`] keeps it out of use a while longer (the client may still be
    /// reading). Blocking: call it where blocking is allowed.
    fn expose(&self, blocks: &[Bytes]) -> Result<Exposure, FabricError>;

    /// Buffers given up on so far (a transfer still ran long after its deadline).
    fn leaked_buffers(&self) -> u64 {
        0
    }

    /// Reads the `len` bytes `offer` from the daemon of `node` exposes, by `deadline`.
    /// Blocking.
    fn read(
        &self,
        node: &str,
        offer: &Offer,
        len: u64,
        deadline: Instant,
    ) -> Result<Vec<u8>, FabricError>;
}

/// Bytes exposed on a fabric.
pub struct Exposure {
    /// What the client needs to read them.
    pub offer: Offer,
    /// Holds the buffer; dropping it frees the buffer for reuse.
    pub held: Box<dyn Held>,
}

/// What keeps an exposure's buffer.
pub trait Held: Send + Sync {
    /// The client may still be reading: keep the buffer out of use a while longer.
    fn abandon(self: Box<Self>);
}

impl Exposure {
    /// The client may still be reading: keep the buffer out of use a while longer.
    pub fn abandon(self) {
        self.held.abandon();
    }
}

impl Held for kvbm_nixl::Exposed {
    fn abandon(self: Box<Self>) {
        self.quarantine();
    }
}

impl fmt::Debug for Exposure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exposure")
            .field("fabric", &self.offer.fabric)
            .field("addr", &self.offer.addr)
            .finish_non_exhaustive()
    }
}

/// A fabric operation failed; the bytes go over the pull connection instead.
#[derive(Debug, thiserror::Error)]
#[error("{fabric}: {source}")]
pub struct FabricError {
    /// The fabric.
    pub fabric: &'static str,
    /// What failed.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// NIXL (its UCX backend) as a fabric.
#[derive(Debug)]
pub struct NixlFabric(kvbm_nixl::Nixl);

impl NixlFabric {
    /// The wire name.
    pub const NAME: &'static str = "nixl";

    /// Wraps a loaded NIXL agent (its pool's buffers must hold an answer:
    /// [`super::wire::MAX_ANSWER_BYTES`]).
    pub fn new(nixl: kvbm_nixl::Nixl) -> Self {
        Self(nixl)
    }

    fn error(source: kvbm_nixl::ReadError) -> FabricError {
        FabricError {
            fabric: Self::NAME,
            source: Box::new(source),
        }
    }
}

impl Fabric for NixlFabric {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn leaked_buffers(&self) -> u64 {
        self.0.leaked_buffers() as u64
    }

    fn expose(&self, blocks: &[Bytes]) -> Result<Exposure, FabricError> {
        let len: usize = blocks.iter().map(Bytes::len).sum();
        let fill = |out: &mut [u8]| {
            let mut at = 0;
            for block in blocks {
                if let Some(dst) = out.get_mut(at..at + block.len()) {
                    dst.copy_from_slice(block);
                }
                at += block.len();
            }
        };
        let exposed = self.0.expose(len as u64, fill).map_err(Self::error)?;
        let offer = Offer {
            fabric: Self::NAME.into(),
            metadata: exposed.offer().metadata.clone(),
            addr: exposed.offer().addr,
        };
        Ok(Exposure {
            offer,
            held: Box::new(exposed),
        })
    }

    fn read(
        &self,
        node: &str,
        offer: &Offer,
        len: u64,
        deadline: Instant,
    ) -> Result<Vec<u8>, FabricError> {
        let offer = kvbm_nixl::Offer {
            metadata: offer.metadata.clone(),
            addr: offer.addr,
            len,
        };
        self.0
            .read(node, &offer, deadline, <[u8]>::to_vec)
            .map_err(Self::error)
    }
}
