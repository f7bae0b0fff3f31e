//! NATS ingestion (DESIGN.md § KV events): sidecar and block-manager envelopes with per-source
//! sequencing and snapshot resynchronisation, engine load samples, in-flight sharing between
//! active-active EPP replicas, and the relay of response events between them.
//!
//! Pure parts: [`kv`] (all sources against the index, one [`kv_sync::SourceSync`] state
//! machine per source), [`inflight_wire`] and [`peer_book`] (sharing), [`relay_wire`] (the
//! relay). I/O: [`adapter`] (connection, subscriptions, snapshot request/reply), [`sharing`] and
//! [`relay`] (their loops).

pub mod adapter;
pub mod inflight_wire;
pub mod kv;
pub mod peer_book;
pub mod relay;
pub mod relay_wire;
pub mod resolve;
pub mod sharing;
pub mod stats;

pub use adapter::{Clock, NatsConfig, NatsError, NatsIngest, Shared};
pub use relay::{ChannelSink, RelayConfig, relay_queue};
pub use sharing::{SharingConfig, random_replica_id};
pub use stats::NatsStats;

/// Publishes `bytes` on `subject`, waiting at most `wait` for the client's buffer (disconnected,
/// full); whether it was queued. A message not sent is logged at debug as `what`: the loops
/// that publish repair what peers missed with their next full state or heartbeat.
async fn publish_within(
    client: &async_nats::Client,
    subject: &str,
    bytes: Vec<u8>,
    wait: std::time::Duration,
    what: &'static str,
) -> bool {
    match tokio::time::timeout(wait, client.publish(subject.to_owned(), bytes.into())).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, what, "not published");
            false
        }
        Err(_) => {
            tracing::debug!(what, "not published: the NATS client's buffer stayed full");
            false
        }
    }
}
