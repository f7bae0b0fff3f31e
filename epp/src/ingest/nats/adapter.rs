//! The NATS edge: connects (in the background, retrying for ever, so the EPP serves whether or
//! not NATS is up), subscribes to the pool's KV-event, block-manager and load subjects, runs
//! the snapshot request/reply exchanges, and starts in-flight sharing. Nothing here is on the
//! request path: the picker only reads the index and the books these tasks write.
//!
//! Reconnects: async-nats re-establishes the connection and its subscriptions itself; every
//! (re)connect is announced on a watch channel, and the KV loop then resynchronises every
//! source (envelopes were lost while down) and the sharing loop sends its full state.

use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event, Subscriber};
use kv_events::envelope::EnvelopeLimits;
use kv_events::load::LoadSample;
use kv_events::snapshot::{SnapshotAssembler, SnapshotChunk};
use kv_events::{Envelope, subject};
use kv_index::{Holder, KvIndex, Millis};
use kv_sync::SyncConfig;
use scheduler::{InflightTracker, LoadBook};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt as _;

use super::kv::{FetchOrder, FetchResult, KvIngest};
use super::relay::{RelayConfig, run_relay};
use super::resolve::Resolver;
use super::sharing::{SharingConfig, run_sharing};
use super::stats::{NatsStats, add, set};
use crate::discovery::Datastore;
use crate::discovery::apply::NodeIds;

/// The EPP's monotonic clock (the picker's).
pub type Clock = Arc<dyn Fn() -> Millis + Send + Sync>;

/// How often sources are ticked (timeouts, backoffs, discovery changes).
const TICK: Duration = Duration::from_millis(100);
/// Largest snapshot (keys) accepted from one source.
const MAX_SNAPSHOT_KEYS: usize = 4 << 20;

/// NATS configuration.
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// Server URL(s), comma-separated.
    pub url: String,
    /// The pool's namespace.
    pub namespace: String,
    /// The pool.
    pub pool: String,
    /// Per-source synchronisation (snapshot timeout, buffer, retries).
    pub sync: SyncConfig,
    /// Envelope bounds.
    pub limits: EnvelopeLimits,
    /// In-flight sharing, when on.
    pub sharing: Option<SharingConfig>,
}

/// The routing state the NATS side writes.
#[derive(Clone)]
pub struct Shared {
    /// The KV index.
    pub index: Arc<KvIndex>,
    /// Engine load samples.
    pub loads: Arc<LoadBook>,
    /// In-flight accounting (own journal out, peers' load in).
    pub inflight: Arc<InflightTracker>,
    /// Endpoints.
    pub datastore: Arc<Datastore>,
    /// Node names.
    pub nodes: Arc<NodeIds>,
    /// The pool's served model (node sources of other models are ignored).
    pub model: Arc<str>,
    /// The clock.
    pub clock: Clock,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl Shared {
    pub(super) fn resolver(&self) -> Resolver<'_> {
        Resolver {
            datastore: &self.datastore,
            nodes: &self.nodes,
            model: &self.model,
        }
    }
}

/// Why NATS ingestion could not start.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// The URL or options were refused.
    #[error("NATS connection: {0}")]
    Connect(#[source] async_nats::ConnectError),
    /// A subscription could not be made.
    #[error("NATS subscription to {subject}: {source}")]
    Subscribe {
        /// The subject.
        subject: String,
        /// Why.
        #[source]
        source: async_nats::SubscribeError,
    },
}

/// Running NATS ingestion; stops when [`NatsIngest::shutdown`] is called (cleanly, with a
/// goodbye to peers) or when it is dropped (abruptly).
#[derive(Debug)]
pub struct NatsIngest {
    stats: Arc<NatsStats>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    client: Client,
    replica: Option<u64>,
}

impl NatsIngest {
    /// Connects (in the background) and starts the loops. Fails only on a malformed URL or a
    /// closed client, never because the server is down.
    pub async fn start(config: NatsConfig, shared: Shared) -> Result<Self, NatsError> {
        Self::start_with_relay(config, shared, None).await
    }

    /// [`NatsIngest::start`], also relaying response events between replicas when `relay` is
    /// given (the response-observer layout).
    pub async fn start_with_relay(
        config: NatsConfig,
        shared: Shared,
        relay: Option<RelayConfig>,
    ) -> Result<Self, NatsError> {
        let stats = Arc::new(NatsStats::default());
        let (connects_tx, connects) = watch::channel(0u64);
        let client = connect(&config.url, Arc::clone(&stats), connects_tx).await?;
        let sub = |subject: String| {
            let client = client.clone();
            async move {
                client
                    .subscribe(subject.clone())
                    .await
                    .map_err(|source| NatsError::Subscribe { subject, source })
            }
        };
        let (ns, pool) = (&config.namespace, &config.pool);
        let kv = sub(subject::kv_pool_wildcard(ns, pool)).await?;
        let kvbm = sub(subject::kvbm_wildcard(ns)).await?;
        let load = sub(format!(
            "kvgate.load.{}.{}.>",
            subject::token(ns),
            subject::token(pool)
        ))
        .await?;
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        let ingest = KvIngest::new(
            config.sync,
            Arc::clone(&shared.index),
            Arc::clone(&shared.loads),
            Arc::clone(&stats),
        );
        let kv_loop = KvLoop {
            client: client.clone(),
            config: config.clone(),
            shared: shared.clone(),
            stats: Arc::clone(&stats),
            ingest,
        };
        tasks.push(tokio::spawn(kv_loop.run(
            kv,
            kvbm,
            load,
            connects.clone(),
            stop_rx.clone(),
        )));
        if let Some(relay) = relay
            && let Some(own) = relay.handoffs.relay().map(|r| r.replica())
        {
            let inbox = sub(subject::handoff(ns, pool, own)).await?;
            tasks.push(tokio::spawn(run_relay(
                client.clone(),
                ns.clone(),
                pool.clone(),
                inbox,
                relay,
                Arc::clone(&stats),
                stop_rx.clone(),
            )));
        }
        let mut replica = None;
        if let Some(sharing) = config.sharing {
            let subject = subject::inflight(ns, pool);
            let peers = sub(subject.clone()).await?;
            replica = Some(sharing.replica);
            shared.inflight.enable_journal(sharing.journal_cap);
            tasks.push(tokio::spawn(run_sharing(
                client.clone(),
                subject,
                peers,
                sharing,
                shared,
                Arc::clone(&stats),
                connects,
                stop_rx,
            )));
        }
        tracing::info!(url = %config.url, namespace = %ns, pool = %pool, replica, "NATS ingestion started");
        Ok(Self {
            stats,
            stop,
            tasks,
            client,
            replica,
        })
    }

    /// The counters.
    pub fn stats(&self) -> Arc<NatsStats> {
        Arc::clone(&self.stats)
    }

    /// This replica's in-flight sharing id, when sharing.
    pub fn replica(&self) -> Option<u64> {
        self.replica
    }

    /// Stops the loops (the sharing loop says goodbye first) and flushes.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        for t in self.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), self.client.flush()).await;
    }
}

/// Dropping without [`NatsIngest::shutdown`] stops the loops where they are: no goodbye, so
/// peers forget this replica only when it expires (as after a crash).
impl Drop for NatsIngest {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn connect(
    url: &str,
    stats: Arc<NatsStats>,
    connects: watch::Sender<u64>,
) -> Result<Client, NatsError> {
    let url_for_log = url.to_owned();
    ConnectOptions::new()
        .name("kvgate-epp")
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(2))
        .reconnect_delay_callback(|attempt| {
            let exp = u32::try_from(attempt.min(6)).unwrap_or(6);
            Duration::from_millis(100u64.saturating_mul(1 << exp)).min(Duration::from_secs(5))
        })
        .event_callback(move |event| {
            let (stats, connects, url) = (Arc::clone(&stats), connects.clone(), url_for_log.clone());
            async move {
                match event {
                    Event::Connected => {
                        set(&stats.connected, 1);
                        add(&stats.connects, 1);
                        connects.send_modify(|n| *n = n.wrapping_add(1));
                        tracing::info!(%url, "connected to NATS");
                    }
                    Event::Disconnected => {
                        set(&stats.connected, 0);
                        tracing::warn!(%url, "disconnected from NATS; routing on cached state and load");
                    }
                    Event::Closed => set(&stats.connected, 0),
                    other => tracing::debug!(%url, event = %other, "NATS event"),
                }
            }
        })
        .connect(url)
        .await
        .map_err(NatsError::Connect)
}

struct KvLoop {
    client: Client,
    config: NatsConfig,
    shared: Shared,
    stats: Arc<NatsStats>,
    ingest: KvIngest,
}

type FetchDone = (Holder, u64, FetchResult);

impl KvLoop {
    async fn run(
        mut self,
        mut kv: Subscriber,
        mut kvbm: Subscriber,
        mut load: Subscriber,
        mut connects: watch::Receiver<u64>,
        mut stop: watch::Receiver<bool>,
    ) {
        let (done_tx, mut done_rx) = mpsc::channel::<FetchDone>(256);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let orders = tokio::select! {
                _ = stop.changed() => break,
                Some(m) = kv.next() => self.envelope(&m.payload),
                Some(m) = kvbm.next() => self.envelope(&m.payload),
                Some(m) = load.next() => self.load(&m.payload),
                Some((holder, id, result)) = done_rx.recv() => {
                    let now = (self.shared.clock)();
                    self.ingest.on_fetch(holder, id, result, &self.shared.resolver(), now)
                }
                Ok(()) = connects.changed() => {
                    let now = (self.shared.clock)();
                    let orders = self.ingest.resync_all(now);
                    if !orders.is_empty() {
                        tracing::info!(sources = orders.len(), "NATS (re)connected: resynchronising every source");
                    }
                    orders
                }
                _ = tick.tick() => {
                    let now = (self.shared.clock)();
                    self.ingest.tick(&self.shared.resolver(), now)
                }
            };
            for order in orders {
                self.spawn_fetch(order, done_tx.clone());
            }
        }
    }

    fn envelope(&mut self, payload: &[u8]) -> Vec<FetchOrder> {
        match Envelope::decode(payload, &self.config.limits) {
            Ok(env) => {
                let now = (self.shared.clock)();
                self.ingest.on_envelope(env, &self.shared.resolver(), now)
            }
            Err(e) => {
                add(&self.stats.malformed, 1);
                tracing::debug!(error = %e, kind = e.metric_label(), "envelope refused");
                Vec::new()
            }
        }
    }

    fn load(&mut self, payload: &[u8]) -> Vec<FetchOrder> {
        match LoadSample::decode(payload) {
            Ok(s) => {
                let now = (self.shared.clock)();
                self.ingest.on_load(&s, &self.shared.resolver(), now)
            }
            Err(e) => {
                add(&self.stats.malformed, 1);
                tracing::debug!(error = %e, "load sample refused");
                Vec::new()
            }
        }
    }

    fn spawn_fetch(&self, order: FetchOrder, done: mpsc::Sender<FetchDone>) {
        let client = self.client.clone();
        let timeout = Duration::from_millis(self.config.sync.snapshot_timeout.0);
        let max_bytes = self.config.limits.max_bytes;
        tokio::spawn(async move {
            let result = tokio::time::timeout(timeout, fetch(&client, &order, max_bytes))
                .await
                .unwrap_or(FetchResult::Failed);
            let _ = done.send((order.holder, order.id, result)).await;
        });
    }
}

/// One snapshot exchange: a fresh inbox, the request, chunks joined until the last.
#[tracing::instrument(level = "debug", skip_all, fields(subject = %order.subject, request = order.id))]
async fn fetch(client: &Client, order: &FetchOrder, max_bytes: usize) -> FetchResult {
    let Ok(body) = order.request.encode() else {
        return FetchResult::Failed;
    };
    let inbox = client.new_inbox();
    let Ok(mut replies) = client.subscribe(inbox.clone()).await else {
        return FetchResult::Failed;
    };
    if let Err(e) = client
        .publish_with_reply(order.subject.clone(), inbox, body.into())
        .await
    {
        tracing::debug!(subject = %order.subject, error = %e, "snapshot request not sent");
        return FetchResult::Failed;
    }
    let mut asm = SnapshotAssembler::new(MAX_SNAPSHOT_KEYS);
    while let Some(msg) = replies.next().await {
        let chunk = match SnapshotChunk::decode(&msg.payload, max_bytes) {
            Ok(c) => c,
            Err(e) => {
                // Also what a "no responders" status (empty payload) ends in.
                tracing::debug!(subject = %order.subject, error = %e, "snapshot reply refused");
                return FetchResult::Failed;
            }
        };
        match asm.push(chunk) {
            Ok(Some(snap)) => return FetchResult::Done(snap),
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(subject = %order.subject, error = %e, "snapshot reply refused");
                return FetchResult::Failed;
            }
        }
    }
    FetchResult::Failed
}
