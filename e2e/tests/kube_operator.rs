//! The operator in the chart's cluster: kvgate installed by `helm install` into kapi (RBAC on,
//! so the operator runs with the chart's least-privilege Role and its ServiceAccount's token),
//! the rendered operator, EPP, sidecars and simulated engines running here (see
//! `kvgate_e2e::kube`), Envoy in front.
//!
//! - Prefill/decode works in a cluster: the operator writes the decode sidecars' prefill
//!   allow-list from the pool's ready prefill pods, the ConfigMap volume carries it to the
//!   sidecar, a long prompt through the gateway takes the P/D path, and the list follows a
//!   scale-up and a deleted pod; a prefiller not on the list is refused.
//! - Live autoscaling: the EPP's real metrics under load through the gateway feed the
//!   operator, which scales the model-server Deployment through `/scale`; the stack plays the
//!   Deployment controller, and the EPP routes to the new pod. Of two operator replicas, one
//!   leads and acts.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use api::autoscaler::PoolAutoscaler;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kvgate_e2e::kube::{KubeStack, KubeStackConfig, PodKind};
use kvgate_e2e::stack::probe;
use serde_json::json;
use support::gateway::{Reply, chat, post};

async fn start(config: KubeStackConfig) -> KubeStack {
    match KubeStack::start(config).await {
        Ok(stack) => stack,
        Err(e) => panic!("the Kubernetes stack did not start: {e}"),
    }
}

/// Polls `check` every 100 ms until it returns `Some`; panics naming `what` after `within`.
async fn until<T, F, Fut>(within: Duration, what: &str, mut check: F) -> T
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
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The sum of the samples of `name` whose labels contain every one of `labels`
/// (`mode="pd"`, …); `None` when there is none.
fn labelled(page: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = None;
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        let Some((key, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (metric, rest) = key.split_once('{').unwrap_or((key, ""));
        if metric == name
            && labels.iter().all(|l| rest.contains(l))
            && let Ok(v) = value.parse::<f64>()
        {
            found = Some(found.unwrap_or(0.0) + v);
        }
    }
    found
}

/// A metric of a pod's page (`kvgate-metrics` for a sidecar, `http-engine` for an engine).
fn pod_metric(stack: &KubeStack, pod: &str, port: &str, name: &str, labels: &[&str]) -> f64 {
    let page = stack
        .pod_page(pod, port, "/metrics")
        .unwrap_or_else(|e| panic!("{pod} /metrics on {port}: {e}"));
    labelled(&page, name, labels).unwrap_or(0.0)
}

/// POSTs `body` to `addr` (a pod's port) with extra headers; `(status, body)`.
fn post_to(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: {}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        addr.ip(),
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// A completion over a prompt of `blocks` KV blocks (16 tokens of 4 bytes each) no pod has
/// seen, of 4 tokens.
fn completion(tag: &str, blocks: usize) -> serde_json::Value {
    let unit = format!("{tag:>8}").replace(' ', "#");
    json!({
        "model": "m",
        "prompt": unit.repeat(blocks * 8),
        "max_tokens": 4,
        "ignore_eos": true,
    })
}

fn completion_tokens(body: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    v["usage"]["completion_tokens"].as_u64().unwrap_or(0)
}

/// How the allow-list names a pod's address.
fn listed(ip: std::net::Ipv4Addr) -> String {
    format!("address: {ip},")
}

/// The prefill allow-list ConfigMap's `prefillers.yaml`, if it exists.
async fn allow_list(stack: &KubeStack, name: &str) -> Option<String> {
    Api::<ConfigMap>::namespaced(stack.client().clone(), &stack.config().namespace)
        .get_opt(name)
        .await
        .unwrap()
        .and_then(|c| c.data)
        .and_then(|d| d.get("prefillers.yaml").cloned())
}

/// A Deployment's replicas through `/scale`: `(spec, status)`.
async fn scale_of(stack: &KubeStack, deployment: &str) -> (i32, i32) {
    let s = Api::<Deployment>::namespaced(stack.client().clone(), &stack.config().namespace)
        .get_scale(deployment)
        .await
        .unwrap();
    (
        s.spec.and_then(|s| s.replicas).unwrap_or(0),
        s.status.map_or(0, |s| s.replicas),
    )
}

/// Sets a Deployment's replicas through `/scale`, as `kubectl scale` does.
async fn scale_to(stack: &KubeStack, deployment: &str, n: i32) {
    Api::<Deployment>::namespaced(stack.client().clone(), &stack.config().namespace)
        .patch_scale(
            deployment,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": n}})),
        )
        .await
        .unwrap();
}

async fn autoscaler(stack: &KubeStack) -> PoolAutoscaler {
    Api::<PoolAutoscaler>::namespaced(stack.client().clone(), &stack.config().namespace)
        .get_status(&stack.config().release)
        .await
        .unwrap()
}

/// The Events about the autoscaler: `(type, reason, note, reporting instance)`.
async fn events(stack: &KubeStack) -> Vec<(String, String, String, String)> {
    Api::<Event>::namespaced(stack.client().clone(), &stack.config().namespace)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("PoolAutoscaler"))
        .map(|e| {
            (
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default(),
                e.reporting_instance.unwrap_or_default(),
            )
        })
        .collect()
}

/// The operator ran under the chart's Role without being refused anything.
fn assert_never_forbidden(stack: &KubeStack, replicas: usize) {
    for n in 0..replicas {
        let log = std::fs::read_to_string(stack.operator_log(n)).unwrap();
        assert!(
            !log.contains("forbidden") && !log.contains(" 403"),
            "operator {n} was refused by the API server (RBAC):\n{log}"
        );
    }
}

/// Two simulated model servers, one prefill and one decode; the EPP disaggregates prompts of
/// at least 2 uncached blocks; one operator keeps the allow-list, with an SLO the simulators
/// meet by far, so it never scales here.
const PD_VALUES: &str = "\
modelServers:
  - {name: prefill, role: prefill, engine: sim, replicas: 1, args: [\"--time-scale=10\"]}
  - {name: decode, role: decode, engine: sim, replicas: 1, args: [\"--time-scale=10\"]}
epp:
  scheduler:
    disaggregation: {enabled: true, min_uncached_blocks: 2}
operator: {enabled: true, replicas: 1}
autoscaling:
  enabled: true
  slo: {ttftMs: 600000, itlMs: 60000}
  planner: {mode: Load, intervalSeconds: 5}
  roles:
    prefill: {modelServer: prefill, minReplicas: 1, maxReplicas: 3}
    decode: {modelServer: decode, minReplicas: 1, maxReplicas: 3}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_decode_runs_on_the_allow_list_the_operator_keeps() {
    let t0 = Instant::now();
    let mut stack = start(KubeStackConfig {
        values: vec![PD_VALUES.into()],
        ..KubeStackConfig::default()
    })
    .await;
    let started = t0.elapsed();
    let release = stack.config().release.clone();
    let prefill = stack.model_server_deployment("prefill").unwrap();
    let decode = stack.model_server_deployment("decode").unwrap();
    let (decode_pod, decode_ip) = stack.pods_of(&decode)[0].clone();
    let (p0, p0_ip) = stack.pods_of(&prefill)[0].clone();
    let pa = stack.manifest().of_kind("PoolAutoscaler").next().unwrap();
    let list_name = pa["spec"]["prefillerAllowList"]["configMapName"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(list_name, format!("{release}-prefillers"));
    assert!(
        stack.manifest().get("ConfigMap", &list_name).is_none(),
        "with autoscaling the chart leaves the allow-list to the operator"
    );
    let decode_proxy = stack.pod_addr(&decode_pod, "http-proxy").unwrap();
    let proxy_port = decode_proxy.port();
    let sidecar = |stack: &KubeStack, name: &str, labels: &[&str]| {
        pod_metric(stack, &decode_pod, "kvgate-metrics", name, labels)
    };
    // The decode pod started before the operator: its optional volume was empty, and its
    // sidecar could not read a list (every P/D request was refused meanwhile).
    assert!(
        sidecar(&stack, "kvgate_sidecar_proxy_allow_list_errors_total", &[]) >= 1.0,
        "the allow-list was absent when the decode pod started"
    );

    // The operator writes the list: the prefill pod on the pool's target port.
    let t = Instant::now();
    let text = until(Duration::from_secs(60), "the allow-list ConfigMap", || {
        let stack = &stack;
        let list_name = &list_name;
        async move {
            let text = allow_list(stack, list_name).await?;
            text.contains(&listed(p0_ip)).then_some(text)
        }
    })
    .await;
    assert!(
        text.contains(&format!(
            "{{name: {p0}, address: {p0_ip}, ports: [{proxy_port}]}}"
        )),
        "{text}"
    );
    assert!(!text.contains(&listed(decode_ip)), "{text}");
    // The ConfigMap volume carries it to the decode sidecar, which loads it.
    until(Duration::from_secs(60), "the sidecar's list", || {
        let n = sidecar(&stack, "kvgate_sidecar_proxy_allow_list_addresses", &[]);
        std::future::ready((n == 1.0).then_some(()))
    })
    .await;
    let listed_after = t.elapsed();

    // A long prompt through the gateway takes the P/D path and succeeds.
    let pd = |stack: &KubeStack| {
        sidecar(
            stack,
            "kvgate_sidecar_proxy_requests_total",
            &["mode=\"pd\""],
        )
    };
    let prefilled = |stack: &KubeStack, pod: &str| {
        pod_metric(stack, pod, "http-engine", "vllm:prompt_tokens_total", &[])
    };
    let (pd_before, prefilled_before) = (pd(&stack), prefilled(&stack, &p0));
    let port = stack.gateway_addr().port();
    let r: Reply =
        tokio::task::block_in_place(|| post(port, "/v1/completions", &[], &completion("pd-1", 8)));
    assert!(r.ok(), "{r:?}");
    assert_eq!(completion_tokens(&r.body), 4, "{r:?}");
    until(
        Duration::from_secs(30),
        "the P/D flow in the decode sidecar",
        || std::future::ready((pd(&stack) == pd_before + 1.0).then_some(())),
    )
    .await;
    assert!(
        prefilled(&stack, &p0) > prefilled_before,
        "the prefill engine computed the prompt"
    );
    assert!(
        r.cached_tokens() > 0,
        "the decode engine got the prompt's KV from the prefill: {r:?}"
    );

    // A prefiller not on the list is refused (403) without being contacted.
    let body = completion("refused", 4).to_string();
    let not_listed = SocketAddr::from((decode_ip, proxy_port)).to_string();
    let (status, answer) = tokio::task::block_in_place(|| {
        post_to(
            decode_proxy,
            "/v1/completions",
            &[("x-prefiller-host-port", &not_listed)],
            &body,
        )
    });
    assert_eq!(status, 403, "{answer}");

    // A second prefill pod (scaled through /scale, the stack following): listed, and usable.
    scale_to(&stack, &prefill, 2).await;
    let t = Instant::now();
    let followed = stack.follow_replicas().await.unwrap();
    assert_eq!(followed.started.len(), 1, "{followed:?}");
    assert!(followed.deleted.is_empty(), "{followed:?}");
    let (p1, p1_ip) = stack.pods_of(&prefill)[1].clone();
    assert_eq!(followed.started[0], p1);
    assert_eq!(
        scale_of(&stack, &prefill).await,
        (2, 2),
        "status follows the pods"
    );
    until(
        Duration::from_secs(60),
        "the second prefill pod listed",
        || {
            let stack = &stack;
            let list_name = &list_name;
            async move {
                let text = allow_list(stack, list_name).await?;
                (text.contains(&listed(p1_ip)) && text.contains(&listed(p0_ip))).then_some(())
            }
        },
    )
    .await;
    until(
        Duration::from_secs(60),
        "two addresses in the sidecar",
        || {
            let n = sidecar(&stack, "kvgate_sidecar_proxy_allow_list_addresses", &[]);
            std::future::ready((n == 2.0).then_some(()))
        },
    )
    .await;
    let scaled_after = t.elapsed();
    let to_p1 = SocketAddr::from((p1_ip, proxy_port)).to_string();
    let p1_before = prefilled(&stack, &p1);
    let (status, answer) = tokio::task::block_in_place(|| {
        post_to(
            decode_proxy,
            "/v1/completions",
            &[("x-prefiller-host-port", &to_p1)],
            &body,
        )
    });
    assert_eq!(status, 200, "{answer}");
    assert_eq!(completion_tokens(&answer), 4, "{answer}");
    assert!(
        prefilled(&stack, &p1) > p1_before,
        "the new prefill pod prefilled"
    );

    // A prefill pod deleted: it leaves the list, and the sidecar refuses it.
    let t = Instant::now();
    stack.delete_pod(&p0).await.unwrap();
    assert_eq!(
        scale_of(&stack, &prefill).await,
        (2, 1),
        "status follows the pods"
    );
    until(Duration::from_secs(60), "the deleted pod unlisted", || {
        let stack = &stack;
        let list_name = &list_name;
        async move {
            let text = allow_list(stack, list_name).await?;
            (!text.contains(&listed(p0_ip)) && text.contains(&listed(p1_ip))).then_some(())
        }
    })
    .await;
    until(
        Duration::from_secs(60),
        "one address in the sidecar",
        || {
            let n = sidecar(&stack, "kvgate_sidecar_proxy_allow_list_addresses", &[]);
            std::future::ready((n == 1.0).then_some(()))
        },
    )
    .await;
    let deleted_after = t.elapsed();
    let to_p0 = SocketAddr::from((p0_ip, proxy_port)).to_string();
    let (status, answer) = tokio::task::block_in_place(|| {
        post_to(
            decode_proxy,
            "/v1/completions",
            &[("x-prefiller-host-port", &to_p0)],
            &body,
        )
    });
    assert_eq!(status, 403, "{answer}");

    // The gateway's P/D still works, on the remaining prefill pod (once the EPP has seen the
    // deletion: the decode and the remaining prefill pod).
    until(Duration::from_secs(60), "two ready pods in the EPP", || {
        let n = stack
            .epp_metrics(0)
            .ok()
            .and_then(|p| probe::metric_sum(&p, "inference_pool_ready_pods"));
        std::future::ready((n == Some(2.0)).then_some(()))
    })
    .await;
    let pd_before = pd(&stack);
    let r =
        tokio::task::block_in_place(|| post(port, "/v1/completions", &[], &completion("pd-2", 8)));
    assert!(r.ok(), "{r:?}");
    until(Duration::from_secs(30), "the second P/D flow", || {
        std::future::ready((pd(&stack) == pd_before + 1.0).then_some(()))
    })
    .await;

    // The operator planned all along without scaling anything itself (the SLO holds), and
    // without being refused anything by its Role.
    let pa = autoscaler(&stack).await;
    let ready = pa
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .map(|c| (c.status.clone(), c.message.clone()));
    assert_eq!(
        ready.as_ref().map(|r| r.0.as_str()),
        Some("True"),
        "{ready:?}"
    );
    assert_eq!(scale_of(&stack, &decode).await.0, 1);
    assert!(
        !events(&stack).await.iter().any(|e| e.1 == "Scaled"),
        "the operator scaled within the SLO"
    );
    assert_never_forbidden(&stack, 1);
    eprintln!(
        "kube operator P/D: stack up in {} ms; allow-list in the sidecar {} ms after; \
         a new prefill pod listed {} ms after its scale; a deleted one unlisted after {} ms",
        started.as_millis(),
        listed_after.as_millis(),
        scaled_after.as_millis(),
        deleted_after.as_millis()
    );
    let dir = stack.run_dir().to_path_buf();
    stack.stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// One simulated model server in an aggregated pool; an SLO of 1 ms TTFT that any request
/// through the gateway misses; at most 2 replicas; two operator replicas.
const LIVE_VALUES: &str = "\
operator: {enabled: true, replicas: 2}
autoscaling:
  enabled: true
  slo: {ttftMs: 1, itlMs: 60000}
  planner: {mode: Load, intervalSeconds: 5}
  roles:
    both: {modelServer: sim, minReplicas: 1, maxReplicas: 2}
";

/// Chat requests through the gateway from `threads` threads until `stop`, counted in [`OK`] and
/// [`FAILED`].
fn load(port: u16, threads: usize, stop: &Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    (0..threads)
        .map(|t| {
            let stop = Arc::clone(stop);
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let r = post(
                        port,
                        "/v1/chat/completions",
                        &[],
                        &chat(&format!("load {t} {i}"), &"words ".repeat(60), 16, false),
                    );
                    let counter = if r.ok() { &OK } else { &FAILED };
                    counter.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect()
}

static OK: AtomicU64 = AtomicU64::new(0);
static FAILED: AtomicU64 = AtomicU64::new(0);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_scales_the_pool_on_its_live_metrics() {
    let t0 = Instant::now();
    let mut stack = start(KubeStackConfig {
        engines: 1,
        values: vec![LIVE_VALUES.into()],
        ..KubeStackConfig::default()
    })
    .await;
    let started = t0.elapsed();
    let sim = stack.model_server_deployment("sim").unwrap();
    assert_eq!(scale_of(&stack, &sim).await, (1, 1));

    // Load through the gateway; the stack follows the Deployment's replicas meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let loaders = load(stack.gateway_addr().port(), 3, &stop);
    let t = Instant::now();
    let mut new_pod = None;
    while new_pod.is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(180),
            "no scale-up within 180 s of load ({} ok, {} failed); operator logs {} and {}",
            OK.load(Ordering::Relaxed),
            FAILED.load(Ordering::Relaxed),
            stack.operator_log(0).display(),
            stack.operator_log(1).display(),
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        let followed = stack.follow_replicas().await.unwrap();
        assert!(followed.deleted.is_empty(), "{followed:?}");
        new_pod = followed.started.first().cloned();
    }
    let new_pod = new_pod.unwrap();
    let scaled_after = t.elapsed();
    assert_eq!(scale_of(&stack, &sim).await, (2, 2));
    // The EPP counts the new pod, and routes to it.
    until(Duration::from_secs(60), "two ready pods in the EPP", || {
        let n = stack
            .epp_metrics(0)
            .ok()
            .and_then(|p| probe::metric_sum(&p, "inference_pool_ready_pods"));
        std::future::ready((n == Some(2.0)).then_some(()))
    })
    .await;
    until(
        Duration::from_secs(60),
        "requests served by the new pod",
        || {
            let n = pod_metric(
                &stack,
                &new_pod,
                "http-engine",
                "vllm:request_success_total",
                &[],
            );
            std::future::ready((n > 0.0).then_some(()))
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    tokio::task::block_in_place(|| {
        for l in loaders {
            l.join().unwrap();
        }
    });
    let (ok, failed) = (OK.load(Ordering::Relaxed), FAILED.load(Ordering::Relaxed));
    assert!(ok > 0 && failed == 0, "{ok} ok, {failed} failed");

    // Status and Events say what happened; one replica leads and acted.
    let pa = until(
        Duration::from_secs(60),
        "observed load in the status",
        || {
            let stack = &stack;
            async move {
                let pa = autoscaler(stack).await;
                let st = pa.status.as_ref()?;
                (st.observed.as_ref()?.rps > 0.0 && st.roles.both.as_ref()?.current_replicas == 2)
                    .then_some(pa)
            }
        },
    )
    .await;
    let st = pa.status.unwrap();
    let observed = st.observed.unwrap();
    assert!(observed.ttft_ms.is_some_and(|t| t > 1.0), "{observed:?}");
    assert!(st.roles.both.unwrap().last_scale_time.is_some());
    let leaders: Vec<usize> = (0..2)
        .filter(|n| {
            let page = stack.operator_metrics(*n).unwrap();
            probe::metric_sum(&page, "kvgate_operator_leader") == Some(1.0)
        })
        .collect();
    assert_eq!(leaders.len(), 1, "one leader: {leaders:?}");
    let leader_pod = stack
        .pods()
        .into_iter()
        .find(|(_, k, _)| *k == PodKind::Operator(leaders[0]))
        .unwrap()
        .0;
    let scaled: Vec<_> = events(&stack)
        .await
        .into_iter()
        .filter(|e| e.1 == "Scaled")
        .collect();
    assert!(
        scaled
            .iter()
            .any(|e| e.0 == "Normal" && e.2.contains(&format!("Deployment {sim}: 1 → 2"))),
        "{scaled:?}"
    );
    assert!(
        scaled.iter().all(|e| e.3 == leader_pod),
        "only the leader {leader_pod} acts: {scaled:?}"
    );
    let other = 1 - leaders[0];
    let page = stack.operator_metrics(other).unwrap();
    assert_eq!(
        probe::metric_sum(&page, "kvgate_operator_scale_operations_total").unwrap_or(0.0),
        0.0,
        "the replica that does not lead scaled:\n{page}"
    );
    assert_never_forbidden(&stack, 2);
    eprintln!(
        "kube operator live: stack up in {} ms; scaled and the new pod Ready {} ms after the \
         load started ({ok} requests)",
        started.as_millis(),
        scaled_after.as_millis(),
    );
    let dir = stack.run_dir().to_path_buf();
    stack.stop();
    let _ = std::fs::remove_dir_all(dir);
}
