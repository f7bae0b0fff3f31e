//! The chart drives the real binaries: kvgate is installed by `helm install` into a real
//! Kubernetes API server (kapi, RBAC on), every rendered kvgate container runs here with the
//! rendered command line and environment, the model servers are registered as Pods, and Envoy
//! in front is configured as the Envoy AI Gateway recipe would configure it. Requests are
//! routed end to end with Kubernetes discovery, and the EPP follows pod, pool and API-server
//! changes, never routing to a pod that is gone. How fast each change reaches the EPP is
//! printed (docs/benchmarks.md § "Kubernetes discovery").
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kvgate_e2e::kube::{KubeStack, KubeStackConfig, PodKind};
use kvgate_e2e::stack::probe;
use support::gateway::{Reply, chat, post};

async fn start(config: KubeStackConfig) -> KubeStack {
    match KubeStack::start(config).await {
        Ok(stack) => stack,
        Err(e) => panic!("the Kubernetes stack did not start: {e}"),
    }
}

fn send(stack: &KubeStack, system: &str, user: &str) -> Reply {
    post(
        stack.gateway_addr().port(),
        "/v1/chat/completions",
        &[],
        &chat(system, user, 4, false),
    )
}

fn metric(stack: &KubeStack, name: &str) -> f64 {
    let page = stack.epp_metrics(0).unwrap();
    probe::metric_sum(&page, name).unwrap_or_else(|| panic!("EPP has no {name}"))
}

/// Polls the EPP's metrics every 5 ms until `cond` holds; returns how long it took.
fn until_metric(stack: &KubeStack, what: &str, cond: impl FnMut(&str) -> bool) -> Duration {
    until_metric_since(stack, what, Instant::now(), cond)
}

/// As [`until_metric`], timed from `start` (before the API write that should show).
fn until_metric_since(
    stack: &KubeStack,
    what: &str,
    start: Instant,
    mut cond: impl FnMut(&str) -> bool,
) -> Duration {
    loop {
        if let Ok(page) = stack.epp_metrics(0)
            && cond(&page)
        {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}; EPP log {}",
            stack
                .log(kvgate_e2e::stack::Component::EppReplica(0))
                .display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn ready_pods(page: &str) -> f64 {
    probe::metric_sum(page, "inference_pool_ready_pods").unwrap_or(-1.0)
}

fn model_servers(stack: &KubeStack) -> Vec<(String, String)> {
    stack
        .pods()
        .into_iter()
        .filter(|(_, k, _)| matches!(k, PodKind::ModelServer(_)))
        .map(|(n, _, ip)| (n, format!("{ip}:8000")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_routes_a_request_end_to_end_and_follows_every_change() {
    let mut stack = start(KubeStackConfig {
        engines: 2,
        ..KubeStackConfig::default()
    })
    .await;
    let endpoints: BTreeSet<String> = stack.endpoints().into_iter().collect();
    assert_eq!(endpoints.len(), 2);

    // A chat completion through the gateway, the EPP and a sidecar to a simulated engine.
    let r = send(&stack, "hello", "world");
    assert!(r.ok(), "{r:?}");
    assert!(
        endpoints.contains(r.upstream()),
        "{r:?} not in {endpoints:?}"
    );
    assert!(metric(&stack, "kvgate_epp_requests_routed_total") >= 1.0);

    // KV events flow engine → sidecar → NATS → EPP, and a shared prefix sticks to its pod.
    let system = "You are the assistant of the Kubernetes test; answer briefly. ".repeat(20);
    let first = send(&stack, &system, "first question");
    assert!(first.ok(), "{first:?}");
    until_metric(&stack, "KV events applied", |p| {
        probe::metric_sum(p, "kvgate_epp_nats_envelopes_applied_total").is_some_and(|v| v > 0.0)
    });
    let second = send(&stack, &system, "second question");
    assert!(second.ok(), "{second:?}");
    assert_eq!(second.upstream(), first.upstream(), "the prefix's pod");
    assert!(second.cached_tokens() > 0, "{second:?}");

    let mut timings: Vec<(&str, Duration)> = Vec::new();
    let servers = model_servers(&stack);
    let (a, a_addr) = servers[0].clone();

    // NotReady: the EPP stops picking it. Times run from before the API write.
    let t0 = Instant::now();
    stack.set_ready(&a, false).await.unwrap();
    timings.push((
        "pod NotReady",
        until_metric_since(&stack, "a not ready", t0, |p| ready_pods(p) == 1.0),
    ));
    for i in 0..6 {
        let r = send(&stack, &format!("nr {i}"), "x");
        assert!(r.ok() && r.upstream() != a_addr, "{r:?}");
    }
    let t0 = Instant::now();
    stack.set_ready(&a, true).await.unwrap();
    timings.push((
        "pod Ready again",
        until_metric_since(&stack, "a ready", t0, |p| ready_pods(p) == 2.0),
    ));

    // A new pod joins (timed from its Ready condition's write, the end of add_model_server).
    let added = stack.add_model_server().await.unwrap();
    timings.push((
        "pod added (Ready)",
        until_metric(&stack, "three pods", |p| ready_pods(p) == 3.0),
    ));
    assert_eq!(stack.endpoints().len(), 3, "{added}");

    // A pod is deleted: never routed to again.
    let t0 = Instant::now();
    stack.delete_pod(&a).await.unwrap();
    timings.push((
        "pod deleted",
        until_metric_since(&stack, "a gone", t0, |p| ready_pods(p) == 2.0),
    ));
    for i in 0..8 {
        let r = send(&stack, &format!("gone {i}"), "x");
        assert!(r.ok(), "{r:?}");
        assert_ne!(r.upstream(), a_addr, "routed to the deleted pod");
    }

    // The API server goes away and returns: the EPP keeps routing meanwhile, then follows.
    stack.kapi_mut().stop_apiserver();
    until_metric(&stack, "staleness", |p| {
        probe::metric_sum(p, "kvgate_epp_kube_stale_seconds").is_some_and(|s| s > 0.0)
    });
    let r = send(&stack, "during the outage", "x");
    assert!(r.ok(), "routing continues on the last view: {r:?}");
    std::thread::sleep(Duration::from_secs(3));
    stack.kapi_mut().start_apiserver().await.unwrap();
    timings.push((
        "API server back (watches current)",
        until_metric(&stack, "fresh again", |p| {
            probe::metric_sum(p, "kvgate_epp_kube_stale_seconds") == Some(0.0)
        }),
    ));
    // One warning for the outage, no ERROR lines (kube-rs's per-retry errors are silenced).
    let log =
        std::fs::read_to_string(stack.log(kvgate_e2e::stack::Component::EppReplica(0))).unwrap();
    assert_eq!(
        log.matches("Kubernetes watch failed").count(),
        1,
        "one warning per outage:\n{log}"
    );
    assert!(
        !log.contains(" ERROR "),
        "ERROR lines in the EPP log:\n{log}"
    );
    assert!(log.contains("Kubernetes watches recovered"), "{log}");
    let (b, _) = model_servers(&stack)[0].clone();
    let t0 = Instant::now();
    stack.set_ready(&b, false).await.unwrap();
    timings.push((
        "pod NotReady after the outage",
        until_metric_since(&stack, "b not ready", t0, |p| ready_pods(p) == 1.0),
    ));
    stack.set_ready(&b, true).await.unwrap();
    until_metric(&stack, "b ready", |p| ready_pods(p) == 2.0);

    // The pool's selector changes (helm upgrade): nothing matches, then everything again.
    let t0 = Instant::now();
    stack
        .upgrade(&["inferencePool: {selector: {app: nothing-here}}".into()])
        .unwrap();
    timings.push((
        "pool selector changed (timed from before helm upgrade)",
        until_metric_since(&stack, "no pods selected", t0, |p| ready_pods(p) == 0.0),
    ));
    stack
        .upgrade(&["inferencePool: {selector: {app: kvgate-sim}}".into()])
        .unwrap();
    until_metric(&stack, "pods selected again", |p| ready_pods(p) == 2.0);

    // The pool is deleted: no endpoints, requests refused.
    let pools: kube::Api<api::pool::v1::InferencePool> =
        kube::Api::namespaced(stack.client().clone(), &stack.config().namespace);
    let t0 = Instant::now();
    pools
        .delete(&stack.config().release, &Default::default())
        .await
        .unwrap();
    timings.push((
        "pool deleted",
        until_metric_since(&stack, "no endpoints", t0, |p| ready_pods(p) == 0.0),
    ));
    let r = send(&stack, "no pool", "x");
    assert!(!r.ok(), "a request without a pool was routed: {r:?}");

    rbac_is_least_privilege(&stack).await;
    for (what, t) in &timings {
        eprintln!(
            "kube discovery: {what}: reflected in the EPP's metrics after {} ms",
            t.as_millis()
        );
    }
    let dir = stack.run_dir().to_path_buf();
    stack.stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// The EPP ran under its ServiceAccount's token with the chart's Role (kapi in RBAC mode); that
/// identity is refused everything the Role does not grant.
async fn rbac_is_least_privilege(stack: &KubeStack) {
    use k8s_openapi::api::core::v1::{Pod, Secret};
    let sa = stack
        .manifest()
        .of_kind("ServiceAccount")
        .find_map(|s| s["metadata"]["name"].as_str())
        .unwrap()
        .to_owned();
    let path = stack.kubeconfig_of(&sa).unwrap();
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let epp = kube::Client::try_from(config).unwrap();
    let ns = stack.config().namespace.clone();
    let pods: kube::Api<Pod> = kube::Api::namespaced(epp.clone(), &ns);
    assert!(
        pods.list(&Default::default()).await.is_ok(),
        "list pods is granted"
    );
    let code = |r: Result<(), kube::Error>| match r {
        Err(kube::Error::Api(s)) => s.code,
        Err(e) => panic!("{e}"),
        Ok(()) => 200,
    };
    let some_pod = model_servers(stack)[0].0.clone();
    assert_eq!(code(pods.get(&some_pod).await.map(drop)), 403, "get pod");
    assert_eq!(
        code(pods.delete(&some_pod, &Default::default()).await.map(drop)),
        403,
        "delete pod"
    );
    let secrets: kube::Api<Secret> = kube::Api::namespaced(epp.clone(), &ns);
    assert_eq!(
        code(secrets.list(&Default::default()).await.map(drop)),
        403,
        "list secrets"
    );
    let elsewhere: kube::Api<Pod> = kube::Api::namespaced(epp.clone(), "default");
    assert_eq!(
        code(elsewhere.list(&Default::default()).await.map(drop)),
        403,
        "pods of another namespace"
    );
    let pools: kube::Api<api::pool::v1::InferencePool> = kube::Api::namespaced(epp, &ns);
    assert_eq!(
        code(
            pools
                .patch_status(
                    &stack.config().release,
                    &Default::default(),
                    &kube::api::Patch::Merge(serde_json::json!({"status": {}})),
                )
                .await
                .map(drop)
        ),
        403,
        "write pool status"
    );
}

/// The block manager's DaemonSet pod and two EPP replicas, all from their rendered command
/// lines: the block manager serves and publishes its node's tiers, and both EPPs route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_block_manager_and_two_epp_replicas_run_from_the_chart() {
    let stack = start(KubeStackConfig {
        engines: 1,
        epp_replicas: 2,
        kvbm: true,
        ..KubeStackConfig::default()
    })
    .await;
    let kinds: Vec<PodKind> = stack.pods().into_iter().map(|(_, k, _)| k).collect();
    assert!(kinds.contains(&PodKind::Kvbm), "{kinds:?}");
    assert!(kinds.contains(&PodKind::Epp(1)), "{kinds:?}");
    let (_, _, kvbm_ip) = stack
        .pods()
        .into_iter()
        .find(|(_, k, _)| *k == PodKind::Kvbm)
        .unwrap();
    let page = probe::http_request_at(
        std::net::SocketAddr::from((kvbm_ip, 9092)),
        "GET",
        "/metrics",
        Duration::from_secs(2),
    )
    .unwrap()
    .1;
    assert_eq!(
        probe::metric_sum(&page, "kvgate_kvbm_nats_connected"),
        Some(1.0)
    );
    assert_eq!(
        probe::metric_sum(&page, "kvgate_kvbm_tier_capacity_bytes"),
        Some(f64::from(1u32 << 30)),
        "the chart's hostMemoryGiB: 1"
    );
    for i in 0..6 {
        let r = send(&stack, &format!("replicas {i}"), "x");
        assert!(r.ok(), "{r:?}");
    }
    let routed: f64 = (0..2)
        .map(|n| {
            probe::metric_sum(
                &stack.epp_metrics(n).unwrap(),
                "kvgate_epp_requests_routed_total",
            )
            .unwrap()
        })
        .sum();
    assert_eq!(
        routed, 6.0,
        "the two replicas routed every request between them"
    );
    let dir = stack.run_dir().to_path_buf();
    stack.stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// The chart's response-observer layout (`epp.responseObserver.enabled`) behind the gateway
/// the way manifests/gateways/envoy-gateway/observer.yaml configures it: two EPP replicas
/// report every response where it was routed (relaying over NATS when the other replica
/// observed it), and streams in flight run to their end when every EPP pod crashes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_response_observer_streams_survive_their_epps_crash() {
    let mut stack = start(KubeStackConfig {
        engines: 1,
        epp_replicas: 2,
        // Real time: a 300-token answer streams for seconds.
        engine_args: vec!["--time-scale=1".into()],
        values: vec!["epp: {responseObserver: {enabled: true}}".into()],
        ..KubeStackConfig::default()
    })
    .await;
    const REQUESTS: usize = 12;
    for i in 0..REQUESTS {
        let r = send(&stack, &format!("observed {i}"), "x");
        assert!(r.ok(), "{r:?}");
    }
    let outcome = support::handoff_outcome;
    let deadline = Instant::now() + Duration::from_secs(10);
    let pages = loop {
        let pages: Vec<String> = (0..2).map(|n| stack.epp_metrics(n).unwrap()).collect();
        let reported = outcome(&pages, "claimed") + outcome(&pages, "relayed_in");
        if reported >= REQUESTS as f64 || Instant::now() > deadline {
            break pages;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "observed where routed: {}; relayed: {}",
        outcome(&pages, "claimed"),
        outcome(&pages, "relayed_in")
    );
    assert_eq!(
        outcome(&pages, "claimed") + outcome(&pages, "relayed_in"),
        REQUESTS as f64,
        "{}",
        pages.join("\n")
    );
    assert_eq!(outcome(&pages, "expired"), 0.0);

    const TOKENS: u32 = 300;
    let port = stack.gateway_addr().port();
    let streams: Vec<_> = (0..3)
        .map(|i| {
            let body = chat(&format!("in flight {i}"), "x", TOKENS, true);
            std::thread::spawn(move || {
                let r = post(port, "/v1/chat/completions", &[], &body);
                (r, Instant::now())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let epps: Vec<String> = stack
        .pods()
        .into_iter()
        .filter(|(_, kind, _)| matches!(kind, PodKind::Epp(_)))
        .map(|(name, _, _)| name)
        .collect();
    assert_eq!(epps.len(), 2);
    for name in &epps {
        stack.kill_pod(name).unwrap();
    }
    let killed = Instant::now();
    for (i, s) in streams.into_iter().enumerate() {
        let (r, ended) = s.join().unwrap();
        assert!(
            ended > killed,
            "stream {i} ended before the EPPs died: {r:?}"
        );
        assert!(r.ok(), "stream {i}: {r:?}");
        assert!(r.body.contains("[DONE]"), "stream {i} was cut: {r:?}");
        let chunks = r.body.matches("\"content\"").count() as u32;
        assert!(chunks >= TOKENS, "stream {i}: {chunks} chunks");
    }
    let dir = stack.run_dir().to_path_buf();
    stack.stop();
    let _ = std::fs::remove_dir_all(dir);
}
