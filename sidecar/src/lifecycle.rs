//! Wiring of the proxy and health parts: bind the proxy (:8000) and the health/metrics port
//! (:9091), start the allow-list watcher, the engine poller and the canary, serve until SIGTERM
//! or SIGINT, then drain ([`health::drain`]).
//!
//! The event bridge joins through [`Parts`]: the [`Readiness`] handle (its
//! `set_kv_events_live`), the [`DrainHook`], and [`Parts::render_metrics`] for its `/metrics`.
//! The :9091 server serves `health::router` and one `/metrics` page: the bridge's metrics
//! followed by the proxy's and readiness's.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use tokio::sync::watch;

use crate::Args;
use crate::health::{self, DrainHook, Readiness, canary, engine};
use crate::proxy::prefill::PrefillConfig;
use crate::proxy::ssrf::{self, LiveAllowList, SsrfPolicy};
use crate::proxy::{self, ProxyMetrics, ProxyState, engine_authority, rank_authorities, upstream};

/// Why the sidecar stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Bad configuration.
    #[error(transparent)]
    Start(#[from] cli_support::StartError),
    /// A port could not be bound.
    #[error("cannot bind the {what} port {addr}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The async runtime could not start.
    #[error("cannot start the runtime")]
    Runtime(#[source] std::io::Error),
}

impl cli_support::ExitStatus for RunError {
    fn exit_code(&self) -> u8 {
        match self {
            Self::Start(e) => e.exit_code(),
            Self::Bind { .. } | Self::Runtime(_) => 1,
        }
    }
}

/// Handles shared between the proxy, health and the rest of the sidecar.
#[derive(Debug, Clone)]
pub struct Parts {
    /// Readiness inputs.
    pub readiness: Readiness,
    /// Proxy counters.
    pub metrics: Arc<ProxyMetrics>,
}

impl Parts {
    /// Appends the proxy's and readiness's metrics to a `/metrics` page.
    pub fn render_metrics(&self, out: &mut String) {
        self.metrics.render(out);
        self.readiness.render(out);
    }
}

/// Runs the proxy and health parts until a shutdown signal, then drains.
/// `readiness` is the caller's, so the bridge can set its KV-event condition.
pub async fn run(
    args: Args,
    hook: Arc<dyn DrainHook>,
    bridge: Option<Arc<crate::metrics::Metrics>>,
    readiness: Readiness,
) -> Result<(), RunError> {
    let p = &args.proxy;
    let engine = engine_authority(&args.engine_url).map_err(cli_support::StartError::Config)?;
    let client = upstream::client(Duration::from_millis(p.upstream_connect_timeout_ms));
    let live = p
        .prefiller_allow_list
        .as_ref()
        .map(|_| Arc::new(LiveAllowList::default()));
    let ssrf_policy = match &live {
        Some(l) => SsrfPolicy::AllowList(l.clone()),
        None if p.disable_ssrf_protection => SsrfPolicy::Disabled,
        // No list and protection on: every P/D request is refused until one is configured.
        None => SsrfPolicy::AllowList(Arc::new(LiveAllowList::default())),
    };
    let metrics = Arc::new(ProxyMetrics::new(live.clone()).with_connector(p.kv_connector));
    let parts = Parts {
        readiness,
        metrics: metrics.clone(),
    };
    // One proxy per data-parallel rank: `--proxy-port` + r in front of the engine's port + r.
    let engines =
        rank_authorities(&engine, args.dp_size).map_err(cli_support::StartError::Config)?;
    let any = args.listen_address;
    let mut proxies = Vec::with_capacity(engines.len());
    for (port, rank_engine) in (args.proxy_port..).zip(&engines) {
        let state = Arc::new(ProxyState {
            client: client.clone(),
            engine: rank_engine.clone(),
            ssrf: ssrf_policy.clone(),
            prefill: PrefillConfig {
                retry: p.retry(),
                timeout: Duration::from_millis(p.prefill_timeout_ms),
                max_body: p.proxy_max_body_bytes,
            },
            connector: p.kv_connector,
            bootstrap_port: p.sglang_bootstrap_port,
            max_body: p.proxy_max_body_bytes,
            migrate_max_attempts: p.migrate_max_attempts,
            metrics: metrics.clone(),
        });
        let addr = SocketAddr::new(any, port);
        let bound = proxy::bind(addr, state)
            .await
            .map_err(|source| RunError::Bind {
                what: "proxy",
                addr,
                source,
            })?;
        proxies.push(bound);
    }
    let health_addr = SocketAddr::new(any, args.metrics_port);
    let health_listener = tokio::net::TcpListener::bind(health_addr)
        .await
        .map_err(|source| RunError::Bind {
            what: "metrics/health",
            addr: health_addr,
            source,
        })?;

    let mut background = tokio::task::JoinSet::new();
    if let (Some(path), Some(live)) = (&p.prefiller_allow_list, &live) {
        let every = Duration::from_millis(p.allow_list_poll_ms);
        background.spawn(ssrf::watch(path.clone(), live.clone(), every));
    }
    let h = &p.health;
    background.spawn(engine::run(
        client.clone(),
        engines.clone(),
        Duration::from_millis(h.engine_health_interval_ms),
        Duration::from_millis(h.engine_health_timeout_ms),
        parts.readiness.clone(),
    ));
    if h.canary {
        let config = canary::CanaryConfig {
            engine: engine.clone(),
            model: args.model.clone(),
            interval: Duration::from_millis(h.canary_interval_ms),
            deadline: Duration::from_millis(h.canary_deadline_ms),
            threshold: h.canary_failures,
        };
        background.spawn(canary::run(client.clone(), config, parts.readiness.clone()));
    }
    let page = parts.clone();
    let health_app = health::router(parts.readiness.clone()).route(
        "/metrics",
        get(move || {
            let page = page.clone();
            let bridge = bridge.clone();
            async move {
                let mut out = match &bridge {
                    Some(b) => b.render(),
                    None => String::with_capacity(4096),
                };
                page.render_metrics(&mut out);
                out
            }
        }),
    );
    background.spawn(async move {
        if let Err(e) = axum::serve(health_listener, health_app).await {
            tracing::error!(error = %e, "metrics/health server failed");
        }
    });

    tracing::info!(
        proxy_port = args.proxy_port,
        ranks = engines.len(),
        health = %health_addr,
        engine = %engine,
        "kvgate-sidecar proxy serving"
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    let server = tokio::spawn(serve_all(proxies, stop_rx));
    cli_support::shutdown_signal().await;
    metrics.drain_started();
    let report = health::drain::drain(
        &parts.readiness,
        hook.as_ref(),
        h.grace(),
        move || {
            let _ = stop_tx.send(true);
        },
        server,
    )
    .await;
    metrics.drain_duration(report.duration);
    background.shutdown().await;
    Ok(())
}

/// Serves every rank's proxy until `stop` turns true and each has finished its open streams;
/// the first error, if any, is returned after all have stopped.
async fn serve_all(
    proxies: Vec<proxy::BoundProxy>,
    stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut servers = tokio::task::JoinSet::new();
    for bound in proxies {
        let mut stop = stop.clone();
        servers.spawn(bound.serve(async move {
            let _ = stop.wait_for(|stop| *stop).await;
        }));
    }
    let mut first = Ok(());
    while let Some(done) = servers.join_next().await {
        let result = done.unwrap_or_else(|e| Err(std::io::Error::other(e)));
        if first.is_ok() {
            first = result;
        }
    }
    first
}
