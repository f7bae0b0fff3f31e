//! Why `kvgate-bench load` or `report` failed.

/// The load generator's and the report's errors.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Bad arguments.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] workload::MooncakeError),
    /// A file or the runtime.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A records file with a line that is not a record.
    #[error("{path}:{line}: not a request record")]
    Record {
        /// The file.
        path: String,
        /// 1-based.
        line: usize,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// Drawing a plot failed.
    #[error("plotting {path}: {reason}")]
    Plot {
        /// The image.
        path: String,
        /// Why.
        reason: String,
    },
    /// A bug.
    #[error("internal error: {0}")]
    Internal(&'static str),
}

impl LoadError {
    /// A bounded label for logs and metrics.
    #[must_use]
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Config(_) => "config",
            Self::Trace(_) => "trace",
            Self::Io { .. } => "io",
            Self::Record { .. } => "record",
            Self::Plot { .. } => "plot",
            Self::Internal(_) => "internal",
        }
    }
}

impl cli_support::ExitStatus for LoadError {
    fn exit_code(&self) -> u8 {
        match self {
            Self::Config(_) | Self::Trace(_) => cli_support::EXIT_CONFIG,
            _ => 1,
        }
    }
}

/// `Result` of the load generator.
pub type Result<T, E = LoadError> = std::result::Result<T, E>;
