//! The operator's metrics (`kvgate_operator_*`) and its `/metrics`, `/healthz` and `/readyz`
//! server on :9093. Labels are bounded: reasons and roles are enums, autoscalers are the
//! cluster's own objects.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::routing::get;
use telemetry::{Exposition, Kind};

/// Counters and gauges the controller updates.
#[derive(Debug, Default)]
pub struct Metrics {
    leader: AtomicBool,
    reconciles_ok: AtomicU64,
    reconciles_failed: AtomicU64,
    decisions: Mutex<BTreeMap<&'static str, u64>>,
    scales: Mutex<BTreeMap<(String, &'static str), u64>>,
    scale_errors: Mutex<BTreeMap<&'static str, u64>>,
    metrics_failures: Mutex<BTreeMap<&'static str, u64>>,
    manual_changes: AtomicU64,
    allow_list_updates: AtomicU64,
    desired: Mutex<BTreeMap<(String, String, String), i64>>,
}

fn bump<K: Ord>(m: &Mutex<BTreeMap<K, u64>>, k: K) {
    *m.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .entry(k)
        .or_insert(0) += 1;
}

impl Metrics {
    /// Whether this replica leads.
    pub fn set_leader(&self, leading: bool) {
        self.leader.store(leading, Ordering::Relaxed);
    }

    /// A reconcile ended.
    pub fn reconciled(&self, ok: bool) {
        let c = if ok {
            &self.reconciles_ok
        } else {
            &self.reconciles_failed
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// A planner decision, by its reason's label.
    pub fn decision(&self, reason: &'static str) {
        bump(&self.decisions, reason);
    }

    /// A target scaled (`role`, `up` or `down`).
    pub fn scaled(&self, role: &str, direction: &'static str) {
        bump(&self.scales, (role.to_owned(), direction));
    }

    /// A scale read or write failed.
    pub fn scale_error(&self, reason: &'static str) {
        bump(&self.scale_errors, reason);
    }

    /// Load and latency could not be read.
    pub fn metrics_failure(&self, reason: &'static str) {
        bump(&self.metrics_failures, reason);
    }

    /// A target's replicas changed outside the operator.
    pub fn manual_change(&self) {
        self.manual_changes.fetch_add(1, Ordering::Relaxed);
    }

    /// The allow-list ConfigMap was written.
    pub fn allow_list_updated(&self) {
        self.allow_list_updates.fetch_add(1, Ordering::Relaxed);
    }

    /// The desired replicas of an autoscaler's role.
    pub fn set_desired(&self, namespace: &str, name: &str, role: &str, replicas: i64) {
        self.desired
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(
                (namespace.to_owned(), name.to_owned(), role.to_owned()),
                replicas,
            );
    }

    /// Forgets an autoscaler that was deleted.
    pub fn forget(&self, namespace: &str, name: &str) {
        self.desired
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|(ns, n, _), _| !(ns == namespace && n == name));
    }

    /// The Prometheus text exposition.
    #[allow(clippy::cast_precision_loss)]
    pub fn render(&self) -> String {
        let mut e = Exposition::new();
        e.single(
            "kvgate_operator_leader",
            Kind::Gauge,
            "1 while this replica holds the lease and acts.",
            &[],
            if self.leader.load(Ordering::Relaxed) {
                1.0
            } else {
                0.0
            },
        );
        e.family(
            "kvgate_operator_reconciles_total",
            Kind::Counter,
            "Reconciles of PoolAutoscalers, by result.",
        );
        for (result, c) in [
            ("ok", &self.reconciles_ok),
            ("error", &self.reconciles_failed),
        ] {
            e.sample(
                "kvgate_operator_reconciles_total",
                &[("result", result)],
                c.load(Ordering::Relaxed) as f64,
            );
        }
        let lock = |m: &Mutex<BTreeMap<&'static str, u64>>| {
            m.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        };
        e.family(
            "kvgate_operator_decisions_total",
            Kind::Counter,
            "Planner decisions, by reason.",
        );
        for (reason, n) in lock(&self.decisions) {
            e.sample(
                "kvgate_operator_decisions_total",
                &[("reason", reason)],
                n as f64,
            );
        }
        e.family(
            "kvgate_operator_scale_operations_total",
            Kind::Counter,
            "Replica changes written to targets' /scale, by role and direction.",
        );
        for ((role, dir), n) in self
            .scales
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
        {
            e.sample(
                "kvgate_operator_scale_operations_total",
                &[("role", &role), ("direction", dir)],
                n as f64,
            );
        }
        e.family(
            "kvgate_operator_scale_errors_total",
            Kind::Counter,
            "Failed reads or writes of targets' /scale, by reason.",
        );
        for (reason, n) in lock(&self.scale_errors) {
            e.sample(
                "kvgate_operator_scale_errors_total",
                &[("reason", reason)],
                n as f64,
            );
        }
        e.family(
            "kvgate_operator_metrics_failures_total",
            Kind::Counter,
            "Intervals without load or latency (the planner held), by reason.",
        );
        for (reason, n) in lock(&self.metrics_failures) {
            e.sample(
                "kvgate_operator_metrics_failures_total",
                &[("reason", reason)],
                n as f64,
            );
        }
        e.single(
            "kvgate_operator_manual_changes_total",
            Kind::Counter,
            "Target replica changes made outside the operator (reported as Warning events).",
            &[],
            self.manual_changes.load(Ordering::Relaxed) as f64,
        );
        e.single(
            "kvgate_operator_allow_list_updates_total",
            Kind::Counter,
            "Writes of prefill allow-list ConfigMaps.",
            &[],
            self.allow_list_updates.load(Ordering::Relaxed) as f64,
        );
        e.family(
            "kvgate_operator_desired_replicas",
            Kind::Gauge,
            "Replicas the planner wants, by autoscaler and role.",
        );
        for ((ns, name, role), n) in self
            .desired
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
        {
            e.sample(
                "kvgate_operator_desired_replicas",
                &[("namespace", &ns), ("autoscaler", &name), ("role", &role)],
                n as f64,
            );
        }
        e.finish()
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` (the process runs; a replica that does not lead
/// is ready too, to take over) on `listener` until `shutdown` completes.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    metrics: std::sync::Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = std::sync::Arc::clone(&metrics);
                async move { m.render() }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ok\n" }));
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "metrics and health serving");
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_with_bounded_labels() {
        let m = Metrics::default();
        m.set_leader(true);
        m.reconciled(true);
        m.decision("hold_metrics_unavailable");
        m.scaled("decode", "up");
        m.set_desired("llm", "qwen3", "decode", 3);
        let text = m.render();
        for want in [
            "kvgate_operator_leader 1",
            "kvgate_operator_reconciles_total{result=\"ok\"} 1",
            "kvgate_operator_decisions_total{reason=\"hold_metrics_unavailable\"} 1",
            "kvgate_operator_scale_operations_total{role=\"decode\",direction=\"up\"} 1",
            "kvgate_operator_desired_replicas{namespace=\"llm\",autoscaler=\"qwen3\",role=\"decode\"} 3",
        ] {
            assert!(text.contains(want), "missing {want}\n{text}");
        }
        m.forget("llm", "qwen3");
        assert!(!m.render().contains("autoscaler=\"qwen3\""));
    }
}
