//! Readiness: the conditions under which the pod should receive traffic, each set by the task
//! that observes it. The pod is ready when the engine answers `/health`, the canary (when on) has
//! not failed too often in a row, the KV-event stream is live (when required), and the sidecar
//! is not draining.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// One condition that keeps the pod unready (a bounded label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotReady {
    /// The engine's `/health` does not answer 200.
    EngineUnhealthy,
    /// The canary generation failed too many times in a row.
    CanaryFailing,
    /// Events are required and the KV-event stream is not live.
    KvEventsDown,
    /// Shutdown has begun.
    Draining,
}

impl NotReady {
    /// The label.
    pub fn label(self) -> &'static str {
        match self {
            Self::EngineUnhealthy => "engine_unhealthy",
            Self::CanaryFailing => "canary_failing",
            Self::KvEventsDown => "kv_events_down",
            Self::Draining => "draining",
        }
    }
}

/// Shared readiness inputs. Cheap to clone (an `Arc` inside).
#[derive(Debug, Clone)]
pub struct Readiness {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    engine_ok: AtomicBool,
    canary_ok: AtomicBool,
    kv_events_live: AtomicBool,
    kv_events_required: bool,
    draining: AtomicBool,
}

impl Readiness {
    /// Starts unready (engine not yet seen), canary passing, events not live.
    pub fn new(kv_events_required: bool) -> Self {
        Self {
            inner: Arc::new(Inner {
                engine_ok: AtomicBool::new(false),
                canary_ok: AtomicBool::new(true),
                kv_events_live: AtomicBool::new(false),
                kv_events_required,
                draining: AtomicBool::new(false),
            }),
        }
    }

    /// Set by the engine health poller.
    pub fn set_engine_healthy(&self, ok: bool) {
        self.inner.engine_ok.store(ok, Ordering::Relaxed);
    }

    /// Set by the canary.
    pub fn set_canary_ok(&self, ok: bool) {
        self.inner.canary_ok.store(ok, Ordering::Relaxed);
    }

    /// **The event bridge's input**: whether the engine's KV-event stream is live (subscribed and
    /// publishing to NATS). Counts only with `--require-kv-events`.
    pub fn set_kv_events_live(&self, live: bool) {
        self.inner.kv_events_live.store(live, Ordering::Relaxed);
    }

    /// Marks the sidecar draining; it never becomes ready again.
    pub fn begin_drain(&self) {
        self.inner.draining.store(true, Ordering::Relaxed);
    }

    /// Whether shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::Relaxed)
    }

    /// The conditions that keep the pod unready (empty when ready).
    pub fn blockers(&self) -> Vec<NotReady> {
        let i = &self.inner;
        let mut out = Vec::new();
        if i.draining.load(Ordering::Relaxed) {
            out.push(NotReady::Draining);
        }
        if !i.engine_ok.load(Ordering::Relaxed) {
            out.push(NotReady::EngineUnhealthy);
        }
        if !i.canary_ok.load(Ordering::Relaxed) {
            out.push(NotReady::CanaryFailing);
        }
        if i.kv_events_required && !i.kv_events_live.load(Ordering::Relaxed) {
            out.push(NotReady::KvEventsDown);
        }
        out
    }

    /// Whether the pod should receive traffic.
    pub fn is_ready(&self) -> bool {
        self.blockers().is_empty()
    }

    /// Appends `kvgate_sidecar_ready` and one gauge per condition.
    pub fn render(&self, out: &mut String) {
        let blockers = self.blockers();
        let _ = writeln!(
            out,
            "# HELP kvgate_sidecar_ready 1 when the pod reports ready.\n# TYPE kvgate_sidecar_ready gauge\nkvgate_sidecar_ready {}",
            u8::from(blockers.is_empty())
        );
        let n = "kvgate_sidecar_not_ready";
        let _ = writeln!(
            out,
            "# HELP {n} 1 for each condition keeping the pod unready.\n# TYPE {n} gauge"
        );
        for c in [
            NotReady::EngineUnhealthy,
            NotReady::CanaryFailing,
            NotReady::KvEventsDown,
            NotReady::Draining,
        ] {
            let _ = writeln!(
                out,
                "{n}{{reason=\"{}\"}} {}",
                c.label(),
                u8::from(blockers.contains(&c))
            );
        }
    }
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

    #[test]
    fn every_condition_counts() {
        let r = Readiness::new(true);
        assert_eq!(
            r.blockers(),
            vec![NotReady::EngineUnhealthy, NotReady::KvEventsDown]
        );
        r.set_engine_healthy(true);
        r.set_kv_events_live(true);
        assert!(r.is_ready());
        r.set_canary_ok(false);
        assert_eq!(r.blockers(), vec![NotReady::CanaryFailing]);
        r.set_canary_ok(true);
        r.begin_drain();
        assert_eq!(r.blockers(), vec![NotReady::Draining]);
        let mut out = String::new();
        r.render(&mut out);
        assert!(out.contains("kvgate_sidecar_ready 0"));
        assert!(out.contains("kvgate_sidecar_not_ready{reason=\"draining\"} 1"));
    }

    #[test]
    fn events_only_count_when_required() {
        let r = Readiness::new(false);
        r.set_engine_healthy(true);
        assert!(r.is_ready());
    }
}
