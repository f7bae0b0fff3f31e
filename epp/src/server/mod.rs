//! Serving: ext_proc over gRPC on :9002 (TLS by default), gRPC health on :9003, graceful
//! shutdown that drains open streams within a bound.
//!
//! [`serve`] is the whole thing; [`bind`] then [`Bound::serve`] splits it so callers (and tests)
//! learn the bound addresses first. Configuration problems (unreadable certificate files, a port
//! in use) are reported before anything is served.

mod ext_proc;
mod health;
mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Server, ServerTlsConfig};

pub use ext_proc::{ExtProcService, RESPONSE_ROLE, ROLE_METADATA};
pub use health::{
    EXT_PROC_SERVICE, INFERENCE_EXTENSION_SERVICE, LIVENESS_SERVICE, READINESS_SERVICE, Readiness,
};
pub use tls::{TlsError, TlsMaterial};

use crate::extproc::{Handoffs, HeaderEndpoints, Router, StreamConfig};

/// After cutting streams, how long connections get to close before serving returns anyway.
const CUT_GRACE: Duration = Duration::from_secs(1);

/// How the ext_proc listener is secured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsMode {
    /// No TLS.
    Plaintext,
    /// A self-signed certificate generated at start for these names (GIE's default).
    SelfSigned {
        /// DNS names or IP addresses in the certificate.
        names: Vec<String>,
    },
    /// A certificate chain and key from PEM files.
    Files {
        /// Certificate chain.
        cert: PathBuf,
        /// Private key.
        key: PathBuf,
    },
}

/// How often parked tickets are swept (one unclaimed is aborted by the second sweep after it
/// was parked).
const HANDOFF_SWEEP: Duration = Duration::from_secs(1);

/// Everything the servers need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// ext_proc listen address (`--listen-address`, `0.0.0.0:9002` by default).
    pub ext_proc_addr: SocketAddr,
    /// gRPC health listen address (`0.0.0.0:9003`), always plaintext.
    pub health_addr: SocketAddr,
    /// The response observer's ext_proc address (`--observer-port`), when it has its own: every
    /// stream on it observes responses. Same TLS as ext_proc.
    pub observer_addr: Option<SocketAddr>,
    /// ext_proc transport security.
    pub tls: TlsMode,
    /// Per-stream behaviour.
    pub stream: StreamConfig,
    /// How long open streams may run after shutdown begins before they are cut.
    pub drain_timeout: Duration,
    /// HTTP/2 adaptive flow-control windows on the ext_proc listener.
    pub http2_adaptive_window: bool,
}

impl ServerConfig {
    /// The configuration the command line asks for.
    pub fn from_args(args: &crate::Args) -> Self {
        let any = args.listen_address;
        let tls = match (&args.cert, &args.key, args.plaintext) {
            (_, _, true) => TlsMode::Plaintext,
            (Some(cert), Some(key), false) => TlsMode::Files {
                cert: cert.clone(),
                key: key.clone(),
            },
            _ => TlsMode::SelfSigned {
                names: default_names(),
            },
        };
        Self {
            ext_proc_addr: SocketAddr::new(any, args.grpc_port),
            health_addr: SocketAddr::new(any, args.grpc_health_port),
            observer_addr: (args.observer_port != 0 && args.response_observer)
                .then(|| SocketAddr::new(any, args.observer_port)),
            tls,
            stream: StreamConfig {
                max_body_bytes: args.max_body_bytes,
                header_endpoints: match args.destination_header {
                    crate::args::DestinationHeaderArg::Primary => HeaderEndpoints::Primary,
                    crate::args::DestinationHeaderArg::All => HeaderEndpoints::All,
                },
                ..StreamConfig::default()
            },
            drain_timeout: Duration::from_secs(args.drain_timeout_seconds),
            http2_adaptive_window: args.http2_adaptive_window,
        }
    }
}

/// Names in the generated certificate: `localhost`, and the pod's hostname when known.
fn default_names() -> Vec<String> {
    let mut names = vec!["localhost".to_owned()];
    if let Ok(host) = std::env::var("HOSTNAME") {
        let host = host.trim();
        if !host.is_empty() && host != "localhost" {
            names.push(host.to_owned());
        }
    }
    names
}

/// Why serving failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// TLS material could not be had.
    #[error("TLS setup failed")]
    Tls(#[from] TlsError),
    /// The TLS material was refused by the TLS stack.
    #[error("TLS configuration rejected")]
    TlsConfig(#[source] tonic::transport::Error),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A server stopped with an error.
    #[error("gRPC server failed")]
    Transport(#[source] tonic::transport::Error),
}

impl ServeError {
    /// Bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Tls(_) => "tls",
            Self::TlsConfig(_) => "tls_config",
            Self::Bind { .. } => "bind",
            Self::Transport(_) => "transport",
        }
    }
}

/// Listeners bound and TLS ready; nothing served yet.
#[derive(Debug)]
pub struct Bound {
    ext_proc: TcpListener,
    health: TcpListener,
    observer: Option<TcpListener>,
    tls: Option<TlsMaterial>,
    config: ServerConfig,
    handoffs: Option<Arc<Handoffs>>,
}

/// Prepares TLS, then binds both listeners.
pub async fn bind(config: ServerConfig) -> Result<Bound, ServeError> {
    let tls = match &config.tls {
        TlsMode::Plaintext => None,
        TlsMode::SelfSigned { names } => Some(TlsMaterial::self_signed(names)?),
        TlsMode::Files { cert, key } => Some(TlsMaterial::from_files(cert, key)?),
    };
    if let Some(material) = &tls {
        // Validate now, so a bad key is reported before any port is taken.
        Server::builder()
            .tls_config(ServerTlsConfig::new().identity(material.identity()))
            .map_err(ServeError::TlsConfig)?;
    }
    let listen = |addr: SocketAddr| async move {
        TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Bind { addr, source })
    };
    let ext_proc = listen(config.ext_proc_addr).await?;
    let health = listen(config.health_addr).await?;
    let observer = match config.observer_addr {
        Some(addr) => Some(listen(addr).await?),
        None => None,
    };
    Ok(Bound {
        ext_proc,
        health,
        observer,
        tls,
        config,
        handoffs: None,
    })
}

/// Binds and serves until `shutdown` resolves, then drains (see [`Bound::serve`]); with
/// `handoffs`, in the response-observer layout (see [`Bound::with_handoffs`]).
pub async fn serve(
    config: ServerConfig,
    handoffs: Option<Arc<Handoffs>>,
    router: Arc<dyn Router>,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut bound = bind(config).await?;
    if let Some(h) = handoffs {
        bound = bound.with_handoffs(h);
    }
    bound.serve(router, readiness, shutdown).await
}

impl Bound {
    /// Serves the response-observer layout: routing streams park their tickets in `handoffs`,
    /// observability-mode streams claim them, and what nobody claims is aborted by a sweep once
    /// a second (so within two seconds).
    pub fn with_handoffs(self, handoffs: Arc<Handoffs>) -> Self {
        Self {
            handoffs: Some(handoffs),
            ..self
        }
    }

    /// The ext_proc address actually bound.
    pub fn ext_proc_addr(&self) -> Option<SocketAddr> {
        self.ext_proc.local_addr().ok()
    }

    /// The health address actually bound.
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health.local_addr().ok()
    }

    /// The response observer's address actually bound, when it has its own port.
    pub fn observer_addr(&self) -> Option<SocketAddr> {
        self.observer.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The certificate served on ext_proc, when TLS is on (clients that verify it need it).
    pub fn certificate_pem(&self) -> Option<&str> {
        self.tls.as_ref().map(|t| t.cert_pem.as_str())
    }

    /// Serves ext_proc and health until `shutdown` resolves. Then readiness turns NOT_SERVING,
    /// listeners stop accepting, HTTP/2 connections get GOAWAY, and open streams may finish for up
    /// to the drain timeout before they are cut (their tickets then hear `Aborted`).
    pub async fn serve(
        self,
        router: Arc<dyn Router>,
        readiness: Readiness,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        let Self {
            ext_proc,
            health,
            observer,
            tls,
            config,
            handoffs,
        } = self;
        let sweeper = handoffs.clone().map(|h| {
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(HANDOFF_SWEEP);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    h.sweep();
                }
            })
        });
        let (stop_tx, stop_rx) = watch::channel(false);
        let (cut_tx, cut_rx) = watch::channel(false);
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            // Ends when told to stop, or when the sender is gone.
            let _ = rx.wait_for(|stop| *stop).await;
        };

        let (reporter, health_service) = tonic_health::server::health_reporter();
        let health_follow = tokio::spawn(health::follow(reporter, readiness, stop_rx.clone()));
        let health_server = Server::builder()
            .add_service(health_service)
            .serve_with_incoming_shutdown(TcpIncoming::from(health), stopped(stop_rx.clone()));

        let grpc = || -> Result<Server, ServeError> {
            let mut builder =
                Server::builder().http2_adaptive_window(Some(config.http2_adaptive_window));
            if let Some(material) = &tls {
                builder = builder
                    .tls_config(ServerTlsConfig::new().identity(material.identity()))
                    .map_err(ServeError::TlsConfig)?;
            }
            Ok(builder)
        };
        let service = ExtProcService::new(router, config.stream.clone())
            .with_handoffs(handoffs)
            .with_cut(cut_rx);
        let observer_server = match observer {
            Some(listener) => Some(
                grpc()?
                    .add_service(service.clone().observing_only().into_server())
                    .serve_with_incoming_shutdown(
                        TcpIncoming::from(listener).with_nodelay(Some(true)),
                        stopped(stop_rx.clone()),
                    ),
            ),
            None => None,
        };
        let observer_server = async move {
            match observer_server {
                Some(server) => server.await,
                None => Ok(()),
            }
        };
        let ext_proc_server = grpc()?
            .add_service(service.into_server())
            .serve_with_incoming_shutdown(
                TcpIncoming::from(ext_proc).with_nodelay(Some(true)),
                stopped(stop_rx),
            );
        tracing::info!(
            ext_proc = %config.ext_proc_addr,
            health = %config.health_addr,
            observer = ?config.observer_addr,
            tls = tls.is_some(),
            "serving"
        );

        let servers = async { tokio::try_join!(ext_proc_server, health_server, observer_server) };
        tokio::pin!(servers);
        tokio::select! {
            result = &mut servers => {
                health_follow.abort();
                if let Some(s) = &sweeper {
                    s.abort();
                }
                return result.map(|_| ()).map_err(ServeError::Transport);
            }
            () = shutdown => {}
        }
        tracing::info!(drain_timeout = ?config.drain_timeout, "shutting down: draining ext_proc streams");
        stop_tx.send_replace(true);
        let result = match tokio::time::timeout(config.drain_timeout, &mut servers).await {
            Ok(result) => result.map(|_| ()).map_err(ServeError::Transport),
            Err(_) => {
                tracing::warn!("drain timeout reached; cutting the remaining streams");
                cut_tx.send_replace(true);
                match tokio::time::timeout(CUT_GRACE, &mut servers).await {
                    Ok(result) => result.map(|_| ()).map_err(ServeError::Transport),
                    Err(_) => Ok(()),
                }
            }
        };
        health_follow.abort();
        if let Some(s) = &sweeper {
            s.abort();
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    fn config(extra: &[&str]) -> ServerConfig {
        let base = ["kvgate-epp", "--pool-name", "p"];
        ServerConfig::from_args(&crate::Args::try_parse_from(base.iter().chain(extra)).unwrap())
    }

    #[test]
    fn tls_mode_follows_the_flags() {
        assert!(
            matches!(config(&[]).tls, TlsMode::SelfSigned { names } if names.contains(&"localhost".to_owned()))
        );
        assert_eq!(config(&["--plaintext"]).tls, TlsMode::Plaintext);
        assert_eq!(
            config(&["--cert", "c.pem", "--key", "k.pem"]).tls,
            TlsMode::Files {
                cert: "c.pem".into(),
                key: "k.pem".into()
            }
        );
    }

    #[test]
    fn ports_limits_and_drain_come_from_the_flags() {
        let c = config(&[
            "--grpc-port",
            "7002",
            "--max-body-bytes",
            "1024",
            "--drain-timeout-seconds",
            "5",
        ]);
        assert_eq!(c.ext_proc_addr.port(), 7002);
        assert_eq!(c.health_addr.port(), 9003);
        assert_eq!(c.observer_addr, None);
        let o = config(&["--response-observer", "true", "--observer-port", "9004"]);
        assert_eq!(o.observer_addr.map(|a| a.port()), Some(9004));
        assert_eq!(c.stream.max_body_bytes, 1024);
        assert_eq!(c.drain_timeout, Duration::from_secs(5));
    }
}
