//! The remote tier (G4) at the edge: a Redis client ([`redis`], on the `redis` crate), or an
//! S3 client ([`s3`], on the AWS SDK's `aws-sdk-s3`); the names blocks take there, and
//! [`Remote`], the one the daemon was given.
//!
//! The remote store is shared by every node's daemon, so a block's name carries what makes its
//! bytes interchangeable: the layout's [fingerprint](crate::store::Layout::fingerprint) (not
//! the per-daemon [`LayoutId`](crate::store::LayoutId)) and the kvgate key. Two nodes that
//! offload the same block write the same bytes under the same name.

pub mod error;
pub mod redis;
pub mod s3;
pub mod tls;

use bytes::Bytes;
use kv_events::BlockKey;

pub use error::RemoteError;

/// The Redis key of a block: `kvgate:kvbm:<layout fingerprint>:<block key>`, both 16 hex
/// digits.
pub fn block_name(layout_fingerprint: u64, key: BlockKey) -> String {
    format!("kvgate:kvbm:{layout_fingerprint:016x}:{:016x}", key.0)
}

/// The remote store: Redis or an S3 bucket.
#[derive(Debug)]
pub enum Remote {
    /// `redis://` or `rediss://`.
    Redis(redis::Redis),
    /// `s3://`.
    S3(s3::S3),
}

impl Remote {
    /// Builds the TLS connector now, when the store speaks TLS: a CA bundle that cannot be
    /// read fails at start.
    pub fn prepare_tls(&self) -> Result<(), RemoteError> {
        match self {
            Self::Redis(r) => r.prepare_tls(),
            Self::S3(s) => s.prepare_tls(),
        }
    }

    /// Where it is (for logs).
    pub fn address(&self) -> String {
        match self {
            Self::Redis(r) => r.address(),
            Self::S3(s) => s.address(),
        }
    }

    /// The store's name of a block.
    pub fn block_name(&self, layout_fingerprint: u64, key: BlockKey) -> String {
        match self {
            Self::Redis(_) => block_name(layout_fingerprint, key),
            Self::S3(s) => s.block_name(layout_fingerprint, key),
        }
    }

    /// Whether the store answers (and, for S3, the bucket is there and may be used).
    pub async fn ping(&self) -> Result<(), RemoteError> {
        match self {
            Self::Redis(r) => r.ping().await,
            Self::S3(s) => s.ping().await,
        }
    }

    /// Stores `value` under `name`.
    pub async fn put(&self, name: &str, value: Bytes) -> Result<(), RemoteError> {
        match self {
            Self::Redis(r) => r.put(name.as_bytes(), &value).await,
            Self::S3(s) => s.put(name, value).await,
        }
    }

    /// The value under `name`, expected to be `len` bytes (S3 reads no more; Redis reads up to
    /// its configured bound); `None` when the store does not have it.
    pub async fn get(&self, name: &str, len: u64) -> Result<Option<Bytes>, RemoteError> {
        match self {
            Self::Redis(r) => r.get(name.as_bytes()).await,
            Self::S3(s) => {
                let limit = usize::try_from(len).unwrap_or(usize::MAX);
                s.get(name, limit).await
            }
        }
    }

    /// Deletes `name` (a missing one is deleted already).
    pub async fn delete(&self, name: &str) -> Result<(), RemoteError> {
        match self {
            Self::Redis(r) => r.delete(name.as_bytes()).await,
            Self::S3(s) => s.delete(name).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_fixed_width_and_layout_scoped() {
        assert_eq!(
            block_name(0xab, BlockKey(1)),
            "kvgate:kvbm:00000000000000ab:0000000000000001"
        );
        assert_ne!(block_name(1, BlockKey(7)), block_name(2, BlockKey(7)));
    }
}
