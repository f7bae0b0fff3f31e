//! A block's SHA-256, stored with its object and checked when it is read back: a body altered
//! in the store or on the way back reads as a damaged block, never as the block. The same hash
//! is the payload hash the `PUT` is signed with, so a body altered on the way up is refused by
//! the store.
//!
//! The format is the one the hand-written client wrote (lowercase hex in the user metadata
//! `x-amz-meta-kvgate-sha256`), so objects it stored still read.

use std::fmt::Write as _;

use bytes::Bytes;
use ring::digest;

use crate::remote::RemoteError;

/// The user-metadata key carrying a block's SHA-256 (sent as `x-amz-meta-kvgate-sha256`).
pub(super) const SHA256_METADATA: &str = "kvgate-sha256";
/// Bodies hashed on the blocking pool rather than on the runtime's worker.
const HASH_INLINE_MAX: usize = 256 << 10;

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = digest::digest(&digest::SHA256, bytes);
    digest
        .as_ref()
        .iter()
        .fold(String::with_capacity(64), |mut out, byte| {
            // Writing to a String cannot fail.
            let _ = write!(out, "{byte:02x}");
            out
        })
}

/// The hex SHA-256 of `bytes`, large ones hashed on the blocking pool (~1.2 ms per 2 MiB).
pub(super) async fn hash(bytes: Bytes) -> Result<String, RemoteError> {
    if bytes.len() <= HASH_INLINE_MAX {
        return Ok(sha256_hex(&bytes));
    }
    tokio::task::spawn_blocking(move || sha256_hex(&bytes))
        .await
        .map_err(|e| RemoteError::Io(std::io::Error::other(e)))
}

/// `body`, once it matches the SHA-256 `stored` with the object `key`.
pub(super) async fn verify(
    key: &str,
    stored: Option<&str>,
    body: Bytes,
) -> Result<Bytes, RemoteError> {
    let Some(stored) = stored else {
        return Err(RemoteError::Integrity(format!(
            "{key} has no x-amz-meta-{SHA256_METADATA} (not written by kvgate-kvbm)"
        )));
    };
    let actual = hash(body.clone()).await?;
    if !stored.eq_ignore_ascii_case(&actual) {
        return Err(RemoteError::Integrity(format!(
            "{key}: the body's SHA-256 is {actual}, stored {stored}"
        )));
    }
    Ok(body)
}
