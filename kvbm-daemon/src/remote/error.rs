//! The remote tier's errors, shared by its Redis and S3 clients.

use std::time::Duration;

use super::resp::{Reply, RespError};

/// Why a remote-tier command (Redis or S3) failed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The URL (or an S3 option) is not one this client understands.
    #[error("invalid remote URL: {0}")]
    Url(String),
    /// Connecting, writing or reading failed.
    #[error("remote I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The command did not complete in time.
    #[error("remote command timed out after {0:?}")]
    Timeout(Duration),
    /// The server broke the protocol or a bound.
    #[error("Redis protocol: {0}")]
    Protocol(#[from] RespError),
    /// The server refused the command.
    #[error("Redis refused {command}: {message}")]
    Refused {
        /// The command.
        command: &'static str,
        /// The server's error line.
        message: String,
    },
    /// A reply of the wrong type.
    #[error("unexpected Redis reply to {command}: {reply:?}")]
    Unexpected {
        /// The command.
        command: &'static str,
        /// The reply.
        reply: Reply,
    },
    /// TLS could not be set up (the CA bundle) or the handshake failed.
    #[error("remote TLS: {0}")]
    Tls(String),
    /// S3: the HTTP exchange failed (connection closed, malformed response).
    #[error("S3 HTTP: {0}")]
    Http(String),
    /// S3 answered with an error status.
    #[error("S3 refused {op}: HTTP {status} {code}")]
    Status {
        /// The operation (`PUT`, `GET`, `DELETE`, `HEAD`).
        op: &'static str,
        /// The HTTP status.
        status: u16,
        /// S3's error code (`AccessDenied`, `NoSuchBucket`, …) when its body carried one.
        code: String,
    },
    /// S3: an object larger than the largest block the tier takes.
    #[error("S3 {op}: the object is larger than {limit} bytes")]
    TooLarge {
        /// The operation.
        op: &'static str,
        /// The bound.
        limit: usize,
    },
    /// S3: no usable credentials.
    #[error("S3 credentials: {0}")]
    Credentials(String),
}

impl RemoteError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Url(_) => "url",
            Self::Io(_) => "io",
            Self::Timeout(_) => "timeout",
            Self::Protocol(_) => "protocol",
            Self::Refused { .. } => "refused",
            Self::Unexpected { .. } => "unexpected",
            Self::Tls(_) => "tls",
            Self::Http(_) => "http",
            Self::Status { .. } => "status",
            Self::TooLarge { .. } => "too_large",
            Self::Credentials(_) => "credentials",
        }
    }
}
