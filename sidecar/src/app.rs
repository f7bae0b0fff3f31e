//! Wiring: one receive thread per DP rank (ZMQ → bridge), the NATS publisher, the snapshot
//! responder, the load relay and the metrics server, until SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine_zmq::{StartFrom, StreamConfig, rank_endpoint};
use kv_events::envelope::EngineKind;
use kv_events::{NormalizerConfig, Source, subject};
use tokio::sync::mpsc;

use crate::args::{Args, Engine};
use crate::bridge::epoch::random_epoch;
use crate::bridge::liveness::{self, Running};
use crate::bridge::rank::{BatchLimits, RankBridge};
use crate::bridge::sink::{BridgeSink, SharedRank};
use crate::load::LoadRelayConfig;
use crate::metrics::Metrics;
use crate::nats::{self, NatsError};

/// Why the sidecar stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Bad configuration.
    #[error(transparent)]
    Start(#[from] cli_support::StartError),
    /// The async runtime could not start.
    #[error("starting the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The metrics port could not be bound or served.
    #[error("metrics server on {addr}: {source}")]
    Serve {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// NATS could not be set up.
    #[error(transparent)]
    Nats(#[from] NatsError),
    /// The proxy or health server failed.
    #[error(transparent)]
    Proxy(#[from] crate::lifecycle::RunError),
}

impl cli_support::ExitStatus for AppError {
    fn exit_code(&self) -> u8 {
        match self {
            AppError::Start(_) => cli_support::EXIT_CONFIG,
            AppError::Proxy(e) => e.exit_code(),
            _ => 1,
        }
    }
}

fn config(msg: impl Into<String>) -> AppError {
    AppError::Start(cli_support::StartError::Config(msg.into()))
}

/// The envelope source of rank `rank`.
pub fn source(args: &Args, rank: u32) -> Source {
    Source {
        namespace: args.namespace.clone(),
        pool: Some(args.pool.clone()),
        pod: Some(args.pod.clone()),
        ip: args.pod_ip.clone(),
        port: u16::try_from(u32::from(args.proxy_port) + rank).ok(),
        dp_rank: rank,
        node: args.node_name.clone(),
        model: args.model.clone(),
        engine: match args.engine {
            Engine::Vllm => EngineKind::Vllm,
            Engine::Sglang => EngineKind::Sglang,
            Engine::Sim => EngineKind::Sim,
        },
        block_size: args.block_size,
    }
}

/// Runs the sidecar until a shutdown signal.
pub(crate) fn run(args: Args) -> Result<(), AppError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvgate-sidecar")
        .enable_all()
        .build()
        .map_err(AppError::Runtime)?;
    // The log, and the trace exporter whose channel lives on the runtime.
    let telemetry = {
        let _runtime = runtime.enter();
        otel::init("kvgate-sidecar", &args.tracing).map_err(|e| config(e.to_string()))?
    };
    args.validate().map_err(config)?;
    let engine = crate::proxy::engine_authority(&args.engine_url).map_err(config)?;
    let mut streams = Vec::new();
    for rank in 0..args.dp_size {
        let publisher =
            rank_endpoint(&args.kv_events_endpoint, rank).map_err(|e| config(e.to_string()))?;
        let replay = if args.no_replay {
            None
        } else {
            Some(rank_endpoint(&args.replay_endpoint, rank).map_err(|e| config(e.to_string()))?)
        };
        let mut cfg = StreamConfig::new(publisher, replay, StartFrom::ReplayNow);
        cfg.topic = args.kv_events_topic.as_bytes().to_vec();
        cfg.poll = Duration::from_millis(args.batch_max_delay_ms.clamp(1, 100));
        streams.push(cfg);
    }
    let served = runtime.block_on(serve(args, engine, streams));
    telemetry.shutdown();
    served
}

async fn serve(args: Args, engine: String, streams: Vec<StreamConfig>) -> Result<(), AppError> {
    let metrics = Arc::new(Metrics::new());
    let resync = Arc::new(AtomicU64::new(0));
    let epoch = random_epoch();
    let limits = BatchLimits {
        max_keys: args.batch_max_keys,
        max_delay: Duration::from_millis(args.batch_max_delay_ms),
        ..BatchLimits::default()
    };
    let ranks: Vec<SharedRank> = (0..args.dp_size)
        .map(|rank| {
            let normalizer = NormalizerConfig::new(args.model.clone(), args.block_size);
            Arc::new(Mutex::new(RankBridge::new(
                source(&args, rank),
                normalizer,
                limits,
                epoch,
            )))
        })
        .collect();
    tracing::info!(
        epoch,
        dp_size = args.dp_size,
        subject = %subject::kv(&args.namespace, &args.pool, &args.pod),
        "kvgate-sidecar starting"
    );

    let client = nats::connect(&args.nats_url, Arc::clone(&metrics), Arc::clone(&resync)).await?;
    let (tx, rx) = mpsc::channel(args.publish_queue);
    let publisher = tokio::spawn(nats::publish_loop(
        client.clone(),
        subject::kv(&args.namespace, &args.pool, &args.pod),
        rx,
        Arc::clone(&metrics),
    ));
    let snapshots = tokio::spawn(nats::serve_snapshots(
        client.clone(),
        subject::snapshot(&args.namespace, &args.pool, &args.pod),
        ranks.clone(),
        Arc::clone(&metrics),
    ));
    let load = tokio::spawn(crate::load::run(
        client.clone(),
        crate::proxy::upstream::client(Duration::from_millis(100)),
        LoadRelayConfig {
            engine,
            interval: Duration::from_millis(args.load_interval_ms),
            subject: subject::load(&args.namespace, &args.pool, &args.pod),
            source: source(&args, 0),
        },
        Arc::clone(&metrics),
    ));

    let readiness = crate::health::Readiness::new(args.proxy.health.require_kv_events);
    let running = Running::default();
    let liveness = tokio::spawn(liveness::watch(
        client.clone(),
        running.clone(),
        ranks.len(),
        readiness.clone(),
        Duration::from_millis(250),
    ));

    let stop = Arc::new(AtomicBool::new(false));
    let ctx = zmq::Context::new();
    let mut threads = Vec::new();
    for (cfg, rank) in streams.into_iter().zip(&ranks) {
        let mut sink = BridgeSink::new(
            Arc::clone(rank),
            tx.clone(),
            Arc::clone(&metrics),
            Arc::clone(&resync),
        );
        let (ctx, stop) = (ctx.clone(), Arc::clone(&stop));
        let name = format!("kv-zmq-{}", threads.len());
        let running = running.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let _running = running.enter();
                if let Err(e) = engine_zmq::run(&ctx, &cfg, &stop, &mut sink) {
                    tracing::error!(error = %e, "KV-event subscription failed");
                }
            })
            .map_err(AppError::Runtime)?;
        threads.push(thread);
    }
    drop(tx);

    // The proxy and health side owns the signal, the drain and the :9091 server; the bridge's
    // metrics join its page, and its drain hook publishes `Cleared` at the end.
    let hook = Arc::new(ClearOnDrain {
        ranks: ranks.clone(),
        client: client.clone(),
        subject: subject::kv(&args.namespace, &args.pool, &args.pod),
    });
    let served = crate::lifecycle::run(args.clone(), hook, Some(Arc::clone(&metrics)), readiness)
        .await
        .map_err(AppError::from);
    liveness.abort();

    stop.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await;
    snapshots.abort();
    load.abort();
    let _ = tokio::time::timeout(Duration::from_secs(2), publisher).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), client.flush()).await;
    tracing::info!("kvgate-sidecar stopped");
    served
}

/// Publishes `Cleared` for every rank once the proxy has drained, so routers stop sending
/// cache-affine traffic to a pod that is going away.
#[derive(Debug)]
struct ClearOnDrain {
    ranks: Vec<SharedRank>,
    client: async_nats::Client,
    subject: String,
}

impl crate::health::DrainHook for ClearOnDrain {
    fn drained(&self) -> crate::health::HookFuture<'_> {
        Box::pin(async move {
            let mut sealed = Vec::new();
            for rank in &self.ranks {
                let mut r = crate::bridge::sink::lock(rank);
                r.lose(std::time::Instant::now());
                r.seal();
                r.take_sealed(&mut sealed);
            }
            for s in sealed {
                match s.envelope.encode() {
                    Ok(bytes) => {
                        if let Err(e) = self
                            .client
                            .publish(self.subject.clone(), bytes.into())
                            .await
                        {
                            tracing::warn!(error = %e, "could not publish Cleared on drain");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "could not encode Cleared on drain"),
                }
            }
            if let Err(e) = self.client.flush().await {
                tracing::warn!(error = %e, "could not flush Cleared on drain");
            } else {
                tracing::info!(ranks = self.ranks.len(), "published Cleared after draining");
            }
        })
    }
}
