//! Wiring: the store and its service, the connector socket, the disk and remote writers, the
//! NATS publisher and snapshot responder, and the metrics/health server, until SIGTERM or
//! SIGINT. On the way out the daemon refuses every request and snapshot, then publishes one
//! `Cleared` as its last envelope: its tiers go with it (the disk directory is emptied at
//! the next start, whose first envelope is a `Cleared` too).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use kv_events::subject;
use tokio::net::UnixListener;
use tokio::sync::watch;

use crate::args::{Args, PeerFabric};
use crate::disk::{DirectIo, DiskDir, DiskError};
use crate::metrics::Metrics;
use crate::outbox::{Identity, Outbox};
use crate::peers::auth::{Secret, SecretError};
use crate::peers::directory::{Announce, Directory, DirectoryConfig};
use crate::peers::fabric::{Fabric, NixlFabric};
use crate::peers::follow::FollowConfig;
use crate::peers::pull::PullConfig;
use crate::peers::serve::ServeConfig;
use crate::peers::{self, Peers};
use crate::remote::redis::{Redis, RedisConfig};
use crate::remote::s3::{self, S3, S3Config, S3Options};
use crate::remote::{Remote, RemoteError};
use crate::server::{self, ServerConfig};
use crate::service::{self, Backends, QueueBounds, Service};
use crate::store::{BlockStore, StoreConfig};

/// Why the daemon stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Bad configuration.
    #[error(transparent)]
    Start(#[from] cli_support::StartError),
    /// The async runtime could not start.
    #[error("starting the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The connector socket could not be set up.
    #[error("connector socket {path}: {message}")]
    Socket {
        /// The path.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The metrics port could not be bound.
    #[error("metrics server on {addr}: {source}")]
    Serve {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The remote URL was refused.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// The disk directory could not be opened (or another daemon holds it).
    #[error("disk tier: {0}")]
    Disk(#[from] DiskError),
    /// The disk writer thread could not start.
    #[error("starting the disk writer: {0}")]
    DiskWriter(#[source] std::io::Error),
    /// NATS could not be set up.
    #[error("NATS: {0}")]
    Nats(String),
    /// The peer secret could not be read or was refused.
    #[error(transparent)]
    PeerSecret(#[from] SecretError),
    /// `--peer-fabric nixl`, but NIXL could not be loaded.
    #[error("--peer-fabric nixl: NIXL cannot be used")]
    Fabric(#[source] kvbm_nixl::LoadError),
    /// Loading NIXL panicked.
    #[error("--peer-fabric nixl: loading NIXL panicked")]
    FabricTask(#[source] tokio::task::JoinError),
    /// The peer port could not be bound.
    #[error("peer server on {addr}: {source}")]
    PeerListen {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl cli_support::ExitStatus for AppError {
    fn exit_code(&self) -> u8 {
        match self {
            AppError::Start(_)
            | AppError::Remote(
                RemoteError::Url(_) | RemoteError::Tls(_) | RemoteError::Credentials(_),
            )
            | AppError::Disk(DiskError::Locked { .. })
            | AppError::PeerSecret(_) => cli_support::EXIT_CONFIG,
            // A wrong bucket, region, key or permission, or a request the S3 SDK cannot build.
            AppError::Remote(e) if e.is_config_refusal() => cli_support::EXIT_CONFIG,
            _ => 1,
        }
    }
}

/// Runs the daemon on its own runtime until SIGTERM or SIGINT.
pub(crate) fn run(args: Args) -> Result<(), AppError> {
    args.validate().map_err(cli_support::StartError::Config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvbm")
        .enable_all()
        .build()
        .map_err(AppError::Runtime)?;
    runtime.block_on(serve(args))
}

/// Binds the connector socket: creates its directory, replaces a stale socket (refusing a
/// live one, or a path that is not a socket), and creates it at mode 0660 (under a umask of
/// 0117 for the bind, at startup before any other thread creates files). Returns the listener
/// and the socket's inode, so shutdown removes only its own socket.
fn bind_socket(path: &Path) -> Result<(UnixListener, u64), AppError> {
    use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
    let fail = |message: String| AppError::Socket {
        path: path.display().to_string(),
        message,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| fail(format!("creating its directory: {e}")))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(fail("the path exists and is not a socket".into()));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(fail("another process is serving on it".into()));
        }
        std::fs::remove_file(path).map_err(|e| fail(format!("removing the stale socket: {e}")))?;
    }
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o117));
    let bound = UnixListener::bind(path);
    rustix::process::umask(old);
    let listener = bound.map_err(|e| fail(e.to_string()))?;
    // Exactly 0660 whatever the umask was (it can only have removed bits).
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| fail(format!("setting its mode: {e}")))?;
    let inode = std::fs::symlink_metadata(path)
        .map_err(|e| fail(e.to_string()))?
        .ino();
    Ok((listener, inode))
}

/// Removes the socket at `path` if it is still the one this daemon bound (a successor may
/// have replaced it).
fn remove_own_socket(path: &Path, inode: u64) {
    use std::os::unix::fs::MetadataExt as _;
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.ino() == inode) {
        let _ = std::fs::remove_file(path);
    }
}

async fn serve(args: Args) -> Result<(), AppError> {
    let remote_bytes = if args.remote_url.is_some() {
        args.remote_bytes
    } else {
        0
    };
    let disk = match &args.disk_dir {
        None => None,
        Some(dir) => {
            let mode = if args.disk_direct_io {
                DirectIo::Auto
            } else {
                DirectIo::Off
            };
            let disk = DiskDir::open(dir, mode)?;
            tracing::info!(
                dir = %dir.display(), direct_io = disk.direct(), removed = disk.removed_at_open(),
                "disk tier ready (blocks a previous run left are removed: they are unindexed)"
            );
            Some(Arc::new(disk))
        }
    };
    let disk_bytes = if disk.is_some() { args.disk_bytes } else { 0 };
    let store = BlockStore::new(StoreConfig {
        host_bytes: args.host_bytes,
        disk_bytes,
        remote_bytes,
        max_pins: args.max_pinned_blocks,
        disk_min_uses: args.disk_min_uses,
        disk_write_through: args.disk_write_through,
    });
    let epoch = kv_bridge::epoch::random_epoch();
    let outbox = Outbox::new(
        Identity {
            namespace: args.namespace.clone(),
            node: args.node.clone(),
            model: args.model.clone(),
            block_size: args.block_size,
        },
        epoch,
        args.max_keys_per_envelope,
    );
    let remote = match &args.remote_url {
        None => None,
        Some(url) => {
            let remote = Arc::new(remote_store(&args, url)?);
            // A CA bundle that cannot be read is a configuration error, found now; the
            // connector built here serves every later connect.
            remote.prepare_tls()?;
            match remote.ping().await {
                Ok(()) => tracing::info!(remote = %remote.address(), "remote store reachable"),
                // A wrong bucket, region, key or permission fails every request: say so now.
                Err(e) if e.is_config_refusal() => return Err(e.into()),
                Err(e) => tracing::warn!(
                    remote = %remote.address(), error = %e,
                    "remote store unreachable now (or the bucket is missing or refused); \
                     each command retries"
                ),
            }
            Some(remote)
        }
    };
    let metrics = Arc::new(Metrics::default());
    metrics
        .disk_direct_io
        .store(disk.as_ref().is_some_and(|d| d.direct()), Ordering::Relaxed);
    let parts = Service::start(
        store,
        outbox,
        Duration::from_millis(u64::from(args.max_pin_ms)),
        Backends {
            disk: disk.clone(),
            remote: remote.clone(),
        },
        [
            QueueBounds {
                ops: args.disk_queue,
                bytes: args.disk_queue_bytes,
            },
            QueueBounds {
                ops: args.remote_queue,
                bytes: args.remote_queue_bytes,
            },
        ],
        Arc::clone(&metrics),
    );
    let service = parts.service;
    // The epoch's first envelope: whatever a previous run left in receivers' indexes goes.
    service.announce_start();
    if let (Some(remote), Some(rx)) = (remote, parts.remote) {
        tokio::spawn(service::remote_writer(Arc::clone(&service), remote, rx));
    }
    if let (Some(disk), Some(rx)) = (disk, parts.disk) {
        let service = Arc::clone(&service);
        std::thread::Builder::new()
            .name("kvbm-disk".into())
            .spawn(move || service::disk_writer(&service, &disk, rx))
            .map_err(AppError::DiskWriter)?;
    }

    let peer_secret = match &args.peer_secret_file {
        Some(path) => Some(Arc::new(Secret::from_file(path)?)),
        None => None,
    };
    let fabric = match (args.peer_listen, args.peer_fabric) {
        (Some(_), PeerFabric::Nixl) => Some(load_nixl(&args, epoch).await?),
        _ => None,
    };
    let peer_listener = match args.peer_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| AppError::PeerListen { addr, source })?,
        ),
        None => None,
    };
    let (listener, inode) = bind_socket(&args.socket)?;
    let addr = SocketAddr::new(args.metrics_bind, args.metrics_port);
    let http = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Serve { addr, source })?;
    let client = crate::nats::connect(&args.nats_url, Arc::clone(&service))
        .await
        .map_err(|e| AppError::Nats(e.to_string()))?;
    let events_subject = subject::kvbm(&args.namespace, &args.node);
    let snapshot_subject = subject::node_snapshot(&args.namespace, &args.node);
    tracing::info!(
        socket = %args.socket.display(), %addr, events = %events_subject,
        snapshots = %snapshot_subject, epoch, host_bytes = args.host_bytes, disk_bytes, remote_bytes,
        "kvgate-kvbm serving"
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let publisher = tokio::spawn(crate::nats::publish_loop(
        client.clone(),
        events_subject.clone(),
        Arc::clone(&service),
        parts.sealed,
        Duration::from_millis(args.publish_interval_ms),
        stopped(stop_rx.clone()),
    ));
    {
        let (client, service) = (client.clone(), Arc::clone(&service));
        tokio::spawn(async move {
            if let Err(e) = crate::nats::serve_snapshots(client, snapshot_subject, service).await {
                tracing::error!(error = %e, "snapshot responder stopped");
            }
        });
    }
    if let (Some(peer_listener), Some(secret), Some(advertise)) =
        (peer_listener, peer_secret, args.peer_address())
    {
        let parts = PeerParts {
            listener: peer_listener,
            secret,
            advertise,
            fabric,
        };
        start_peers(&args, parts, &client, &service, stopped(stop_rx.clone()));
    }
    let router = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .with_state(Arc::clone(&service));
    {
        let stop = stopped(stop_rx.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(http, router).with_graceful_shutdown(stop).await {
                tracing::error!(error = %e, "metrics server stopped");
            }
        });
    }
    let socket_server = tokio::spawn(server::serve(
        listener,
        Arc::clone(&service),
        ServerConfig {
            max_connections: args.max_connections,
            max_segment_bytes: args.max_segment_bytes,
            idle_timeout: Duration::from_secs(args.idle_timeout_s),
            offload_bytes_per_s: args.connector_offload_bytes_per_s,
        },
        stopped(stop_rx),
    ));

    cli_support::shutdown_signal().await;
    // From here every request and snapshot is refused, so the Cleared sealed now is the last
    // envelope the node publishes.
    service.close();
    let _ = stop_tx.send(true);
    let _ = socket_server.await;
    if tokio::time::timeout(Duration::from_secs(2), publisher)
        .await
        .is_err()
    {
        tracing::warn!("the final Cleared events were not confirmed published within 2 s");
    }
    remove_own_socket(&args.socket, inode);
    tracing::info!("kvgate-kvbm stopped");
    Ok(())
}

/// A NIXL agent for `--peer-fabric nixl`, named after the node and this run's epoch (peers
/// key the metadata they load by agent name).
async fn load_nixl(args: &Args, epoch: u64) -> Result<Arc<dyn Fabric>, AppError> {
    let name = kvbm_nixl::agent_name(&args.node, epoch);
    let library = args.nixl_library.clone();
    let pool = kvbm_nixl::PoolConfig {
        buffers: args.nixl_buffers,
        buffer_bytes: usize::try_from(crate::peers::wire::MAX_ANSWER_BYTES).unwrap_or(usize::MAX),
    };
    let loaded =
        tokio::task::spawn_blocking(move || kvbm_nixl::Nixl::load(&name, library.as_deref(), pool))
            .await
            .map_err(AppError::FabricTask)?;
    let nixl = loaded.map_err(AppError::Fabric)?;
    tracing::info!(
        agent = nixl.name(),
        "pull answers travel through NIXL (UCX) when the puller has it too"
    );
    Ok(Arc::new(NixlFabric::new(nixl)))
}

/// What serving and pulling from peers start from.
struct PeerParts {
    listener: tokio::net::TcpListener,
    secret: Arc<Secret>,
    /// The address peers are told.
    advertise: SocketAddr,
    fabric: Option<Arc<dyn Fabric>>,
}

/// Pulls from peers and serving theirs: the directory, its NATS edge and the pull server.
fn start_peers(
    args: &Args,
    parts: PeerParts,
    client: &async_nats::Client,
    service: &Arc<Service>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let PeerParts {
        listener,
        secret,
        advertise,
        fabric,
    } = parts;
    let interval = Duration::from_secs(args.peer_announce_interval_s);
    let config = DirectoryConfig {
        ttl: kv_index::Millis(
            u64::try_from(interval.as_millis())
                .unwrap_or(u64::MAX)
                .saturating_mul(3),
        ),
        ..DirectoryConfig::default()
    };
    let directory = match Directory::new(&args.node, &args.model, args.block_size, config) {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(error = %e, "peer directory not started");
            return;
        }
    };
    let timeout = Duration::from_millis(args.peer_timeout_ms);
    let peers = Arc::new(Peers::new(
        directory,
        PullConfig {
            node: args.node.clone(),
            secret: Arc::clone(&secret),
            timeout,
            fabric: fabric.clone(),
            metrics: Arc::clone(service.metrics()),
        },
    ));
    service.attach_peers(Arc::clone(&peers));
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    tokio::spawn(async move {
        stop.await;
        let _ = stop_tx.send(true);
    });
    let follow = peers::follow::follow(
        client.clone(),
        peers,
        FollowConfig {
            namespace: args.namespace.clone(),
            me: Announce {
                node: args.node.clone(),
                model: args.model.clone(),
                block_size: args.block_size,
                addr: advertise,
                interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
                layouts: Vec::new(),
            },
            interval,
            snapshot_timeout: Duration::from_secs(2),
        },
        Arc::clone(service.metrics()),
        {
            let service = Arc::clone(service);
            move || service.layout_fingerprints()
        },
        stopped(stop_rx.clone()),
    );
    tokio::spawn(async move {
        if let Err(e) = follow.await {
            tracing::error!(error = %e, "peer follower stopped");
        }
    });
    tracing::info!(listen = ?listener.local_addr().ok(), %advertise, "serving pulls to peers");
    tokio::spawn(peers::serve::serve(
        listener,
        Arc::clone(service),
        ServeConfig {
            node: args.node.clone(),
            advertise,
            secret,
            max_connections: args.peer_max_connections,
            io_timeout: timeout,
            idle_timeout: Duration::from_secs(60),
            fabric,
        },
        stopped(stop_rx),
    ));
}

async fn metrics_text(State(service): State<Arc<Service>>) -> String {
    service.metrics_text()
}

async fn ready(State(service): State<Arc<Service>>) -> (StatusCode, &'static str) {
    if service.metrics().nats_connected.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "NATS not connected")
    }
}

/// The remote store `url` names, configured from the flags (and, for S3, the environment's
/// AWS credentials and region).
fn remote_store(args: &Args, url: &str) -> Result<Remote, RemoteError> {
    let timeout = Duration::from_millis(args.remote_timeout_ms);
    let max_value = usize::try_from(args.max_segment_bytes.min(1 << 30)).unwrap_or(1 << 30);
    if url.starts_with("s3://") {
        let env = |name: &str| std::env::var(name).ok();
        let options = S3Options {
            endpoint: args.s3_endpoint.clone(),
            region: args
                .s3_region
                .clone()
                .unwrap_or_else(|| s3::region_from(env)),
            addressing: args.s3_addressing,
        };
        let mut config = S3Config::from_url(
            url,
            &options,
            s3::credentials_from(env)?,
            timeout,
            max_value,
        )?;
        config.ca_file.clone_from(&args.remote_ca_file);
        return Ok(Remote::S3(S3::new(config)));
    }
    let mut config = RedisConfig::from_url(url, timeout, max_value)?;
    if let Some(tls) = &mut config.tls {
        tls.ca_file.clone_from(&args.remote_ca_file);
    }
    Ok(Remote::Redis(Redis::new(config)))
}
