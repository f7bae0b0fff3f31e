//! The remote tier's S3 client: objects in one bucket under one prefix, on the AWS SDK for
//! Rust (`aws-sdk-s3`), which signs every request with SigV4; each operation under a deadline.
//!
//! It speaks to AWS S3 and to S3-compatible stores (MinIO, Ceph RGW, SeaweedFS, …): `PUT`,
//! `GET`, `DELETE` of an object and `HEAD` of the bucket, nothing else. How the SDK is set up
//! (HTTP, TLS, credentials, no retries) is in the `sdk` module; what its errors mean, in
//! `errors`; the SHA-256 each block is stored and checked with, in `integrity`.
//!
//! Addressing is path-style (`https://endpoint/bucket/key`) for a given endpoint, and
//! virtual-hosted (`https://bucket.s3.<region>.amazonaws.com/key`) for AWS's own, unless
//! [`Addressing`] says otherwise. The payload is always signed (its SHA-256 is sent), so a
//! body altered in flight is refused even over plain HTTP.

mod config;
mod error_body;
mod errors;
mod integrity;
mod sdk;
#[cfg(test)]
mod tests;

use std::sync::OnceLock;

use aws_sdk_s3::primitives::ByteStream;
use bytes::{Bytes, BytesMut};
use kv_events::BlockKey;

pub use config::{Addressing, Credentials, S3Config, S3Options, credentials_from, region_from};
pub use integrity::sha256_hex;

use super::RemoteError;
use super::error::Failure;
use integrity::SHA256_METADATA;

/// An S3 client for the remote tier.
pub struct S3 {
    config: S3Config,
    /// The SDK client, built once (by [`S3::prepare_tls`] or the first request).
    client: OnceLock<aws_sdk_s3::Client>,
}

impl std::fmt::Debug for S3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3")
            .field("config", &self.config)
            .field("client_ready", &self.client.get().is_some())
            .finish_non_exhaustive()
    }
}

impl S3 {
    /// A client; nothing is connected until the first request.
    pub fn new(config: S3Config) -> Self {
        Self {
            config,
            client: OnceLock::new(),
        }
    }

    /// Builds the SDK client now, so a CA bundle that cannot be read (for `https`) fails at
    /// start rather than at the first request.
    pub fn prepare_tls(&self) -> Result<(), RemoteError> {
        self.client().map(|_| ())
    }

    fn client(&self) -> Result<&aws_sdk_s3::Client, RemoteError> {
        if let Some(client) = self.client.get() {
            return Ok(client);
        }
        let client = sdk::client(&self.config)?;
        Ok(self.client.get_or_init(|| client))
    }

    /// Where it sends requests (for logs): endpoint, bucket and prefix.
    pub fn address(&self) -> String {
        format!(
            "{}/{}/{}",
            self.config.endpoint(),
            self.config.bucket,
            self.config.prefix
        )
    }

    /// A block's object key: `<prefix><layout fingerprint>/<block key>`, both 16 hex digits.
    pub fn block_name(&self, layout_fingerprint: u64, key: BlockKey) -> String {
        format!(
            "{}{layout_fingerprint:016x}/{:016x}",
            self.config.prefix, key.0
        )
    }

    /// `HEAD` of the bucket: it exists and the credentials may use it.
    pub async fn ping(&self) -> Result<(), RemoteError> {
        let request = self.client()?.head_bucket().bucket(&self.config.bucket);
        self.deadline(async {
            match request.send().await {
                Ok(_) => Ok(()),
                Err(e) => Err(errors::classify("HEAD", e, self.config.timeout)),
            }
        })
        .await
    }

    /// `PUT` of the object `key`, signed with its SHA-256, which is stored as metadata.
    pub async fn put(&self, key: &str, value: Bytes) -> Result<(), RemoteError> {
        let client = self.client()?;
        let sha256 = integrity::hash(value.clone()).await?;
        let request = client
            .put_object()
            .bucket(&self.config.bucket)
            .key(key)
            .metadata(SHA256_METADATA, &sha256)
            .body(ByteStream::from(value))
            .customize()
            .interceptor(sdk::SignedPayload(sha256));
        self.deadline(async {
            match request.send().await {
                Ok(_) => Ok(()),
                Err(e) => Err(errors::classify("PUT", e, self.config.timeout)),
            }
        })
        .await
    }

    /// `GET` of the object `key`, at most `limit` bytes (the block's size): `None` when the
    /// bucket does not have it. An object announced larger is refused without reading it; the
    /// body must match the SHA-256 stored with it.
    pub async fn get(&self, key: &str, limit: usize) -> Result<Option<Bytes>, RemoteError> {
        let limit = limit.min(self.config.max_value_bytes);
        let request = self
            .client()?
            .get_object()
            .bucket(&self.config.bucket)
            .key(key);
        let read = self.deadline(async {
            let output = match request.send().await {
                Ok(output) => output,
                Err(e) if errors::missing_key(&e) => return Ok(None),
                Err(e) => return Err(errors::classify("GET", e, self.config.timeout)),
            };
            let announced = output
                .content_length()
                .and_then(|n| usize::try_from(n).ok());
            if announced.is_some_and(|n| n > limit) {
                return Err(RemoteError::TooLarge { op: "GET", limit });
            }
            let stored = output
                .metadata()
                .and_then(|m| m.get(SHA256_METADATA))
                .cloned();
            let body = read_bounded(output.body, limit, announced).await?;
            Ok(Some((stored, body)))
        });
        match read.await? {
            None => Ok(None),
            Some((stored, body)) => integrity::verify(key, stored.as_deref(), body)
                .await
                .map(Some),
        }
    }

    /// `DELETE` of the object `key` (one that is not there is deleted already).
    pub async fn delete(&self, key: &str) -> Result<(), RemoteError> {
        let request = self
            .client()?
            .delete_object()
            .bucket(&self.config.bucket)
            .key(key);
        self.deadline(async {
            match request.send().await {
                Ok(_) => Ok(()),
                Err(e) if errors::missing_key(&e) => Ok(()),
                Err(e) => Err(errors::classify("DELETE", e, self.config.timeout)),
            }
        })
        .await
    }

    /// `operation` under the deadline of one request (connecting and reading the body
    /// included).
    async fn deadline<T>(
        &self,
        operation: impl Future<Output = Result<T, RemoteError>>,
    ) -> Result<T, RemoteError> {
        let timeout = self.config.timeout;
        tokio::time::timeout(timeout, operation)
            .await
            .unwrap_or(Err(RemoteError::Timeout(timeout)))
    }
}

/// A response body, at most `limit` bytes: a longer one is refused once it passes the bound.
async fn read_bounded(
    mut body: ByteStream,
    limit: usize,
    announced: Option<usize>,
) -> Result<Bytes, RemoteError> {
    let mut out = BytesMut::with_capacity(announced.unwrap_or(0));
    while let Some(chunk) = body
        .try_next()
        .await
        .map_err(|e| errors::exchange("GET", Failure::Http, e))?
    {
        if chunk.len() > limit.saturating_sub(out.len()) {
            return Err(RemoteError::TooLarge { op: "GET", limit });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}
