//! The daemon's metrics: `kvgate_kvbm_…`, base units, bounded labels (operation, error code,
//! tier and the remote client's error kinds are fixed sets).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use telemetry::{Exposition, Histogram, Kind, buckets};

use crate::protocol::ErrorCode;
use crate::store::{BlockStore, TierUsage};

/// Connector operations, in label order.
pub const OPS: [&str; 4] = ["register", "offload", "lookup", "onboard"];

const CODES: [(ErrorCode, &str); 6] = [
    (ErrorCode::Malformed, "malformed"),
    (ErrorCode::Sequence, "sequence"),
    (ErrorCode::Layout, "layout"),
    (ErrorCode::Slot, "slot"),
    (ErrorCode::Segment, "segment"),
    (ErrorCode::Unavailable, "unavailable"),
];

/// Counters and gauges the edges update.
#[derive(Debug)]
pub struct Metrics {
    /// Connectors connected now.
    pub connections: AtomicU64,
    /// Connections accepted since start.
    pub connections_total: AtomicU64,
    /// Connections refused (over the limit, or a failed handshake).
    pub connections_refused: AtomicU64,
    requests: [AtomicU64; 4],
    request_seconds: [Histogram; 4],
    errors: [AtomicU64; 6],
    /// Remote writes done.
    pub remote_ops: AtomicU64,
    /// Remote writes dropped because the queue was full.
    pub remote_dropped: AtomicU64,
    remote_errors: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    /// Envelopes published.
    pub envelopes_published: AtomicU64,
    /// Envelope publishes that failed.
    pub publish_errors: AtomicU64,
    /// Snapshot requests received.
    pub snapshot_requests: AtomicU64,
    /// Snapshot requests not answered.
    pub snapshot_errors: AtomicU64,
    /// Times unpublished events piled up and a new epoch replaced them.
    pub outbox_overflows: AtomicU64,
    /// Whether NATS is connected.
    pub nats_connected: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            connections: AtomicU64::new(0),
            connections_total: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            requests: Default::default(),
            request_seconds: std::array::from_fn(|_| Histogram::new(buckets::SECONDS)),
            errors: Default::default(),
            remote_ops: AtomicU64::new(0),
            remote_dropped: AtomicU64::new(0),
            remote_errors: Mutex::new(BTreeMap::new()),
            envelopes_published: AtomicU64::new(0),
            publish_errors: AtomicU64::new(0),
            snapshot_requests: AtomicU64::new(0),
            snapshot_errors: AtomicU64::new(0),
            outbox_overflows: AtomicU64::new(0),
            nats_connected: AtomicBool::new(false),
        }
    }
}

impl Metrics {
    /// Counts a request of operation `op` (an [`OPS`] name) that took `elapsed`.
    pub fn request(&self, op: &str, elapsed: std::time::Duration) {
        if let Some(i) = OPS.iter().position(|o| *o == op) {
            if let Some(c) = self.requests.get(i) {
                c.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(h) = self.request_seconds.get(i) {
                h.observe_duration(elapsed);
            }
        }
    }

    /// Counts a request that failed with `code`.
    pub fn error(&self, code: ErrorCode) {
        if let Some(i) = CODES.iter().position(|(c, _)| *c == code)
            && let Some(c) = self.errors.get(i)
        {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a failed remote operation (`op`: get, put, delete; `kind`: the error's label).
    pub fn remote_error(&self, op: &'static str, kind: &'static str) {
        let mut m = self
            .remote_errors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *m.entry((op, kind)).or_default() += 1;
    }

    /// The exposition, with the store's gauges read through `store` and the bytes queued for
    /// the remote store.
    pub fn render(&self, store: &BlockStore, queued_bytes: u64) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let mut e = Exposition::new();
        e.single(
            "kvgate_kvbm_connections",
            Kind::Gauge,
            "Connectors connected.",
            &[],
            get(&self.connections),
        )
        .single(
            "kvgate_kvbm_connections_total",
            Kind::Counter,
            "Connector connections accepted.",
            &[],
            get(&self.connections_total),
        )
        .single(
            "kvgate_kvbm_connections_refused_total",
            Kind::Counter,
            "Connections refused: over the limit, or a failed handshake.",
            &[],
            get(&self.connections_refused),
        );
        e.family(
            "kvgate_kvbm_requests_total",
            Kind::Counter,
            "Connector requests by operation.",
        );
        for (op, c) in OPS.iter().zip(&self.requests) {
            e.sample("kvgate_kvbm_requests_total", &[("op", op)], get(c));
        }
        e.family(
            "kvgate_kvbm_request_duration_seconds",
            Kind::Histogram,
            "Connector request handling time by operation (segment I/O and remote fetches included).",
        );
        for (op, h) in OPS.iter().zip(&self.request_seconds) {
            e.histogram(
                "kvgate_kvbm_request_duration_seconds",
                &[("op", op)],
                &h.snapshot(),
            );
        }
        e.family(
            "kvgate_kvbm_request_errors_total",
            Kind::Counter,
            "Connector requests answered with an error, by code.",
        );
        for ((_, code), c) in CODES.iter().zip(&self.errors) {
            e.sample(
                "kvgate_kvbm_request_errors_total",
                &[("code", code)],
                get(c),
            );
        }
        let tier = |e: &mut Exposition, name: &str, u: TierUsage| {
            e.sample(
                "kvgate_kvbm_tier_blocks",
                &[("tier", name)],
                u.blocks as f64,
            );
            e.sample("kvgate_kvbm_tier_bytes", &[("tier", name)], u.bytes as f64);
            e.sample(
                "kvgate_kvbm_tier_capacity_bytes",
                &[("tier", name)],
                u.capacity as f64,
            );
        };
        e.family(
            "kvgate_kvbm_tier_blocks",
            Kind::Gauge,
            "Blocks held per tier.",
        )
        .family(
            "kvgate_kvbm_tier_bytes",
            Kind::Gauge,
            "Bytes held per tier.",
        )
        .family(
            "kvgate_kvbm_tier_capacity_bytes",
            Kind::Gauge,
            "Byte budget per tier.",
        );
        tier(&mut e, "host", store.host_usage());
        tier(&mut e, "remote", store.remote_usage());
        let c = store.counters();
        for (name, help, v) in [
            (
                "kvgate_kvbm_host_stored_blocks_total",
                "Blocks stored into host memory (offloads and promotions).",
                c.host_stored,
            ),
            (
                "kvgate_kvbm_host_evicted_blocks_total",
                "Blocks evicted from host memory.",
                c.host_evicted,
            ),
            (
                "kvgate_kvbm_demoted_blocks_total",
                "Host evictions written to the remote store.",
                c.demoted,
            ),
            (
                "kvgate_kvbm_remote_stored_blocks_total",
                "Blocks stored into the remote store.",
                c.remote_stored,
            ),
            (
                "kvgate_kvbm_remote_evicted_blocks_total",
                "Blocks evicted from this node's remote budget.",
                c.remote_evicted,
            ),
            (
                "kvgate_kvbm_remote_lost_blocks_total",
                "Remote blocks the remote store no longer had at onboard.",
                c.remote_lost,
            ),
            (
                "kvgate_kvbm_onboarded_host_blocks_total",
                "Blocks onboarded from host memory.",
                c.onboarded_host,
            ),
            (
                "kvgate_kvbm_onboarded_remote_blocks_total",
                "Blocks onboarded from the remote store.",
                c.onboarded_remote,
            ),
        ] {
            e.single(name, Kind::Counter, help, &[], v as f64);
        }
        e.single(
            "kvgate_kvbm_remote_ops_total",
            Kind::Counter,
            "Remote writes (puts and deletes) done.",
            &[],
            get(&self.remote_ops),
        )
        .single(
            "kvgate_kvbm_remote_queued_bytes",
            Kind::Gauge,
            "Block bytes queued for the remote store.",
            &[],
            queued_bytes as f64,
        )
        .single(
            "kvgate_kvbm_remote_dropped_total",
            Kind::Counter,
            "Remote writes dropped because the write queue was full.",
            &[],
            get(&self.remote_dropped),
        );
        e.family(
            "kvgate_kvbm_remote_errors_total",
            Kind::Counter,
            "Failed remote operations by operation and error kind.",
        );
        let errors = self
            .remote_errors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for ((op, kind), n) in errors {
            e.sample(
                "kvgate_kvbm_remote_errors_total",
                &[("op", op), ("kind", kind)],
                n as f64,
            );
        }
        e.single(
            "kvgate_kvbm_envelopes_published_total",
            Kind::Counter,
            "KV-event envelopes published on NATS.",
            &[],
            get(&self.envelopes_published),
        )
        .single(
            "kvgate_kvbm_publish_errors_total",
            Kind::Counter,
            "Envelope publishes that failed.",
            &[],
            get(&self.publish_errors),
        )
        .single(
            "kvgate_kvbm_snapshot_requests_total",
            Kind::Counter,
            "Snapshot requests received.",
            &[],
            get(&self.snapshot_requests),
        )
        .single(
            "kvgate_kvbm_snapshot_errors_total",
            Kind::Counter,
            "Snapshot requests not answered.",
            &[],
            get(&self.snapshot_errors),
        )
        .single(
            "kvgate_kvbm_outbox_overflows_total",
            Kind::Counter,
            "Times unpublished events piled up (NATS away) and a new epoch replaced them.",
            &[],
            get(&self.outbox_overflows),
        )
        .single(
            "kvgate_kvbm_nats_connected",
            Kind::Gauge,
            "1 while connected to NATS.",
            &[],
            f64::from(u8::from(self.nats_connected.load(Ordering::Relaxed))),
        );
        e.finish()
    }
}
