//! Drain on SIGTERM: go unready, tell the hook, stop accepting, let in-flight responses finish
//! within the grace period, tell the hook again, report.
//!
//! [`DrainHook`] is how the rest of the sidecar joins in. The event bridge implements
//! [`DrainHook::drained`] to publish `Cleared` for this pod on NATS once no request runs here any
//! more, so every EPP drops the pod's blocks from its index before the engine goes away.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;

use tokio::task::JoinHandle;

use super::readiness::Readiness;

/// A boxed future, as the hook's methods return.
pub type HookFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Called at the two edges of a drain.
pub trait DrainHook: Send + Sync + std::fmt::Debug {
    /// Shutdown began: the pod reports unready and the proxy is about to stop accepting.
    fn draining(&self) -> HookFuture<'_> {
        Box::pin(async {})
    }

    /// In-flight requests finished (or the grace period ended): publish `Cleared` here.
    fn drained(&self) -> HookFuture<'_>;
}

/// A hook that does nothing (the proxy running without the event bridge).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHook;

impl DrainHook for NoHook {
    fn drained(&self) -> HookFuture<'_> {
        Box::pin(async {})
    }
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// From the signal to the end of the hook.
    pub duration: Duration,
    /// Whether every in-flight response finished within the grace period.
    pub completed: bool,
}

/// Longest the `drained` hook may take.
pub const HOOK_LIMIT: Duration = Duration::from_secs(5);

/// Runs the drain. `stop` makes the server stop accepting; `server` ends when its last
/// connection closed.
pub async fn drain(
    readiness: &Readiness,
    hook: &dyn DrainHook,
    grace: Duration,
    stop: impl FnOnce(),
    server: JoinHandle<std::io::Result<()>>,
) -> DrainReport {
    let started = Instant::now();
    readiness.begin_drain();
    tracing::info!(
        grace_s = grace.as_secs_f64(),
        "draining: unready, refusing new connections"
    );
    if tokio::time::timeout(HOOK_LIMIT, hook.draining())
        .await
        .is_err()
    {
        tracing::warn!("drain hook (draining) overran its limit");
    }
    stop();
    let abort = server.abort_handle();
    let completed = match tokio::time::timeout(grace, server).await {
        Ok(Ok(Ok(()))) => true,
        Ok(Ok(Err(e))) => {
            tracing::warn!(error = %e, "proxy server ended with an error while draining");
            true
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "proxy server task failed while draining");
            true
        }
        Err(_) => {
            abort.abort();
            false
        }
    };
    if tokio::time::timeout(HOOK_LIMIT, hook.drained())
        .await
        .is_err()
    {
        tracing::warn!("drain hook (drained) overran its limit");
    }
    let report = DrainReport {
        duration: started.elapsed(),
        completed,
    };
    if completed {
        tracing::info!(duration_s = report.duration.as_secs_f64(), "drained");
    } else {
        tracing::warn!(
            duration_s = report.duration.as_secs_f64(),
            "grace period ended with responses still open; they were cut"
        );
    }
    report
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[derive(Debug, Default)]
    struct Recorder(Mutex<Vec<&'static str>>);

    impl DrainHook for Recorder {
        fn draining(&self) -> HookFuture<'_> {
            Box::pin(async { self.0.lock().unwrap().push("draining") })
        }
        fn drained(&self) -> HookFuture<'_> {
            Box::pin(async { self.0.lock().unwrap().push("drained") })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn waits_for_the_server_then_calls_the_hook() {
        let r = Readiness::new(false);
        r.set_engine_healthy(true);
        let hook = Recorder::default();
        let stopped = std::sync::Arc::new(AtomicBool::new(false));
        let s2 = stopped.clone();
        let server = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            Ok(())
        });
        let report = drain(
            &r,
            &hook,
            Duration::from_secs(10),
            move || s2.store(true, Ordering::SeqCst),
            server,
        )
        .await;
        assert!(report.completed);
        assert!(report.duration >= Duration::from_secs(3));
        assert!(stopped.load(Ordering::SeqCst));
        assert!(!r.is_ready());
        assert_eq!(*hook.0.lock().unwrap(), vec!["draining", "drained"]);
    }

    #[tokio::test(start_paused = true)]
    async fn grace_period_bounds_the_wait() {
        let r = Readiness::new(false);
        let server = tokio::spawn(async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(())
        });
        let report = drain(&r, &NoHook, Duration::from_secs(2), || {}, server).await;
        assert!(!report.completed);
        assert!(report.duration < Duration::from_secs(10));
    }
}
