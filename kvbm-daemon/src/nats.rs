//! The NATS edge: publishing the outbox's envelopes on `kvgate.kvbm.<namespace>.<node>` and
//! answering snapshot requests on `kvgate.snapshot.<namespace>.<node>`.
//!
//! The connection is made in the background and retried for ever; connectors are served
//! meanwhile. Each reconnect starts a new epoch, so receivers fetch fresh snapshots.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event};
use bytes::Bytes;
use kv_events::Envelope;
use kv_events::snapshot::SnapshotRequest;
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;

use crate::metrics::Metrics;
use crate::service::Service;

/// Connects to `url` in the background; every reconnect starts a new epoch in `service`.
pub async fn connect(url: &str, service: Arc<Service>) -> Result<Client, async_nats::ConnectError> {
    let ever = Arc::new(AtomicBool::new(false));
    let options = ConnectOptions::new()
        .name("kvgate-kvbm")
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(2))
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis(100 * u64::try_from(attempts.min(20)).unwrap_or(20))
        })
        .event_callback(move |event| {
            let service = Arc::clone(&service);
            let ever = Arc::clone(&ever);
            async move {
                let metrics = service.metrics();
                match event {
                    Event::Connected => {
                        metrics.nats_connected.store(true, Ordering::Relaxed);
                        if ever.swap(true, Ordering::Relaxed) {
                            service.new_epoch(kv_bridge::epoch::random_epoch());
                            tracing::info!("NATS reconnected: new epoch");
                        } else {
                            tracing::info!("NATS connected");
                        }
                    }
                    Event::Disconnected | Event::Closed => {
                        metrics.nats_connected.store(false, Ordering::Relaxed);
                        tracing::warn!(%event, "NATS connection lost; serving connectors meanwhile");
                    }
                    other => tracing::warn!(event = %other, "NATS event"),
                }
            }
        });
    options.connect(url).await
}

/// The one publisher: seals pending events whenever the store changed (and at least every
/// `interval`) and publishes the sealed channel in order, until `shutdown`; then publishes
/// what is left (the final `Cleared`) once more and flushes.
pub async fn publish_loop(
    client: Client,
    subject: String,
    service: Arc<Service>,
    mut sealed: mpsc::UnboundedReceiver<Envelope>,
    interval: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let subject = async_nats::Subject::from(subject);
    tokio::pin!(shutdown);
    let metrics = Arc::clone(service.metrics());
    loop {
        let stop = tokio::select! {
            () = &mut shutdown => true,
            () = service.changed() => false,
            () = tokio::time::sleep(interval) => false,
        };
        service.seal();
        while let Ok(envelope) = sealed.try_recv() {
            publish(&client, &subject, &envelope, &metrics).await;
        }
        if stop {
            let _ = client.flush().await;
            return;
        }
    }
}

async fn publish(client: &Client, subject: &async_nats::Subject, e: &Envelope, metrics: &Metrics) {
    let sent = match e.encode() {
        Ok(bytes) => client
            .publish(subject.clone(), Bytes::from(bytes))
            .await
            .is_ok(),
        Err(_) => false,
    };
    if sent {
        metrics.envelopes_published.fetch_add(1, Ordering::Relaxed);
    } else {
        metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(epoch = e.epoch, seq = e.seq, "envelope publish failed");
    }
}

/// Answers snapshot requests on `subject` until the subscription ends.
pub async fn serve_snapshots(
    client: Client,
    subject: String,
    service: Arc<Service>,
) -> Result<(), async_nats::SubscribeError> {
    let mut sub = client.subscribe(subject.clone()).await?;
    tracing::info!(%subject, "answering snapshot requests");
    let metrics = Arc::clone(service.metrics());
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
        // Envelopes sealed for the snapshot go to the publisher (other receivers need them;
        // this one drops them, as they are below the snapshot's next_seq).
        let snapshot = match service.snapshot(req.model.as_deref()) {
            Ok(s) => s,
            Err(e) => {
                metrics.snapshot_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "snapshot request not answered");
                continue;
            }
        };
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
            tracing::warn!("snapshot reply failed");
        } else {
            tracing::debug!(epoch, next_seq, keys, model = ?req.model, "snapshot sent");
        }
    }
    Ok(())
}
