//! Kubernetes discovery against a real API server (kapi: the Kubernetes API server libraries
//! over etcd): the watchers follow the InferencePool and its Pods, survive the API server going
//! away, and rebuild their view after an etcd restore takes resource versions back in time.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use api::objective::llm_d;
use api::pool::{v1, v1alpha2};
use kapi::pods::{self, PodInfo};
use kapi::{Kapi, KapiOptions};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kvgate_epp::discovery::Wake;
use kvgate_epp::discovery::kubernetes::{KubeDiscovery, PoolGroup, Snapshot, WatchConfig};
use serde_json::json;
use tokio::sync::watch;

const NS: &str = "llm";

async fn cluster(crds: impl Fn(&str) -> bool) -> (Kapi, kube::Client) {
    let kapi = Kapi::start(KapiOptions::default()).await.unwrap();
    let client = kapi.client().await.unwrap();
    kapi::crds::install_dir(&client, &kapi::crds::test_copies_dir(), crds)
        .await
        .unwrap();
    pods::ensure_namespace(&client, NS).await.unwrap();
    (kapi, client)
}

fn pool_v1(app: &str, ports: &[i32]) -> v1::InferencePool {
    serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": NS},
        "spec": {"selector": {"matchLabels": {"app": app}},
                 "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
                 "endpointPickerRef": {"name": "pool-epp", "port": {"number": 9002}}}
    }))
    .unwrap()
}

async fn apply_pool(client: &kube::Client, pool: &v1::InferencePool) {
    Api::<v1::InferencePool>::namespaced(client.clone(), NS)
        .patch(
            "pool",
            &PatchParams::apply("test").force(),
            &Patch::Apply(pool),
        )
        .await
        .unwrap();
}

fn pod(name: &str, app: &str, ip: &str, ready: bool) -> PodInfo {
    PodInfo {
        name: name.to_owned(),
        labels: BTreeMap::from([("app".to_owned(), app.to_owned())]),
        node: "node-a".to_owned(),
        ip: ip.parse().unwrap(),
        ready,
    }
}

fn start(client: &kube::Client, config: WatchConfig) -> (KubeDiscovery, watch::Receiver<Snapshot>) {
    let discovery = KubeDiscovery::with_client(
        client.clone(),
        config,
        &tokio::runtime::Handle::current(),
        Arc::new(Wake::default()),
    );
    let rx = discovery.subscribe();
    (discovery, rx)
}

fn config() -> WatchConfig {
    WatchConfig {
        max_backoff: Duration::from_millis(500),
        ..WatchConfig::new("pool", NS)
    }
}

/// Waits for a snapshot satisfying `pred`; returns it and how long it took.
async fn until(
    rx: &mut watch::Receiver<Snapshot>,
    what: &str,
    pred: impl FnMut(&Snapshot) -> bool,
) -> (Snapshot, Duration) {
    let start = Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(30), rx.wait_for(pred))
        .await
        .map(|r| r.map(|s| s.clone()));
    match got {
        Ok(Ok(s)) => (s, start.elapsed()),
        _ => panic!(
            "timed out waiting for {what}; last snapshot {:?}",
            *rx.borrow()
        ),
    }
}

fn keys(s: &Snapshot) -> Vec<(String, u16, bool)> {
    s.endpoints
        .iter()
        .map(|e| (e.key.0.clone(), e.key.1, e.ready))
        .collect()
}

fn ready_of(s: &Snapshot, name: &str) -> Option<bool> {
    s.endpoints
        .iter()
        .find(|e| e.key.0 == name)
        .map(|e| e.ready)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_follow_the_pool_and_its_pods() {
    let (_kapi, client) = cluster(|_| true).await;
    apply_pool(&client, &pool_v1("m", &[8000, 8001])).await;
    for p in [
        pod("a", "m", "10.0.0.1", true),
        pod("b", "m", "10.0.0.2", true),
        pod("c", "other", "10.0.0.3", true),
    ] {
        pods::create(&client, NS, &p).await.unwrap();
    }
    let (discovery, mut rx) = start(&client, config());

    let (s, _) = until(&mut rx, "the initial endpoints", |s| s.ready).await;
    assert_eq!(
        keys(&s),
        vec![
            ("a".into(), 8000, true),
            ("a".into(), 8001, true),
            ("b".into(), 8000, true),
            ("b".into(), 8001, true)
        ]
    );
    assert_eq!(s.endpoints[1].address.to_string(), "10.0.0.1:8001");
    assert_eq!(s.endpoints[0].node.as_deref(), Some("node-a"));

    let mut timings = Vec::new();
    pods::set_ready(&client, NS, "b", false).await.unwrap();
    let (_, t) = until(&mut rx, "b not ready", |s| ready_of(s, "b") == Some(false)).await;
    timings.push(("pod NotReady", t));
    pods::create(&client, NS, &pod("d", "m", "10.0.0.4", true))
        .await
        .unwrap();
    let (_, t) = until(&mut rx, "d", |s| ready_of(s, "d") == Some(true)).await;
    timings.push(("pod added", t));
    Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), NS)
        .delete("a", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let (s, t) = until(&mut rx, "a gone", |s| ready_of(s, "a").is_none()).await;
    timings.push(("pod deleted", t));
    assert_eq!(s.endpoints.len(), 4);

    // Objectives of this pool give priorities.
    let objective: llm_d::InferenceObjective = serde_json::from_value(json!({
        "apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
        "metadata": {"name": "critical", "namespace": NS},
        "spec": {"priority": 3, "poolRef": {"name": "pool"}}
    }))
    .unwrap();
    Api::<llm_d::InferenceObjective>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &objective)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), async {
        while discovery.objectives().priority("critical") != Some(3) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the objective arrives");

    // A new selector restarts the pod watch on it.
    apply_pool(&client, &pool_v1("other", &[9000])).await;
    let (s, t) = until(&mut rx, "the new selector's pods", |s| {
        keys(s) == vec![("c".into(), 9000, true)]
    })
    .await;
    timings.push(("pool selector changed", t));
    assert!(s.ready);

    // Without the pool there are no endpoints and the EPP is not ready.
    Api::<v1::InferencePool>::namespaced(client.clone(), NS)
        .delete("pool", &DeleteParams::default())
        .await
        .unwrap();
    let (s, t) = until(&mut rx, "the pool gone", |s| !s.ready).await;
    timings.push(("pool deleted", t));
    assert!(s.endpoints.is_empty());
    for (what, t) in &timings {
        eprintln!("discovery latency: {what}: {} ms", t.as_millis());
        assert!(*t < Duration::from_secs(5), "{what} took {t:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1alpha2_pool_is_found_when_v1_is_not_installed_and_a_pinned_group_ignores_the_other() {
    let (_kapi, client) =
        cluster(|f| !f.starts_with("inferencepools.inference.networking.k8s.io")).await;
    let pool: v1alpha2::InferencePool = serde_json::from_value(json!({
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": NS},
        "spec": {"selector": {"app": "m"}, "targetPortNumber": 8000,
                 "extensionRef": {"name": "pool-epp"}}
    }))
    .unwrap();
    Api::<v1alpha2::InferencePool>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &pool)
        .await
        .unwrap();
    pods::create(&client, NS, &pod("a", "m", "10.0.0.1", true))
        .await
        .unwrap();
    let (discovery, mut rx) = start(&client, config());
    let (s, _) = until(&mut rx, "v1alpha2 endpoints", |s| s.ready).await;
    assert_eq!(keys(&s), vec![("a".into(), 8000, true)]);
    let watches = discovery.stats().watches();
    assert!(
        watches.iter().all(|(_, up, ..)| *up),
        "an uninstalled v1 CRD is not an outage: {watches:?}"
    );
    drop(discovery);

    let pinned = WatchConfig {
        group: PoolGroup::V1,
        ..config()
    };
    let (_discovery, mut rx) = start(&client, pinned);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        *rx.borrow_and_update(),
        Snapshot::default(),
        "the v1alpha2 pool is not watched"
    );
}

/// The API server goes away and comes back; then etcd is restored from a backup, so resource
/// versions go back in time: the watches list again (never resuming from a version the server
/// does not know), and a readiness change made after the restore reaches the view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_survives_an_api_outage_and_an_etcd_restore() {
    let (mut kapi, client) = cluster(|_| true).await;
    apply_pool(&client, &pool_v1("m", &[8000])).await;
    pods::create(&client, NS, &pod("a", "m", "10.0.0.1", true))
        .await
        .unwrap();
    pods::create(&client, NS, &pod("b", "m", "10.0.0.2", true))
        .await
        .unwrap();
    let relisting = WatchConfig {
        relist_every: Some(Duration::from_secs(2)),
        ..config()
    };
    let (discovery, mut rx) = start(&client, relisting);
    until(&mut rx, "both pods", |s| s.ready && s.endpoints.len() == 2).await;

    // The periodic relist runs and changes nothing.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let periodic: u64 = discovery
        .stats()
        .watches()
        .iter()
        .filter(|(w, ..)| *w == "pods")
        .map(|(.., p)| *p)
        .sum();
    assert!(periodic >= 1, "the pods were listed again periodically");
    assert_eq!(rx.borrow().endpoints.len(), 2);

    // An outage: the view stays, marked stale; it recovers soon after the server returns.
    kapi.stop_apiserver();
    let stale_deadline = Instant::now() + Duration::from_secs(20);
    while discovery.stats().stale_for(Instant::now()).is_zero() {
        assert!(
            Instant::now() < stale_deadline,
            "the outage was never noticed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(rx.borrow().endpoints.len(), 2, "the last view is kept");
    assert!(rx.borrow().ready);
    tokio::time::sleep(Duration::from_secs(2)).await;
    kapi.start_apiserver().await.unwrap();
    let back = Instant::now();
    while !discovery.stats().stale_for(Instant::now()).is_zero() {
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "still stale {:?} after the API server returned",
            back.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let recovered = back.elapsed();
    eprintln!(
        "discovery latency: watches current again {} ms after the API server returned",
        recovered.as_millis()
    );
    pods::set_ready(&client, NS, "a", false).await.unwrap();
    let (_, t) = until(&mut rx, "a not ready after the outage", |s| {
        ready_of(s, "a") == Some(false)
    })
    .await;
    eprintln!(
        "discovery latency: pod NotReady after the outage: {} ms",
        t.as_millis()
    );
    pods::set_ready(&client, NS, "a", true).await.unwrap();
    until(&mut rx, "a ready", |s| ready_of(s, "a") == Some(true)).await;

    // An etcd restore: back up, move resource versions well past the backup, restore.
    let backup = kapi.backup_etcd().await.unwrap();
    let before_restore = pod("late", "m", "10.0.0.9", true);
    pods::create(&client, NS, &before_restore).await.unwrap();
    for i in 0..30 {
        pods::set_ready(&client, NS, "late", i % 2 == 0)
            .await
            .unwrap();
    }
    until(&mut rx, "late seen", |s| ready_of(s, "late").is_some()).await;
    kapi.restore_etcd(&backup).await.unwrap();
    let (_, t) = until(&mut rx, "late gone after the restore", |s| {
        ready_of(s, "late").is_none()
    })
    .await;
    eprintln!(
        "discovery latency: etcd restore reflected in {} ms",
        t.as_millis()
    );
    // The server's resource versions are now below what the watches last saw.
    pods::set_ready(&client, NS, "b", false).await.unwrap();
    let (_, t) = until(&mut rx, "b not ready after the restore", |s| {
        ready_of(s, "b") == Some(false)
    })
    .await;
    eprintln!(
        "discovery latency: pod NotReady after the restore: {} ms",
        t.as_millis()
    );
    let failures: u64 = discovery
        .stats()
        .watches()
        .iter()
        .map(|(_, _, f, ..)| *f)
        .sum();
    assert!(failures > 0, "the outages were counted");
}
