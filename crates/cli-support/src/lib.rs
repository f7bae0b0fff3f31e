//! Helpers shared by kvgate's binaries: how they report errors, which exit codes they use, and
//! how they set up logging.
//!
//! Exit codes: 0 success, 1 runtime failure, 2 bad configuration or a capability this build
//! does not contain. Errors print once to stderr with their chain of causes.

use std::error::Error;
use std::process::ExitCode;

/// The exit code for bad configuration (as clap uses for bad arguments).
pub const EXIT_CONFIG: u8 = 2;

/// A component whose capability has not landed in this build yet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{component}: {capability} is not implemented in this build (tracked in issue #{issue}); \
     the arguments were parsed and validated, nothing was started"
)]
pub struct NotInThisBuild {
    /// The binary's name.
    pub component: &'static str,
    /// What is missing.
    pub capability: &'static str,
    /// The issue that delivers it.
    pub issue: u32,
}

/// Why a binary could not start: its configuration, or a capability this build lacks.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The capability has not landed yet.
    #[error(transparent)]
    NotInThisBuild(#[from] NotInThisBuild),
}

impl ExitStatus for StartError {
    fn exit_code(&self) -> u8 {
        EXIT_CONFIG
    }
}

/// Whether an error is the user's to fix (configuration) or a runtime failure.
pub trait ExitStatus {
    /// The process exit code for this error.
    fn exit_code(&self) -> u8 {
        1
    }
}

impl ExitStatus for NotInThisBuild {
    fn exit_code(&self) -> u8 {
        EXIT_CONFIG
    }
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM (Kubernetes' stop signal), logging which; servers
/// pass it as their graceful-shutdown future.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT received: shutting down"),
        () = term => tracing::info!("SIGTERM received: shutting down"),
    }
}

/// Renders an error and its causes, one per line.
pub fn render<E: Error + ?Sized>(err: &E) -> String {
    let mut out = format!("error: {err}");
    for cause in causes(err) {
        out.push_str(&format!("\n  caused by: {cause}"));
    }
    out
}

/// An error and its causes on one line (`a: b: c`), for log fields and error bodies (hyper's
/// and reqwest's top-level errors say little alone).
pub fn one_line<E: Error + ?Sized>(err: &E) -> String {
    let mut out = err.to_string();
    for cause in causes(err) {
        out.push_str(": ");
        out.push_str(&cause.to_string());
    }
    out
}

/// The chain of `err`'s sources, nearest first.
fn causes<E: Error + ?Sized>(err: &E) -> impl Iterator<Item = &(dyn Error + 'static)> + '_ {
    std::iter::successors(err.source(), |&cause| cause.source())
}

/// Turns a binary's result into its exit code, printing the error if any.
pub fn exit<E: Error + ExitStatus>(result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", render(&e));
            ExitCode::from(e.exit_code())
        }
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`); does nothing if a subscriber is
/// already installed (tests, a second call).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::new(log_directives(
        std::env::var("RUST_LOG").ok().as_deref(),
    ));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// kube-rs's HTTP tracing layer logs every failed request at ERROR (53 lines in one API
/// outage, one per watch retry). kvgate's watchers report an outage themselves (one warning,
/// then each retry at debug), so the layer is silenced unless `RUST_LOG` names `kube_client`.
const QUIET_TARGETS: &str = "kube_client::client::builder=off";

/// The filter directives: `RUST_LOG` (default `info`), plus `QUIET_TARGETS` unless
/// `RUST_LOG` mentions `kube_client`.
pub fn log_directives(rust_log: Option<&str>) -> String {
    let base = rust_log
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .unwrap_or("info");
    if base.contains("kube_client") {
        base.to_owned()
    } else {
        format!("{base},{QUIET_TARGETS}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_client_request_errors_stay_at_debug_unless_asked_for() {
        assert_eq!(
            log_directives(None),
            "info,kube_client::client::builder=off"
        );
        assert_eq!(
            log_directives(Some("warn,kvgate_epp=debug")),
            "warn,kvgate_epp=debug,kube_client::client::builder=off"
        );
        assert_eq!(
            log_directives(Some("kube_client=trace")),
            "kube_client=trace"
        );
        assert_eq!(
            log_directives(Some("  ")),
            "info,kube_client::client::builder=off"
        );
    }

    #[derive(Debug)]
    struct Wrapped(&'static str, Option<Box<Wrapped>>);
    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl Error for Wrapped {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn one_line_joins_every_cause() {
        let e = Wrapped(
            "connect failed",
            Some(Box::new(Wrapped(
                "tcp",
                Some(Box::new(Wrapped("connection refused", None))),
            ))),
        );
        assert_eq!(one_line(&e), "connect failed: tcp: connection refused");
        assert_eq!(one_line(&Wrapped("alone", None)), "alone");
        assert_eq!(
            render(&e),
            "error: connect failed\n  caused by: tcp\n  caused by: connection refused"
        );
    }

    #[test]
    fn not_in_this_build_names_the_issue_and_exits_2() {
        let e = NotInThisBuild {
            component: "kvgate-epp",
            capability: "the ext_proc server",
            issue: 5,
        };
        let text = render(&e);
        assert!(
            text.contains("kvgate-epp") && text.contains("issue #5"),
            "{text}"
        );
        assert_eq!(e.exit_code(), EXIT_CONFIG);
    }
}
