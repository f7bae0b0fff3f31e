//! `kvgate_kvbm_peer_…`: pulls from peers and pulls served to them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use telemetry::{Exposition, Histogram, Kind, buckets};

use super::directory::DirectoryStats;

/// Why a pull failed, in label order.
const FAILURES: [&str; 3] = ["io", "timeout", "protocol"];

/// How an answer offered on a fabric reached this node.
#[derive(Debug, Clone, Copy)]
pub enum FabricRead {
    /// Read there, every sum right.
    Ok = 0,
    /// The read failed or a sum was wrong: taken from the connection.
    FellBack = 1,
}

const FABRIC_READS: [&str; 2] = ["ok", "fell_back"];

/// What became of an answer this node served to a client that named its fabric.
#[derive(Debug, Clone, Copy)]
pub enum FabricServe {
    /// The client read it there.
    Read = 0,
    /// The client could not: sent on the connection.
    FellBack = 1,
    /// It could not be exposed: sent on the connection.
    Failed = 2,
    /// Exposed, but the connection failed or the client broke the protocol before saying
    /// whether it read it.
    Abandoned = 3,
}

const FABRIC_SERVES: [&str; 4] = ["read", "fell_back", "not_exposed", "abandoned"];

/// The peer counters and gauges.
#[derive(Debug)]
pub struct PeerMetrics {
    pulls: AtomicU64,
    pull_failures: [AtomicU64; 3],
    short_pulls: AtomicU64,
    pulled_blocks: AtomicU64,
    pulled_bytes: AtomicU64,
    pull_seconds: Histogram,
    fabric_reads: [AtomicU64; 2],
    fabric_serves: [AtomicU64; 4],
    /// Fabric buffers given up on (read from the fabric at each scrape).
    pub fabric_leaked: AtomicU64,
    /// Pulls served to peers.
    pub served_pulls: AtomicU64,
    /// Blocks served to peers.
    pub served_blocks: AtomicU64,
    /// Bytes served to peers.
    pub served_bytes: AtomicU64,
    /// Peer connections open now.
    pub connections: AtomicU64,
    /// Peer connections refused at the limit.
    pub connections_refused: AtomicU64,
    /// Connections that failed to prove the secret.
    pub auth_failures: AtomicU64,
    /// This node's announces sent.
    pub announces: AtomicU64,
    peers: AtomicU64,
    stale: AtomicU64,
    resyncs: AtomicU64,
    snapshot_failures: AtomicU64,
    expired: AtomicU64,
}

impl Default for PeerMetrics {
    fn default() -> Self {
        Self {
            pulls: AtomicU64::new(0),
            pull_failures: Default::default(),
            short_pulls: AtomicU64::new(0),
            pulled_blocks: AtomicU64::new(0),
            pulled_bytes: AtomicU64::new(0),
            pull_seconds: Histogram::new(buckets::SECONDS),
            fabric_reads: Default::default(),
            fabric_serves: Default::default(),
            fabric_leaked: AtomicU64::new(0),
            served_pulls: AtomicU64::new(0),
            served_blocks: AtomicU64::new(0),
            served_bytes: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
            announces: AtomicU64::new(0),
            peers: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            snapshot_failures: AtomicU64::new(0),
            expired: AtomicU64::new(0),
        }
    }
}

impl PeerMetrics {
    /// A pull that brought `got` of the `wanted` blocks (`bytes` in all) in `elapsed`.
    pub fn pulled(&self, got: usize, wanted: usize, bytes: u64, elapsed: Duration) {
        self.pulls.fetch_add(1, Ordering::Relaxed);
        if got < wanted {
            self.short_pulls.fetch_add(1, Ordering::Relaxed);
        }
        self.pulled_blocks.fetch_add(got as u64, Ordering::Relaxed);
        self.pulled_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.pull_seconds.observe_duration(elapsed);
    }

    /// A pull that failed (`kind`: a [`super::conn::ConnError::metric_label`]).
    pub fn pull_failed(&self, kind: &str) {
        if let Some(i) = FAILURES.iter().position(|k| *k == kind)
            && let Some(c) = self.pull_failures.get(i)
        {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// An answer offered on a fabric reached this node as `outcome` says.
    pub fn fabric_read(&self, outcome: FabricRead) {
        if let Some(c) = self.fabric_reads.get(outcome as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// An answer for a client that named this node's fabric went as `outcome` says.
    pub fn fabric_served(&self, outcome: FabricServe) {
        if let Some(c) = self.fabric_serves.get(outcome as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The directory's state, as of now.
    pub fn publish_directory(&self, peers: usize, stale: usize, stats: DirectoryStats) {
        self.peers.store(peers as u64, Ordering::Relaxed);
        self.stale.store(stale as u64, Ordering::Relaxed);
        self.resyncs.store(stats.resyncs, Ordering::Relaxed);
        self.snapshot_failures
            .store(stats.snapshot_failures, Ordering::Relaxed);
        self.expired.store(stats.expired, Ordering::Relaxed);
    }

    /// Appends the families.
    pub fn render(&self, e: &mut Exposition) {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        e.single(
            "kvgate_kvbm_peers",
            Kind::Gauge,
            "Peer block managers followed (announced within the TTL).",
            &[],
            get(&self.peers),
        )
        .single(
            "kvgate_kvbm_peers_stale",
            Kind::Gauge,
            "Peers whose KV-event stream is out of step (a snapshot awaited).",
            &[],
            get(&self.stale),
        )
        .single(
            "kvgate_kvbm_peer_resyncs_total",
            Kind::Counter,
            "Gaps and new epochs in peers' KV-event streams.",
            &[],
            get(&self.resyncs),
        )
        .single(
            "kvgate_kvbm_peer_snapshot_failures_total",
            Kind::Counter,
            "Peer snapshot fetches that failed or timed out.",
            &[],
            get(&self.snapshot_failures),
        )
        .single(
            "kvgate_kvbm_peers_expired_total",
            Kind::Counter,
            "Peers forgotten because they stopped announcing.",
            &[],
            get(&self.expired),
        )
        .single(
            "kvgate_kvbm_peer_announces_total",
            Kind::Counter,
            "This node's announces published.",
            &[],
            get(&self.announces),
        )
        .single(
            "kvgate_kvbm_peer_pulls_total",
            Kind::Counter,
            "Pulls from peers answered (with any number of blocks).",
            &[],
            get(&self.pulls),
        )
        .single(
            "kvgate_kvbm_peer_short_pulls_total",
            Kind::Counter,
            "Answered pulls that brought fewer blocks than the directory promised.",
            &[],
            get(&self.short_pulls),
        );
        e.family(
            "kvgate_kvbm_peer_pull_failures_total",
            Kind::Counter,
            "Pulls from peers that failed, by kind (the engine computes those blocks).",
        );
        for (kind, c) in FAILURES.iter().zip(&self.pull_failures) {
            e.sample(
                "kvgate_kvbm_peer_pull_failures_total",
                &[("kind", kind)],
                get(c),
            );
        }
        e.single(
            "kvgate_kvbm_peer_pulled_blocks_total",
            Kind::Counter,
            "Blocks pulled from peers.",
            &[],
            get(&self.pulled_blocks),
        )
        .single(
            "kvgate_kvbm_peer_pulled_bytes_total",
            Kind::Counter,
            "Bytes pulled from peers.",
            &[],
            get(&self.pulled_bytes),
        );
        e.family(
            "kvgate_kvbm_peer_fabric_reads_total",
            Kind::Counter,
            "Answers peers offered on the fabric (--peer-fabric), by outcome: read there, or fell_back to the connection (the read failed or a block failed its checksum).",
        );
        for (outcome, c) in FABRIC_READS.iter().zip(&self.fabric_reads) {
            e.sample(
                "kvgate_kvbm_peer_fabric_reads_total",
                &[("outcome", outcome)],
                get(c),
            );
        }
        e.single(
            "kvgate_kvbm_peer_fabric_leaked_buffers",
            Kind::Gauge,
            "Fabric (NIXL) buffers given up on: a read still ran 30 s after its deadline, so its buffer was leaked and the pool is that much smaller.",
            &[],
            get(&self.fabric_leaked),
        );
        e.family(
            "kvgate_kvbm_peer_fabric_served_total",
            Kind::Counter,
            "Answers served to peers that named this node's fabric, by outcome: read there, fell_back to the connection at the client's word, not_exposed (sent on the connection), or abandoned (the connection failed or the client broke the protocol first).",
        );
        for (outcome, c) in FABRIC_SERVES.iter().zip(&self.fabric_serves) {
            e.sample(
                "kvgate_kvbm_peer_fabric_served_total",
                &[("outcome", outcome)],
                get(c),
            );
        }
        e.family(
            "kvgate_kvbm_peer_pull_duration_seconds",
            Kind::Histogram,
            "Time of an answered pull: connecting, authenticating, the blocks.",
        );
        e.histogram(
            "kvgate_kvbm_peer_pull_duration_seconds",
            &[],
            &self.pull_seconds.snapshot(),
        );
        e.single(
            "kvgate_kvbm_peer_served_pulls_total",
            Kind::Counter,
            "Pulls served to peers.",
            &[],
            get(&self.served_pulls),
        )
        .single(
            "kvgate_kvbm_peer_served_blocks_total",
            Kind::Counter,
            "Blocks served to peers.",
            &[],
            get(&self.served_blocks),
        )
        .single(
            "kvgate_kvbm_peer_served_bytes_total",
            Kind::Counter,
            "Bytes served to peers.",
            &[],
            get(&self.served_bytes),
        )
        .single(
            "kvgate_kvbm_peer_connections",
            Kind::Gauge,
            "Peer connections being served.",
            &[],
            get(&self.connections),
        )
        .single(
            "kvgate_kvbm_peer_connections_refused_total",
            Kind::Counter,
            "Peer connections closed at once: at --peer-max-connections.",
            &[],
            get(&self.connections_refused),
        )
        .single(
            "kvgate_kvbm_peer_auth_failures_total",
            Kind::Counter,
            "Peer connections that did not prove they hold the mesh's secret.",
            &[],
            get(&self.auth_failures),
        );
    }
}
