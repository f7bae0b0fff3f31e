//! Why the stack could not start, or stopped.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use super::config::Component;

/// A stack failure; every variant about a component names it and its log file.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// The configuration is inconsistent.
    #[error("invalid stack configuration: {0}")]
    Config(String),
    /// A binary the stack runs is not where it should be.
    #[error("{name} not found at {}: {hint}", path.display())]
    MissingBinary {
        /// Which binary.
        name: String,
        /// Where it was looked for.
        path: PathBuf,
        /// How to get it.
        hint: String,
    },
    /// Writing the run directory or a config file failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A component's process could not be started.
    #[error("{component}: cannot start {}: {source}", program.display())]
    Spawn {
        /// The component.
        component: Component,
        /// Its program.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A component did not become ready in time.
    #[error("{component} not ready after {waited:?} (log {}):\n{tail}", log.display())]
    NotReady {
        /// The component.
        component: Component,
        /// How long it was given.
        waited: Duration,
        /// Its log file.
        log: PathBuf,
        /// The end of its log.
        tail: String,
    },
    /// A component exited: during start-up, or later while the stack was running.
    #[error("{component} exited ({status}); log {}:\n{tail}", log.display())]
    Exited {
        /// The component.
        component: Component,
        /// Its exit status.
        status: ExitStatus,
        /// Its log file.
        log: PathBuf,
        /// The end of its log.
        tail: String,
    },
    /// The stack has no such component (an engine index out of range).
    #[error("this stack has no {0}")]
    NoSuchComponent(Component),
    /// The Kubernetes mode failed (`kvgate-bench up --kube`).
    #[error("Kubernetes stack: {0}")]
    Kube(#[source] Box<crate::kube::KubeStackError>),
}

impl StackError {
    /// The component this error is about, if any.
    pub fn component(&self) -> Option<Component> {
        match self {
            StackError::Spawn { component, .. }
            | StackError::NotReady { component, .. }
            | StackError::Exited { component, .. } => Some(*component),
            StackError::NoSuchComponent(c) => Some(*c),
            _ => None,
        }
    }
}

impl cli_support::ExitStatus for StackError {
    fn exit_code(&self) -> u8 {
        match self {
            StackError::Config(_) | StackError::MissingBinary { .. } => cli_support::EXIT_CONFIG,
            _ => 1,
        }
    }
}
