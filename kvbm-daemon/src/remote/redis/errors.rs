//! The Redis library's errors as the remote tier's: refusals by the server, failed TLS
//! handshakes, timeouts, and the rest kept whole as their source.

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use ::redis::{ErrorKind, RedisError};

use super::RemoteError;

/// Whether `e` says the connection broke or could not be made (so a command may go again on
/// a new one), rather than a refusal, a bad reply or a timeout.
pub(super) fn broken_connection(e: &RedisError) -> bool {
    (e.is_io_error() || e.is_connection_dropped()) && !e.is_timeout()
}

/// The remote tier's error for `command` failing with `e` (`timeout` being its deadline).
pub(super) fn classify(command: &'static str, e: RedisError, timeout: Duration) -> RemoteError {
    if let Some(tls) = tls_cause(&e) {
        return RemoteError::Tls(format!("handshake: {tls}"));
    }
    if e.is_timeout() {
        return RemoteError::Timeout(timeout);
    }
    match e.kind() {
        ErrorKind::AuthenticationFailed => RemoteError::Refused {
            command: "AUTH",
            message: e.to_string(),
        },
        ErrorKind::Server(_) | ErrorKind::Extension => RemoteError::Refused {
            command,
            message: e.to_string(),
        },
        _ => RemoteError::Redis { command, source: e },
    }
}

/// The TLS error under `e`, if the handshake failed: the library reports it as an I/O error
/// whose payload is rustls's.
fn tls_cause(e: &RedisError) -> Option<&rustls::Error> {
    let mut next: Option<&(dyn Error + 'static)> = e.source();
    while let Some(err) = next {
        let io = err.downcast_ref::<std::io::Error>().or_else(|| {
            err.downcast_ref::<Arc<dyn Error + Send + Sync>>()
                .and_then(|inner| inner.downcast_ref::<std::io::Error>())
        });
        if let Some(tls) = io
            .and_then(std::io::Error::get_ref)
            .and_then(|payload| payload.downcast_ref::<rustls::Error>())
        {
            return Some(tls);
        }
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        next = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(1);

    #[test]
    fn a_failed_handshake_is_a_tls_error() {
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        let e = classify("PING", RedisError::from(io), T);
        assert_eq!(e.metric_label(), "tls", "{e}");
        assert!(e.to_string().contains("handshake"), "{e}");
        assert!(e.is_transient());
    }

    #[test]
    fn connection_failures_are_transient_and_replies_are_not() {
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(broken_connection(&refused));
        let e = classify("GET", refused, T);
        assert!(
            matches!(e, RemoteError::Redis { command: "GET", .. }),
            "{e}"
        );
        assert_eq!(e.metric_label(), "io");
        assert!(e.is_transient());
        assert!(e.source().is_some(), "the library's error is kept");

        let timed_out = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(!broken_connection(&timed_out));
        assert!(matches!(
            classify("GET", timed_out, T),
            RemoteError::Timeout(_)
        ));

        let bad_reply = RedisError::from((ErrorKind::UnexpectedReturnType, "not a number"));
        assert!(!broken_connection(&bad_reply));
        let e = classify("DEL", bad_reply, T);
        assert_eq!(e.metric_label(), "protocol");
        assert!(!e.is_transient());

        let auth = RedisError::from((ErrorKind::AuthenticationFailed, "WRONGPASS"));
        assert!(matches!(
            classify("GET", auth, T),
            RemoteError::Refused {
                command: "AUTH",
                ..
            }
        ));
    }
}
