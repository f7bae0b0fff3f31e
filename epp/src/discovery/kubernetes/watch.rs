//! The reflectors: kube-rs watchers on the InferencePool (by name, per enabled API version), on
//! the Pods its selector picks (restarted when the selector changes), and on InferenceObjectives
//! (both groups). Each event goes into the synchronous [`PoolState`] or [`Objectives`]; every
//! change of endpoints or readiness is published as a [`Snapshot`] on a `watch` channel.
//!
//! Watchers retry with kube's default backoff; a resource whose CRD is not installed (404) keeps
//! being retried quietly, so installing it later is picked up.

use std::fmt::Debug;
use std::pin::pin;
use std::sync::{Arc, Mutex};

use api::objective::{ObjectiveView, llm_d, x_k8s};
use api::pool::{PoolView, v1, v1alpha2};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client, Resource, ResourceExt as _};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::convert::pod_view;
use super::objectives::{ObjectiveGroup, Objectives};
use super::relist::StoreEvent;
use super::state::{PoolState, PoolVersion, Snapshot};

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

/// What to watch.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    /// The InferencePool's name.
    pub pool_name: String,
    /// Its namespace (pods and objectives are watched there too).
    pub namespace: String,
    /// Which API versions.
    pub group: PoolGroup,
}

/// State shared by the watcher tasks.
struct Shared {
    state: Mutex<PoolState>,
    snapshots: watch::Sender<Snapshot>,
    selector: watch::Sender<Option<String>>,
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
        self.snapshots
            .send_if_modified(|cur| replace_if_new(cur, snapshot));
    }
}

fn replace_if_new<T: PartialEq>(cur: &mut T, new: T) -> bool {
    if *cur == new {
        return false;
    }
    *cur = new;
    true
}

/// Logs a watcher's errors: the first of a run at warn, repeats at debug, recovery at info.
#[derive(Debug)]
struct ErrorLog {
    what: &'static str,
    failing: u64,
}

impl ErrorLog {
    fn new(what: &'static str) -> Self {
        Self { what, failing: 0 }
    }

    fn error(&mut self, e: &watcher::Error) {
        if self.failing == 0 {
            tracing::warn!(watch = self.what, error = %e, "watch failed; retrying with backoff");
        } else {
            tracing::debug!(watch = self.what, error = %e, failures = self.failing + 1, "watch still failing");
        }
        self.failing += 1;
    }

    /// An event arrived. `Init` opens every (re)list attempt, before its request, so only the
    /// events after it show the watch works again.
    fn ok<K>(&mut self, event: &Event<K>) {
        if self.failing > 0 && !matches!(event, Event::Init) {
            tracing::info!(
                watch = self.what,
                failures = self.failing,
                "watch recovered"
            );
            self.failing = 0;
        }
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

/// Runs every watcher until the future is dropped.
pub async fn run(
    client: Client,
    config: WatchConfig,
    snapshots: watch::Sender<Snapshot>,
    objectives: Arc<Objectives>,
) {
    let (selector, selector_rx) = watch::channel(None);
    let shared = Arc::new(Shared {
        state: Mutex::new(PoolState::new(config.pool_name.clone())),
        snapshots,
        selector,
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
        Arc::clone(&objectives),
        |o: &llm_d::InferenceObjective| ObjectiveView::from(&o.spec),
    ));
    tasks.spawn(watch_objectives(
        Api::<x_k8s::InferenceObjective>::namespaced(client, ns),
        ObjectiveGroup::XK8s,
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
    let what = match version {
        PoolVersion::V1 => "inferencepools.inference.networking.k8s.io/v1",
        PoolVersion::V1Alpha2 => "inferencepools.inference.networking.x-k8s.io/v1alpha2",
    };
    let mut errors = ErrorLog::new(what);
    let mut stream = pin!(watcher(api, config).default_backoff());
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                errors.ok(&event);
                if let Event::Apply(p) | Event::InitApply(p) = &event {
                    tracing::info!(pool = %p.name_any(), api = what, "InferencePool seen");
                }
                let event = store_event(event, |k| Some(view(k)));
                shared.update(|s| s.pool_event(version, event));
            }
            Err(e) => errors.error(&e),
        }
    }
}

async fn watch_pods(
    api: Api<Pod>,
    shared: Arc<Shared>,
    mut selector: watch::Receiver<Option<String>>,
) {
    let mut errors = ErrorLog::new("pods");
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
        let mut stream = pin!(watcher(api.clone(), config).default_backoff());
        loop {
            tokio::select! {
                changed = selector.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    break;
                }
                event = stream.next() => match event {
                    Some(Ok(event)) => {
                        errors.ok(&event);
                        let event = store_event(event, pod_view);
                        shared.update(|s| s.pod_event(event));
                    }
                    Some(Err(e)) => errors.error(&e),
                    None => return,
                },
            }
        }
    }
}

async fn watch_objectives<K>(
    api: Api<K>,
    group: ObjectiveGroup,
    objectives: Arc<Objectives>,
    view: fn(&K) -> ObjectiveView,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let what = match group {
        ObjectiveGroup::LlmD => "inferenceobjectives.llm-d.ai",
        ObjectiveGroup::XK8s => "inferenceobjectives.inference.networking.x-k8s.io",
    };
    let mut errors = ErrorLog::new(what);
    let mut stream = pin!(watcher(api, watcher::Config::default()).default_backoff());
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                errors.ok(&event);
                objectives.apply(group, store_event(event, |k| Some(view(k))));
            }
            Err(e) => errors.error(&e),
        }
    }
}

#[cfg(test)]
#[path = "watch_tests.rs"]
mod tests;
