//! gRPC health (:9003): `liveness` is always serving; `readiness`, the ext_proc service name,
//! `inference-extension` and the empty (whole-server) name follow [`Readiness`] — GIE's
//! `cmd/epp/runner/health.go` semantics and the names its charts and Envoy probe.

use std::sync::Arc;

use tokio::sync::watch;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// Service that reports the process alive.
pub const LIVENESS_SERVICE: &str = "liveness";
/// Service that reports the EPP ready to pick.
pub const READINESS_SERVICE: &str = "readiness";
/// The ext_proc service's own name, which Envoy's `grpc_health_check` probes.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// The name GIE's charts probe for a single replica.
pub const INFERENCE_EXTENSION_SERVICE: &str = "inference-extension";

/// The services whose status follows readiness.
const FOLLOW_READINESS: [&str; 4] = [
    READINESS_SERVICE,
    EXT_PROC_SERVICE,
    INFERENCE_EXTENSION_SERVICE,
    "",
];

/// Whether the EPP is ready to pick (its endpoint view synced). Cloneable; starts not ready.
#[derive(Debug, Clone)]
pub struct Readiness {
    tx: Arc<watch::Sender<bool>>,
}

impl Default for Readiness {
    fn default() -> Self {
        Self::new()
    }
}

impl Readiness {
    /// A handle that reports not ready until [`Readiness::set`] says otherwise.
    pub fn new() -> Self {
        Self {
            tx: Arc::new(watch::Sender::new(false)),
        }
    }

    /// Marks the EPP ready or not.
    pub fn set(&self, ready: bool) {
        self.tx.send_replace(ready);
    }

    /// The current state.
    pub fn is_ready(&self) -> bool {
        *self.tx.borrow()
    }

    pub(super) fn subscribe(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }
}

fn status(ready: bool) -> ServingStatus {
    if ready {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

/// Sets every readiness-following service to `ready`.
pub(super) async fn report(reporter: &HealthReporter, ready: bool) {
    for name in FOLLOW_READINESS {
        reporter.set_service_status(name, status(ready)).await;
    }
}

/// Keeps the reporter in step with `readiness` until `stop` turns true, then reports not ready
/// (draining) while liveness stays serving.
pub(super) async fn follow(
    reporter: HealthReporter,
    readiness: Readiness,
    mut stop: watch::Receiver<bool>,
) {
    reporter
        .set_service_status(LIVENESS_SERVICE, ServingStatus::Serving)
        .await;
    let mut rx = readiness.subscribe();
    loop {
        let ready = *rx.borrow_and_update() && !*stop.borrow();
        report(&reporter, ready).await;
        if *stop.borrow() {
            return;
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            _ = stop.changed() => {}
        }
    }
}
