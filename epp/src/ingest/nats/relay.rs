//! The relay loop: publishes what this replica's response observers queued for peer replicas'
//! requests (see [`crate::extproc::Relay`]) to each owner's `kvgate.handoff.<ns>.<pool>.<id>`,
//! a heartbeat every second, and applies what peers relay for this replica's requests to the
//! handoff table.

use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, Subscriber};
use kv_events::subject;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt as _;

use super::relay_wire::{MAX_RELAY_BYTES, Received, RelayMessage, WireItem, split};
use super::stats::{NatsStats, add};
use crate::extproc::{Handoffs, Outgoing, RelaySink};

/// How long one publish may wait for the client's buffer before the message is dropped (the
/// owner then aborts the tickets whose end it missed, on the next heartbeat).
const PUBLISH_WAIT: Duration = Duration::from_millis(200);
/// Most queued items published per pass.
const PASS_ITEMS: usize = 8192;
/// Target size of one published message.
const MESSAGE_BYTES: usize = MAX_RELAY_BYTES / 2;

/// The queue between the observer streams and the relay loop.
#[derive(Debug, Clone)]
pub struct ChannelSink(mpsc::Sender<Outgoing>);

impl RelaySink for ChannelSink {
    fn send(&self, item: Outgoing) -> bool {
        self.0.try_send(item).is_ok()
    }
}

/// A queue of `capacity` items: the sink for [`crate::extproc::Relay`] and the receiver for
/// [`RelayConfig::outbox`].
pub fn relay_queue(capacity: usize) -> (ChannelSink, mpsc::Receiver<Outgoing>) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    (ChannelSink(tx), rx)
}

/// Relay configuration.
#[derive(Debug)]
pub struct RelayConfig {
    /// The handoff table, with its [`crate::extproc::Relay`] (whose replica id is this one's).
    pub handoffs: Arc<Handoffs>,
    /// What the observer streams queued.
    pub outbox: mpsc::Receiver<Outgoing>,
    /// How often the open relayed tickets are listed to their owners.
    pub heartbeat: Duration,
}

impl RelayConfig {
    /// The relay over `handoffs` and `outbox`, with a 1 s heartbeat.
    pub fn new(handoffs: Arc<Handoffs>, outbox: mpsc::Receiver<Outgoing>) -> Self {
        Self {
            handoffs,
            outbox,
            heartbeat: Duration::from_secs(1),
        }
    }
}

/// The relay loop; `inbox` is the subscription to this replica's own subject.
pub(super) async fn run_relay(
    client: Client,
    namespace: String,
    pool: String,
    mut inbox: Subscriber,
    mut config: RelayConfig,
    stats: Arc<NatsStats>,
    mut stop: watch::Receiver<bool>,
) {
    let Some(relay) = config.handoffs.relay().cloned() else {
        tracing::error!("the relay loop started without a relay in the handoff table");
        return;
    };
    let own = relay.replica();
    let mut heartbeat = tokio::time::interval(config.heartbeat);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut batch = Vec::new();
    let publish_batch = |batch: Vec<Outgoing>| {
        let (client, stats, namespace, pool) = (&client, &stats, &namespace, &pool);
        async move {
            let mut by_owner: Vec<(u64, Vec<WireItem>)> = Vec::new();
            for item in batch {
                let owner = item.owner();
                let wire = WireItem::from_outgoing(item);
                match by_owner.iter_mut().find(|(o, _)| *o == owner) {
                    Some((_, items)) => items.push(wire),
                    None => by_owner.push((owner, vec![wire])),
                }
            }
            for (owner, items) in by_owner {
                let subject = subject::handoff(namespace, pool, owner);
                for msg in split(own, items, MESSAGE_BYTES) {
                    let sent = publish(client, &subject, &msg).await;
                    add(
                        if sent {
                            &stats.relay_messages_sent
                        } else {
                            &stats.relay_publish_failed
                        },
                        1,
                    );
                }
            }
        }
    };
    loop {
        tokio::select! {
            _ = stop.changed() => {
                // The ends of streams that finished while draining are still queued: send them,
                // or their owners count those responses lost.
                let mut rest = Vec::new();
                while let Ok(item) = config.outbox.try_recv() {
                    rest.push(item);
                }
                publish_batch(rest).await;
                break;
            }
            _ = heartbeat.tick() => relay.heartbeat(),
            n = config.outbox.recv_many(&mut batch, PASS_ITEMS) => {
                if n == 0 {
                    break;
                }
                publish_batch(std::mem::take(&mut batch)).await;
            }
            Some(m) = inbox.next() => {
                let msg = match RelayMessage::decode(&m.payload) {
                    Ok((msg, dropped)) => {
                        if dropped > 0 {
                            add(&stats.malformed, dropped as u64);
                            tracing::debug!(dropped, "relay items over their bounds dropped");
                        }
                        msg
                    }
                    Err(e) => {
                        add(&stats.malformed, 1);
                        tracing::debug!(error = %e, kind = e.metric_label(), "relay message refused");
                        continue;
                    }
                };
                if msg.observer == own {
                    continue;
                }
                add(&stats.relay_messages_received, 1);
                let observer = msg.observer;
                for item in msg.into_received() {
                    match item {
                        Received::Event(id, event) => config.handoffs.relay_event(observer, &id, event),
                        Received::Observing(ids) => {
                            config.handoffs.relay_observing(observer, &ids);
                        }
                    }
                }
            }
        }
    }
}

async fn publish(client: &Client, subject: &str, msg: &RelayMessage) -> bool {
    match msg.encode() {
        Ok(bytes) => {
            super::publish_within(client, subject, bytes, PUBLISH_WAIT, "relay message").await
        }
        Err(e) => {
            tracing::warn!(error = %e, "relay message not encoded");
            false
        }
    }
}
