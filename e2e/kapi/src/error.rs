//! Why the test API server could not be run.

use std::path::PathBuf;

/// An error starting, stopping or talking to the test API server.
#[derive(Debug, thiserror::Error)]
pub enum KapiError {
    /// A binary is missing.
    #[error(
        "{name} not found at {path}: run scripts/bootstrap.sh (it installs kapi, etcd, kubectl and helm into .cache/kube/bin) or set KVGATE_KUBE_BIN"
    )]
    MissingTool {
        /// The program.
        name: &'static str,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A process did not become ready in time.
    #[error("{what} did not become ready within {seconds} s; see {log}")]
    NotReady {
        /// The process.
        what: &'static str,
        /// How long was waited.
        seconds: u64,
        /// Its log.
        log: PathBuf,
    },
    /// A process exited before it became ready.
    #[error("{what} exited before it became ready; see {log}")]
    Exited {
        /// The process.
        what: &'static str,
        /// Its log.
        log: PathBuf,
    },
    /// The kube client could not be built or a request failed.
    #[error("kube client: {0}")]
    Client(#[from] kube::Error),
    /// The kubeconfig could not be read.
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: kube::config::KubeconfigError,
    },
}

impl KapiError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        KapiError::Io {
            what: what.into(),
            source,
        }
    }
}
