//! The SDK's errors as the remote tier's: an answer with an error status keeps its status, S3's
//! error code and, after a wrong-region refusal, the bucket's region; a request that got no
//! status says where it failed (building it, connecting, TLS, HTTP) and keeps the SDK's error.
//! The remote tier, not the SDK, decides what is worth trying again
//! ([`RemoteError::is_transient`]).

use std::error::Error;
use std::time::Duration;

use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};

use crate::remote::RemoteError;
use crate::remote::error::Failure;

/// The header S3 names the bucket's region in, with a refusal for the wrong one.
const BUCKET_REGION: &str = "x-amz-bucket-region";

/// The SDK's error of one operation.
pub(super) type Sdk<E> = SdkError<E, HttpResponse>;

/// Whether `e` is S3's 404 for a missing key, not for a missing bucket: `NoSuchKey`, or no
/// code at all (a `HEAD`'s answer has no body; the SDK calls that `NotFound`).
pub(super) fn missing_key<E: ProvideErrorMetadata>(e: &Sdk<E>) -> bool {
    refused_with(e).is_some_and(|status| status == 404)
        && e.code()
            .is_none_or(|code| code == "NoSuchKey" || code == "NotFound")
}

/// The remote tier's error for `op` failing with `e`, `timeout` being its deadline.
pub(super) fn classify<E>(op: &'static str, e: Sdk<E>, timeout: Duration) -> RemoteError
where
    E: ProvideErrorMetadata + Error + Send + Sync + 'static,
{
    if let Some(status) = refused_with(&e) {
        let region = e
            .raw_response()
            .and_then(|r| r.headers().get(BUCKET_REGION));
        return status_error(op, status, e.code(), region);
    }
    let failure = match &e {
        SdkError::TimeoutError(_) => return RemoteError::Timeout(timeout),
        SdkError::DispatchFailure(d) if d.is_timeout() => return RemoteError::Timeout(timeout),
        _ if tls_cause(&e) => Failure::Tls,
        SdkError::ConstructionFailure(_) => Failure::Request,
        SdkError::DispatchFailure(d) if d.is_user() => Failure::Request,
        SdkError::DispatchFailure(d) if d.is_io() => Failure::Connect,
        _ => Failure::Http,
    };
    exchange(op, failure, e)
}

/// A request that got no status to judge, `failure` saying where, `e` why.
pub(super) fn exchange(
    op: &'static str,
    failure: Failure,
    e: impl Error + Send + Sync + 'static,
) -> RemoteError {
    RemoteError::Exchange {
        op,
        failure,
        detail: DisplayErrorContext(&e).to_string(),
        source: Box::new(e),
    }
}

/// The status of an answer that is not a success: S3's refusal (its body parsed or not).
fn refused_with<E>(e: &Sdk<E>) -> Option<u16> {
    let status = e.raw_response()?.status();
    (!status.is_success()).then(|| status.as_u16())
}

/// An error status with S3's code when the answer carried a sane one (else the status's
/// reason), and the bucket's region when S3 says the request went to the wrong one.
pub(super) fn status_error(
    op: &'static str,
    status: u16,
    code: Option<&str>,
    bucket_region: Option<&str>,
) -> RemoteError {
    let detail = match bucket_region {
        Some(region) if region.len() <= 64 && !region.chars().any(char::is_control) => {
            format!(" (the bucket is in {region}: set --s3-region {region})")
        }
        _ => String::new(),
    };
    let code = code.filter(|c| sane_code(c)).map_or_else(
        || {
            http::StatusCode::from_u16(status)
                .ok()
                .and_then(|s| s.canonical_reason())
                .unwrap_or("unknown status")
                .to_owned()
        },
        str::to_owned,
    );
    RemoteError::Status {
        op,
        status,
        code,
        detail,
    }
}

/// Whether an error code is short and printable (it goes into log lines).
fn sane_code(code: &str) -> bool {
    !code.is_empty()
        && code.len() <= 64
        && code.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.')
}

/// Whether a TLS error is among `e`'s causes: the handshake failed (an unknown CA, a wrong
/// name), as rustls reports it, possibly inside (nested) I/O errors.
fn tls_cause(e: &(dyn Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if err.is::<rustls::Error>() {
            return true;
        }
        // An I/O error's `source` skips the error it wraps: look at that one first.
        next = match err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
        {
            Some(inner) => Some(inner as &(dyn Error + 'static)),
            None => err.source(),
        };
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_the_code_or_the_status_and_the_region_to_set() {
        let e = status_error("GET", 403, None, None);
        assert_eq!(e.to_string(), "S3 refused GET: HTTP 403 Forbidden");
        assert_eq!(e.metric_label(), "status");
        let e = status_error("GET", 403, Some("<script>"), None);
        assert_eq!(e.to_string(), "S3 refused GET: HTTP 403 Forbidden");
        let e = status_error("PUT", 404, Some("NoSuchBucket"), None);
        assert_eq!(e.to_string(), "S3 refused PUT: HTTP 404 NoSuchBucket");
        let moved = status_error("HEAD", 301, None, Some("eu-west-1"));
        assert_eq!(
            moved.to_string(),
            "S3 refused HEAD: HTTP 301 Moved Permanently (the bucket is in eu-west-1: set \
             --s3-region eu-west-1)"
        );
        assert!(moved.is_config_refusal() && !moved.is_transient());
        let slow = status_error("PUT", 503, Some("SlowDown"), None);
        assert!(slow.is_transient() && !slow.is_config_refusal());
        let odd_region = status_error("HEAD", 301, None, Some("eu\nwest"));
        assert!(!odd_region.to_string().contains("set --s3-region"));
    }
}
