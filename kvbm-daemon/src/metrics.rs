//! The daemon's metrics: `kvgate_kvbm_…`, base units, bounded labels (operation, error code,
//! tier and the lower tiers' error kinds are fixed sets).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use telemetry::{Exposition, Histogram, Kind, buckets};

use crate::peers::metrics::PeerMetrics;
use crate::protocol::ErrorCode;
use kv_events::Tier;

use crate::store::{BlockStore, TierUsage};

/// Connector operations, in label order.
pub const OPS: [&str; 5] = ["register", "offload", "lookup", "unpin", "onboard"];

const CODES: [(ErrorCode, &str); 6] = [
    (ErrorCode::Malformed, "malformed"),
    (ErrorCode::Sequence, "sequence"),
    (ErrorCode::Layout, "layout"),
    (ErrorCode::Slot, "slot"),
    (ErrorCode::Segment, "segment"),
    (ErrorCode::Unavailable, "unavailable"),
];

/// A lower tier's write queue.
#[derive(Debug, Default)]
pub struct WriteCounters {
    /// Writes (puts and deletes) done.
    pub done: AtomicU64,
    /// Writes dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Queued puts skipped because a later delete of the block superseded them.
    pub superseded: AtomicU64,
}

/// Counters and gauges the edges update.
#[derive(Debug)]
pub struct Metrics {
    /// Connectors connected now.
    pub connections: AtomicU64,
    /// Connections accepted since start.
    pub connections_total: AtomicU64,
    /// Connections refused (over the limit, or a failed handshake).
    pub connections_refused: AtomicU64,
    requests: [AtomicU64; 5],
    request_seconds: [Histogram; 5],
    errors: [AtomicU64; 6],
    /// The disk tier's write queue.
    pub disk_writes: WriteCounters,
    /// The remote tier's write queue.
    pub remote_writes: WriteCounters,
    tier_errors: Mutex<BTreeMap<(&'static str, &'static str, &'static str), u64>>,
    /// Whether the disk tier uses `O_DIRECT`.
    pub disk_direct_io: AtomicBool,
    /// Bytes the disk tier's slab files span (set at each scrape).
    pub disk_file_bytes: AtomicU64,
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
    /// Offloaded blocks not stored because their connection was over its offload budget.
    pub offload_throttled_blocks: AtomicU64,
    /// Pulls from peers and pulls served to them.
    pub peer: PeerMetrics,
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
            disk_writes: WriteCounters::default(),
            remote_writes: WriteCounters::default(),
            tier_errors: Mutex::new(BTreeMap::new()),
            disk_direct_io: AtomicBool::new(false),
            disk_file_bytes: AtomicU64::new(0),
            envelopes_published: AtomicU64::new(0),
            publish_errors: AtomicU64::new(0),
            snapshot_requests: AtomicU64::new(0),
            snapshot_errors: AtomicU64::new(0),
            outbox_overflows: AtomicU64::new(0),
            nats_connected: AtomicBool::new(false),
            offload_throttled_blocks: AtomicU64::new(0),
            peer: PeerMetrics::default(),
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

    /// A lower tier's write-queue counters (none for host memory).
    pub fn writes(&self, tier: Tier) -> Option<&WriteCounters> {
        match tier {
            Tier::Disk => Some(&self.disk_writes),
            Tier::Remote => Some(&self.remote_writes),
            Tier::Gpu | Tier::Host => None,
        }
    }

    /// Counts a failed lower-tier operation (`tier`: disk or remote; `op`: read, write,
    /// delete; `kind`: the error's label).
    pub fn tier_error(&self, tier: &'static str, op: &'static str, kind: &'static str) {
        let mut m = self
            .tier_errors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *m.entry((tier, op, kind)).or_default() += 1;
    }

    /// The exposition, with the store's gauges read through `store` and the bytes queued for
    /// each lower tier (disk, remote).
    pub fn render(&self, store: &BlockStore, queued_bytes: [u64; 2]) -> String {
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
        // One family per metric, its samples together, labelled by tier.
        let by_tier = |e: &mut Exposition, name: &str, kind, help, samples: &[(&str, f64)]| {
            e.family(name, kind, help);
            for (tier, v) in samples {
                e.sample(name, &[("tier", tier)], *v);
            }
        };
        let usage: Vec<(&str, TierUsage)> = [
            ("host", Tier::Host),
            ("disk", Tier::Disk),
            ("remote", Tier::Remote),
        ]
        .into_iter()
        .map(|(n, t)| (n, store.usage(t)))
        .collect();
        let of = |f: fn(&TierUsage) -> u64| -> Vec<(&str, f64)> {
            usage.iter().map(|(n, u)| (*n, f(u) as f64)).collect()
        };
        by_tier(
            &mut e,
            "kvgate_kvbm_tier_blocks",
            Kind::Gauge,
            "Blocks held per tier.",
            &of(|u| u.blocks),
        );
        by_tier(
            &mut e,
            "kvgate_kvbm_tier_bytes",
            Kind::Gauge,
            "Bytes held per tier.",
            &of(|u| u.bytes),
        );
        by_tier(
            &mut e,
            "kvgate_kvbm_tier_capacity_bytes",
            Kind::Gauge,
            "Byte budget per tier (0: disabled).",
            &of(|u| u.capacity),
        );
        e.single(
            "kvgate_kvbm_blocks",
            Kind::Gauge,
            "Distinct blocks held in any tier (a block in host memory and in a lower tier counts once).",
            &[],
            store.distinct_blocks() as f64,
        );
        let c = store.counters();
        let (d, r) = (c.disk, c.remote);
        by_tier(
            &mut e,
            "kvgate_kvbm_stored_blocks_total",
            Kind::Counter,
            "Blocks stored per tier (host: offloads and promotions; lower tiers: demotions and direct offloads).",
            &[
                ("host", c.host_stored as f64),
                ("disk", d.stored as f64),
                ("remote", r.stored as f64),
            ],
        );
        by_tier(
            &mut e,
            "kvgate_kvbm_evicted_blocks_total",
            Kind::Counter,
            "Blocks evicted per tier by its byte budget.",
            &[
                ("host", c.host_evicted as f64),
                ("disk", d.evicted as f64),
                ("remote", r.evicted as f64),
            ],
        );
        by_tier(
            &mut e,
            "kvgate_kvbm_lost_blocks_total",
            Kind::Counter,
            "Lower-tier blocks found gone (a missing file, a key the store evicted, an object refused or damaged) or whose write failed.",
            &[("disk", d.lost as f64), ("remote", r.lost as f64)],
        );
        by_tier(
            &mut e,
            "kvgate_kvbm_onboarded_blocks_total",
            Kind::Counter,
            "Blocks onboarded, per tier they came from.",
            &[
                ("host", c.onboarded_host as f64),
                ("disk", d.onboarded as f64),
                ("remote", r.onboarded as f64),
            ],
        );
        e.single(
            "kvgate_kvbm_demoted_blocks_total",
            Kind::Counter,
            "Host evictions written to at least one lower tier.",
            &[],
            c.demoted as f64,
        )
        .single(
            "kvgate_kvbm_pinned_blocks",
            Kind::Gauge,
            "Blocks pinned by connectors now (not evicted until released or expired).",
            &[],
            store.pinned() as f64,
        )
        .single(
            "kvgate_kvbm_pins_expired_total",
            Kind::Counter,
            "Pins that expired before their connector released them.",
            &[],
            c.pins_expired as f64,
        )
        .single(
            "kvgate_kvbm_disk_rejected_blocks_total",
            Kind::Counter,
            "Times the disk's admission filter turned a block away (used fewer than --disk-min-uses times).",
            &[],
            c.disk_rejected as f64,
        )
        .single(
            "kvgate_kvbm_offload_skipped_blocks_total",
            Kind::Counter,
            "Offloaded blocks not stored because pinned blocks left their tier no room.",
            &[],
            c.skipped as f64,
        )
        .single(
            "kvgate_kvbm_offload_throttled_blocks_total",
            Kind::Counter,
            "Offloaded blocks not stored because their connection was over --connector-offload-bytes-per-s.",
            &[],
            get(&self.offload_throttled_blocks),
        );
        let (w, [queued_disk, queued_remote]) =
            ([&self.disk_writes, &self.remote_writes], queued_bytes);
        let [wd, wr] = w;
        by_tier(
            &mut e,
            "kvgate_kvbm_writes_total",
            Kind::Counter,
            "Lower-tier writes (puts and deletes) done, per tier.",
            &[("disk", get(&wd.done)), ("remote", get(&wr.done))],
        );
        by_tier(
            &mut e,
            "kvgate_kvbm_write_queued_bytes",
            Kind::Gauge,
            "Block bytes queued for a lower tier.",
            &[
                ("disk", queued_disk as f64),
                ("remote", queued_remote as f64),
            ],
        );
        by_tier(
            &mut e,
            "kvgate_kvbm_write_dropped_total",
            Kind::Counter,
            "Lower-tier writes dropped because the tier's write queue was full.",
            &[("disk", get(&wd.dropped)), ("remote", get(&wr.dropped))],
        );
        by_tier(
            &mut e,
            "kvgate_kvbm_write_superseded_total",
            Kind::Counter,
            "Queued lower-tier puts skipped because the block left the tier before its write ran (the delete queued behind them removes any earlier copy).",
            &[
                ("disk", get(&wd.superseded)),
                ("remote", get(&wr.superseded)),
            ],
        );
        e.family(
            "kvgate_kvbm_tier_errors_total",
            Kind::Counter,
            "Failed lower-tier operations by tier, operation and error kind.",
        );
        let errors = self
            .tier_errors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for ((tier, op, kind), n) in errors {
            e.sample(
                "kvgate_kvbm_tier_errors_total",
                &[("tier", tier), ("op", op), ("kind", kind)],
                n as f64,
            );
        }
        e.single(
            "kvgate_kvbm_disk_direct_io",
            Kind::Gauge,
            "1 when the disk tier reads and writes with O_DIRECT.",
            &[],
            f64::from(u8::from(self.disk_direct_io.load(Ordering::Relaxed))),
        );
        e.single(
            "kvgate_kvbm_disk_file_bytes",
            Kind::Gauge,
            "Bytes the disk tier's slab files span (freed slots are reused, not returned to the \
             file system until the next start).",
            &[],
            get(&self.disk_file_bytes),
        );
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
        self.peer.render(&mut e);
        e.finish()
    }
}
