//! Kubernetes discovery: the InferencePool named by `--pool-name` in `--pool-namespace`
//! (`inference.networking.k8s.io/v1`, or `inference.networking.x-k8s.io/v1alpha2`), the Pods its
//! selector picks, and the namespace's InferenceObjectives.
//!
//! Layers, pure first: [`convert`] (Pod → endpoints), [`relist`] (the reflector store's state
//! machine), [`state`] (one pool's state → [`Snapshot`]), [`objectives`] (name → priority), then
//! [`watch`] (kube-rs watchers feeding them). [`KubeDiscovery`] runs the watchers on a thread of
//! its own with a single-threaded tokio runtime, so the discovery thread in `app` reads snapshots
//! the way it polls the endpoints file, and installs them through the same
//! [`apply`](crate::discovery::apply::apply).

pub mod convert;
pub mod objectives;
pub mod relist;
pub mod state;
pub mod watch;

use std::sync::Arc;
use std::thread::JoinHandle;

pub use objectives::Objectives;
pub use state::Snapshot;
pub use watch::{PoolGroup, WatchConfig};

/// Why Kubernetes discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// Neither in-cluster configuration nor a kubeconfig was usable.
    #[error(
        "Kubernetes discovery needs the in-cluster service account (KUBERNETES_SERVICE_HOST and a \
         mounted token) or a kubeconfig: {0}"
    )]
    Config(#[source] kube::Error),
    /// The discovery thread or its runtime could not start.
    #[error("Kubernetes discovery thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The discovery thread ended before reporting.
    #[error("Kubernetes discovery thread stopped during start-up")]
    Died,
}

impl KubeError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            KubeError::Config(_) => "config",
            KubeError::Thread(_) => "thread",
            KubeError::Died => "died",
        }
    }
}

/// Running Kubernetes discovery; dropping it stops the watchers.
#[derive(Debug)]
pub struct KubeDiscovery {
    snapshots: tokio::sync::watch::Receiver<Snapshot>,
    objectives: Arc<Objectives>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl KubeDiscovery {
    /// Connects with `kube::Client::try_default()` (in-cluster config, else kubeconfig) and
    /// starts the watchers; fails when no configuration is usable.
    pub fn start(config: WatchConfig) -> Result<Self, KubeError> {
        let (snap_tx, snapshots) = tokio::sync::watch::channel(Snapshot::default());
        let objectives = Arc::new(Objectives::new(config.pool_name.clone()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (started_tx, started) = std::sync::mpsc::channel::<Result<(), KubeError>>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(KubeError::Thread)?;
        let objectives_for_watch = Arc::clone(&objectives);
        let thread = std::thread::Builder::new()
            .name("kube-discovery".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let client = match kube::Client::try_default().await {
                        Ok(c) => c,
                        Err(e) => {
                            let _ = started_tx.send(Err(KubeError::Config(e)));
                            return;
                        }
                    };
                    let _ = started_tx.send(Ok(()));
                    tracing::info!(
                        pool = %config.pool_name,
                        namespace = %config.namespace,
                        group = ?config.group,
                        "Kubernetes discovery started"
                    );
                    tokio::select! {
                        () = watch::run(client, config, snap_tx, objectives_for_watch) => {}
                        _ = stopped => {}
                    }
                });
            })
            .map_err(KubeError::Thread)?;
        match started.recv() {
            Ok(Ok(())) => Ok(Self {
                snapshots,
                objectives,
                stop: Some(stop),
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(KubeError::Died)
            }
        }
    }

    /// The newest snapshot, when it changed since the last call.
    pub fn changed(&mut self) -> Option<Snapshot> {
        match self.snapshots.has_changed() {
            Ok(true) => Some(self.snapshots.borrow_and_update().clone()),
            Ok(false) | Err(_) => None,
        }
    }

    /// The pool's InferenceObjectives.
    pub fn objectives(&self) -> &Arc<Objectives> {
        &self.objectives
    }
}

impl Drop for KubeDiscovery {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
