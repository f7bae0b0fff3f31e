//! What the operator's kapi tests share: a cluster with the CRDs, a fake EPP `/metrics` page
//! whose counters grow at a set load, Deployments whose status follows their spec (kapi runs no
//! Deployment controller), the operator's controller run in-process, and readers of status and
//! Events.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::autoscaler::PoolAutoscaler;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use kapi::pods::{self, PodInfo};
use kapi::{Kapi, KapiOptions};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kvgate_operator::controller::{self, Context};
use kvgate_operator::events::Events;
use kvgate_operator::metrics::Metrics;
use kvgate_operator::source::Http;
use serde_json::{Value, json};
use tokio::sync::watch;

pub const NS: &str = "llm";

/// kapi with the InferencePool test copies and kvgate's own CRDs, and the test namespace.
pub async fn cluster() -> (Kapi, kube::Client) {
    let kapi = Kapi::start(KapiOptions::default()).await.unwrap();
    let client = kapi.client().await.unwrap();
    kapi::crds::install_dir(&client, &kapi::crds::test_copies_dir(), |f| {
        f.contains("inferencepools")
    })
    .await
    .unwrap();
    kapi::crds::install_dir(&client, &kapi::crds::owned_dir(), |_| true)
        .await
        .unwrap();
    pods::ensure_namespace(&client, NS).await.unwrap();
    (kapi, client)
}

/// The load and latency the fake EPP reports.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub rps: f64,
    pub isl: f64,
    pub osl: f64,
    pub ttft_s: f64,
    pub itl_s: f64,
}

/// A fake EPP `/metrics`: cumulative counters growing at [`Load`] since the server started
/// (GIE's metric names, as the EPP exports them); `None` answers 503.
#[derive(Clone)]
pub struct FakeEpp {
    state: Arc<Mutex<(Option<Load>, Instant, Counters)>>,
    pub port: u16,
}

#[derive(Default, Clone, Copy)]
struct Counters {
    at: Option<Instant>,
    requests: f64,
}

const TTFT_BOUNDS: [f64; 7] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0];
const ITL_BOUNDS: [f64; 6] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5];
const TOKEN_BOUNDS: [f64; 6] = [128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0];

fn histogram(out: &mut String, name: &str, bounds: &[f64], value: f64, count: f64) {
    out.push_str(&format!("# TYPE {name} histogram\n"));
    for b in bounds {
        let n = if value <= *b { count } else { 0.0 };
        out.push_str(&format!(
            "{name}_bucket{{model_name=\"m\",target_model_name=\"m\",le=\"{b}\"}} {n}\n"
        ));
    }
    out.push_str(&format!(
        "{name}_bucket{{model_name=\"m\",target_model_name=\"m\",le=\"+Inf\"}} {count}\n"
    ));
    out.push_str(&format!(
        "{name}_sum{{model_name=\"m\",target_model_name=\"m\"}} {}\n",
        value * count
    ));
    out.push_str(&format!(
        "{name}_count{{model_name=\"m\",target_model_name=\"m\"}} {count}\n"
    ));
}

impl FakeEpp {
    /// Serves on 127.0.0.1, a free port.
    pub async fn start(load: Option<Load>) -> FakeEpp {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let fake = FakeEpp {
            state: Arc::new(Mutex::new((load, Instant::now(), Counters::default()))),
            port,
        };
        let serving = fake.clone();
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let f = serving.clone();
                async move {
                    match f.page() {
                        Some(p) => (http::StatusCode::OK, p),
                        None => (http::StatusCode::SERVICE_UNAVAILABLE, "down\n".into()),
                    }
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        fake
    }

    /// Changes the load from now on (the counters keep growing from where they are).
    pub fn set(&self, load: Option<Load>) {
        let mut s = self.state.lock().unwrap();
        s.0 = load;
    }

    /// The page: one request's worth of observations per request counted.
    fn page(&self) -> Option<String> {
        let mut s = self.state.lock().unwrap();
        let load = s.0?;
        let now = Instant::now();
        let last = s.2.at.unwrap_or(s.1);
        s.2.requests += load.rps * now.duration_since(last).as_secs_f64();
        s.2.at = Some(now);
        let n = s.2.requests.floor();
        let mut out = String::new();
        out.push_str("# TYPE inference_objective_request_total counter\n");
        out.push_str(&format!(
            "inference_objective_request_total{{model_name=\"m\",target_model_name=\"m\"}} {n}\n"
        ));
        // Every observation carries the current value: the page is consistent as long as the
        // load is constant between two scrapes, which is all a test needs.
        histogram(
            &mut out,
            "inference_objective_input_tokens",
            &TOKEN_BOUNDS,
            load.isl,
            n,
        );
        histogram(
            &mut out,
            "inference_objective_output_tokens",
            &TOKEN_BOUNDS,
            load.osl,
            n,
        );
        histogram(
            &mut out,
            "inference_objective_request_ttft_seconds",
            &TTFT_BOUNDS,
            load.ttft_s,
            n,
        );
        histogram(
            &mut out,
            "inference_objective_request_tpot_seconds",
            &ITL_BOUNDS,
            load.itl_s,
            n,
        );
        out.push_str("# TYPE inference_pool_average_queue_size gauge\ninference_pool_average_queue_size{name=\"pool\"} 0\n");
        Some(out)
    }
}

/// A pool whose EPP Service `pool-epp` selects one EPP pod at 127.0.0.1 whose metrics port is
/// `metrics_port`; model servers are `app: model` on 8000.
pub async fn pool(client: &kube::Client, metrics_port: u16) {
    let pool: api::pool::v1::InferencePool = serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": NS},
        "spec": {"selector": {"matchLabels": {"app": "model"}},
                 "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "pool-epp", "port": {"number": 9002}}}
    }))
    .unwrap();
    Api::<api::pool::v1::InferencePool>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &pool)
        .await
        .unwrap();
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "pool-epp", "namespace": NS},
        "spec": {"selector": {"app": "epp"},
                 "ports": [{"name": "grpc-ext-proc", "port": 9002},
                           {"name": "http-metrics", "port": 9090, "targetPort": metrics_port}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    pods::create(
        client,
        NS,
        &PodInfo {
            name: "pool-epp-0".into(),
            labels: BTreeMap::from([("app".into(), "epp".into())]),
            node: "node-a".into(),
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            ready: true,
        },
    )
    .await
    .unwrap();
}

/// A Deployment of `replicas`, its status saying they all run.
pub async fn deployment(client: &kube::Client, name: &str, replicas: i32) {
    let d: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": replicas,
                 "selector": {"matchLabels": {"app": "model", "workload": name}},
                 "template": {"metadata": {"labels": {"app": "model", "workload": name}},
                              "spec": {"containers": [{"name": "engine", "image": "engine"}]}}}
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    settle(client, name).await;
}

/// Sets a Deployment's status to its spec, as its controller would once the pods run.
pub async fn settle(client: &kube::Client, name: &str) {
    let api = Api::<Deployment>::namespaced(client.clone(), NS);
    let Ok(d) = api.get(name).await else {
        return;
    };
    let want = d.spec.replicas.unwrap_or(1);
    let have = d.status.and_then(|s| s.replicas).unwrap_or(-1);
    if want != have {
        let patch = json!({"status": {"replicas": want, "readyReplicas": want,
                                      "availableReplicas": want, "updatedReplicas": want}});
        let _ = api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await;
    }
}

/// Plays the Deployment controller for `names` until the test ends.
pub fn deployment_controller(client: &kube::Client, names: &[&str]) -> tokio::task::JoinHandle<()> {
    let client = client.clone();
    let names: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
    tokio::spawn(async move {
        loop {
            for n in &names {
                settle(&client, n).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

/// The `/scale` spec replicas of a Deployment.
pub async fn replicas(client: &kube::Client, name: &str) -> i32 {
    Api::<Deployment>::namespaced(client.clone(), NS)
        .get_scale(name)
        .await
        .unwrap()
        .spec
        .and_then(|s| s.replicas)
        .unwrap_or(0)
}

/// Sets a Deployment's replicas through `/scale`, as `kubectl scale` does.
pub async fn scale_by_hand(client: &kube::Client, name: &str, n: i32) {
    let patch = json!({"spec": {"replicas": n}});
    Api::<Deployment>::namespaced(client.clone(), NS)
        .patch_scale(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// Creates a PoolAutoscaler from its spec (JSON), named `name`.
pub async fn autoscaler(client: &kube::Client, name: &str, spec: Value) {
    let pa: PoolAutoscaler = serde_json::from_value(json!({
        "apiVersion": "kvgate.io/v1alpha1", "kind": "PoolAutoscaler",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }))
    .unwrap();
    Api::<PoolAutoscaler>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &pa)
        .await
        .unwrap();
}

/// The autoscaler as stored.
pub async fn get(client: &kube::Client, name: &str) -> PoolAutoscaler {
    Api::<PoolAutoscaler>::namespaced(client.clone(), NS)
        .get_status(name)
        .await
        .unwrap()
}

/// A condition's `(status, reason, message)`.
pub fn condition(pa: &PoolAutoscaler, type_: &str) -> Option<(String, String, String)> {
    pa.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// The Events about the autoscaler `name`: `(type, reason, note, reporting instance)`, one per
/// occurrence (a series counts as its count).
pub async fn events(client: &kube::Client, name: &str) -> Vec<(String, String, String, String)> {
    Api::<Event>::namespaced(client.clone(), NS)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .flat_map(|e| {
            let n = e.series.as_ref().map_or(1, |s| s.count);
            let one = (
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default(),
                e.reporting_instance.unwrap_or_default(),
            );
            std::iter::repeat_n(one, usize::try_from(n).unwrap_or(1))
        })
        .collect()
}

/// Polls `check` every 200 ms until it returns `Some`, or panics after `within` naming `what`.
pub async fn until<T, F, Fut>(within: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(start.elapsed() < within, "no {what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The controller run in-process on the test namespace; stops when dropped.
pub struct Operator {
    pub metrics: Arc<Metrics>,
    stop: watch::Sender<bool>,
}

impl Operator {
    pub fn start(client: &kube::Client, instance: &str) -> Operator {
        let metrics = Arc::new(Metrics::default());
        let events = Events::new(client.clone(), "kvgate-operator", instance);
        let ctx = Arc::new(Context::new(
            client.clone(),
            Http::new(Duration::from_secs(2)),
            events,
            Arc::clone(&metrics),
        ));
        let (stop, mut rx) = watch::channel(false);
        tokio::spawn(controller::run(ctx, Some(NS.into()), async move {
            let _ = rx.wait_for(|s| *s).await;
        }));
        Operator { metrics, stop }
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// A Load-mode spec for one aggregated Deployment `model`.
pub fn load_mode_spec(min: i32, max: i32) -> Value {
    json!({
        "poolRef": {"name": "pool"},
        "roles": {"both": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "model"},
                           "minReplicas": min, "maxReplicas": max}},
        "slo": {"ttftMs": 500, "itlMs": 50, "percentile": 90},
        "planner": {"mode": "Load", "intervalSeconds": 5,
                    "scaleDownStabilizationSeconds": 0, "minReplicaLifetimeSeconds": 0},
        "metrics": {"source": "Epp"}
    })
}

/// Latency well over the SLO (TTFT 1.5 s against 500 ms).
pub const SLOW: Load = Load {
    rps: 20.0,
    isl: 1000.0,
    osl: 200.0,
    ttft_s: 1.5,
    itl_s: 0.02,
};
