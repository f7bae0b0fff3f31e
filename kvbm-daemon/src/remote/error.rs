//! The remote tier's errors, shared by its Redis and S3 clients.

use std::time::Duration;

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
    /// Redis: the client library failed the command: connecting, the connection, or a reply
    /// it could not read.
    #[error("Redis {command}: {source}")]
    Redis {
        /// The command.
        command: &'static str,
        /// The library's error.
        #[source]
        source: ::redis::RedisError,
    },
    /// The server refused the command.
    #[error("Redis refused {command}: {message}")]
    Refused {
        /// The command.
        command: &'static str,
        /// The server's error line.
        message: String,
    },
    /// A reply of the wrong type.
    #[error("unexpected Redis reply to {command}: {reply}")]
    Unexpected {
        /// The command.
        command: &'static str,
        /// The reply, as the library shows it.
        reply: String,
    },
    /// TLS could not be set up (the CA bundle) or the handshake failed.
    #[error("remote TLS: {0}")]
    Tls(String),
    /// S3: the HTTP exchange failed (connection closed, malformed response).
    #[error("S3 HTTP: {0}")]
    Http(String),
    /// S3 answered with an error status.
    #[error("S3 refused {op}: HTTP {status} {code}{detail}")]
    Status {
        /// The operation (`PUT`, `GET`, `DELETE`, `HEAD`).
        op: &'static str,
        /// The HTTP status.
        status: u16,
        /// S3's error code (`AccessDenied`, `NoSuchBucket`, …) when its body carried one.
        code: String,
        /// More for the operator (the bucket's region after a wrong-region refusal), or empty.
        detail: String,
    },
    /// S3: an object whose body does not match the SHA-256 stored with it, or that has none.
    #[error("S3 object damaged: {0}")]
    Integrity(String),
    /// A value (Redis) or object (S3) larger than the block read: refused, not read whole.
    #[error("remote {op}: the value is larger than {limit} bytes")]
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
            Self::Redis { source, .. } if is_connection(source) => "io",
            Self::Redis { .. } => "protocol",
            Self::Refused { .. } => "refused",
            Self::Unexpected { .. } => "unexpected",
            Self::Tls(_) => "tls",
            Self::Http(_) => "http",
            Self::Status { .. } => "status",
            Self::TooLarge { .. } => "too_large",
            Self::Credentials(_) => "credentials",
            Self::Integrity(_) => "integrity",
        }
    }
}

impl RemoteError {
    /// Whether trying again later may succeed: the store was slow, away or busy. Anything else
    /// (a refusal, a damaged or oversized object, a broken protocol) will fail again, so a
    /// block whose read fails so is forgotten rather than kept indexed.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Io(_)
            | Self::Timeout(_)
            | Self::Http(_)
            | Self::Tls(_)
            | Self::Refused { .. } => true,
            Self::Redis { source, .. } => is_connection(source),
            Self::Status { status, code, .. } => {
                *status >= 500 || *status == 429 || *status == 408 || code == "SlowDown"
            }
            Self::Url(_)
            | Self::Unexpected { .. }
            | Self::TooLarge { .. }
            | Self::Credentials(_)
            | Self::Integrity(_) => false,
        }
    }

    /// Whether the store refused the daemon's configuration outright (a wrong bucket, region,
    /// key or permission): at start, that is a configuration error.
    pub fn is_config_refusal(&self) -> bool {
        matches!(self, Self::Status { status, .. } if (300..500).contains(status) && !self.is_transient())
    }
}

/// Whether the Redis library's error is about the connection (refused, dropped, timed out,
/// not established) rather than a reply.
fn is_connection(e: &::redis::RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout()
}
