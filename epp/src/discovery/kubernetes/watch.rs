//! The reflectors: kube-rs watchers on the InferencePool (by name, per enabled API version), on
//! the Pods its selector picks (restarted when the selector changes), and on InferenceObjectives
//! (both groups). Each event goes into the synchronous [`PoolState`] or [`Objectives`]; every
//! change of endpoints or readiness is published as a [`Snapshot`] on a `watch` channel and
//! wakes the routing table's installer at once.
//!
//! A watch that fails is never resumed from its last resourceVersion: after the
//! [`Backoff`] delay it lists again from scratch, and the list replaces the store atomically.
//! Resuming is what kube-rs's watcher does, and after an etcd restore (resource versions going
//! back in time) it resumed from a version the server had not reached and never saw the
//! changes in between. Every watch also lists again every `--kube-relist-seconds`, which
//! catches a silently lost event. A resource whose CRD is not installed (404) is retried
//! quietly at the maximum delay, so installing it later is picked up.

use std::fmt::Debug;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::objective::{ObjectiveView, llm_d, x_k8s};
use api::pool::{PoolView, v1, v1alpha2};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client, Resource, ResourceExt as _};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::time::Instant;

use super::backoff::{Backoff, MIN_DELAY};
use super::convert::pod_view;
use super::health::{Failure, KubeStats, Note, Relist, WatchKind};
use super::objectives::{ObjectiveGroup, Objectives};
use super::relist::StoreEvent;
use super::state::{PoolState, PoolVersion, Snapshot};
use crate::discovery::Wake;

/// Which InferencePool API versions are watched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolGroup {
    /// Both; v1 wins when the pool exists in both.
    Auto,
    /// `inference.networking.k8s.io/v1` only.
    V1,
    /// `inference.networking.x-k8s.io/v1alpha2` only.
    V1Alpha2,
}

/// What to watch, and how.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    /// The InferencePool's name.
    pub pool_name: String,
    /// Its namespace (pods and objectives are watched there too).
    pub namespace: String,
    /// Which API versions.
    pub group: PoolGroup,
    /// The longest wait between retries while the API server fails.
    pub max_backoff: Duration,
    /// How often every watch lists again from scratch; never when `None`.
    pub relist_every: Option<Duration>,
}

impl WatchConfig {
    /// Defaults for `pool_name` in `namespace`: both versions, 2 s maximum backoff, a relist
    /// every 5 minutes.
    pub fn new(pool_name: impl Into<String>, namespace: impl Into<String>) -> Self {
        Self {
            pool_name: pool_name.into(),
            namespace: namespace.into(),
            group: PoolGroup::Auto,
            max_backoff: Duration::from_secs(2),
            relist_every: Some(Duration::from_secs(300)),
        }
    }
}

/// What the watcher tasks share.
struct Shared {
    state: Mutex<PoolState>,
    snapshots: watch::Sender<Snapshot>,
    selector: watch::Sender<Option<String>>,
    wake: Arc<Wake>,
    stats: Arc<KubeStats>,
    max_backoff: Duration,
    relist_every: Option<Duration>,
}

impl Shared {
    /// Changes the state, then publishes the selector and the snapshot if they changed.
    fn update(&self, f: impl FnOnce(&mut PoolState)) {
        let (snapshot, selector) = {
            let mut state = self
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            f(&mut state);
            (state.snapshot(), state.pod_selector())
        };
        self.selector
            .send_if_modified(|cur| replace_if_new(cur, selector));
        if self
            .snapshots
            .send_if_modified(|cur| replace_if_new(cur, snapshot))
        {
            self.wake.notify();
        }
    }

    /// Logs and counts a failure of `watch`.
    fn failed(&self, watch: WatchKind, error: &watcher::Error) -> Failure {
        let failure = classify(error);
        let w = watch.label();
        match self.stats.failed(watch, failure, std::time::Instant::now()) {
            Note::OutageStarted => tracing::warn!(
                watch = w, error = %error,
                "Kubernetes watch failed: routing on the last known endpoints while the watches retry \
                 (at most every {} ms; kvgate_epp_kube_stale_seconds counts how long)",
                self.max_backoff.as_millis()
            ),
            Note::Absent => tracing::info!(
                watch = w,
                "resource not served by the API server (CRD not installed?); retrying quietly"
            ),
            Note::Forbidden => tracing::warn!(
                watch = w, error = %error,
                "the API server refused this watch: the EPP's Role must grant list and watch on it"
            ),
            Note::Repeat | Note::Recovered { .. } => {
                tracing::debug!(watch = w, error = %error, "watch still failing")
            }
        }
        failure
    }

    /// Logs a completed list of `watch`.
    fn listed(&self, watch: WatchKind) {
        if let Note::Recovered { after } = self.stats.listed(watch, std::time::Instant::now()) {
            tracing::info!(
                stale_ms = after.as_millis() as u64,
                "Kubernetes watches recovered: every watch listed again"
            );
        }
    }
}

fn replace_if_new<T: PartialEq>(cur: &mut T, new: T) -> bool {
    if *cur == new {
        return false;
    }
    *cur = new;
    true
}

/// What a watcher error means for discovery.
fn classify(error: &watcher::Error) -> Failure {
    let api_code = match error {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => Some(s.code),
        watcher::Error::WatchError(s) => Some(s.code),
        _ => None,
    };
    match api_code {
        Some(404) => Failure::Absent,
        Some(401 | 403) => Failure::Forbidden,
        _ => Failure::Unavailable,
    }
}

/// A watcher event as a store event, `view` converting the object.
fn store_event<K: Resource, T>(event: Event<K>, view: impl Fn(&K) -> Option<T>) -> StoreEvent<T> {
    match event {
        Event::Apply(k) => StoreEvent::Apply(k.name_any(), view(&k)),
        Event::Delete(k) => StoreEvent::Delete(k.name_any()),
        Event::Init => StoreEvent::Init,
        Event::InitApply(k) => StoreEvent::InitApply(k.name_any(), view(&k)),
        Event::InitDone => StoreEvent::InitDone,
    }
}

/// Why one watcher stream ended.
enum End {
    /// It failed; wait, then list again.
    Failed(Failure),
    /// Time for the periodic relist.
    Relist,
    /// The caller's stop future completed (e.g. the pod selector changed).
    Stopped,
}

/// Runs one watch until `stop` completes: a fresh list each time the stream starts, events to
/// `on_event`, a new list after each failure (after the backoff) and every `relist_every`.
async fn watch_loop<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: WatchKind,
    shared: &Shared,
    mut stop: impl Future<Output = ()> + Unpin,
    mut on_event: impl FnMut(Event<K>),
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let seed = std::process::id() as u64 ^ (kind as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut backoff = Backoff::new(MIN_DELAY, shared.max_backoff, seed);
    loop {
        let mut stream = pin!(watcher(api.clone(), config.clone()));
        let relist = async {
            match shared.relist_every {
                Some(every) => tokio::time::sleep_until(Instant::now() + every).await,
                None => std::future::pending().await,
            }
        };
        let mut relist = pin!(relist);
        let end = loop {
            tokio::select! {
                event = stream.next() => match event {
                    Some(Ok(event)) => {
                        if matches!(event, Event::InitDone) {
                            backoff.reset();
                            shared.listed(kind);
                        }
                        on_event(event);
                    }
                    Some(Err(e)) => break End::Failed(shared.failed(kind, &e)),
                    None => break End::Failed(Failure::Unavailable),
                },
                () = &mut relist => break End::Relist,
                () = &mut stop => break End::Stopped,
            }
        };
        match end {
            End::Stopped => return,
            End::Relist => shared.stats.relisted(kind, Relist::Periodic),
            End::Failed(failure) => {
                shared.stats.relisted(kind, Relist::Error);
                let delay = match failure {
                    // Not installed: check now and then, not in a tight loop.
                    Failure::Absent => shared.max_backoff,
                    Failure::Forbidden | Failure::Unavailable => backoff.next_delay(),
                };
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = &mut stop => return,
                }
            }
        }
    }
}

/// Runs every watcher until the future is dropped.
pub async fn run(
    client: Client,
    config: WatchConfig,
    snapshots: watch::Sender<Snapshot>,
    objectives: Arc<Objectives>,
    wake: Arc<Wake>,
    stats: Arc<KubeStats>,
) {
    let (selector, selector_rx) = watch::channel(None);
    let shared = Arc::new(Shared {
        state: Mutex::new(PoolState::new(config.pool_name.clone())),
        snapshots,
        selector,
        wake,
        stats,
        max_backoff: config.max_backoff,
        relist_every: config.relist_every,
    });
    let ns = config.namespace.as_str();
    let by_name = watcher::Config::default().fields(&format!("metadata.name={}", config.pool_name));
    let mut tasks = tokio::task::JoinSet::new();
    if config.group != PoolGroup::V1Alpha2 {
        tasks.spawn(watch_pool(
            Api::<v1::InferencePool>::namespaced(client.clone(), ns),
            by_name.clone(),
            PoolVersion::V1,
            Arc::clone(&shared),
            |p: &v1::InferencePool| PoolView::from(&p.spec),
        ));
    }
    if config.group != PoolGroup::V1 {
        tasks.spawn(watch_pool(
            Api::<v1alpha2::InferencePool>::namespaced(client.clone(), ns),
            by_name,
            PoolVersion::V1Alpha2,
            Arc::clone(&shared),
            |p: &v1alpha2::InferencePool| PoolView::from(&p.spec),
        ));
    }
    tasks.spawn(watch_pods(
        Api::<Pod>::namespaced(client.clone(), ns),
        Arc::clone(&shared),
        selector_rx,
    ));
    tasks.spawn(watch_objectives(
        Api::<llm_d::InferenceObjective>::namespaced(client.clone(), ns),
        ObjectiveGroup::LlmD,
        Arc::clone(&shared),
        Arc::clone(&objectives),
        |o: &llm_d::InferenceObjective| ObjectiveView::from(&o.spec),
    ));
    tasks.spawn(watch_objectives(
        Api::<x_k8s::InferenceObjective>::namespaced(client, ns),
        ObjectiveGroup::XK8s,
        shared,
        objectives,
        |o: &x_k8s::InferenceObjective| ObjectiveView::from(&o.spec),
    ));
    while tasks.join_next().await.is_some() {}
}

async fn watch_pool<K>(
    api: Api<K>,
    config: watcher::Config,
    version: PoolVersion,
    shared: Arc<Shared>,
    view: fn(&K) -> PoolView,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let kind = match version {
        PoolVersion::V1 => WatchKind::PoolV1,
        PoolVersion::V1Alpha2 => WatchKind::PoolV1Alpha2,
    };
    let never = std::future::pending::<()>();
    watch_loop(api, config, kind, &shared, pin!(never), |event| {
        if let Event::Apply(p) = &event {
            tracing::info!(pool = %p.name_any(), api = kind.label(), "InferencePool changed");
        }
        let event = store_event(event, |k| Some(view(k)));
        shared.update(|s| s.pool_event(version, event));
    })
    .await;
}

async fn watch_pods(
    api: Api<Pod>,
    shared: Arc<Shared>,
    mut selector: watch::Receiver<Option<String>>,
) {
    loop {
        let current = selector.borrow_and_update().clone();
        let Some(labels) = current else {
            if selector.changed().await.is_err() {
                return;
            }
            continue;
        };
        tracing::info!(selector = %labels, "watching pods");
        let config = watcher::Config::default().labels(&labels);
        let mut changes = selector.clone();
        let changed = pin!(async move {
            let _ = changes.changed().await;
        });
        watch_loop(
            api.clone(),
            config,
            WatchKind::Pods,
            &shared,
            changed,
            |event| {
                let event = store_event(event, pod_view);
                shared.update(|s| s.pod_event(event));
            },
        )
        .await;
        // The selector changed (or its sender is gone).
        if selector.has_changed().is_err() {
            return;
        }
    }
}

async fn watch_objectives<K>(
    api: Api<K>,
    group: ObjectiveGroup,
    shared: Arc<Shared>,
    objectives: Arc<Objectives>,
    view: fn(&K) -> ObjectiveView,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let kind = match group {
        ObjectiveGroup::LlmD => WatchKind::ObjectivesLlmD,
        ObjectiveGroup::XK8s => WatchKind::ObjectivesXK8s,
    };
    let never = std::future::pending::<()>();
    watch_loop(
        api,
        watcher::Config::default(),
        kind,
        &shared,
        pin!(never),
        |event| objectives.apply(group, store_event(event, |k| Some(view(k)))),
    )
    .await;
}
