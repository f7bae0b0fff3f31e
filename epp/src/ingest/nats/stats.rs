//! Counters and gauges of NATS ingestion and in-flight sharing, and their Prometheus text.
//! Names are `kvgate_epp_*` in base units; the only labels are the pool and a bounded reason.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use kv_sync::Failure;

/// Everything the NATS side counts.
#[derive(Debug, Default)]
pub struct NatsStats {
    /// 1 while connected to NATS.
    pub connected: AtomicU64,
    /// Connections (re)established.
    pub connects: AtomicU64,
    /// Envelopes applied to the index.
    pub envelopes_applied: AtomicU64,
    /// kvgate events applied to the index.
    pub events_applied: AtomicU64,
    /// Sequence gaps seen.
    pub gaps: AtomicU64,
    /// New epochs seen.
    pub new_epochs: AtomicU64,
    /// Snapshot requests sent.
    pub snapshots_requested: AtomicU64,
    /// Snapshots applied.
    pub snapshots_ok: AtomicU64,
    /// Snapshot attempts that failed: timeout.
    pub snapshot_timeout: AtomicU64,
    /// … error (send failed, malformed reply).
    pub snapshot_error: AtomicU64,
    /// … superseded by a newer epoch.
    pub snapshot_superseded: AtomicU64,
    /// … buffer overflow while waiting.
    pub snapshot_overflow: AtomicU64,
    /// Replies to requests no longer awaited.
    pub snapshot_late: AtomicU64,
    /// Sources currently stale.
    pub stale_sources: AtomicU64,
    /// Sources currently tracked.
    pub sources: AtomicU64,
    /// Envelopes or samples from sources discovery does not know.
    pub unknown_sources: AtomicU64,
    /// Messages that failed to decode or broke a bound.
    pub malformed: AtomicU64,
    /// Load samples recorded.
    pub load_samples: AtomicU64,
    /// In-flight deltas published.
    pub inflight_deltas_sent: AtomicU64,
    /// In-flight messages published (deltas or full state).
    pub inflight_messages_sent: AtomicU64,
    /// In-flight deltas received from peers and applied.
    pub inflight_deltas_received: AtomicU64,
    /// Gaps in peers' in-flight sequences.
    pub inflight_gaps: AtomicU64,
    /// Peer replicas currently contributing load.
    pub peer_replicas: AtomicU64,
    /// Peer replicas forgotten after falling silent.
    pub peers_expired: AtomicU64,
    /// Relay messages published to peer replicas (response events of their requests).
    pub relay_messages_sent: AtomicU64,
    /// Relay messages that could not be published (disconnected, buffer full).
    pub relay_publish_failed: AtomicU64,
    /// Relay messages received from peer replicas and applied.
    pub relay_messages_received: AtomicU64,
}

impl NatsStats {
    /// Counts a failed snapshot attempt.
    pub fn failed(&self, f: Failure) {
        let c = match f {
            Failure::Timeout => &self.snapshot_timeout,
            Failure::Error => &self.snapshot_error,
            Failure::Superseded => &self.snapshot_superseded,
            Failure::Overflow => &self.snapshot_overflow,
        };
        add(c, 1);
    }

    /// Appends the exposition, every series labelled with `labels` (`pool="…"`).
    pub fn render_into(&self, labels: &str, out: &mut String) {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let mut one = |name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {v}"
            );
        };
        one(
            "kvgate_epp_nats_connected",
            "gauge",
            "1 while connected to NATS.",
            get(&self.connected),
        );
        one(
            "kvgate_epp_nats_connects_total",
            "counter",
            "NATS connections established, reconnects included.",
            get(&self.connects),
        );
        one(
            "kvgate_epp_nats_envelopes_applied_total",
            "counter",
            "KV-event envelopes applied to the index.",
            get(&self.envelopes_applied),
        );
        one(
            "kvgate_epp_nats_events_applied_total",
            "counter",
            "KV events from envelopes and snapshot catch-up applied to the index.",
            get(&self.events_applied),
        );
        one(
            "kvgate_epp_nats_gaps_total",
            "counter",
            "Sequence gaps in sources' envelope streams.",
            get(&self.gaps),
        );
        one(
            "kvgate_epp_nats_new_epochs_total",
            "counter",
            "Sources seen restarting with a new epoch.",
            get(&self.new_epochs),
        );
        one(
            "kvgate_epp_nats_snapshots_requested_total",
            "counter",
            "Snapshot requests sent.",
            get(&self.snapshots_requested),
        );
        one(
            "kvgate_epp_nats_snapshots_applied_total",
            "counter",
            "Snapshots that replaced a source's entries.",
            get(&self.snapshots_ok),
        );
        one(
            "kvgate_epp_nats_snapshot_late_replies_total",
            "counter",
            "Snapshot replies to requests no longer awaited, dropped.",
            get(&self.snapshot_late),
        );
        one(
            "kvgate_epp_nats_stale_sources",
            "gauge",
            "Sources out of step, routing on cached entries until a snapshot lands.",
            get(&self.stale_sources),
        );
        one(
            "kvgate_epp_nats_sources",
            "gauge",
            "Sources tracked.",
            get(&self.sources),
        );
        one(
            "kvgate_epp_nats_unknown_source_messages_total",
            "counter",
            "Envelopes and load samples from sources discovery does not know, ignored.",
            get(&self.unknown_sources),
        );
        one(
            "kvgate_epp_nats_malformed_messages_total",
            "counter",
            "NATS messages that failed to decode or broke a bound.",
            get(&self.malformed),
        );
        one(
            "kvgate_epp_nats_load_samples_total",
            "counter",
            "Engine load samples recorded from NATS.",
            get(&self.load_samples),
        );
        one(
            "kvgate_epp_inflight_deltas_sent_total",
            "counter",
            "In-flight deltas published to peer replicas.",
            get(&self.inflight_deltas_sent),
        );
        one(
            "kvgate_epp_inflight_messages_sent_total",
            "counter",
            "In-flight messages (deltas or full state) published.",
            get(&self.inflight_messages_sent),
        );
        one(
            "kvgate_epp_inflight_deltas_received_total",
            "counter",
            "In-flight deltas received from peer replicas and applied.",
            get(&self.inflight_deltas_received),
        );
        one(
            "kvgate_epp_inflight_gaps_total",
            "counter",
            "Gaps in peer replicas' in-flight sequences.",
            get(&self.inflight_gaps),
        );
        one(
            "kvgate_epp_peer_replicas",
            "gauge",
            "Peer EPP replicas whose in-flight load is counted.",
            get(&self.peer_replicas),
        );
        one(
            "kvgate_epp_relay_messages_sent_total",
            "counter",
            "Relay messages (response events of peer replicas' requests) published.",
            get(&self.relay_messages_sent),
        );
        one(
            "kvgate_epp_relay_publish_failures_total",
            "counter",
            "Relay messages that could not be published (NATS disconnected or its buffer full).",
            get(&self.relay_publish_failed),
        );
        one(
            "kvgate_epp_relay_messages_received_total",
            "counter",
            "Relay messages received from peer replicas and applied.",
            get(&self.relay_messages_received),
        );
        one(
            "kvgate_epp_peer_replicas_expired_total",
            "counter",
            "Peer replicas forgotten after falling silent.",
            get(&self.peers_expired),
        );
        let name = "kvgate_epp_nats_snapshot_failures_total";
        let _ = writeln!(
            out,
            "# HELP {name} Snapshot attempts that did not bring a source in step, by reason.\n# TYPE {name} counter"
        );
        for (f, c) in [
            (Failure::Timeout, &self.snapshot_timeout),
            (Failure::Error, &self.snapshot_error),
            (Failure::Superseded, &self.snapshot_superseded),
            (Failure::Overflow, &self.snapshot_overflow),
        ] {
            let _ = writeln!(
                out,
                "{name}{{{labels},reason=\"{}\"}} {}",
                f.metric_label(),
                get(c)
            );
        }
    }
}

/// `a += n`, relaxed.
pub fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// `a = v`, relaxed.
pub fn set(a: &AtomicU64, v: u64) {
    a.store(v, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_reasons_and_gauges() {
        let s = NatsStats::default();
        s.failed(Failure::Superseded);
        set(&s.connected, 1);
        let mut out = String::new();
        s.render_into("pool=\"p\"", &mut out);
        for want in [
            "kvgate_epp_nats_snapshot_failures_total{pool=\"p\",reason=\"superseded\"} 1",
            "kvgate_epp_nats_snapshot_failures_total{pool=\"p\",reason=\"timeout\"} 0",
            "kvgate_epp_nats_connected{pool=\"p\"} 1",
            "# TYPE kvgate_epp_peer_replicas gauge",
        ] {
            assert!(out.contains(want), "missing {want}\n{out}");
        }
    }
}
