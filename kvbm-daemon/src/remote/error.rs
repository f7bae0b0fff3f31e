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
    /// S3: the request got no HTTP status to judge: it could not be built, connecting or the
    /// TLS handshake failed, the connection closed, or the response could not be read. The
    /// SDK's error is kept whole; `detail` is it with its causes, for the log.
    #[error("S3 {op}: {failure}: {detail}")]
    Exchange {
        /// The operation (`PUT`, `GET`, `DELETE`, `HEAD`).
        op: &'static str,
        /// Where it failed.
        failure: Failure,
        /// The error and its causes, as one line.
        detail: String,
        /// The SDK's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
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
            Self::Exchange { failure, .. } => failure.metric_label(),
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
            Self::Io(_) | Self::Timeout(_) | Self::Tls(_) | Self::Refused { .. } => true,
            Self::Exchange { failure, .. } => *failure != Failure::Request,
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
        match self {
            Self::Status { status, .. } => (300..500).contains(status) && !self.is_transient(),
            Self::Exchange { failure, .. } => *failure == Failure::Request,
            _ => false,
        }
    }
}

/// Where an S3 request that got no HTTP status failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The request could not be built from the configuration (an endpoint or bucket the SDK
    /// cannot address): it will fail again.
    Request,
    /// Connecting failed, or the connection broke.
    Connect,
    /// The TLS handshake failed.
    Tls,
    /// The HTTP exchange failed: a connection closed mid-response, a response that could not
    /// be read.
    Http,
}

impl Failure {
    /// The metrics label (`io`, `tls` and `http` as for the other clients' failures).
    pub fn metric_label(self) -> &'static str {
        match self {
            Self::Request => "request",
            Self::Connect => "io",
            Self::Tls => "tls",
            Self::Http => "http",
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Request => "building the request",
            Self::Connect => "connecting",
            Self::Tls => "TLS",
            Self::Http => "HTTP",
        })
    }
}

/// Whether the Redis library's error is about the connection (refused, dropped, timed out,
/// not established) rather than a reply.
fn is_connection(e: &::redis::RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout()
}
