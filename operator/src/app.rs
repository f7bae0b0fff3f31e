//! Composition: the API client, the metrics server, leader election, and the controller while
//! this replica leads; a clean stop on SIGINT/SIGTERM (the lease is released so another replica
//! takes over at once).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::Args;
use crate::controller::{self, Context};
use crate::events::Events;
use crate::leader::{ElectionConfig, Elector};
use crate::metrics::{self, Metrics};
use crate::source::Http;

/// Why the operator stopped.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Bad configuration (exit 2).
    #[error(transparent)]
    Start(#[from] cli_support::StartError),
    /// The runtime could not start.
    #[error("runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The metrics server failed.
    #[error("metrics server on {addr}: {source}")]
    Serve {
        /// Its address.
        addr: std::net::SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl cli_support::ExitStatus for AppError {
    fn exit_code(&self) -> u8 {
        match self {
            AppError::Start(_) => cli_support::EXIT_CONFIG,
            AppError::Runtime(_) | AppError::Serve { .. } => 1,
        }
    }
}

fn config_error(msg: impl Into<String>) -> AppError {
    AppError::Start(cli_support::StartError::Config(msg.into()))
}

/// Runs until a shutdown signal.
pub fn run(args: Args) -> Result<(), AppError> {
    args.validate().map_err(config_error)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(AppError::Runtime)?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> Result<(), AppError> {
    let client = kube::Client::try_default().await.map_err(|e| {
        config_error(format!(
            "the operator needs the in-cluster service account or a kubeconfig: {e}"
        ))
    })?;
    let identity = args.identity();
    let metrics = Arc::new(Metrics::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let addr = std::net::SocketAddr::new(args.listen_address, args.metrics_port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Serve { addr, source })?;
    let server = tokio::spawn(metrics::serve_on(
        listener,
        Arc::clone(&metrics),
        stopped(stop_rx.clone()),
    ));
    let events = Events::new(client.clone(), "kvgate-operator", &identity);
    let ctx = Arc::new(Context::new(
        client.clone(),
        Http::new(args.scrape_timeout()),
        events,
        Arc::clone(&metrics),
    ));
    tracing::info!(
        identity = %identity,
        namespace = ?args.namespace,
        leader_election = !args.no_leader_election,
        "kvgate-operator starting"
    );
    let signal = tokio::spawn(async move {
        cli_support::shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    if args.no_leader_election {
        metrics.set_leader(true);
        controller::run(ctx, args.namespace.clone(), stopped(stop_rx.clone())).await;
    } else {
        let config = ElectionConfig {
            namespace: args.lease_namespace.clone(),
            name: args.lease_name.clone(),
            identity: identity.clone(),
            lease_duration: Duration::from_secs(args.lease_duration_seconds),
            renew_deadline: Duration::from_secs(args.renew_deadline_seconds),
            retry_period: Duration::from_secs(args.retry_period_seconds),
        };
        let elector = Elector::new(client.clone(), config.clone());
        let mut leading = elector.subscribe();
        let election = tokio::spawn(elector.run());
        let mut stop = stop_rx.clone();
        loop {
            tokio::select! {
                _ = leading.wait_for(|l| *l) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            metrics.set_leader(true);
            ctx.reset();
            let mut lost = leading.clone();
            let until = {
                let stop = stop_rx.clone();
                async move {
                    tokio::select! {
                        _ = lost.wait_for(|l| !*l) => {}
                        () = stopped(stop) => {}
                    }
                }
            };
            controller::run(Arc::clone(&ctx), args.namespace.clone(), until).await;
            metrics.set_leader(false);
            if *stop_rx.borrow() {
                break;
            }
            tracing::warn!("leadership lost: the controller stopped");
        }
        election.abort();
        crate::leader::release(client, &config).await;
    }
    let _ = signal.await;
    let _ = server.await;
    tracing::info!("kvgate-operator stopped");
    Ok(())
}
