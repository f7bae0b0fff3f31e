//! Kubernetes discovery: the InferencePool named by `--pool-name` in `--pool-namespace`
//! (`inference.networking.k8s.io/v1`, or `inference.networking.x-k8s.io/v1alpha2`), the Pods its
//! selector picks, and the namespace's InferenceObjectives.
//!
//! Layers, pure first: [`convert`] (Pod → endpoints), [`relist`] (the reflector store's state
//! machine), [`state`] (one pool's state → [`Snapshot`]), [`objectives`] (name → priority),
//! [`backoff`] and [`health`] (retry delays, staleness and what to log), then [`watch`]
//! (kube-rs watchers feeding them). [`KubeDiscovery`] runs the watchers as tasks on the EPP's
//! runtime; the discovery thread in `app` installs each new snapshot through
//! [`apply`](crate::discovery::apply::apply) as soon as [`Wake`] tells it one arrived.

pub mod backoff;
pub mod convert;
pub mod health;
pub mod objectives;
pub mod relist;
pub mod state;
pub mod watch;

use std::sync::Arc;

pub use health::KubeStats;
pub use objectives::Objectives;
pub use state::Snapshot;
pub use watch::{PoolGroup, WatchConfig};

use crate::discovery::Wake;

/// Why Kubernetes discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// Neither in-cluster configuration nor a kubeconfig was usable.
    #[error(
        "Kubernetes discovery needs the in-cluster service account (KUBERNETES_SERVICE_HOST and a \
         mounted token) or a kubeconfig: {0}"
    )]
    Config(#[source] kube::Error),
}

impl KubeError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            KubeError::Config(_) => "config",
        }
    }
}

/// Running Kubernetes discovery; dropping it stops the watchers.
#[derive(Debug)]
pub struct KubeDiscovery {
    snapshots: tokio::sync::watch::Receiver<Snapshot>,
    objectives: Arc<Objectives>,
    stats: Arc<KubeStats>,
    task: tokio::task::JoinHandle<()>,
}

impl KubeDiscovery {
    /// Connects with `kube::Client::try_default()` (in-cluster config, else `KUBECONFIG` or
    /// `~/.kube/config`) and starts the watchers on `runtime`; fails when no configuration is
    /// usable. Must not be called from inside the runtime. `wake` is notified whenever a new
    /// snapshot is published.
    pub fn start(
        config: WatchConfig,
        runtime: &tokio::runtime::Handle,
        wake: Arc<Wake>,
    ) -> Result<Self, KubeError> {
        let client = runtime
            .block_on(kube::Client::try_default())
            .map_err(KubeError::Config)?;
        Ok(Self::with_client(client, config, runtime, wake))
    }

    /// Starts the watchers with `client`.
    pub fn with_client(
        client: kube::Client,
        config: WatchConfig,
        runtime: &tokio::runtime::Handle,
        wake: Arc<Wake>,
    ) -> Self {
        let (snap_tx, snapshots) = tokio::sync::watch::channel(Snapshot::default());
        let objectives = Arc::new(Objectives::new(config.pool_name.clone()));
        let stats = Arc::new(KubeStats::default());
        tracing::info!(
            pool = %config.pool_name,
            namespace = %config.namespace,
            group = ?config.group,
            max_backoff_ms = config.max_backoff.as_millis() as u64,
            relist_every_s = config.relist_every.map(|d| d.as_secs()),
            "Kubernetes discovery started"
        );
        let task = runtime.spawn(watch::run(
            client,
            config,
            snap_tx,
            Arc::clone(&objectives),
            wake,
            Arc::clone(&stats),
        ));
        Self {
            snapshots,
            objectives,
            stats,
            task,
        }
    }

    /// The newest snapshot, when it changed since the last call.
    pub fn changed(&mut self) -> Option<Snapshot> {
        match self.snapshots.has_changed() {
            Ok(true) => Some(self.snapshots.borrow_and_update().clone()),
            Ok(false) | Err(_) => None,
        }
    }

    /// A receiver of every snapshot (tests, tools).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Snapshot> {
        self.snapshots.clone()
    }

    /// The pool's InferenceObjectives.
    pub fn objectives(&self) -> &Arc<Objectives> {
        &self.objectives
    }

    /// The watches' health and counters.
    pub fn stats(&self) -> &Arc<KubeStats> {
        &self.stats
    }
}

impl Drop for KubeDiscovery {
    fn drop(&mut self) {
        self.task.abort();
    }
}
