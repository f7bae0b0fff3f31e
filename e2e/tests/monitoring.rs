//! The chart's monitoring (charts/kvgate/templates/monitoring, files/dashboards) against the
//! real tools:
//!
//! 1. the PrometheusRule, rendered with `helm template` from monitoring/tests/values.yaml, passes
//!    `promtool check rules` and the unit tests of monitoring/tests/alerts.test.yaml, which must
//!    make every alert fire once and stay silent once; every alert links its runbook section;
//! 2. the dashboards are well formed (data source, namespace and pool variables on every query);
//! 3. a real `prometheus` scrapes the local stack (EPP, sidecars, simulated engines, block
//!    manager) and `kvgate-operator` (reconciling a PoolAutoscaler of the stack's pool in kapi,
//!    reading the stack's EPP) through the ServiceMonitor's and PodMonitors' own relabelings,
//!    while load runs through Envoy, and every query of every dashboard panel returns data.
//!
//! Needs helm, kapi and etcd at `.cache/kube/bin` and Envoy in `.venv` (scripts/bootstrap.sh),
//! `promtool` and `prometheus` on the PATH (Debian package `prometheus`), `nats-server` and
//! `redis-server`, and `kvgate-epp`, `kvgate-sidecar`, `kvgate-kvbm`, `kvgate-operator` built
//! into the same target directory. A missing tool fails the test and names it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvgate_e2e::stack::{Component, KvbmConfig, Stack, StackConfig, probe};
use serde::Deserialize as _;
use serde_json::{Value as Json, json};
use serde_yaml_ng::Value as Yaml;
use support::gateway::{chat, post, post_bytes};

const INSTALL_PROMETHEUS: &str = "install the Debian package `prometheus` (apt-get install -y --no-install-recommends prometheus)";

/// How long load runs before the panels are queried, and the window their rates use.
const WARM_UP: Duration = Duration::from_secs(25);
const RATE_INTERVAL: &str = "20s";

fn workspace() -> PathBuf {
    support::workspace()
}

/// A program on the PATH, or a failure naming how to get it.
fn on_path(name: &str, hint: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(name))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| panic!("`{name}` is not on the PATH: {hint}"))
}

fn helm() -> PathBuf {
    let helm = workspace().join(".cache/kube/bin/helm");
    assert!(
        helm.is_file(),
        "helm is missing at {}: run scripts/bootstrap.sh",
        helm.display()
    );
    helm
}

/// Runs `cmd` to completion; fails with its output unless it succeeds. Returns stdout.
fn run(cmd: &mut Command) -> String {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?} did not start: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `helm template kvgate charts/kvgate --namespace <namespace> <args>`, only `templates`, as
/// YAML documents.
fn render(namespace: &str, args: &[&str], templates: &[&str]) -> Vec<Yaml> {
    let mut cmd = Command::new(helm());
    cmd.current_dir(workspace())
        .args([
            "template",
            "kvgate",
            "charts/kvgate",
            "--namespace",
            namespace,
        ])
        .args(args);
    for t in templates {
        cmd.args(["--show-only", t]);
    }
    let out = run(&mut cmd);
    serde_yaml_ng::Deserializer::from_str(&out)
        .map(|doc| Yaml::deserialize(doc).unwrap())
        .filter(|doc| !doc.is_null())
        .collect()
}

/// A fresh directory for one test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-monitoring-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn text(v: &Yaml) -> &str {
    v.as_str().unwrap_or("")
}

// ------------------------------------------------------------------------------------------
// 1. Alert rules

#[test]
fn the_alert_rules_pass_promtool_and_every_alert_fires_and_stays_silent_in_a_test() {
    let promtool = on_path("promtool", INSTALL_PROMETHEUS);
    let docs = render(
        "inference",
        &["-f", "monitoring/tests/values.yaml"],
        &["templates/monitoring/prometheusrule.yaml"],
    );
    assert_eq!(docs.len(), 1, "one PrometheusRule: {docs:?}");
    let rule = &docs[0];
    assert_eq!(text(&rule["apiVersion"]), "monitoring.coreos.com/v1");
    assert_eq!(text(&rule["kind"]), "PrometheusRule");
    let groups = rule["spec"]["groups"].clone();

    // Every rule is an alert with a severity and annotations pointing at its runbook section.
    let runbook = std::fs::read_to_string(workspace().join("docs/operations.md"))
        .expect("docs/operations.md (the runbook)");
    let mut alerts = BTreeSet::new();
    let mut problems = Vec::new();
    for rule in groups
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap())
    {
        let name = text(&rule["alert"]).to_owned();
        if name.is_empty() {
            problems.push(format!("a rule without an alert name: {rule:?}"));
            continue;
        }
        if !matches!(
            text(&rule["labels"]["severity"]),
            "critical" | "warning" | "info"
        ) {
            problems.push(format!("{name}: severity is not critical, warning or info"));
        }
        for key in ["summary", "description"] {
            if text(&rule["annotations"][key]).trim().is_empty() {
                problems.push(format!("{name}: no {key}"));
            }
        }
        let anchor = format!("docs/operations.md#{}", name.to_lowercase());
        if !text(&rule["annotations"]["runbook_url"]).ends_with(&anchor) {
            problems.push(format!("{name}: runbook_url does not end with {anchor}"));
        }
        if !runbook.lines().any(|l| l.trim() == format!("### {name}")) {
            problems.push(format!(
                "{name}: docs/operations.md has no `### {name}` section"
            ));
        }
        if text(&rule["for"]).is_empty() {
            problems.push(format!(
                "{name}: no `for:` (it would fire on one evaluation)"
            ));
        }
        if !alerts.insert(name.clone()) {
            problems.push(format!("{name}: defined twice"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // promtool: the rules load, and the unit tests pass against them.
    let dir = scratch("rules");
    let mut file = serde_yaml_ng::Mapping::new();
    file.insert("groups".into(), groups);
    std::fs::write(
        dir.join("rules.yaml"),
        serde_yaml_ng::to_string(&file).unwrap(),
    )
    .unwrap();
    let tests_file = workspace().join("monitoring/tests/alerts.test.yaml");
    std::fs::copy(&tests_file, dir.join("alerts.test.yaml")).unwrap();
    run(Command::new(&promtool)
        .current_dir(&dir)
        .args(["check", "rules", "rules.yaml"]));
    run(Command::new(&promtool)
        .current_dir(&dir)
        .args(["test", "rules", "alerts.test.yaml"]));

    // Every alert has a case where it fires and one where it stays silent.
    let tests: Yaml =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&tests_file).unwrap()).unwrap();
    let (mut fires, mut silent) = (BTreeSet::new(), BTreeSet::new());
    for case in tests["tests"].as_sequence().unwrap().iter().flat_map(|t| {
        t["alert_rule_test"]
            .as_sequence()
            .cloned()
            .unwrap_or_default()
    }) {
        let name = text(&case["alertname"]).to_owned();
        let expected = case["exp_alerts"]
            .as_sequence()
            .map_or(0, |alerts| alerts.len());
        if expected > 0 {
            fires.insert(name);
        } else {
            silent.insert(name);
        }
    }
    let untested: Vec<String> = alerts
        .iter()
        .flat_map(|a| {
            [
                (!fires.contains(a)).then(|| format!("{a}: no case where it fires")),
                (!silent.contains(a)).then(|| format!("{a}: no case where it stays silent")),
            ]
        })
        .flatten()
        .collect();
    assert!(untested.is_empty(), "{}", untested.join("\n"));
    let unknown: Vec<&String> = fires
        .union(&silent)
        .filter(|a| !alerts.contains(*a))
        .collect();
    assert!(
        unknown.is_empty(),
        "tests of alerts the chart does not define: {unknown:?}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

// ------------------------------------------------------------------------------------------
// 2. Dashboards, statically

/// The committed dashboards, by file name.
fn dashboards() -> Vec<(String, Json)> {
    let dir = workspace().join("charts/kvgate/files/dashboards");
    let mut out: Vec<(String, Json)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let json = serde_json::from_str(&std::fs::read_to_string(&p).unwrap())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, json)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!out.is_empty(), "no dashboards in {}", dir.display());
    out
}

/// Every panel (rows' nested panels included) that is not a row.
fn panels(dashboard: &Json) -> Vec<&Json> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().into_iter().flatten() {
        if p["type"] == "row" {
            out.extend(p["panels"].as_array().into_iter().flatten());
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn the_dashboards_select_data_source_namespace_and_pool_on_every_query() {
    let mut problems = Vec::new();
    let mut uids = BTreeSet::new();
    for (name, d) in dashboards() {
        let uid = d["uid"].as_str().unwrap_or_default();
        if !uid.starts_with("kvgate-") || !uids.insert(uid.to_owned()) {
            problems.push(format!("{name}: uid {uid:?} is not a unique kvgate-… uid"));
        }
        if !(36..=41).contains(&d["schemaVersion"].as_u64().unwrap_or(0)) {
            problems.push(format!("{name}: schemaVersion {}", d["schemaVersion"]));
        }
        let vars: BTreeMap<&str, &Json> = d["templating"]["list"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| (v["name"].as_str().unwrap_or_default(), v))
            .collect();
        if vars.get("datasource").map(|v| (&v["type"], &v["query"]))
            != Some((&json!("datasource"), &json!("prometheus")))
        {
            problems.push(format!("{name}: no Prometheus `datasource` variable"));
        }
        for var in ["namespace", "pool"] {
            if vars.get(var).map(|v| &v["type"]) != Some(&json!("query")) {
                problems.push(format!("{name}: no `{var}` query variable"));
            }
        }
        let panels = panels(&d);
        if panels.is_empty() {
            problems.push(format!("{name}: no panels"));
        }
        let mut ids = BTreeSet::new();
        for p in panels {
            let title = p["title"].as_str().unwrap_or_default();
            if !ids.insert(p["id"].as_u64()) {
                problems.push(format!("{name} / {title}: duplicate panel id"));
            }
            if p["datasource"]["uid"] != "${datasource}" {
                problems.push(format!("{name} / {title}: not on the datasource variable"));
            }
            let targets = p["targets"].as_array().cloned().unwrap_or_default();
            if targets.is_empty() {
                problems.push(format!("{name} / {title}: no queries"));
            }
            for t in targets {
                let expr = t["expr"].as_str().unwrap_or_default();
                if !(expr.contains("namespace=\"$namespace\"") && expr.contains("pool=\"$pool\"")) {
                    problems.push(format!(
                        "{name} / {title}: query does not select namespace and pool: {expr}"
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ------------------------------------------------------------------------------------------
// 3. Dashboards against a real Prometheus scraping the local stack under load

/// A running Prometheus, killed on drop.
struct Prometheus {
    child: Child,
    port: u16,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(dir: &Path, config: &Json) -> Prometheus {
        let binary = on_path("prometheus", INSTALL_PROMETHEUS);
        let config_file = dir.join("prometheus.yml");
        // JSON is YAML: Prometheus reads it as its configuration file.
        std::fs::write(&config_file, serde_json::to_string_pretty(config).unwrap()).unwrap();
        let port = support::free_port();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let mut prometheus = Prometheus { child, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = prometheus.child.try_wait().unwrap() {
                panic!(
                    "prometheus exited ({status}):\n{}",
                    std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
                );
            }
            if matches!(
                probe::http_get(port, "/-/ready", Duration::from_secs(1)),
                Ok((200, _))
            ) {
                return prometheus;
            }
            assert!(Instant::now() < deadline, "prometheus did not become ready");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// GET an API path; its `data`.
    fn api(&self, path: &str) -> Result<Json, String> {
        let (status, body) = probe::http_get(self.port, path, Duration::from_secs(10))
            .map_err(|e| format!("GET {path}: {e}"))?;
        let v: Json = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if status != 200 || v["status"] != "success" {
            return Err(format!("HTTP {status}: {body}"));
        }
        Ok(v["data"].clone())
    }

    /// An instant query: Ok(values of the result's samples).
    fn query(&self, expr: &str) -> Result<Vec<f64>, String> {
        let data = self.api(&format!("/api/v1/query?query={}", encode(expr)))?;
        let value = |v: &Json| v[1].as_str().and_then(|s| s.parse::<f64>().ok());
        Ok(match data["resultType"].as_str() {
            Some("scalar") => value(&data["result"]).into_iter().collect(),
            _ => data["result"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| value(&s["value"]))
                .collect(),
        })
    }
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A scrape target as Kubernetes service discovery would give it: an address and the
/// `__meta_kubernetes_*` labels the monitors' relabelings read.
struct Target {
    address: String,
    pod: String,
    container: &'static str,
}

/// The stack's processes behind a monitor endpoint, chosen by what the monitor selects (its
/// selector's component label, or the pool's selector for the model servers) and the port name;
/// the operator is `operator`'s process.
fn targets_of(
    stack: &Stack,
    operator: &Operator,
    monitor: &Yaml,
    port: &str,
    pool_selector: &Yaml,
) -> Vec<Target> {
    let selector = &monitor["spec"]["selector"]["matchLabels"];
    let component = text(&selector["app.kubernetes.io/component"]);
    let kind = text(&monitor["kind"]);
    let ports = stack.ports();
    let at = |p: u16| format!("127.0.0.1:{p}");
    match (kind, component, port) {
        ("ServiceMonitor", "epp", "http-metrics") => vec![Target {
            address: at(ports.epp_metrics),
            pod: "kvgate-epp-0".into(),
            container: "epp",
        }],
        ("PodMonitor", "kvbm", "http-metrics") => vec![Target {
            address: at(ports.kvbm_metrics),
            pod: "kvgate-kvbm-local".into(),
            container: "kvbm",
        }],
        ("PodMonitor", "operator", "http-metrics") => vec![Target {
            address: at(operator.metrics_port),
            pod: "kvgate-operator-0".into(),
            container: "operator",
        }],
        ("PodMonitor", _, "kvgate-metrics") if selector == pool_selector => ports
            .engines
            .iter()
            .enumerate()
            .map(|(i, e)| Target {
                address: at(e.sidecar_metrics),
                pod: Component::pod_name(i),
                container: "kvgate-sidecar",
            })
            .collect(),
        ("PodMonitor", _, "http-engine") if selector == pool_selector => (0..ports.engines.len())
            .map(|i| Target {
                address: at(ports.engine_http(i).unwrap()),
                pod: Component::pod_name(i),
                container: "engine",
            })
            .collect(),
        _ => panic!(
            "the test does not know which stack process serves {kind} {} port {port} \
             (selector {selector:?}): teach targets_of",
            text(&monitor["metadata"]["name"])
        ),
    }
}

/// A Prometheus Operator relabeling (camelCase) as a Prometheus relabel config.
fn relabel(r: &Yaml) -> Json {
    let mut out = serde_json::Map::new();
    for (key, value) in r.as_mapping().unwrap() {
        let name = match text(key) {
            "sourceLabels" => "source_labels",
            "targetLabel" => "target_label",
            "action" => "action",
            "regex" => "regex",
            "replacement" => "replacement",
            "separator" => "separator",
            "modulus" => "modulus",
            other => panic!("relabeling field {other} unknown to the test"),
        };
        let mut v: Json = serde_json::to_value(value).unwrap();
        if name == "action" {
            v = json!(text(value).to_lowercase());
        }
        out.insert(name.into(), v);
    }
    Json::Object(out)
}

/// One scrape job per monitor endpoint, targets labelled as Kubernetes discovery labels pods,
/// then the relabelings the Operator generates (namespace, service, pod, container, endpoint,
/// default job), then the chart's own.
fn scrape_configs(
    stack: &Stack,
    operator: &Operator,
    monitors: &[Yaml],
    namespace: &str,
    pool_selector: &Yaml,
) -> Json {
    let mut jobs = Vec::new();
    for m in monitors {
        let kind = text(&m["kind"]);
        let name = text(&m["metadata"]["name"]);
        let endpoints = match kind {
            "ServiceMonitor" => &m["spec"]["endpoints"],
            "PodMonitor" => &m["spec"]["podMetricsEndpoints"],
            other => panic!("not a monitor: {other}"),
        };
        assert_eq!(
            m["spec"]["namespaceSelector"]["matchNames"],
            Yaml::Sequence(vec![namespace.into()]),
            "{name} must watch the release's namespace"
        );
        for (i, e) in endpoints.as_sequence().unwrap().iter().enumerate() {
            let port = text(&e["port"]);
            let static_configs: Vec<Json> = targets_of(stack, operator, m, port, pool_selector)
                .into_iter()
                .map(|t| {
                    json!({
                        "targets": [t.address],
                        "labels": {
                            "__meta_kubernetes_namespace": namespace,
                            "__meta_kubernetes_pod_name": t.pod,
                            "__meta_kubernetes_pod_container_name": t.container,
                            "__meta_kubernetes_pod_node_name": "local",
                            "__meta_kubernetes_service_name": if kind == "ServiceMonitor" { name } else { "" },
                        }
                    })
                })
                .collect();
            let default_job = if kind == "ServiceMonitor" {
                name.to_owned()
            } else {
                format!("{namespace}/{name}")
            };
            let mut relabels = vec![
                json!({"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"}),
                json!({"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}),
                json!({"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"}),
                json!({"target_label": "endpoint", "replacement": port}),
                json!({"target_label": "job", "replacement": default_job}),
            ];
            if kind == "ServiceMonitor" {
                relabels.push(json!({"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"}));
            }
            relabels.extend(
                e["relabelings"]
                    .as_sequence()
                    .into_iter()
                    .flatten()
                    .map(relabel),
            );
            let metric_relabels: Vec<Json> = e["metricRelabelings"]
                .as_sequence()
                .into_iter()
                .flatten()
                .map(relabel)
                .collect();
            assert_eq!(text(&e["path"]), "/metrics", "{name} {port}: path");
            jobs.push(json!({
                "job_name": format!("{kind}/{name}/{i}"),
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "metrics_path": "/metrics",
                "static_configs": static_configs,
                "relabel_configs": relabels,
                "metric_relabel_configs": metric_relabels,
            }));
        }
    }
    json!({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": jobs,
    })
}

/// `kvgate-operator` (the real binary, leader election on) against kapi, reconciling a
/// PoolAutoscaler of the stack's pool: the InferencePool names an EPP Service whose one pod is
/// the stack's EPP (127.0.0.1, its metrics port), and the autoscaled Deployment starts at 0
/// replicas under a minimum of 1, so the first decision scales it. Stopped (operator, then
/// kapi) on drop.
struct Operator {
    child: Child,
    metrics_port: u16,
    _kapi: kapi::Kapi,
    _runtime: tokio::runtime::Runtime,
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Operator {
    fn start(stack: &Stack, dir: &Path) -> Operator {
        use k8s_openapi::api::apps::v1::Deployment;
        use k8s_openapi::api::core::v1::Service;

        let binary = bin_dir().join("kvgate-operator");
        assert!(
            binary.is_file(),
            "{} is missing: cargo build -p kvgate-operator",
            binary.display()
        );
        let config = stack.config();
        let (namespace, pool) = (config.namespace.clone(), config.pool.clone());
        let epp_metrics = stack.ports().epp_metrics;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let kapi = runtime.block_on(async {
            let kapi = kapi::Kapi::start(kapi::KapiOptions::default())
                .await
                .unwrap_or_else(|e| panic!("kapi did not start: {e}"));
            let client = kapi.client().await.unwrap();
            kapi::crds::install_dir(&client, &kapi::crds::test_copies_dir(), |f| {
                f.contains("inferencepools")
            })
            .await
            .unwrap();
            kapi::crds::install_dir(&client, &kapi::crds::owned_dir(), |_| true)
                .await
                .unwrap();
            kapi::pods::ensure_namespace(&client, &namespace)
                .await
                .unwrap();
            let epp = format!("{pool}-epp");
            let model = format!("{pool}-model");
            let pool_object = json!({
                "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": pool, "namespace": namespace},
                "spec": {"selector": {"matchLabels": {"app": "kvgate-sim"}},
                         "targetPorts": [{"number": 8000}],
                         "endpointPickerRef": {"name": epp, "port": {"number": 9002}}}
            });
            create::<api::pool::v1::InferencePool>(&client, &namespace, pool_object).await;
            let service = json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": epp, "namespace": namespace},
                "spec": {"selector": {"app": "epp"},
                         "ports": [{"name": "grpc-ext-proc", "port": 9002},
                                   {"name": "http-metrics", "port": 9090,
                                    "targetPort": epp_metrics}]}
            });
            create::<Service>(&client, &namespace, service).await;
            let epp_pod = kapi::pods::PodInfo {
                name: format!("{epp}-0"),
                labels: BTreeMap::from([("app".into(), "epp".into())]),
                node: "local".into(),
                ip: std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
                ready: true,
            };
            kapi::pods::create(&client, &namespace, &epp_pod)
                .await
                .unwrap();
            let deployment = json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": model, "namespace": namespace},
                "spec": {"replicas": 0,
                         "selector": {"matchLabels": {"app": "model"}},
                         "template": {"metadata": {"labels": {"app": "model"}},
                                      "spec": {"containers": [{"name": "e", "image": "e"}]}}}
            });
            create::<Deployment>(&client, &namespace, deployment).await;
            let target = json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": model});
            let autoscaler = json!({
                "apiVersion": "kvgate.io/v1alpha1", "kind": "PoolAutoscaler",
                "metadata": {"name": pool, "namespace": namespace},
                "spec": {
                    "poolRef": {"name": pool},
                    "roles": {"both": {"scaleTargetRef": target,
                                       "minReplicas": 1, "maxReplicas": 2}},
                    "slo": {"ttftMs": 2000, "itlMs": 200},
                    "planner": {"mode": "Load", "intervalSeconds": 5},
                    "metrics": {"source": "Epp", "eppMetricsPortName": "http-metrics"}
                }
            });
            create::<api::autoscaler::PoolAutoscaler>(&client, &namespace, autoscaler).await;
            kapi
        });
        let metrics_port = support::free_port();
        let log = std::fs::File::create(dir.join("operator.log")).unwrap();
        let child = Command::new(&binary)
            .args([
                &format!("--namespace={namespace}"),
                &format!("--metrics-port={metrics_port}"),
                "--listen-address=127.0.0.1",
                "--lease-name=kvgate-operator",
                &format!("--lease-namespace={namespace}"),
                "--identity=kvgate-operator-0",
            ])
            .env("KUBECONFIG", kapi.kubeconfig())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start kvgate-operator");
        let mut operator = Operator {
            child,
            metrics_port,
            _kapi: kapi,
            _runtime: runtime,
        };
        // Ready once it serves its metrics and leads (the Lease is free: at once).
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = operator.child.try_wait().unwrap() {
                panic!(
                    "kvgate-operator exited ({status}):\n{}",
                    std::fs::read_to_string(dir.join("operator.log")).unwrap_or_default()
                );
            }
            if let Ok((200, page)) =
                probe::http_get(metrics_port, "/metrics", Duration::from_secs(1))
                && page.contains("kvgate_operator_leader 1")
            {
                return operator;
            }
            assert!(
                Instant::now() < deadline,
                "kvgate-operator did not lead within 20 s:\n{}",
                std::fs::read_to_string(dir.join("operator.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Creates a namespaced object from its JSON, or fails naming its kind.
async fn create<K>(client: &kube::Client, namespace: &str, object: Json)
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + serde::Serialize,
    K::DynamicType: Default,
{
    let kind = object["kind"].clone();
    let object: K = serde_json::from_value(object).unwrap();
    kube::Api::<K>::namespaced(client.clone(), namespace)
        .create(&kube::api::PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create {kind}: {e}"));
}

/// The directory of the kvgate binaries: the test executable's target directory.
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    if dir.ends_with("deps") {
        dir.parent().unwrap().to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// Load through Envoy from a few threads, and a block-manager connector offloading and
/// onboarding, until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    threads: Vec<JoinHandle<Vec<String>>>,
}

const CLIENTS: usize = 4;
const BLOCK: u64 = 256 << 10;

impl Load {
    fn start(stack: &Stack) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let port = stack.ports().envoy_listen;
        let mut threads: Vec<JoinHandle<Vec<String>>> = (0..CLIENTS)
            .map(|client| {
                let (stop, ok) = (Arc::clone(&stop), Arc::clone(&ok));
                std::thread::spawn(move || {
                    let mut failures = Vec::new();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        if i.is_multiple_of(20) {
                            // Clients send broken bodies too; the EPP answers them itself.
                            let r = post_bytes(port, "/v1/chat/completions", &[], b"{not json");
                            if r.status != 400 {
                                failures.push(format!("malformed body: {r:?}"));
                            }
                            continue;
                        }
                        // Four shared system prompts (cache hits), each turn's question new.
                        let system = format!("group {}: ", i % 4)
                            + &"You are a careful assistant for the monitoring test. ".repeat(40);
                        let mut body =
                            chat(&system, &format!("client {client} question {i}"), 24, true);
                        body["stream_options"] = json!({"include_usage": true});
                        let r = post(port, "/v1/chat/completions", &[], &body);
                        if r.ok() {
                            ok.fetch_add(1, Ordering::Relaxed);
                        } else {
                            failures.push(format!("{r:?}"));
                        }
                    }
                    failures
                })
            })
            .collect();
        let socket = stack
            .kvbm_socket()
            .expect("the stack runs the block manager");
        let layout = kvgate_kvbm::store::Layout {
            model: stack.config().model.clone(),
            dtype: "bf16".into(),
            layers: 32,
            block_size: stack.config().block_size,
            block_bytes: BLOCK,
            shard: 0,
            shards: 1,
        };
        let stop_connector = Arc::clone(&stop);
        threads.push(std::thread::spawn(move || {
            connector(&socket, layout, &stop_connector)
        }));
        Load { stop, ok, threads }
    }

    /// Stops every thread; the failures they saw.
    fn stop(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let failures = self
            .threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        (self.ok.load(Ordering::Relaxed), failures)
    }
}

/// An engine connector: offloads 8 fresh blocks (the 4 MiB host tier fills and demotes to
/// Redis), looks them up and onboards them, every 200 ms.
fn connector(socket: &Path, layout: kvgate_kvbm::store::Layout, stop: &AtomicBool) -> Vec<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut c = match kvgate_kvbm::client::Client::connect(socket, layout, 8 * BLOCK).await {
            Ok(c) => c,
            Err(e) => return vec![format!("connector: {e}")],
        };
        let mut round = 0u64;
        while !stop.load(Ordering::Relaxed) {
            round += 1;
            let slots: Vec<kvgate_kvbm::protocol::Slot> = (0..8u64)
                .map(|i| {
                    c.segment()
                        .write(i * BLOCK, &vec![(round + i) as u8; BLOCK as usize])
                        .unwrap();
                    kvgate_kvbm::protocol::Slot {
                        key: (round << 8) | i,
                        offset: i * BLOCK,
                    }
                })
                .collect();
            let keys: Vec<u64> = slots.iter().map(|s| s.key).collect();
            let done = async {
                c.offload(None, slots.clone()).await?;
                c.lookup(keys).await?;
                c.onboard(slots).await
            };
            if let Err(e) = done.await {
                return vec![format!("connector round {round}: {e}")];
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Vec::new()
    })
}

/// Replaces the dashboard variables the panels use (any other `$…` is left for the caller to refuse).
fn substitute(expr: &str, namespace: &str, pool: &str) -> String {
    expr.replace("${namespace}", namespace)
        .replace("$namespace", namespace)
        .replace("${pool}", pool)
        .replace("$pool", pool)
        .replace("$__rate_interval", RATE_INTERVAL)
}

/// `label_values(<selector>, <label>)` → (selector, label).
fn label_values(query: &str) -> Option<(&str, &str)> {
    let inner = query
        .trim()
        .strip_prefix("label_values(")?
        .strip_suffix(')')?;
    let (selector, label) = inner.rsplit_once(',')?;
    Some((selector.trim(), label.trim()))
}

#[test]
fn every_dashboard_panel_has_data_while_the_stack_serves_load() {
    // Tools first: a missing one fails before anything starts.
    on_path("prometheus", INSTALL_PROMETHEUS);
    assert!(
        bin_dir().join("kvgate-operator").is_file(),
        "kvgate-operator is not built: cargo build -p kvgate-operator"
    );
    let config = StackConfig {
        kvbm: Some(KvbmConfig {
            host_bytes: 4 << 20,
            remote_bytes: 64 << 20,
            ..KvbmConfig::default()
        }),
        ..StackConfig::default()
    };
    let (namespace, pool) = (config.namespace.clone(), config.pool.clone());
    // The chart's monitors for this stack: its namespace, its pool's name, its pods' labels.
    let monitors = render(
        &namespace,
        &[
            "--set",
            "model.name=m",
            "--set",
            &format!("inferencePool.name={pool}"),
            "--set",
            "inferencePool.selector.app=kvgate-sim",
            "--set",
            "kvbm.enabled=true",
            "--set",
            "operator.enabled=true",
            "--set",
            "monitoring.serviceMonitor.enabled=true",
            "--set",
            "monitoring.podMonitor.enabled=true",
            "--set",
            "monitoring.prometheusRule.enabled=true",
        ],
        &[
            "templates/monitoring/servicemonitor.yaml",
            "templates/monitoring/podmonitor.yaml",
            "templates/monitoring/prometheusrule.yaml",
        ],
    );
    let (rules, monitors): (Vec<Yaml>, Vec<Yaml>) = monitors
        .into_iter()
        .partition(|doc| text(&doc["kind"]) == "PrometheusRule");
    let pool_selector: Yaml = serde_yaml_ng::from_str("{app: kvgate-sim}").unwrap();
    let started = Instant::now();
    let stack = Stack::start(config).unwrap_or_else(|e| panic!("stack did not start: {e}"));
    let dir = scratch("prometheus");
    let operator = Operator::start(&stack, &dir);
    let prometheus = Prometheus::start(
        &dir,
        &scrape_configs(&stack, &operator, &monitors, &namespace, &pool_selector),
    );
    let load = Load::start(&stack);
    std::thread::sleep(WARM_UP);

    // Every target the monitors define is scraped and up.
    let targets = prometheus.api("/api/v1/targets?state=active").unwrap();
    let down: Vec<String> = targets["activeTargets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["health"] != "up")
        .map(|t| {
            format!(
                "{} {}: {}",
                t["labels"]["job"], t["scrapeUrl"], t["lastError"]
            )
        })
        .collect();
    let scraped = targets["activeTargets"].as_array().unwrap().len();
    assert_eq!(
        scraped,
        1 + 2 * stack.ports().engines.len() + 1 + 1,
        "{targets}"
    );
    assert!(down.is_empty(), "targets down:\n{}", down.join("\n"));

    // Every variable finds this stack's namespace and pool; every panel query returns a finite
    // value.
    let mut empty = Vec::new();
    let mut queries = 0;
    for (name, d) in dashboards() {
        for var in d["templating"]["list"].as_array().unwrap() {
            let (Some(query), Some(var_name)) =
                (var["query"]["query"].as_str(), var["name"].as_str())
            else {
                continue;
            };
            let (selector, label) = label_values(query).unwrap_or_else(|| {
                panic!("{name}: variable {var_name}: not label_values(…): {query}")
            });
            let selector = substitute(selector, &namespace, &pool);
            let want = if label == "namespace" {
                &namespace
            } else {
                &pool
            };
            let series = prometheus
                .api(&format!("/api/v1/series?match[]={}", encode(&selector)))
                .unwrap();
            let found: BTreeSet<&str> = series
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|s| s[label].as_str())
                .collect();
            if !found.contains(want.as_str()) {
                empty.push(format!(
                    "{name}: variable {var_name} ({query}) offers {found:?}, not {want}"
                ));
            }
        }
        for p in panels(&d) {
            let title = p["title"].as_str().unwrap_or_default();
            for t in p["targets"].as_array().into_iter().flatten() {
                let expr = substitute(t["expr"].as_str().unwrap_or_default(), &namespace, &pool);
                queries += 1;
                if expr.contains('$') {
                    empty.push(format!(
                        "{name} / {title} [{}]: unknown variable in {expr}",
                        t["refId"]
                    ));
                    continue;
                }
                match prometheus.query(&expr) {
                    Ok(values) if values.iter().any(|v| v.is_finite()) => {}
                    Ok(values) => empty.push(format!(
                        "{name} / {title} [{}]: {} (values {values:?})",
                        t["refId"], expr
                    )),
                    Err(e) => empty.push(format!("{name} / {title} [{}]: {expr}: {e}", t["refId"])),
                }
            }
        }
    }
    // A healthy pool under load trips no alert: every expression evaluates, to nothing (its
    // `for:` aside), on this stack's series.
    let mut alerting = Vec::new();
    for rule in rules
        .iter()
        .flat_map(|r| r["spec"]["groups"].as_sequence().unwrap())
        .flat_map(|g| g["rules"].as_sequence().unwrap())
    {
        let expr = text(&rule["expr"]);
        match prometheus.api(&format!("/api/v1/query?query={}", encode(expr))) {
            Ok(data) if data["result"].as_array().is_some_and(Vec::is_empty) => {}
            Ok(data) => alerting.push(format!("{}: {}", text(&rule["alert"]), data["result"])),
            Err(e) => alerting.push(format!("{}: {e}", text(&rule["alert"]))),
        }
    }
    let (ok, failures) = load.stop();
    let took = started.elapsed();
    eprintln!(
        "{queries} panel queries over {ok} requests; stack, Prometheus and load took {took:?}"
    );
    assert!(failures.is_empty(), "load failed:\n{}", failures.join("\n"));
    assert!(ok >= 20, "only {ok} requests completed");
    assert!(
        empty.is_empty(),
        "{} of {queries} dashboard queries returned no data (run dir {}, prometheus {}):\n{}",
        empty.len(),
        stack.run_dir().display(),
        dir.display(),
        empty.join("\n")
    );
    assert!(
        alerting.is_empty(),
        "alert expressions true on a healthy stack:\n{}\nthe block manager's write path:\n{}",
        alerting.join("\n"),
        stack.kvbm_metrics().map_or_else(
            |e| e.to_string(),
            |m| m
                .lines()
                .filter(|l| l.starts_with("kvgate_kvbm_write") || l.starts_with("kvgate_kvbm_lost"))
                .collect::<Vec<_>>()
                .join("\n")
        )
    );
    drop(prometheus);
    drop(operator);
    let run_dir = stack.run_dir().to_path_buf();
    stack.stop();
    std::fs::remove_dir_all(run_dir).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
