//! The sidecar's own metrics (`kvgate_sidecar_…`, Prometheus text) and the router serving them
//! on the metrics port. [`router`] returns a plain `axum::Router` so health and readiness routes
//! can be merged onto the same port.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::bridge::rank::RankStats;

/// Upper bounds of the relay-latency histogram, in seconds.
const LATENCY_BUCKETS: [f64; 10] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05, 0.25,
];

/// A duration histogram over the sidecar's latency buckets (the counting is `telemetry`'s).
#[derive(Debug)]
pub struct Histogram(telemetry::Histogram);

impl Default for Histogram {
    fn default() -> Self {
        Self(telemetry::Histogram::new(&LATENCY_BUCKETS))
    }
}

impl Histogram {
    /// Records one duration.
    pub fn observe(&self, d: Duration) {
        self.0.observe_duration(d);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0.snapshot().count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let mut e = telemetry::Exposition::new();
        e.family(name, telemetry::Kind::Histogram, help)
            .histogram(name, &[], &self.0.snapshot());
        out.push_str(&e.finish());
    }
}

/// Every counter and gauge the sidecar exports.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Engine frames received in sequence (live and replayed).
    pub frames_in: AtomicU64,
    /// Engine events decoded.
    pub events_in: AtomicU64,
    /// Engine blocks those events concerned.
    pub blocks_in: AtomicU64,
    /// kvgate events sealed into envelopes.
    pub events_out: AtomicU64,
    /// Envelopes queued for NATS.
    pub envelopes_queued: AtomicU64,
    /// Envelopes published to NATS.
    pub envelopes_published: AtomicU64,
    /// Publishes NATS refused.
    pub publish_errors: AtomicU64,
    /// Envelopes dropped (publish queue full or encoding failed).
    pub drops: AtomicU64,
    /// New epochs started to resynchronise receivers (after drops or NATS reconnects).
    pub resyncs: AtomicU64,
    /// Gaps in the engine's seq.
    pub gaps: AtomicU64,
    /// Gaps repaired by replay.
    pub replays: AtomicU64,
    /// Gaps replay could not cover (published as `Cleared`).
    pub lost: AtomicU64,
    /// Engine restarts seen.
    pub restarts: AtomicU64,
    /// Messages that are not KV-event frames, and payloads that do not decode.
    pub malformed: AtomicU64,
    /// Engine events the normaliser refused.
    pub rejected: AtomicU64,
    /// Snapshot requests received.
    pub snapshot_requests: AtomicU64,
    /// Snapshot requests not answered (malformed, unknown rank, no reply subject, send failed).
    pub snapshot_errors: AtomicU64,
    /// Engine `/metrics` scrapes that succeeded.
    pub scrapes: AtomicU64,
    /// Engine `/metrics` scrapes that failed.
    pub scrape_errors: AtomicU64,
    /// Load samples published.
    pub load_samples: AtomicU64,
    /// Whether the NATS client is connected.
    pub nats_connected: AtomicBool,
    /// When the last scrape succeeded (nanoseconds after `started`, 0 = never).
    last_scrape_nanos: AtomicU64,
    /// Relay latency: engine frame received → envelope handed to the NATS client.
    pub relay_latency: Histogram,
    started: Option<Instant>,
}

impl Metrics {
    /// Fresh metrics.
    pub fn new() -> Self {
        Self {
            started: Some(Instant::now()),
            ..Self::default()
        }
    }

    /// Adds what a rank's counters gained.
    pub fn add_rank_delta(&self, before: &RankStats, after: &RankStats) {
        let add = |c: &AtomicU64, a: u64, b: u64| {
            if b > a {
                c.fetch_add(b - a, Ordering::Relaxed);
            }
        };
        add(&self.events_in, before.engine_events, after.engine_events);
        add(&self.blocks_in, before.engine_blocks, after.engine_blocks);
        add(&self.events_out, before.kv_events, after.kv_events);
        add(&self.malformed, before.undecodable, after.undecodable);
        add(&self.rejected, before.rejected, after.rejected);
    }

    /// Records a successful scrape now.
    pub fn scraped(&self) {
        let since = self.started.map_or(0, |s| s.elapsed().as_nanos());
        let nanos = u64::try_from(since).unwrap_or(u64::MAX).max(1);
        self.last_scrape_nanos.store(nanos, Ordering::Relaxed);
        self.scrapes.fetch_add(1, Ordering::Relaxed);
    }

    /// Seconds since the last successful scrape (`+Inf` before the first).
    pub fn scrape_staleness(&self) -> f64 {
        let last = self.last_scrape_nanos.load(Ordering::Relaxed);
        match self.started {
            Some(s) if last > 0 => {
                let now = u64::try_from(s.elapsed().as_nanos()).unwrap_or(u64::MAX);
                now.saturating_sub(last) as f64 / 1e9
            }
            _ => f64::INFINITY,
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let counters: [(&str, &AtomicU64, &str); 20] = [
            (
                "frames_in_total",
                &self.frames_in,
                "Engine KV-event frames received in sequence.",
            ),
            (
                "events_in_total",
                &self.events_in,
                "Engine KV events decoded.",
            ),
            (
                "blocks_in_total",
                &self.blocks_in,
                "Engine blocks the decoded events concerned.",
            ),
            (
                "events_out_total",
                &self.events_out,
                "kvgate events sealed into envelopes.",
            ),
            (
                "envelopes_queued_total",
                &self.envelopes_queued,
                "Envelopes queued for NATS.",
            ),
            (
                "envelopes_published_total",
                &self.envelopes_published,
                "Envelopes published to NATS.",
            ),
            (
                "publish_errors_total",
                &self.publish_errors,
                "Envelope publishes the NATS client refused.",
            ),
            (
                "drops_total",
                &self.drops,
                "Envelopes dropped because the NATS publish queue was full.",
            ),
            (
                "resyncs_total",
                &self.resyncs,
                "New epochs started so receivers resynchronise.",
            ),
            (
                "gaps_total",
                &self.gaps,
                "Gaps in the engine's KV-event sequence.",
            ),
            (
                "replays_total",
                &self.replays,
                "Gaps repaired through the engine's replay socket.",
            ),
            (
                "lost_total",
                &self.lost,
                "Gaps replay could not cover (published as Cleared).",
            ),
            (
                "engine_restarts_total",
                &self.restarts,
                "Engine restarts seen (the sequence went back, or a replay answered with another stream).",
            ),
            (
                "malformed_total",
                &self.malformed,
                "Malformed engine messages or payloads skipped.",
            ),
            (
                "rejected_events_total",
                &self.rejected,
                "Engine events the normaliser refused.",
            ),
            (
                "snapshot_requests_total",
                &self.snapshot_requests,
                "Snapshot requests received.",
            ),
            (
                "snapshot_errors_total",
                &self.snapshot_errors,
                "Snapshot requests not answered.",
            ),
            (
                "engine_scrapes_total",
                &self.scrapes,
                "Successful engine /metrics scrapes.",
            ),
            (
                "engine_scrape_errors_total",
                &self.scrape_errors,
                "Failed engine /metrics scrapes.",
            ),
            (
                "load_samples_total",
                &self.load_samples,
                "Load samples published.",
            ),
        ];
        for (name, c, help) in counters {
            let v = c.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "# HELP kvgate_sidecar_{name} {help}\n# TYPE kvgate_sidecar_{name} counter\nkvgate_sidecar_{name} {v}"
            );
        }
        let connected = u8::from(self.nats_connected.load(Ordering::Relaxed));
        let _ = writeln!(
            out,
            "# HELP kvgate_sidecar_nats_connected Whether the NATS client is connected.\n\
             # TYPE kvgate_sidecar_nats_connected gauge\nkvgate_sidecar_nats_connected {connected}"
        );
        let stale = self.scrape_staleness();
        let stale = if stale.is_finite() {
            stale.to_string()
        } else {
            "+Inf".to_owned()
        };
        let _ = writeln!(
            out,
            "# HELP kvgate_sidecar_engine_scrape_staleness_seconds Time since the last successful engine scrape.\n\
             # TYPE kvgate_sidecar_engine_scrape_staleness_seconds gauge\n\
             kvgate_sidecar_engine_scrape_staleness_seconds {stale}"
        );
        self.relay_latency.render(
            &mut out,
            "kvgate_sidecar_relay_latency_seconds",
            "Time from receiving an engine frame to handing its envelope to the NATS client.",
        );
        out
    }
}

/// `GET /metrics` over `metrics`; merge other routes onto it with `Router::merge`.
pub fn router(metrics: Arc<Metrics>) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        get(move || {
            let m = Arc::clone(&metrics);
            async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    m.render(),
                )
                    .into_response()
            }
        }),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn renders_counters_gauges_and_a_cumulative_histogram() {
        let m = Metrics::new();
        m.gaps.fetch_add(2, Ordering::Relaxed);
        m.relay_latency.observe(Duration::from_micros(80));
        m.relay_latency.observe(Duration::from_millis(3));
        let text = m.render();
        assert!(text.contains("kvgate_sidecar_gaps_total 2\n"));
        assert!(text.contains("kvgate_sidecar_engine_scrape_staleness_seconds +Inf\n"));
        assert!(text.contains("kvgate_sidecar_relay_latency_seconds_bucket{le=\"0.0001\"} 1\n"));
        assert!(text.contains("kvgate_sidecar_relay_latency_seconds_bucket{le=\"0.005\"} 2\n"));
        assert!(text.contains("kvgate_sidecar_relay_latency_seconds_count 2\n"));
        m.scraped();
        assert!(m.scrape_staleness() < 1.0);
    }
}
