//! Active-active in-flight sharing over `kvgate.inflight.<namespace>.<pool>`: publishes this
//! replica's routing changes (drained from the tracker's journal every few milliseconds) and a
//! full state on a heartbeat, applies peers' messages to a [`PeerBook`], and installs the
//! peers' summed load in the tracker the scheduler reads. Silent peers expire.

use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, Subscriber};
use kv_index::{EndpointId, Millis};
use tokio::sync::watch;
use tokio_stream::StreamExt as _;

use super::adapter::Shared;
use super::inflight_wire::{InflightMessage, Outbox, PeerEndpoint};
use super::peer_book::PeerBook;
use super::stats::{NatsStats, add, set};

/// How long one publish may wait for the client's buffer (disconnected, full) before the
/// message is dropped; the next full state repairs what peers missed.
const PUBLISH_WAIT: Duration = Duration::from_millis(200);

/// Sharing configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharingConfig {
    /// This replica's id (random per start).
    pub replica: u64,
    /// How long changes are batched before they are published.
    pub batch: Duration,
    /// How often the full own state is published.
    pub heartbeat: Duration,
    /// A peer silent this long is forgotten.
    pub expiry: Duration,
    /// Changes journalled between drains before the journal overflows (then full state).
    pub journal_cap: usize,
}

impl SharingConfig {
    /// Defaults (5 ms batches, 1 s heartbeat, 3 s expiry) for `replica`.
    pub fn new(replica: u64) -> Self {
        Self {
            replica,
            batch: Duration::from_millis(5),
            heartbeat: Duration::from_secs(1),
            expiry: Duration::from_secs(3),
            journal_cap: 65_536,
        }
    }
}

/// A replica id unlikely to collide with a peer's: the process id, the clock and a random
/// hasher key mixed.
pub fn random_replica_id() -> u64 {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

fn millis(d: Duration) -> Millis {
    Millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The sharing loop.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_sharing(
    client: Client,
    subject: String,
    mut peers: Subscriber,
    config: SharingConfig,
    shared: Shared,
    stats: Arc<NatsStats>,
    mut connects: watch::Receiver<u64>,
    mut stop: watch::Receiver<bool>,
) {
    let mut outbox = Outbox::new(config.replica);
    let mut book = PeerBook::new(config.replica, millis(config.expiry));
    let mut batch = tokio::time::interval(config.batch);
    batch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut heartbeat = tokio::time::interval(config.heartbeat);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut full_due = true;
    let mut changes = Vec::new();
    let name = |id: EndpointId| {
        shared
            .datastore
            .key_of(id)
            .map(|(pod, port)| PeerEndpoint { pod, port })
    };
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = batch.tick() => {
                changes.clear();
                let drain = shared.inflight.drain_journal(&mut changes);
                let full = std::mem::take(&mut full_due) || drain.overflowed;
                if let Some(msg) = outbox.build(&changes, &drain.own, full, name) {
                    let deltas = msg.deltas.len() as u64;
                    if publish(&client, &subject, &msg).await {
                        add(&stats.inflight_messages_sent, 1);
                        add(&stats.inflight_deltas_sent, deltas);
                    }
                }
            }
            _ = heartbeat.tick() => {
                full_due = true;
                let now = (shared.clock)();
                let expired = book.expire(now);
                if expired > 0 {
                    add(&stats.peers_expired, expired as u64);
                    tracing::info!(expired, "peer EPP replicas fell silent; their in-flight load is dropped");
                    shared.inflight.set_peer_loads(book.totals());
                }
                set(&stats.peer_replicas, book.replicas() as u64);
            }
            Ok(()) = connects.changed() => full_due = true,
            Some(m) = peers.next() => {
                let msg = match InflightMessage::decode(&m.payload) {
                    Ok(msg) => msg,
                    Err(e) => {
                        add(&stats.malformed, 1);
                        tracing::debug!(error = %e, kind = e.metric_label(), "in-flight message refused");
                        continue;
                    }
                };
                let now = (shared.clock)();
                let ds = &shared.datastore;
                let done = book.apply(&msg, now, |p| ds.live_id(&(p.pod.clone(), p.port)));
                if done.own {
                    continue;
                }
                if done.new_peer {
                    tracing::info!(peer = msg.replica, "peer EPP replica joined");
                    full_due = true;
                }
                if done.gap {
                    add(&stats.inflight_gaps, 1);
                }
                add(&stats.inflight_deltas_received, done.deltas as u64);
                shared.inflight.set_peer_loads(book.totals());
                set(&stats.peer_replicas, book.replicas() as u64);
            }
        }
    }
    publish(&client, &subject, &outbox.bye()).await;
}

async fn publish(client: &Client, subject: &str, msg: &InflightMessage) -> bool {
    let Ok(bytes) = msg.encode() else {
        return false;
    };
    super::publish_within(client, subject, bytes, PUBLISH_WAIT, "in-flight message").await
}
