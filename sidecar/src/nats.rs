//! The NATS edge: connecting (in the background, retrying for ever), publishing queued
//! envelopes, and answering snapshot requests from the ranks' resident sets.
//!
//! A disconnect never stops the engine side: the ranks keep consuming and keep their resident
//! sets current; envelopes that do not fit the bounded queue are dropped (a new epoch follows).
//! Each reconnect bumps a generation counter the ranks watch, so every rank starts a new epoch
//! and receivers fetch a fresh snapshot.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event};
use bytes::Bytes;
use kv_events::snapshot::SnapshotRequest;
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;

use crate::bridge::sink::{Outgoing, SharedRank, lock};
use crate::metrics::Metrics;

/// Why NATS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// The URL or options were refused.
    #[error("connecting to NATS: {0}")]
    Connect(#[from] async_nats::ConnectError),
    /// The snapshot subscription failed.
    #[error("subscribing to {subject}: {source}")]
    Subscribe {
        /// The subject.
        subject: String,
        /// The cause.
        #[source]
        source: async_nats::SubscribeError,
    },
}

/// Connects to `url` in the background: returns at once, keeps retrying while the server is
/// away, tracks the connection in `metrics` and bumps `resync` on every reconnect.
pub async fn connect(
    url: &str,
    metrics: Arc<Metrics>,
    resync: Arc<AtomicU64>,
) -> Result<Client, NatsError> {
    let ever = Arc::new(AtomicBool::new(false));
    let options = ConnectOptions::new()
        .name("kvgate-sidecar")
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(2))
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis(100 * u64::try_from(attempts.min(20)).unwrap_or(20))
        })
        .event_callback(move |event| {
            let metrics = Arc::clone(&metrics);
            let resync = Arc::clone(&resync);
            let ever = Arc::clone(&ever);
            async move {
                match event {
                    Event::Connected => {
                        metrics.nats_connected.store(true, Ordering::Relaxed);
                        if ever.swap(true, Ordering::Relaxed) {
                            resync.fetch_add(1, Ordering::Relaxed);
                            tracing::info!("NATS reconnected: ranks start new epochs");
                        } else {
                            tracing::info!("NATS connected");
                        }
                    }
                    Event::Disconnected | Event::Closed => {
                        metrics.nats_connected.store(false, Ordering::Relaxed);
                        tracing::warn!(%event, "NATS connection lost; consuming the engine stream meanwhile");
                    }
                    other => tracing::warn!(event = %other, "NATS event"),
                }
            }
        });
    Ok(options.connect(url).await?)
}

/// Publishes queued envelopes on `subject` until every sender is gone.
pub async fn publish_loop(
    client: Client,
    subject: String,
    mut rx: mpsc::Receiver<Outgoing>,
    metrics: Arc<Metrics>,
) {
    let subject = async_nats::Subject::from(subject);
    while let Some(out) = rx.recv().await {
        match client.publish(subject.clone(), out.payload).await {
            Ok(()) => {
                metrics.envelopes_published.fetch_add(1, Ordering::Relaxed);
                if let Some(t) = out.oldest {
                    metrics.relay_latency.observe(t.elapsed());
                }
            }
            Err(e) => {
                metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(dp_rank = out.dp_rank, error = %e, "envelope publish failed");
            }
        }
    }
}

/// Answers snapshot requests on `subject` from `ranks` (indexed by DP rank) until the
/// subscription ends.
pub async fn serve_snapshots(
    client: Client,
    subject: String,
    ranks: Vec<SharedRank>,
    metrics: Arc<Metrics>,
) -> Result<(), NatsError> {
    let mut sub =
        client
            .subscribe(subject.clone())
            .await
            .map_err(|source| NatsError::Subscribe {
                subject: subject.clone(),
                source,
            })?;
    tracing::info!(%subject, "answering snapshot requests");
    while let Some(msg) = sub.next().await {
        metrics.snapshot_requests.fetch_add(1, Ordering::Relaxed);
        let Some(reply) = msg.reply else {
            metrics.snapshot_errors.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let req = match SnapshotRequest::decode(&msg.payload) {
            Ok(r) => r,
            Err(e) => {
                metrics.snapshot_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "malformed snapshot request");
                continue;
            }
        };
        let Some(rank) = usize::try_from(req.dp_rank).ok().and_then(|r| ranks.get(r)) else {
            metrics.snapshot_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                dp_rank = req.dp_rank,
                "snapshot request for a rank this pod does not serve"
            );
            continue;
        };
        let snapshot = lock(rank).snapshot();
        let (epoch, next_seq, keys) = (snapshot.epoch, snapshot.next_seq, snapshot.len());
        let mut failed = false;
        for chunk in snapshot.into_chunks(req.keys_per_chunk()) {
            let sent = match chunk.encode() {
                Ok(bytes) => client
                    .publish(reply.clone(), Bytes::from(bytes))
                    .await
                    .is_ok(),
                Err(_) => false,
            };
            if !sent {
                failed = true;
                break;
            }
        }
        if failed {
            metrics.snapshot_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(dp_rank = req.dp_rank, "snapshot reply failed");
        } else {
            tracing::debug!(
                dp_rank = req.dp_rank,
                epoch,
                next_seq,
                keys,
                "snapshot sent"
            );
        }
    }
    Ok(())
}
