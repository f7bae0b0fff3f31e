//! The watchers against kube-rs's mocked client: a small in-memory API server behind
//! `tower_test::mock` answers list and watch requests from a store with resource versions, and
//! tests change objects and wait for the published snapshots.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};

use super::*;

const NS: &str = "llm";
const POOLS_V1: &str = "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools";
const POOLS_V1ALPHA2: &str =
    "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/llm/inferencepools";
const PODS: &str = "/api/v1/namespaces/llm/pods";
const OBJECTIVES_LLM_D: &str = "/apis/llm-d.ai/v1alpha2/namespaces/llm/inferenceobjectives";

/// The fake API server's data: collections by path, and an event log for watches.
#[derive(Default)]
struct World {
    rv: u64,
    served: BTreeSet<&'static str>,
    objects: BTreeMap<&'static str, BTreeMap<String, Value>>,
    log: Vec<(u64, &'static str, &'static str, Value)>,
    /// Label selectors pod lists were asked for, in order.
    pod_selectors: Vec<String>,
}

#[derive(Clone)]
struct Fake {
    world: Arc<Mutex<World>>,
    version: Arc<watch::Sender<u64>>,
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

fn query(req: &Request<Body>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// Whether `obj` passes the request's label and field selectors (equality only).
fn selected(obj: &Value, q: &BTreeMap<String, String>) -> bool {
    let labels_ok = q.get("labelSelector").is_none_or(|sel| {
        sel.split(',').all(|pair| {
            let (k, v) = pair.split_once('=').unwrap();
            obj["metadata"]["labels"][k] == json!(v)
        })
    });
    let fields_ok = q.get("fieldSelector").is_none_or(|sel| {
        let name = sel.strip_prefix("metadata.name=").unwrap();
        obj["metadata"]["name"] == json!(name)
    });
    labels_ok && fields_ok
}

fn json_response(status: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap()
}

impl Fake {
    fn new(served: &[&'static str]) -> Self {
        let world = World {
            served: served.iter().copied().collect(),
            ..World::default()
        };
        Self {
            world: Arc::new(Mutex::new(world)),
            version: Arc::new(watch::channel(0).0),
        }
    }

    fn write(&self, path: &'static str, name: &str, obj: Option<Value>) {
        let mut w = self.world.lock().unwrap();
        w.rv += 1;
        let rv = w.rv;
        let collection = w.objects.entry(path).or_default();
        let event = match obj {
            Some(mut obj) => {
                obj["metadata"]["resourceVersion"] = json!(rv.to_string());
                let kind = if collection.contains_key(name) {
                    "MODIFIED"
                } else {
                    "ADDED"
                };
                collection.insert(name.to_owned(), obj.clone());
                (kind, obj)
            }
            None => {
                let mut obj = collection.remove(name).expect("deleting a missing object");
                obj["metadata"]["resourceVersion"] = json!(rv.to_string());
                ("DELETED", obj)
            }
        };
        w.log.push((rv, path, event.0, event.1));
        drop(w);
        self.version.send_replace(rv);
    }

    fn put(&self, path: &'static str, obj: Value) {
        let name = obj["metadata"]["name"].as_str().unwrap().to_owned();
        self.write(path, &name, Some(obj));
    }

    fn delete(&self, path: &'static str, name: &str) {
        self.write(path, name, None);
    }

    async fn respond(self, req: Request<Body>) -> Response<Body> {
        let path: &str = req.uri().path();
        let q = query(&req);
        let served = self
            .world
            .lock()
            .unwrap()
            .served
            .iter()
            .find(|p| **p == path)
            .copied();
        let Some(path) = served else {
            return json_response(
                StatusCode::NOT_FOUND,
                &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": "the server could not find the requested resource",
                        "reason": "NotFound", "code": 404}),
            );
        };
        if q.get("watch").map(String::as_str) != Some("true") {
            let mut w = self.world.lock().unwrap();
            if path == PODS {
                w.pod_selectors
                    .push(q.get("labelSelector").cloned().unwrap_or_default());
            }
            let items: Vec<Value> = w
                .objects
                .get(path)
                .into_iter()
                .flat_map(|c| c.values())
                .filter(|o| selected(o, &q))
                .cloned()
                .collect();
            let body = json!({"apiVersion": "v1", "kind": "List",
                              "metadata": {"resourceVersion": w.rv.to_string()}, "items": items});
            return json_response(StatusCode::OK, &body);
        }
        let since: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut version = self.version.subscribe();
        loop {
            let lines: Vec<u8> = {
                let w = self.world.lock().unwrap();
                w.log
                    .iter()
                    .filter(|(rv, p, _, o)| *rv > since && *p == path && selected(o, &q))
                    .flat_map(|(_, _, t, o)| {
                        let mut line =
                            serde_json::to_vec(&json!({"type": t, "object": o})).unwrap();
                        line.push(b'\n');
                        line
                    })
                    .collect()
            };
            if !lines.is_empty() {
                return Response::builder()
                    .status(StatusCode::OK)
                    .body(Body::from(lines))
                    .unwrap();
            }
            if version.changed().await.is_err() {
                return json_response(StatusCode::GONE, &json!({}));
            }
        }
    }

    /// Serves the mocked client's requests, each on a task of its own (watches wait).
    fn client(&self) -> Client {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let fake = self.clone();
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let fake = fake.clone();
                tokio::spawn(async move { send.send_response(fake.respond(req).await) });
            }
        });
        Client::new(svc, NS)
    }
}

fn pool_v1(app: &str, ports: &[u16]) -> Value {
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
           "metadata": {"name": "pool", "namespace": NS},
           "spec": {"selector": {"matchLabels": {"app": app}}, "targetPorts": ports,
                    "endpointPickerRef": {"name": "pool-epp", "port": {"number": 9002}}}})
}

fn pod(name: &str, app: &str, ip: &str, ready: bool) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NS, "labels": {"app": app}},
           "spec": {"nodeName": "node-a", "containers": [{"name": "engine"}]},
           "status": {"phase": "Running", "podIP": ip,
                      "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
}

async fn until(
    rx: &mut watch::Receiver<Snapshot>,
    what: &str,
    pred: impl FnMut(&Snapshot) -> bool,
) -> Snapshot {
    let got = tokio::time::timeout(Duration::from_secs(20), rx.wait_for(pred))
        .await
        .map(|r| r.map(|s| s.clone()));
    match got {
        Ok(Ok(s)) => s,
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

fn start(fake: &Fake, group: PoolGroup) -> (watch::Receiver<Snapshot>, Arc<Objectives>) {
    let (tx, rx) = watch::channel(Snapshot::default());
    let objectives = Arc::new(Objectives::new("pool"));
    let config = WatchConfig {
        pool_name: "pool".into(),
        namespace: NS.into(),
        group,
    };
    tokio::spawn(run(fake.client(), config, tx, Arc::clone(&objectives)));
    (rx, objectives)
}

#[tokio::test]
async fn endpoints_follow_the_pool_and_its_pods() {
    let fake = Fake::new(&[POOLS_V1, PODS, OBJECTIVES_LLM_D]);
    fake.put(POOLS_V1, pool_v1("m", &[8000, 8001]));
    fake.put(PODS, pod("a", "m", "10.0.0.1", true));
    fake.put(PODS, pod("b", "m", "10.0.0.2", true));
    fake.put(PODS, pod("c", "other", "10.0.0.3", true));
    let (mut rx, objectives) = start(&fake, PoolGroup::Auto);

    let s = until(&mut rx, "the initial endpoints", |s| s.ready).await;
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

    // Readiness flips are seen, and a new pod appears.
    fake.put(PODS, pod("b", "m", "10.0.0.2", false));
    let s = until(&mut rx, "b not ready", |s| {
        s.endpoints.iter().any(|e| e.key.0 == "b" && !e.ready)
    })
    .await;
    assert!(
        s.endpoints
            .iter()
            .filter(|e| e.key.0 == "b")
            .all(|e| !e.ready)
    );
    fake.put(PODS, pod("d", "m", "10.0.0.4", true));
    until(&mut rx, "d", |s| s.endpoints.iter().any(|e| e.key.0 == "d")).await;

    // Deleted pods disappear.
    fake.delete(PODS, "a");
    let s = until(&mut rx, "a gone", |s| {
        s.endpoints.iter().all(|e| e.key.0 != "a")
    })
    .await;
    assert_eq!(s.endpoints.len(), 4);

    // Objectives of this pool give priorities.
    fake.put(
        OBJECTIVES_LLM_D,
        json!({"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
               "metadata": {"name": "critical", "namespace": NS},
               "spec": {"priority": 3, "poolRef": {"name": "pool"}}}),
    );
    tokio::time::timeout(Duration::from_secs(20), async {
        while objectives.priority("critical") != Some(3) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the objective arrives");

    // A new selector restarts the pod watch on it.
    fake.put(POOLS_V1, pool_v1("other", &[9000]));
    let s = until(&mut rx, "the new selector's pods", |s| {
        keys(s) == vec![("c".into(), 9000, true)]
    })
    .await;
    assert!(s.ready);
    let selectors = fake.world.lock().unwrap().pod_selectors.clone();
    assert_eq!(selectors.first().map(String::as_str), Some("app=m"));
    assert_eq!(selectors.last().map(String::as_str), Some("app=other"));

    // Without the pool there are no endpoints and the EPP is not ready.
    fake.delete(POOLS_V1, "pool");
    let s = until(&mut rx, "the pool gone", |s| !s.ready).await;
    assert!(s.endpoints.is_empty());
}

#[tokio::test]
async fn a_v1alpha2_pool_is_found_when_v1_is_not_installed() {
    let fake = Fake::new(&[POOLS_V1ALPHA2, PODS]);
    fake.put(
        POOLS_V1ALPHA2,
        json!({"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
               "metadata": {"name": "pool", "namespace": NS},
               "spec": {"selector": {"app": "m"}, "targetPortNumber": 8000,
                        "extensionRef": {"name": "pool-epp"}}}),
    );
    fake.put(PODS, pod("a", "m", "10.0.0.1", true));
    let (mut rx, _) = start(&fake, PoolGroup::Auto);
    let s = until(&mut rx, "v1alpha2 endpoints", |s| s.ready).await;
    assert_eq!(keys(&s), vec![("a".into(), 8000, true)]);
}

#[tokio::test]
async fn a_pinned_group_ignores_the_other() {
    let fake = Fake::new(&[POOLS_V1, PODS]);
    fake.put(POOLS_V1, pool_v1("m", &[8000]));
    fake.put(PODS, pod("a", "m", "10.0.0.1", true));
    let (mut rx, _) = start(&fake, PoolGroup::V1Alpha2);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        *rx.borrow_and_update(),
        Snapshot::default(),
        "the v1 pool is not watched"
    );
}
