//! The NATS edge of the peer directory: this node's announces on
//! `kvgate.kvbm-peers.<namespace>`, the peers' announces and KV-event streams
//! (`kvgate.kvbm.<namespace>.*`), and their snapshots (`kvgate.snapshot.<namespace>.<node>`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::Client;
use bytes::Bytes;
use kv_events::envelope::EnvelopeLimits;
use kv_events::snapshot::{Snapshot, SnapshotAssembler, SnapshotChunk, SnapshotRequest};
use kv_events::{Envelope, subject};
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;

use super::Peers;
use super::directory::{Announce, Announced, Fetch};
use crate::metrics::Metrics;

/// The most keys a peer's snapshot may hold (a node's host and disk tiers in blocks; 4 Mi is
/// 256 TiB of 64-KiB blocks).
const MAX_SNAPSHOT_KEYS: usize = 1 << 22;
/// Snapshot fetches in flight at once (each may assemble up to [`MAX_SNAPSHOT_KEYS`] keys).
const MAX_FETCHES: usize = 4;
/// The least time between two of this node's announces made to greet new peers.
const GREETING_GAP: Duration = Duration::from_millis(500);

/// What the edge needs.
#[derive(Debug, Clone)]
pub struct FollowConfig {
    /// The Kubernetes namespace of the subjects.
    pub namespace: String,
    /// This node's announce (its `layouts` are filled in at each announce).
    pub me: Announce,
    /// How often this node announces itself (peers forget it after their TTL).
    pub interval: Duration,
    /// How long a snapshot request may take.
    pub snapshot_timeout: Duration,
}

/// Follows the peers until `shutdown`; `layouts` says which layouts this node's connectors
/// registered (announced, so peers only ask for those).
pub async fn follow(
    client: Client,
    peers: Arc<Peers>,
    config: FollowConfig,
    metrics: Arc<Metrics>,
    layouts: impl Fn() -> Vec<u64>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), async_nats::SubscribeError> {
    let announce_subject = subject::kvbm_peers(&config.namespace);
    let mut announces = client.subscribe(announce_subject.clone()).await?;
    let mut envelopes = client
        .subscribe(subject::kvbm_wildcard(&config.namespace))
        .await?;
    tracing::info!(subject = %announce_subject, addr = %config.me.addr, "following peers");
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(Fetch, Option<Snapshot>)>();
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_FETCHES));
    let fetch = |f: Fetch| {
        let (client, tx, namespace) = (client.clone(), done_tx.clone(), config.namespace.clone());
        let (model, timeout) = (config.me.model.clone(), config.snapshot_timeout);
        let in_flight = Arc::clone(&in_flight);
        tokio::spawn(async move {
            // The deadline counts from the request, not from the wait for a turn.
            let Ok(_turn) = in_flight.acquire_owned().await else {
                return;
            };
            let subject = subject::node_snapshot(&namespace, &f.node);
            let got = tokio::time::timeout(timeout, fetch_snapshot(&client, subject, model))
                .await
                .ok()
                .flatten();
            let _ = tx.send((f, got));
        });
    };
    let send_announce = |client: &Client| {
        let mut me = config.me.clone();
        me.layouts = layouts();
        let body = Bytes::from(me.encode());
        let (client, subject) = (client.clone(), announce_subject.clone());
        let metrics = Arc::clone(&metrics);
        async move {
            if client.publish(subject, body).await.is_ok() {
                metrics.peer.announces.fetch_add(1, Ordering::Relaxed);
            }
        }
    };
    // Every directory change queues index writes, applied here after its lock is released;
    // the gauges follow each change.
    let change = |f: &mut dyn FnMut(&mut super::directory::Directory) -> Vec<Fetch>| {
        let (fetches, writes) = {
            let mut dir = peers.directory();
            let fetches = f(&mut dir);
            metrics
                .peer
                .publish_directory(dir.peers(), dir.stale(), dir.stats());
            (fetches, dir.take_writes())
        };
        writes.apply();
        fetches
    };
    send_announce(&client).await;
    let mut last_announce = tokio::time::Instant::now();
    let mut owe_greeting = false;
    let mut connected = metrics.nats_connected.load(Ordering::Relaxed);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        let fetches: Vec<Fetch> = tokio::select! {
            () = &mut shutdown => return Ok(()),
            Some(msg) = announces.next() => match Announce::decode(&msg.payload) {
                Ok(a) => {
                    let now = peers.now();
                    let mut fetches = Vec::new();
                    change(&mut |dir| {
                        if let Announced::New(f) = dir.announced(&a, now) {
                            tracing::info!(node = %a.node, addr = %a.addr, "peer found");
                            owe_greeting = true;
                            fetches.push(f);
                        }
                        Vec::new()
                    });
                    fetches
                }
                Err(e) => {
                    tracing::debug!(error = %e, "announce refused");
                    Vec::new()
                }
            },
            Some(msg) = envelopes.next() => match Envelope::decode(&msg.payload, &EnvelopeLimits::default()) {
                Ok(e) => {
                    let now = peers.now();
                    let mut e = Some(e);
                    change(&mut |dir| e.take().map_or_else(Vec::new, |e| dir.envelope(e, now)))
                }
                Err(e) => {
                    tracing::debug!(error = %e, "peer envelope refused");
                    Vec::new()
                }
            },
            Some((f, got)) = done_rx.recv() => {
                if got.is_none() {
                    tracing::debug!(node = %f.node, "peer snapshot not fetched");
                }
                let now = peers.now();
                let mut got = Some(got);
                change(&mut |dir| dir.snapshot_done(&f, got.take().flatten(), now))
            }
            _ = tick.tick() => {
                let now = peers.now();
                let mut fetches = Vec::new();
                // The connection came back: every stream may have missed envelopes.
                let up = metrics.nats_connected.load(Ordering::Relaxed);
                if up && !connected {
                    fetches.extend(change(&mut |dir| dir.resync(now)));
                    owe_greeting = true;
                }
                connected = up;
                let mut expired = Vec::new();
                fetches.extend(change(&mut |dir| {
                    let (due, gone) = dir.tick(now);
                    expired = gone;
                    due
                }));
                for node in expired {
                    tracing::info!(%node, "peer forgotten: no announce within the TTL");
                }
                let since = last_announce.elapsed();
                if since >= config.interval || (owe_greeting && since >= GREETING_GAP) {
                    send_announce(&client).await;
                    last_announce = tokio::time::Instant::now();
                    owe_greeting = false;
                }
                fetches
            }
        };
        for f in fetches {
            fetch(f);
        }
    }
}

/// One snapshot exchange: a fresh inbox, the request, chunks joined until the last.
async fn fetch_snapshot(client: &Client, subject: String, model: String) -> Option<Snapshot> {
    let mut request = SnapshotRequest::new(0);
    request.model = Some(model);
    let body = request.encode().ok()?;
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.ok()?;
    client
        .publish_with_reply(subject, inbox, body.into())
        .await
        .ok()?;
    let mut assembler = SnapshotAssembler::new(MAX_SNAPSHOT_KEYS);
    while let Some(msg) = replies.next().await {
        let chunk = SnapshotChunk::decode(&msg.payload, 1 << 20).ok()?;
        if let Some(snapshot) = assembler.push(chunk).ok()? {
            return Some(snapshot);
        }
    }
    None
}
