//! The Helm chart and the example manifests against the real tools and a real API server:
//! `helm lint --strict` and `helm template` of every value set in `charts/kvgate/ci/`, `helm
//! install` and `helm upgrade` of each into kapi (server-side apply refuses undeclared fields),
//! values the schema refuses with the key's path, CRD instances accepted and refused by the real
//! CRD validation, the RBAC the chart grants against a committed allow-list, checkov over the
//! rendered objects, every flag a template passes accepted by its binary, and the manifests'
//! sidecar containers identical to the chart's.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use kapi::{Kapi, KapiOptions, Tools};
use kvgate_e2e::kube::chart::{Helm, Rendered, workspace_root};
use serde_json::Value;

/// The value sets in `charts/kvgate/ci/`.
const SETS: [&str; 6] = [
    "defaults",
    "everything",
    "pd",
    "external-nats",
    "tls-off",
    "no-monitoring",
];

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvgate-chart-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn helm(name: &str) -> Helm {
    Helm::new(Tools::locate().unwrap().helm, scratch(name))
}

fn set(name: &str) -> String {
    std::fs::read_to_string(workspace_root().join(format!("charts/kvgate/ci/{name}-values.yaml")))
        .unwrap()
}

fn render(h: &Helm, name: &str) -> Rendered {
    h.template("kvgate", "llm", &[&set(name)])
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn every_value_set_lints_and_renders_secure_workloads() {
    let h = helm("render");
    for name in SETS {
        h.lint(&[&set(name)])
            .unwrap_or_else(|e| panic!("helm lint --strict {name}: {e}"));
        let r = render(&h, name);
        assert!(r.get("Deployment", "kvgate-epp").is_some(), "{name}");
        for (kind, workload, c) in r.containers() {
            let what = format!("{name}: {kind}/{workload} container {}", c["name"]);
            let sc = &c["securityContext"];
            let engine = workload.starts_with("kvgate-")
                && kind == "Deployment"
                && c["name"] == "engine"
                && !c["image"].as_str().unwrap().contains("kvgate-sim");
            assert!(
                !c["resources"]["requests"].is_null() && !c["resources"]["limits"].is_null(),
                "{what}: requests and limits"
            );
            if engine {
                // vLLM's and SGLang's images run as root; the chart does not pretend otherwise.
                continue;
            }
            assert_eq!(sc["readOnlyRootFilesystem"], true, "{what}");
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{what}");
            assert_eq!(sc["runAsNonRoot"], true, "{what}");
            assert_eq!(
                sc["capabilities"]["drop"],
                serde_json::json!(["ALL"]),
                "{what}"
            );
            assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault", "{what}");
        }
        // A scheduler configuration the chart passes is one the EPP accepts.
        if let Some(cm) = r.get("ConfigMap", "kvgate-epp-scheduler") {
            let text = cm["data"]["scheduler.yaml"].as_str().unwrap();
            scheduler::SchedulerConfig::from_yaml(text)
                .unwrap_or_else(|e| panic!("{name}: the EPP would refuse its scheduler file: {e}"));
        }
    }
    let everything = render(&h, "everything");
    for (kind, name) in [
        ("InferencePool", "kvgate"),
        ("HTTPRoute", "kvgate"),
        ("StatefulSet", "kvgate-nats"),
        ("DaemonSet", "kvgate-kvbm"),
        ("ServiceMonitor", "kvgate-epp"),
        ("PrometheusRule", "kvgate"),
        ("PodDisruptionBudget", "kvgate-epp"),
        ("NetworkPolicy", "kvgate-epp"),
        ("Secret", "kvgate-epp-tls"),
    ] {
        assert!(
            everything.get(kind, name).is_some(),
            "everything renders {kind} {name}"
        );
    }
    // Tracing reaches the EPP and every sidecar as the standard OpenTelemetry variables.
    let traced: Vec<String> = everything
        .containers()
        .into_iter()
        .filter(|(_, _, c)| {
            c["env"].as_array().is_some_and(|env| {
                env.iter().any(|e| {
                    e["name"] == "OTEL_EXPORTER_OTLP_ENDPOINT"
                        && e["value"] == "http://otel-collector.observability:4317"
                }) && env
                    .iter()
                    .any(|e| e["name"] == "OTEL_TRACES_SAMPLER_ARG" && e["value"] == "0.25")
            })
        })
        .map(|(_, workload, c)| format!("{workload}/{}", c["name"].as_str().unwrap_or("")))
        .collect();
    assert!(
        traced.iter().any(|w| w.starts_with("kvgate-epp/"))
            && traced.iter().any(|w| w.ends_with("/kvgate-sidecar")),
        "traced containers: {traced:?}"
    );
    assert!(
        render(&h, "defaults")
            .containers()
            .iter()
            .all(|(_, _, c)| !c.to_string().contains("OTEL_")),
        "no tracing by default"
    );
    let pool = everything.get("InferencePool", "kvgate").unwrap();
    assert_eq!(
        pool["spec"]["endpointPickerRef"],
        serde_json::json!({"kind": "Service", "name": "kvgate-epp", "port": {"number": 9002}, "failureMode": "FailClose"})
    );
    let defaults = render(&h, "defaults");
    assert_eq!(
        defaults.get("InferencePool", "kvgate").unwrap()["spec"]["endpointPickerRef"]["failureMode"],
        "FailOpen",
        "FailOpen by default"
    );
    // The response-observer layout: the EPP's second port, in its Service and NetworkPolicy.
    let observer_port = |r: &Rendered, kind: &str, name: &str| -> bool {
        r.get(kind, name).unwrap().to_string().contains("9004")
    };
    let epp_args = |r: &Rendered| {
        r.get("Deployment", "kvgate-epp").unwrap()["spec"]["template"]["spec"]["containers"][0]
            ["args"]
            .clone()
    };
    assert!(
        epp_args(&everything)
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--observer-port=9004")
    );
    for (kind, name) in [("Service", "kvgate-epp"), ("NetworkPolicy", "kvgate-epp")] {
        assert!(observer_port(&everything, kind, name), "{kind} {name}");
    }
    assert!(
        !epp_args(&defaults).to_string().contains("observer")
            && !observer_port(&defaults, "Service", "kvgate-epp"),
        "one filter by default"
    );
    // Pulls between block managers: the pod IP advertised, the secret mounted, the port open
    // to the release's block managers only; none of it by default.
    let kvbm = |r: &Rendered| r.get("DaemonSet", "kvgate-kvbm").map(|d| d.to_string());
    let peers = kvbm(&everything).unwrap();
    for needle in [
        "--peer-listen=0.0.0.0:9094",
        "--peer-advertise-ip=$(POD_IP)",
        "--peer-secret-file=/etc/kvgate/peer/secret",
        "--peer-timeout-ms=1500",
        "--peer-fabric=nixl",
        "--nixl-library=/opt/nixl/lib/libnixl_capi.so",
        "status.podIP",
        "kvbm-peers",
    ] {
        assert!(peers.contains(needle), "the kvbm DaemonSet has {needle}");
    }
    // The rule letting the release's block managers in: with NIXL, on every port (UCX's own);
    // over TCP only, on the pull port alone.
    let peer_rule = |r: &Rendered| -> Value {
        let policy = r.get("NetworkPolicy", "kvgate-kvbm").unwrap();
        policy["spec"]["ingress"]
            .as_array()
            .unwrap()
            .iter()
            .find(|rule| rule["from"][0]["podSelector"].is_object())
            .cloned()
            .unwrap()
    };
    assert!(peer_rule(&everything).get("ports").is_none());
    let tcp = h
        .template(
            "kvgate",
            "llm",
            &[&set("everything"), "kvbm: {peers: {fabric: tcp}}"],
        )
        .unwrap();
    assert_eq!(
        peer_rule(&tcp)["ports"],
        serde_json::json!([{"port": 9094, "protocol": "TCP"}])
    );
    assert!(!kvbm(&tcp).unwrap().contains("nixl"));
    // NIXL's libraries come with their own image; over TCP the plain one runs.
    let image = |r: &Rendered| {
        r.get("DaemonSet", "kvgate-kvbm").unwrap()["spec"]["template"]["spec"]["containers"][0]
            ["image"]
            .clone()
    };
    assert_eq!(image(&everything), "ghcr.io/kvgate/kvgate-kvbm-nixl:0.1.0");
    assert_eq!(image(&tcp), "ghcr.io/kvgate/kvgate-kvbm:0.1.0");
    assert!(kvbm(&defaults).is_none_or(|d| !d.contains("peer")));
    let tls_off = render(&h, "tls-off");
    let args = &tls_off.get("Deployment", "kvgate-epp").unwrap()["spec"]["template"]["spec"]["containers"]
        [0]["args"];
    assert!(args.as_array().unwrap().iter().any(|a| a == "--plaintext"));
    assert!(tls_off.get("Secret", "kvgate-epp-tls").is_none());
}

#[test]
fn bad_values_fail_with_a_message_naming_them() {
    let h = helm("bad");
    let base = set("defaults");
    for (values, want) in [
        ("epp: {replicas: 0}", "/epp/replicas"),
        ("epp: {tls: {mode: magic}}", "/epp/tls/mode"),
        ("epp: {tlss: {}}", "'tlss' not allowed"),
        (
            "inferencePool: {failureMode: Sometimes}",
            "/inferencePool/failureMode",
        ),
        (
            "inferencePool: {targetPorts: [0]}",
            "/inferencePool/targetPorts/0",
        ),
        ("nats: {mode: external}", "nats.url is required"),
        (
            "nats: {mode: none}\nepp: {responseObserver: {enabled: true}}",
            "needs NATS",
        ),
        ("nats: {mode: external, url: \"http://x\"}", "/nats/url"),
        ("kvbm: {remote: {url: \"ftp://x\"}}", "/kvbm/remote/url"),
        (
            "kvbm: {enabled: true, peers: {enabled: true}}",
            "kvbm.peers.enabled needs kvbm.peers.existingSecret",
        ),
        ("model: {name: \"\"}", "model.name is required"),
        (
            "inferencePool: {selector: null}",
            "inferencePool.selector is required",
        ),
        (
            "httpRoute: {create: true}",
            "httpRoute.parentRefs is required",
        ),
        (
            "epp: {tls: {mode: secret}}",
            "epp.tls.secretName is required",
        ),
        (
            "modelServers: [{name: x, engine: vllm}]",
            "modelServers[x].image is required",
        ),
        ("modelServers: [{name: Bad_Name}]", "/modelServers/0/name"),
        (
            "nats: {mode: none}\nmodelServers: [{name: s, engine: sim}]",
            "set nats.mode to internal or external",
        ),
        (
            "autoscaling: {enabled: true}",
            "autoscaling.roles: give both",
        ),
        (
            "autoscaling: {enabled: true, roles: {both: {maxReplicas: 2}}}",
            "/autoscaling/roles/both",
        ),
        (
            "autoscaling: {enabled: true, roles: {both: {modelServer: nope, maxReplicas: 2}}}",
            "modelServer \"nope\" names no modelServers entry",
        ),
        (
            "autoscaling: {planner: {mode: Sometimes}}",
            "/autoscaling/planner/mode",
        ),
        (
            "operator: {leaseDurationSeconds: 1}",
            "/operator/leaseDurationSeconds",
        ),
        (
            "tracing: {otlpEndpoint: \"otel:4317\"}",
            "/tracing/otlpEndpoint",
        ),
        ("tracing: {sampleRatio: 2}", "/tracing/sampleRatio"),
    ] {
        let err = h
            .template("kvgate", "llm", &[&base, values])
            .expect_err(values)
            .to_string();
        assert!(err.contains(want), "{values}: expected {want:?} in {err}");
    }
}

/// Installs CRDs into a fresh API server: the test copies and the upstream ones from the
/// bootstrap's cache (Prometheus Operator, Istio DestinationRule).
async fn cluster() -> (Kapi, kube::Client) {
    let kapi = Kapi::start(KapiOptions::default()).await.unwrap();
    let client = kapi.client().await.unwrap();
    kapi::crds::install_dir(&client, &kapi::crds::test_copies_dir(), |_| true)
        .await
        .unwrap();
    let upstream = workspace_root().join(".cache/kube/crds");
    let names = kapi::crds::install_dir(&client, &upstream, |_| true)
        .await
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/bootstrap.sh)", upstream.display()));
    assert_eq!(names.len(), 4, "{names:?}");
    (kapi, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_value_set_installs_and_upgrades_into_a_real_api_server() {
    let (kapi, client) = cluster().await;
    let h = helm("install").with_kubeconfig(kapi.kubeconfig());
    for name in SETS {
        let ns = format!("set-{name}");
        kapi::pods::ensure_namespace(&client, &ns).await.unwrap();
        h.install("kvgate", &ns, &[&set(name)])
            .unwrap_or_else(|e| panic!("helm install {name}: {e}"));
        let installed = h.manifest("kvgate", &ns).unwrap();
        let tls = installed.get("Secret", "kvgate-epp-tls").cloned();
        h.upgrade("kvgate", &ns, &[&set(name), "epp: {replicas: 4}"])
            .unwrap_or_else(|e| panic!("helm upgrade {name}: {e}"));
        let upgraded = h.manifest("kvgate", &ns).unwrap();
        assert_eq!(
            upgraded.get("Deployment", "kvgate-epp").unwrap()["spec"]["replicas"],
            4
        );
        assert_eq!(
            upgraded.get("Secret", "kvgate-epp-tls").cloned(),
            tls,
            "{name}: the generated certificate survives an upgrade"
        );
    }
    // Server-side apply refuses a field no schema declares.
    kapi::pods::ensure_namespace(&client, "misspelt")
        .await
        .unwrap();
    let err = h
        .install(
            "kvgate",
            "misspelt",
            &[&set("defaults"), "epp: {extraEnv: [{name: X, valu: y}]}"],
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(".valu") && err.contains("not declared"),
        "{err}"
    );
}

/// Every Kubernetes object in `manifests/` (values files for charts are skipped).
fn manifest_objects() -> Vec<(PathBuf, Value)> {
    let mut out = Vec::new();
    let mut stack = vec![workspace_root().join("manifests")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                let text = std::fs::read_to_string(&path).unwrap();
                for o in Rendered::parse(&text).unwrap().objects {
                    if o["apiVersion"].is_string() && o["kind"].is_string() {
                        out.push((path.clone(), o));
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Kinds in `manifests/` whose CRDs cannot be installed here (no registry package carries
/// them): their objects are checked for shape by the YAML parser only.
const UNVALIDATED: [&str; 4] = [
    "gateway.envoyproxy.io/v1alpha1",
    "agentgateway.dev/v1alpha1",
    "aigateway.envoyproxy.io/v1alpha1",
    "aigateway.envoyproxy.io/v1beta1",
];

fn kubectl(kapi: &Kapi, args: &[&str], stdin: &str) -> Result<String, String> {
    use std::io::Write as _;
    let mut child = Command::new(&kapi.tools().kubectl)
        .arg("--kubeconfig")
        .arg(kapi.kubeconfig())
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

fn apply(kapi: &Kapi, object: &Value) -> Result<String, String> {
    kubectl(
        kapi,
        &[
            "apply",
            "--server-side",
            "--dry-run=server",
            "--validate=strict",
            "-f",
            "-",
        ],
        &serde_json::to_string(object).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crd_instances_are_accepted_or_refused_by_the_real_validation() {
    let (kapi, client) = cluster().await;
    for ns in ["llm", "gateway-system", "istio-system"] {
        kapi::pods::ensure_namespace(&client, ns).await.unwrap();
    }
    // Every example object the API server knows the kind of is accepted as written.
    let mut skipped = BTreeSet::new();
    let mut checked = 0;
    for (file, o) in manifest_objects() {
        let api_version = o["apiVersion"].as_str().unwrap_or_default();
        if UNVALIDATED.contains(&api_version) {
            skipped.insert(format!("{api_version} {}", o["kind"]));
            continue;
        }
        apply(&kapi, &o).unwrap_or_else(|e| {
            panic!(
                "{}: {} {} refused: {e}",
                file.display(),
                o["kind"],
                o["metadata"]["name"]
            )
        });
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} objects checked");
    eprintln!("manifests: {checked} objects validated; not validatable here: {skipped:?}");
    // The chart's own InferencePool and HTTPRoute, as rendered with everything on.
    let everything = render(&helm("crd"), "everything");
    for kind in [
        "InferencePool",
        "HTTPRoute",
        "ServiceMonitor",
        "PodMonitor",
        "PrometheusRule",
    ] {
        for o in everything.of_kind(kind) {
            apply(&kapi, o).unwrap_or_else(|e| panic!("chart {kind}: {e}"));
        }
    }
    // Invalid instances are refused with the API server's reason.
    let pool = |spec: Value| {
        serde_json::json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                           "metadata": {"name": "bad", "namespace": "llm"}, "spec": spec})
    };
    for (object, want) in [
        (
            pool(
                serde_json::json!({"selector": {"matchLabels": {"app": "x"}},
                                    "targetPorts": [{"number": 8000}, {"number": 8000}]}),
            ),
            "port number must be unique",
        ),
        (
            pool(serde_json::json!({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": []})),
            "should have at least 1 items",
        ),
        (
            pool(
                serde_json::json!({"selector": {"matchLabels": {"app": "x"}},
                                    "targetPorts": [{"number": 70000}]}),
            ),
            "should be less than or equal to 65535",
        ),
        (
            pool(
                serde_json::json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}),
            ),
            "should have at least 1 properties",
        ),
        (
            pool(
                serde_json::json!({"selector": {"matchLabels": {"app": "x"}},
                                    "targetPorts": [{"number": 8000}], "appProtocol": "grpc"}),
            ),
            "Unsupported value: \"grpc\"",
        ),
        (
            pool(
                serde_json::json!({"selector": {"matchLabels": {"app": "x"}},
                                    "targetPorts": [{"number": 8000}],
                                    "endpointPickerRef": {"name": "epp"}}),
            ),
            "port is required when kind is 'Service'",
        ),
        (
            pool(
                serde_json::json!({"selector": {"matchLabels": {"app": "x"}},
                                    "targetPorts": [{"number": 8000}],
                                    "endpointPickerRef": {"name": "epp", "port": {"number": 9002},
                                                          "failureMode": "Sometimes"}}),
            ),
            "Unsupported value: \"Sometimes\"",
        ),
        (
            pool(serde_json::json!({"targetPorts": [{"number": 8000}]})),
            "spec.selector: Required value",
        ),
        (
            pool(
                serde_json::json!({"selector": {"matchLabels": {"app": "x"}},
                                    "targetPorts": [{"number": 8000}], "replicas": 3}),
            ),
            "field not declared in schema",
        ),
        (
            serde_json::json!({"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
                               "metadata": {"name": "bad", "namespace": "llm"},
                               "spec": {"priority": 1}}),
            "spec.poolRef: Required value",
        ),
        (
            serde_json::json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                               "metadata": {"name": "bad", "namespace": "llm"},
                               "spec": {"rules": [{"matches": [{"path": {"type": "Glob", "value": "/v1"}}]}]}}),
            "Unsupported value: \"Glob\"",
        ),
        (
            serde_json::json!({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
                               "metadata": {"name": "bad", "namespace": "llm"},
                               "spec": {"selector": {}, "endpoints": [{"port": "m", "scheme": "gopher"}]}}),
            "Unsupported value: \"gopher\"",
        ),
    ] {
        let err = apply(&kapi, &object).expect_err(&object.to_string());
        assert!(err.contains(want), "expected {want:?}: {err}");
    }
}

/// The committed allow-list of what the chart's Roles grant.
fn allow_list() -> BTreeSet<String> {
    let text =
        std::fs::read_to_string(workspace_root().join("e2e/testdata/rbac-allowlist.txt")).unwrap();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_chart_grants_exactly_the_committed_rbac() {
    let h = helm("rbac");
    let allowed = allow_list();
    let mut rendered_roles = BTreeSet::new();
    for name in SETS {
        let r = render(&h, name);
        assert!(
            r.of_kind("ClusterRole").next().is_none()
                && r.of_kind("ClusterRoleBinding").next().is_none(),
            "{name}: no cluster-wide RBAC"
        );
        let mut granted = BTreeSet::new();
        let mut roles = BTreeSet::new();
        for role in r.of_kind("Role") {
            let role_name = role["metadata"]["name"].as_str().unwrap();
            roles.insert(role_name.to_owned());
            for rule in role["rules"].as_array().unwrap() {
                let names = rule["resourceNames"]
                    .as_array()
                    .map(|n| {
                        let n: Vec<&str> = n.iter().map(|v| v.as_str().unwrap()).collect();
                        format!(" [{}]", n.join(","))
                    })
                    .unwrap_or_default();
                for g in rule["apiGroups"].as_array().unwrap() {
                    for res in rule["resources"].as_array().unwrap() {
                        for v in rule["verbs"].as_array().unwrap() {
                            let g = g.as_str().unwrap();
                            granted.insert(format!(
                                "{role_name} {} {} {}{names}",
                                if g.is_empty() { "core" } else { g },
                                res.as_str().unwrap(),
                                v.as_str().unwrap()
                            ));
                        }
                    }
                }
            }
        }
        // Each Role the set renders grants exactly its lines of the allow-list.
        let expected: BTreeSet<String> = allowed
            .iter()
            .filter(|l| roles.iter().any(|r| l.starts_with(&format!("{r} "))))
            .cloned()
            .collect();
        assert_eq!(
            granted, expected,
            "{name}: the chart's RBAC differs from e2e/testdata/rbac-allowlist.txt"
        );
        rendered_roles.extend(roles);
    }
    // And every Role of the allow-list is rendered by some value set.
    for line in &allowed {
        let role = line.split(' ').next().unwrap();
        assert!(
            rendered_roles.contains(role),
            "the allow-list names {role}, which no value set renders"
        );
    }
}

/// checkov's findings that are accepted, with the reason, from the committed list.
fn accepted_findings() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(workspace_root().join("e2e/testdata/checkov-accepted.txt"))
        .unwrap();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (key, reason) = l.split_once(" -- ").unwrap_or((l, ""));
            assert!(!reason.trim().is_empty(), "no reason for {key}");
            (key.trim().to_owned(), reason.trim().to_owned())
        })
        .collect()
}

#[test]
fn checkov_findings_are_fixed_or_explained() {
    let checkov = workspace_root().join(".cache/checkov/bin/checkov");
    assert!(
        checkov.is_file(),
        "{} missing: run scripts/bootstrap.sh",
        checkov.display()
    );
    let h = helm("checkov");
    let dir = scratch("checkov-objects");
    for name in SETS {
        let text = render(&h, name)
            .objects
            .iter()
            .map(|o| serde_yaml_ng::to_string(o).unwrap())
            .collect::<Vec<_>>()
            .join("---\n");
        std::fs::write(dir.join(format!("{name}.yaml")), text).unwrap();
    }
    let out = Command::new(&checkov)
        .args(["--directory", dir.to_str().unwrap()])
        .args([
            "--framework",
            "kubernetes",
            "--output",
            "json",
            "--quiet",
            "--compact",
        ])
        .arg("--skip-download")
        .env("BC_SKIP_MAPPING", "TRUE")
        .env("CHECKOV_RUN_SCA_PACKAGE_SCAN_V2", "false")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "checkov output is not JSON ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let reports: Vec<&Value> = match &report {
        Value::Array(a) => a.iter().collect(),
        o => vec![o],
    };
    let mut found = BTreeSet::new();
    let mut passed = 0;
    for r in reports {
        passed += r["summary"]["passed"].as_u64().unwrap_or(0);
        for f in r["results"]["failed_checks"]
            .as_array()
            .into_iter()
            .flatten()
        {
            // Resource ids look like "Deployment.llm.kvgate-epp" (pod checks append the
            // labels); the namespace is the same everywhere, so the key is check, kind, name.
            let resource = f["resource"].as_str().unwrap_or_default();
            let parts: Vec<&str> = resource.split('.').collect();
            let (kind, name) = (parts[0], parts.get(2).copied().unwrap_or_default());
            found.insert(format!("{} {kind}/{name}", f["check_id"].as_str().unwrap()));
        }
    }
    assert!(passed > 100, "checkov ran only {passed} checks");
    let accepted = accepted_findings();
    let unexplained: Vec<&String> = found
        .iter()
        .filter(|k| !accepted.contains_key(*k))
        .collect();
    let stale: Vec<&String> = accepted.keys().filter(|k| !found.contains(*k)).collect();
    assert!(
        unexplained.is_empty(),
        "checkov findings neither fixed nor listed in e2e/testdata/checkov-accepted.txt: {unexplained:#?}"
    );
    assert!(
        stale.is_empty(),
        "listed in e2e/testdata/checkov-accepted.txt but no longer found (remove them): {stale:#?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The `--flags` of a binary's `--help`.
fn help_flags(binary: &Path) -> BTreeSet<String> {
    let out = Command::new(binary).arg("--help").output().unwrap();
    assert!(out.status.success(), "{} --help failed", binary.display());
    String::from_utf8_lossy(&out.stdout)
        .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == '=')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| {
            w.trim_end_matches(|c: char| !c.is_alphanumeric())
                .to_owned()
        })
        .collect()
}

fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    if dir.ends_with("deps") {
        dir.parent().unwrap().to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

#[test]
fn every_flag_a_template_or_manifest_passes_is_accepted_by_its_binary() {
    let h = helm("flags");
    let mut containers: Vec<(String, Value)> = Vec::new();
    for name in SETS {
        for (kind, workload, c) in render(&h, name).containers() {
            containers.push((format!("{name}: {kind}/{workload}"), c.clone()));
        }
    }
    for (file, o) in manifest_objects() {
        for c in o["spec"]["template"]["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
        {
            containers.push((file.display().to_string(), c.clone()));
        }
    }
    let mut help: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut checked = 0;
    for (what, c) in containers {
        let image = c["image"].as_str().unwrap_or_default();
        let Some(binary) = image
            .rsplit('/')
            .next()
            .and_then(|l| l.split(':').next())
            .filter(|b| b.starts_with("kvgate-"))
        else {
            continue;
        };
        // The NIXL image runs the block manager's binary (images/README.md).
        let binary = match binary {
            "kvgate-kvbm-nixl" => "kvgate-kvbm",
            b => b,
        };
        let path = bin_dir().join(binary);
        assert!(path.is_file(), "{} not built", path.display());
        let flags = help
            .entry(binary.to_owned())
            .or_insert_with(|| help_flags(&path));
        for arg in c["args"].as_array().into_iter().flatten() {
            let arg = arg.as_str().unwrap();
            if let Some(flag) = arg.strip_prefix("--") {
                let flag = format!("--{}", flag.split('=').next().unwrap());
                assert!(
                    flags.contains(&flag),
                    "{what}: {binary} does not accept {flag} (its --help lists {flags:?})"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 100, "only {checked} flags checked");
}

#[test]
fn the_manifests_sidecars_are_the_charts() {
    let h = helm("sidecars");
    let pairs = [
        ("engines/vllm.yaml", "vllm.yaml", "vllm"),
        ("engines/sglang.yaml", "sglang.yaml", "sglang"),
        ("engines/sim.yaml", "sim.yaml", "sim"),
        ("engines/pd-vllm.yaml", "pd.yaml", "vllm"),
    ];
    let root = workspace_root().join("manifests");
    let mut compared = 0;
    for (manifest, values, engine) in pairs {
        let text = std::fs::read_to_string(root.join(manifest)).unwrap();
        let values = std::fs::read_to_string(root.join("values").join(values)).unwrap();
        for d in Rendered::parse(&text).unwrap().of_kind("Deployment") {
            let spec = &d["spec"]["template"];
            let role = spec["metadata"]["labels"]["kvgate.io/role"]
                .as_str()
                .unwrap_or("both");
            let sidecar = spec["spec"]["containers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["name"] == "kvgate-sidecar")
                .unwrap_or_else(|| panic!("{manifest}: no kvgate-sidecar container"));
            let servers = format!(
                "modelServers: [{{name: cmp, engine: {engine}, role: {role}, image: engine-image}}]"
            );
            let r = h.template("kvgate", "llm", &[&values, &servers]).unwrap();
            let chart = r
                .containers()
                .into_iter()
                .find(|(_, w, c)| w == "kvgate-cmp" && c["name"] == "kvgate-sidecar")
                .map(|(_, _, c)| c.clone())
                .unwrap();
            assert_eq!(
                sidecar, &chart,
                "{manifest} ({role}): the sidecar differs from the chart's kvgate.sidecar"
            );
            compared += 1;
        }
    }
    assert_eq!(compared, 5);
}
