//! `kvgate_sidecar_proxy_*` metrics: plain atomics the proxy updates, rendered as Prometheus
//! text by [`ProxyMetrics::render`] into whatever `/metrics` page the sidecar serves (:9091).
//! Labels are bounded: mode (`passthrough`, `pd`), status class, failure reason.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use super::connector::Connector;
use super::retry::Failure;
use super::ssrf::LiveAllowList;

/// How a request was proxied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Straight to the local engine.
    Passthrough,
    /// Prefill on a remote prefiller, then decode locally.
    Pd,
}

impl Mode {
    const ALL: [Self; 2] = [Self::Passthrough, Self::Pd];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Passthrough => "passthrough",
            Self::Pd => "pd",
        }
    }
}

const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// Upper bounds of the added-latency buckets, in seconds.
pub const LATENCY_BUCKETS: [f64; 12] = [
    0.000_025, 0.000_05, 0.000_1, 0.000_2, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.1, 1.0,
];

/// A duration histogram over [`LATENCY_BUCKETS`] (the counting is `telemetry`'s).
#[derive(Debug)]
pub struct Histogram(telemetry::Histogram);

impl Default for Histogram {
    fn default() -> Self {
        Self(telemetry::Histogram::new(&LATENCY_BUCKETS))
    }
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        self.0.observe_duration(d);
    }

    fn render(&self, out: &mut String, name: &str, labels: &[(&str, &str)]) {
        let mut e = telemetry::Exposition::new();
        e.histogram(name, labels, &self.0.snapshot());
        out.push_str(&e.finish());
    }
}

/// The proxy's counters.
#[derive(Debug, Default)]
pub struct ProxyMetrics {
    requests: [[AtomicU64; CLASSES.len()]; 2],
    added_latency: [Histogram; 2],
    prefill_attempts: AtomicU64,
    prefill_failures: [AtomicU64; Failure::ALL.len()],
    ssrf_refusals: AtomicU64,
    migrations: [AtomicU64; MigrationOutcome::ALL.len()],
    migration_attempts: AtomicU64,
    in_flight: AtomicI64,
    drain_seconds_bits: AtomicU64,
    drain_started: std::sync::OnceLock<std::time::Instant>,
    allow_list: Option<Arc<LiveAllowList>>,
    connector: Connector,
}

/// How a mid-stream engine failure ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigrationOutcome {
    /// Another endpoint generated the rest into the same stream.
    Migrated,
    /// Every attempt failed.
    Failed,
    /// No fallback endpoint that SSRF protection allows.
    NoTarget,
    /// The answer could not be carried over (see `migrate`).
    NotMigratable,
}

impl MigrationOutcome {
    /// Every outcome, in label order.
    pub const ALL: [Self; 4] = [
        Self::Migrated,
        Self::Failed,
        Self::NoTarget,
        Self::NotMigratable,
    ];

    /// Bounded label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Migrated => "migrated",
            Self::Failed => "failed",
            Self::NoTarget => "no_target",
            Self::NotMigratable => "not_migratable",
        }
    }
}

/// A request's lifetime, until its response (body included) is done: decrements the in-flight
/// gauge then, and holds the request's trace span open until then.
#[derive(Debug)]
pub struct InFlight {
    metrics: Arc<ProxyMetrics>,
    span: tracing::Span,
}

impl InFlight {
    /// Keeps `span` (the request's trace span) open as long as the response.
    pub fn traced(mut self, span: tracing::Span) -> Self {
        self.span = span;
        self
    }

    /// The request's trace span (disabled when tracing is off).
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ProxyMetrics {
    /// Metrics that also report the allow-list's size and reloads.
    pub fn new(allow_list: Option<Arc<LiveAllowList>>) -> Self {
        Self {
            allow_list,
            ..Self::default()
        }
    }

    /// The same metrics, reporting `connector` as the P/D protocol in force.
    pub fn with_connector(self, connector: Connector) -> Self {
        Self { connector, ..self }
    }

    /// Counts a request in flight until the guard drops.
    pub fn in_flight(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            metrics: Arc::clone(self),
            span: tracing::Span::none(),
        }
    }

    /// Requests in flight now.
    pub fn in_flight_now(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Counts a finished request by mode and the status the client got.
    pub fn request(&self, mode: Mode, status: u16) {
        let class = usize::from(status / 100).saturating_sub(1);
        if let Some(c) = self.requests.get(mode as usize).and_then(|m| m.get(class)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records the time the proxy itself added to a request's response head.
    pub fn added_latency(&self, mode: Mode, d: Duration) {
        if let Some(h) = self.added_latency.get(mode as usize) {
            h.observe(d);
        }
    }

    /// Counts one prefill attempt.
    pub fn prefill_attempt(&self) {
        self.prefill_attempts.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one failed prefill attempt.
    pub fn prefill_failure(&self, f: Failure) {
        if let Some(c) = self.prefill_failures.get(f.index()) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts how a mid-stream engine failure ended.
    pub fn migration(&self, outcome: MigrationOutcome) {
        if let Some(c) = self.migrations.get(outcome as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts one continuation request sent to another endpoint.
    pub fn migration_attempt(&self) {
        self.migration_attempts.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request refused by SSRF protection.
    pub fn ssrf_refusal(&self) {
        self.ssrf_refusals.fetch_add(1, Ordering::Relaxed);
    }

    /// Marks the start of the drain: until [`ProxyMetrics::drain_duration`] the gauge shows the
    /// time drained so far, so a scrape during the drain sees it grow.
    pub fn drain_started(&self) {
        let _ = self.drain_started.set(std::time::Instant::now());
    }

    fn drain_seconds(&self) -> f64 {
        let done = f64::from_bits(self.drain_seconds_bits.load(Ordering::Relaxed));
        match self.drain_started.get() {
            Some(t) if done == 0.0 => t.elapsed().as_secs_f64(),
            _ => done,
        }
    }

    /// Records how long the drain took.
    pub fn drain_duration(&self, d: Duration) {
        self.drain_seconds_bits
            .store(d.as_secs_f64().to_bits(), Ordering::Relaxed);
    }

    /// Appends the Prometheus text exposition.
    pub fn render(&self, out: &mut String) {
        let n = "kvgate_sidecar_proxy_requests_total";
        let _ = writeln!(
            out,
            "# HELP {n} Requests proxied, by mode and the status class the client got.\n# TYPE {n} counter"
        );
        for (mode, counts) in Mode::ALL.iter().zip(&self.requests) {
            for (class, c) in CLASSES.iter().zip(counts) {
                let v = c.load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "{n}{{mode=\"{}\",outcome=\"{class}\"}} {v}",
                    mode.label()
                );
            }
        }
        let n = "kvgate_sidecar_proxy_added_latency_seconds";
        let _ = writeln!(
            out,
            "# HELP {n} Time the proxy adds before the response head (upstream waits excluded).\n# TYPE {n} histogram"
        );
        for (mode, h) in Mode::ALL.iter().zip(&self.added_latency) {
            h.render(out, n, &[("mode", mode.label())]);
        }
        let mut single = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        single(
            "kvgate_sidecar_proxy_prefill_attempts_total",
            "counter",
            "Prefill-leg attempts made to remote prefillers.",
            self.prefill_attempts.load(Ordering::Relaxed).to_string(),
        );
        single(
            "kvgate_sidecar_proxy_ssrf_refusals_total",
            "counter",
            "P/D requests refused because the prefiller is not allowed.",
            self.ssrf_refusals.load(Ordering::Relaxed).to_string(),
        );
        single(
            "kvgate_sidecar_proxy_in_flight",
            "gauge",
            "Requests whose response has not finished.",
            self.in_flight_now().to_string(),
        );
        single(
            "kvgate_sidecar_proxy_drain_duration_seconds",
            "gauge",
            "Time spent draining (growing during the drain; 0 before it).",
            self.drain_seconds().to_string(),
        );
        if let Some(live) = &self.allow_list {
            single(
                "kvgate_sidecar_proxy_allow_list_addresses",
                "gauge",
                "Prefiller addresses in the allow-list in force.",
                live.len().to_string(),
            );
            single(
                "kvgate_sidecar_proxy_allow_list_reloads_total",
                "counter",
                "Allow-list files loaded.",
                live.reloads.load(Ordering::Relaxed).to_string(),
            );
            single(
                "kvgate_sidecar_proxy_allow_list_errors_total",
                "counter",
                "Allow-list reads or parses refused (the previous list stayed).",
                live.errors.load(Ordering::Relaxed).to_string(),
            );
        }
        let n = "kvgate_sidecar_proxy_connector_info";
        let _ = writeln!(
            out,
            "# HELP {n} The P/D connector protocol in force (1 for the one in use).\n# TYPE {n} gauge"
        );
        for c in Connector::ALL {
            let v = u8::from(c == self.connector);
            let _ = writeln!(out, "{n}{{connector=\"{}\"}} {v}", c.label());
        }
        let n = "kvgate_sidecar_proxy_prefill_failures_total";
        let _ = writeln!(
            out,
            "# HELP {n} Failed prefill-leg attempts, by reason.\n# TYPE {n} counter"
        );
        for (f, c) in Failure::ALL.iter().zip(&self.prefill_failures) {
            let v = c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{n}{{reason=\"{}\"}} {v}", f.label());
        }
        let n = "kvgate_sidecar_proxy_migrations_total";
        let _ = writeln!(
            out,
            "# HELP {n} Streamed answers whose engine failed mid-way, by outcome: migrated (the rest came from another endpoint), failed (every attempt failed), no_target (no allowed fallback endpoint), not_migratable (the answer could not be carried over).\n# TYPE {n} counter"
        );
        for (o, c) in MigrationOutcome::ALL.iter().zip(&self.migrations) {
            let v = c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{n}{{outcome=\"{}\"}} {v}", o.label());
        }
        let n = "kvgate_sidecar_proxy_migration_attempts_total";
        let _ = writeln!(
            out,
            "# HELP {n} Continuation requests sent to other endpoints.\n# TYPE {n} counter\n{n} {}",
            self.migration_attempts.load(Ordering::Relaxed)
        );
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
    fn renders_counts_and_cumulative_buckets() {
        let m = Arc::new(ProxyMetrics::new(None));
        m.request(Mode::Pd, 200);
        m.request(Mode::Pd, 502);
        m.request(Mode::Passthrough, 404);
        m.added_latency(Mode::Passthrough, Duration::from_micros(30));
        m.added_latency(Mode::Passthrough, Duration::from_millis(3));
        m.prefill_failure(Failure::Status503);
        let guard = m.in_flight();
        let mut out = String::new();
        m.render(&mut out);
        for line in [
            "kvgate_sidecar_proxy_requests_total{mode=\"pd\",outcome=\"2xx\"} 1",
            "kvgate_sidecar_proxy_requests_total{mode=\"pd\",outcome=\"5xx\"} 1",
            "kvgate_sidecar_proxy_requests_total{mode=\"passthrough\",outcome=\"4xx\"} 1",
            "kvgate_sidecar_proxy_added_latency_seconds_bucket{mode=\"passthrough\",le=\"0.00005\"} 1",
            "kvgate_sidecar_proxy_added_latency_seconds_bucket{mode=\"passthrough\",le=\"0.005\"} 2",
            "kvgate_sidecar_proxy_added_latency_seconds_count{mode=\"passthrough\"} 2",
            "kvgate_sidecar_proxy_prefill_failures_total{reason=\"status_503\"} 1",
            "kvgate_sidecar_proxy_in_flight 1",
            "kvgate_sidecar_proxy_connector_info{connector=\"nixlv2\"} 1",
            "kvgate_sidecar_proxy_connector_info{connector=\"sglang\"} 0",
        ] {
            assert!(out.lines().any(|l| l == line), "missing {line}\n{out}");
        }
        drop(guard);
        assert_eq!(m.in_flight_now(), 0);
    }
}
