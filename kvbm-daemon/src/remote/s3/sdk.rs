//! The AWS SDK's S3 client as the remote tier configures it.
//!
//! - HTTP: the smithy hyper client, HTTP/1.1 keep-alive (HTTP/2 where an `https` endpoint
//!   offers it; at most [`MAX_IDLE`] idle connections, none kept past [`MAX_IDLE_AGE`]); a
//!   request that finds its kept connection closed before it was written goes again on a new
//!   one (hyper's pool), a written one never. Error answers are read up to
//!   [`MAX_ERROR_BODY`](super::error_body::MAX_ERROR_BODY).
//! - TLS: rustls on ring, trusting `--remote-ca-file`'s CAs or the system's roots (checked
//!   here, so a bad bundle fails at start); none for an `http` endpoint.
//! - Credentials: the static ones the daemon read from its environment; no provider chain.
//! - No retries and no SDK timeouts: each operation runs once under the daemon's own deadline,
//!   and [`RemoteError::is_transient`] decides what a failure means.
//! - No CRC checksums (S3 requires none for these operations): integrity is the block's
//!   SHA-256 ([`integrity`](super::integrity)), which also signs the `PUT`'s payload
//!   ([`SignedPayload`]), so a block is hashed once.

use std::time::Duration;

use aws_runtime::auth::PayloadSigningOverride;
use aws_sdk_s3::config::interceptors::BeforeTransmitInterceptorContextMut;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    BehaviorVersion, ConfigBag, Credentials as SdkCredentials, Intercept, Region,
    RequestChecksumCalculation, ResponseChecksumValidation, RuntimeComponents, SharedHttpClient,
    StalledStreamProtectionConfig,
};
use aws_sdk_s3::error::BoxError;
use aws_smithy_http_client::tls::rustls_provider::CryptoMode;
use aws_smithy_http_client::tls::{Provider, TlsContext, TrustStore};

use super::S3Config;
use super::error_body::BoundedErrorBody;
use crate::remote::{RemoteError, tls};

/// Idle keep-alive connections kept for reuse.
const MAX_IDLE: usize = 8;
/// An idle connection older than this is closed rather than reused: servers and middleboxes
/// drop idle connections (S3 after about 20 s), and a silently dropped one costs a request its
/// whole deadline.
const MAX_IDLE_AGE: Duration = Duration::from_secs(15);

/// The SDK client for `config`; reads and checks the CA bundle (or the system's roots) for an
/// `https` endpoint.
pub(super) fn client(config: &S3Config) -> Result<aws_sdk_s3::Client, RemoteError> {
    let c = &config.credentials;
    let credentials = SdkCredentials::new(
        &c.access_key_id,
        &c.secret_access_key,
        c.session_token.clone(),
        None,
        "environment",
    );
    let mut builder = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(config.region.clone()))
        .credentials_provider(credentials)
        .force_path_style(config.path_style)
        .http_client(http_client(config)?)
        .retry_config(RetryConfig::disabled())
        .timeout_config(TimeoutConfig::disabled())
        .stalled_stream_protection(StalledStreamProtectionConfig::disabled())
        .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
        .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
        .interceptor(BoundedErrorBody);
    if let Some(url) = config.endpoint_url() {
        builder = builder.endpoint_url(url);
    }
    Ok(aws_sdk_s3::Client::from_conf(builder.build()))
}

/// The HTTP client, with the trust `config` asks for.
fn http_client(config: &S3Config) -> Result<SharedHttpClient, RemoteError> {
    let trust = match (&config.ca_file, config.https) {
        // Never used: no handshake happens with an `http` endpoint.
        (_, false) => TrustStore::empty(),
        (Some(path), true) => TrustStore::empty().with_pem_certificate(tls::ca_bundle(path)?),
        (None, true) => {
            tls::check_system_roots()?;
            TrustStore::default()
        }
    };
    let context = TlsContext::builder()
        .with_trust_store(trust)
        .build()
        .map_err(|e| RemoteError::Tls(e.to_string()))?;
    Ok(aws_smithy_http_client::Builder::new()
        .pool_max_idle_per_host(MAX_IDLE)
        .pool_idle_timeout(MAX_IDLE_AGE)
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .tls_context(context)
        .build_https())
}

/// Signs a request's payload with its SHA-256, computed already, instead of letting the SDK
/// hash the body again.
#[derive(Debug)]
pub(super) struct SignedPayload(pub(super) String);

impl Intercept for SignedPayload {
    fn name(&self) -> &'static str {
        "kvgate-kvbm payload SHA-256"
    }

    fn modify_before_signing(
        &self,
        _context: &mut BeforeTransmitInterceptorContextMut<'_>,
        _components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        cfg.interceptor_state()
            .store_put(PayloadSigningOverride::Precomputed(self.0.clone()));
        Ok(())
    }
}
