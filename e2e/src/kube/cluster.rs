//! [`KubeStack`]: kvgate installed by its Helm chart into the test API server, with every
//! rendered kvgate container running here as a process (see [`super::podexec`] for the
//! emulation rules), and Envoy in front as the Envoy AI Gateway recipe configures it.
//!
//! Start order: the chart is rendered once to learn its ServiceAccounts (each gets a static
//! token); kapi starts (RBAC on by default) with the test copies of the InferencePool and
//! InferenceObjective CRDs; NATS starts on its own "service" address; `helm install` applies the
//! chart; then, from the installed manifests, the block manager's DaemonSet pod, every
//! model-server pod (engine and sidecar containers), the EPP replicas, the operator replicas
//! (when the chart renders the operator), and Envoy. Each pod is registered as a Pod object with
//! its IP and its template's containers (names, images, ports) and turned Ready once its
//! containers' probes pass, as a kubelet would. Stop order: the operator, Envoy, the EPPs, the
//! model servers, the block manager, NATS.
//!
//! What the stack plays besides a kubelet (see [`super::podexec`] for the rules):
//!
//! - **ConfigMap volumes follow the API server**: a background task owned by the stack rewrites
//!   every mounted ConfigMap's changed keys every [`CONFIG_MAP_REFRESH`].
//! - **The Deployment controller, in part**: each Deployment's `status` replica counts are the
//!   number of its pods running here, set whenever one starts or stops; and
//!   [`KubeStack::follow_replicas`] brings the model-server Deployments' pods to their
//!   `spec.replicas` (what the operator writes through `/scale`): new pods up to it, the newest
//!   deleted down to it. The tests call it when they want the stack to follow, so what runs is
//!   never a surprise to them.

// serde_json's `Value[&str]` and `Value[usize]` return `Null` for a missing key or a value of
// another type; they never panic, and the rendered manifests are read through them.
#![allow(clippy::indexing_slicing)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret};
use kapi::pods::{self, PodInfo};
use kapi::{Authorization, Kapi, KapiOptions, Token};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};

use super::chart::{ChartError, Helm, Rendered};
use super::gateway::{GatewayConfig, envoy_yaml};
use super::podexec::{self, Launch, LaunchError, Lookup, PodContext};
use crate::stack::bins;
use crate::stack::probe;
use crate::stack::process::{Proc, Spec};
use crate::stack::{Component, StackError};

/// The node every emulated pod runs on.
pub const NODE: &str = "node-a";

/// How often mounted ConfigMaps are re-read (a kubelet's sync period plus its cache TTL make
/// that up to about a minute in a real cluster).
pub const CONFIG_MAP_REFRESH: Duration = Duration::from_millis(500);

/// Why the Kubernetes stack failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeStackError {
    /// A process, a file or a binary.
    #[error(transparent)]
    Stack(#[from] StackError),
    /// The test API server.
    #[error(transparent)]
    Kapi(#[from] kapi::KapiError),
    /// Helm.
    #[error(transparent)]
    Chart(#[from] ChartError),
    /// A rendered container cannot run here.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// An API request.
    #[error("API request: {0}")]
    Api(#[from] kube::Error),
    /// The chart rendered something the stack cannot use.
    #[error("rendered chart: {0}")]
    Manifest(String),
    /// A pod did not become ready.
    #[error("pod {pod} not ready within {waited:?}: {why}")]
    NotReady {
        /// The pod.
        pod: String,
        /// How long was waited.
        waited: Duration,
        /// What was not ready.
        why: String,
    },
}

/// What to install and run.
#[derive(Debug, Clone)]
pub struct KubeStackConfig {
    /// The Helm release.
    pub release: String,
    /// Its namespace.
    pub namespace: String,
    /// The served model.
    pub model: String,
    /// `kvgate-sim` model-server replicas.
    pub engines: usize,
    /// EPP replicas.
    pub epp_replicas: usize,
    /// Extra `kvgate-sim` arguments (through the chart's `modelServers[].args`).
    pub engine_args: Vec<String>,
    /// Extra values documents, applied after the stack's own.
    pub values: Vec<String>,
    /// Run the block manager DaemonSet's pod.
    pub kvbm: bool,
    /// kapi's RBAC mode with a static token per ServiceAccount (else every request is admin).
    pub rbac: bool,
    /// Where kvgate's binaries are (next to the running executable when `None`).
    pub bin_dir: Option<PathBuf>,
    /// Envoy (the workspace venv's when `None`).
    pub envoy: Option<PathBuf>,
    /// `nats-server`.
    pub nats_server: PathBuf,
    /// Run directory (a fresh one when `None`).
    pub run_dir: Option<PathBuf>,
    /// How long each pod may take to become ready.
    pub ready_timeout: Duration,
    /// How long a stopped process may take to exit before it is killed.
    pub stop_grace: Duration,
    /// `RUST_LOG` given to kvgate's containers through the chart (`epp.logLevel`).
    pub log_level: String,
}

impl Default for KubeStackConfig {
    fn default() -> Self {
        Self {
            release: "kvgate".into(),
            namespace: "llm".into(),
            model: "m".into(),
            engines: 3,
            epp_replicas: 1,
            engine_args: vec!["--time-scale=10".into()],
            values: Vec::new(),
            kvbm: false,
            rbac: true,
            bin_dir: None,
            envoy: None,
            nats_server: PathBuf::from("nats-server"),
            run_dir: None,
            ready_timeout: Duration::from_secs(30),
            stop_grace: Duration::from_secs(5),
            log_level: "info".into(),
        }
    }
}

/// The pool's pod label (the InferencePool's selector).
pub const POOL_LABEL: (&str, &str) = ("app", "kvgate-sim");

impl KubeStackConfig {
    /// The stack's own values (before [`KubeStackConfig::values`]): the model, the pool's
    /// selector, external NATS at `nats`, the EPP replicas, the simulated model servers, and
    /// the block manager without GPU node constraints.
    pub fn base_values(&self, nats: SocketAddr) -> String {
        let args: Vec<String> = self
            .engine_args
            .iter()
            .map(|a| serde_json::to_string(a).unwrap_or_default())
            .collect();
        format!(
            "model: {{name: {model}}}\n\
             inferencePool: {{selector: {{{k}: {v}}}}}\n\
             nats: {{mode: external, url: \"nats://{nats}\"}}\n\
             epp: {{replicas: {replicas}, logLevel: {log}}}\n\
             modelServers:\n  - {{name: sim, engine: sim, replicas: {engines}, args: [{args}]}}\n\
             kvbm: {{enabled: {kvbm}, hostMemoryGiB: 1, nodeSelector: {{}}, tolerations: []}}\n",
            model = self.model,
            k = POOL_LABEL.0,
            v = POOL_LABEL.1,
            replicas = self.epp_replicas,
            log = self.log_level,
            engines = self.engines,
            args = args.join(", "),
            kvbm = self.kvbm,
        )
    }
}

/// Loopback addresses for pods: `127.<a>.<b>.<n>`, `<a>.<b>` random per stack so that stacks
/// running side by side do not meet; `.1` is the NATS "service".
#[derive(Debug)]
struct LoopbackNet {
    a: u8,
    b: u8,
    next: u8,
}

impl LoopbackNet {
    fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(17);
        let bytes = seed.to_le_bytes();
        Self {
            a: bytes[0] % 250 + 2,
            b: bytes[1] ^ bytes[3],
            next: 2,
        }
    }

    fn service(&self) -> Ipv4Addr {
        Ipv4Addr::new(127, self.a, self.b, 1)
    }

    fn next(&mut self) -> Ipv4Addr {
        let ip = Ipv4Addr::new(127, self.a, self.b, self.next);
        self.next = self.next.wrapping_add(1).max(2);
        ip
    }
}

/// What a running emulated pod is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodKind {
    /// A model server (engine and sidecar) of the named Deployment.
    ModelServer(String),
    /// EPP replica `n`.
    Epp(usize),
    /// The block manager on [`NODE`].
    Kvbm,
    /// Operator replica `n`.
    Operator(usize),
}

/// A running emulated pod.
#[derive(Debug)]
struct PodRun {
    ctx: PodContext,
    kind: PodKind,
    /// Creation order across the stack (the newest pod has the largest).
    seq: usize,
    /// The Deployment it belongs to (none for the DaemonSet's pod).
    deployment: Option<String>,
    /// Its containers' named ports.
    ports: BTreeMap<String, u16>,
    /// The Deployment/DaemonSet container specs it runs (for restarts).
    procs: Vec<(Component, Proc)>,
}

/// What [`KubeStack::follow_replicas`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Followed {
    /// Pods started (Ready), in order.
    pub started: Vec<String>,
    /// Pods deleted, in order.
    pub deleted: Vec<String>,
}

impl Followed {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.started.is_empty() && self.deleted.is_empty()
    }
}

/// A running pod's ConfigMap volume.
#[derive(Debug, Clone)]
struct ConfigMapVolume {
    /// The pod.
    pod: String,
    /// The ConfigMap.
    config_map: String,
    /// Whether the ConfigMap may be missing (then the directory is empty).
    optional: bool,
    /// The volume's directory.
    dir: PathBuf,
}

/// The ConfigMap volumes of the running pods, and the task keeping them current.
#[derive(Debug)]
struct Refresher {
    volumes: Arc<Mutex<Vec<ConfigMapVolume>>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Refresher {
    fn start(client: kube::Client, namespace: String) -> Self {
        let volumes = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn(refresh_config_maps(client, namespace, Arc::clone(&volumes)));
        Self {
            volumes,
            task: Some(task),
        }
    }

    fn add(&self, added: Vec<ConfigMapVolume>) {
        self.volumes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(added);
    }

    fn remove_pod(&self, pod: &str) {
        self.volumes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|v| v.pod != pod);
    }

    fn stop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl Drop for Refresher {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The programs.
#[derive(Debug, Clone)]
struct Programs {
    bin_dir: PathBuf,
    envoy: PathBuf,
    nats: PathBuf,
}

/// kvgate, installed by its chart into the test API server and running here.
pub struct KubeStack {
    config: KubeStackConfig,
    run_dir: PathBuf,
    kapi: Kapi,
    client: kube::Client,
    helm: Helm,
    programs: Programs,
    net: LoopbackNet,
    nats_addr: SocketAddr,
    nats: Option<Proc>,
    values: Vec<String>,
    manifest: Rendered,
    pods: BTreeMap<String, PodRun>,
    next_pod: usize,
    envoy: Option<Proc>,
    gateway: GatewayConfig,
    refresher: Refresher,
}

impl KubeStack {
    /// Installs the chart and starts everything; see the module docs for the order.
    pub async fn start(config: KubeStackConfig) -> Result<KubeStack, KubeStackError> {
        let run_dir = make_run_dir(config.run_dir.as_deref())?;
        let programs = Programs {
            bin_dir: match &config.bin_dir {
                Some(d) => d.clone(),
                None => bins::exe_dir()?,
            },
            envoy: match &config.envoy {
                Some(p) => bins::existing("envoy", p.clone(), "pass an existing Envoy binary")?,
                None => bins::venv_envoy()?,
            },
            nats: bins::on_path(&config.nats_server).ok_or_else(|| StackError::MissingBinary {
                name: "nats-server".into(),
                path: config.nats_server.clone(),
                hint: "install it (Debian: apt-get install nats-server)".into(),
            })?,
        };
        for name in ["kvgate-epp", "kvgate-sidecar", "kvgate-sim", "kvgate-kvbm"] {
            bins::existing(
                name,
                programs.bin_dir.join(name),
                "build them first: cargo build -p kvgate-e2e -p kvgate-epp -p kvgate-sidecar -p kvgate-kvbm",
            )?;
        }
        let mut net = LoopbackNet::new();
        let nats_addr = SocketAddr::from((net.service(), 4222));
        let _ = net.next();
        let mut values = vec![config.base_values(nats_addr)];
        values.extend(config.values.iter().cloned());
        let tools = kapi::Tools::locate()?;
        let offline = Helm::new(&tools.helm, run_dir.join("helm"));
        let preview = offline.template(&config.release, &config.namespace, &refs(&values))?;
        if operator_of(&preview).is_some() {
            bins::existing(
                "kvgate-operator",
                programs.bin_dir.join("kvgate-operator"),
                "the chart runs the operator; build it first: cargo build -p kvgate-operator",
            )?;
        }
        let tokens: Vec<Token> = preview
            .of_kind("ServiceAccount")
            .filter_map(|sa| sa["metadata"]["name"].as_str())
            .map(|name| Token::service_account(&sa_token(name), &config.namespace, name))
            .collect();
        let kapi = Kapi::start(KapiOptions {
            authorization: if config.rbac {
                Authorization::Rbac
            } else {
                Authorization::AlwaysAllow
            },
            tokens,
            ..KapiOptions::default()
        })
        .await?;
        let client = kapi.client().await?;
        kapi::crds::install_dir(&client, &kapi::crds::test_copies_dir(), |_| true).await?;
        pods::ensure_namespace(&client, &config.namespace).await?;
        let helm = offline.with_kubeconfig(kapi.kubeconfig());
        let refresher = Refresher::start(client.clone(), config.namespace.clone());
        let mut stack = KubeStack {
            gateway: GatewayConfig {
                listen: SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?)),
                admin_port: free_port()?,
                epp: Vec::new(),
                observer: Vec::new(),
                epp_tls: true,
                paths: Vec::new(),
                request_timeout: Duration::from_secs(300),
            },
            config,
            run_dir,
            kapi,
            client,
            helm,
            programs,
            net,
            nats_addr,
            nats: None,
            values,
            manifest: Rendered::default(),
            pods: BTreeMap::new(),
            next_pod: 0,
            envoy: None,
            refresher,
        };
        stack.start_nats()?;
        stack.helm.install(
            &stack.config.release,
            &stack.config.namespace,
            &refs(&stack.values),
        )?;
        stack.manifest = stack
            .helm
            .manifest(&stack.config.release, &stack.config.namespace)?;
        if stack.manifest.of_kind("DaemonSet").next().is_some() {
            stack.start_pod(PodKind::Kvbm).await?;
        }
        for deployment in stack.model_server_deployments() {
            let replicas = stack.replicas("Deployment", &deployment)?;
            for _ in 0..replicas {
                stack
                    .start_pod(PodKind::ModelServer(deployment.clone()))
                    .await?;
            }
        }
        let epp = stack.epp_deployment()?;
        for n in 0..stack.replicas("Deployment", &epp)? {
            stack.start_pod(PodKind::Epp(n)).await?;
        }
        if let Some(operator) = operator_of(&stack.manifest) {
            for n in 0..stack.replicas("Deployment", &operator)? {
                stack.start_pod(PodKind::Operator(n)).await?;
            }
        }
        stack.start_envoy()?;
        tracing::info!(
            run_dir = %stack.run_dir.display(),
            base_url = %stack.base_url(),
            api = %stack.kapi.server_url(),
            "Kubernetes stack ready"
        );
        Ok(stack)
    }

    /// The OpenAI base URL through the gateway.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.gateway.listen)
    }

    /// The gateway's listener.
    pub fn gateway_addr(&self) -> SocketAddr {
        self.gateway.listen
    }

    /// Where configs and logs are.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The test API server (to stop and start it, or restore its etcd).
    pub fn kapi_mut(&mut self) -> &mut Kapi {
        &mut self.kapi
    }

    /// The test API server.
    pub fn kapi(&self) -> &Kapi {
        &self.kapi
    }

    /// A kubeconfig authenticating as the ServiceAccount `name` of the release's namespace
    /// (what its pods use).
    pub fn kubeconfig_of(&self, service_account: &str) -> Result<PathBuf, KubeStackError> {
        Ok(self
            .kapi
            .kubeconfig_for(&format!("sa-{service_account}"), &sa_token(service_account))?)
    }

    /// An admin client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The configuration.
    pub fn config(&self) -> &KubeStackConfig {
        &self.config
    }

    /// The installed release's manifests.
    pub fn manifest(&self) -> &Rendered {
        &self.manifest
    }

    /// Helm, bound to the test API server.
    pub fn helm(&self) -> &Helm {
        &self.helm
    }

    /// Running pods: name, kind and IP, by name.
    pub fn pods(&self) -> Vec<(String, PodKind, Ipv4Addr)> {
        self.pods
            .iter()
            .map(|(n, p)| (n.clone(), p.kind.clone(), p.ctx.ip))
            .collect()
    }

    /// The model-server pods' endpoints (`ip:port` of each target port).
    pub fn endpoints(&self) -> Vec<String> {
        let ports = self.target_ports();
        self.pods
            .values()
            .filter(|p| matches!(p.kind, PodKind::ModelServer(_)))
            .flat_map(|p| ports.iter().map(move |port| format!("{}:{port}", p.ctx.ip)))
            .collect()
    }

    /// The EPP replica `n`'s metrics URL.
    pub fn epp_metrics_url(&self, n: usize) -> Option<String> {
        let pod = self.pods.values().find(|p| p.kind == PodKind::Epp(n))?;
        let port = self.epp_port("http-metrics").unwrap_or(9090);
        Some(format!("http://{}:{port}/metrics", pod.ctx.ip))
    }

    /// The EPP replica `n`'s metrics page.
    pub fn epp_metrics(&self, n: usize) -> std::io::Result<String> {
        let pod = self
            .pods
            .values()
            .find(|p| p.kind == PodKind::Epp(n))
            .ok_or_else(|| std::io::Error::other(format!("no EPP replica {n}")))?;
        let port = self.epp_port("http-metrics").unwrap_or(9090);
        page(SocketAddr::from((pod.ctx.ip, port)), "/metrics")
    }

    /// A component's log file.
    pub fn log(&self, component: Component) -> PathBuf {
        self.run_dir.join(format!("{component}.log"))
    }

    /// Operator replica `n`'s log file.
    pub fn operator_log(&self, n: usize) -> PathBuf {
        self.run_dir.join(format!("operator-{n}.log"))
    }

    /// The address of a running pod's container port named `port` (`http-metrics`,
    /// `kvgate-metrics`, `http-engine`, …), from its template's containers.
    pub fn pod_addr(&self, pod: &str, port: &str) -> Option<SocketAddr> {
        let run = self.pods.get(pod)?;
        let number = run.ports.get(port)?;
        Some(SocketAddr::from((run.ctx.ip, *number)))
    }

    /// `GET path` on a running pod's named container port; the body of a 200.
    pub fn pod_page(&self, pod: &str, port: &str, path: &str) -> std::io::Result<String> {
        let addr = self
            .pod_addr(pod, port)
            .ok_or_else(|| std::io::Error::other(format!("no pod {pod} with a port {port}")))?;
        page(addr, path)
    }

    /// The running pods of the Deployment `deployment`, oldest first: `(name, IP)`.
    pub fn pods_of(&self, deployment: &str) -> Vec<(String, Ipv4Addr)> {
        let mut runs: Vec<(&String, &PodRun)> = self
            .pods
            .iter()
            .filter(|(_, p)| p.deployment.as_deref() == Some(deployment))
            .collect();
        runs.sort_by_key(|(_, p)| p.seq);
        runs.into_iter()
            .map(|(n, p)| (n.clone(), p.ctx.ip))
            .collect()
    }

    /// The Deployment of the chart's `modelServers` entry `entry` (component
    /// `model-server-<entry>`).
    pub fn model_server_deployment(&self, entry: &str) -> Option<String> {
        let component = format!("model-server-{entry}");
        self.manifest
            .of_kind("Deployment")
            .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == component.as_str())
            .and_then(|d| d["metadata"]["name"].as_str().map(str::to_owned))
    }

    /// The operator replica `n`'s metrics page.
    pub fn operator_metrics(&self, n: usize) -> std::io::Result<String> {
        let name = self
            .pods
            .iter()
            .find(|(_, p)| p.kind == PodKind::Operator(n))
            .map(|(name, _)| name.clone())
            .ok_or_else(|| std::io::Error::other(format!("no operator replica {n}")))?;
        self.pod_page(&name, "http-metrics", "/metrics")
    }

    /// Plays the Deployment controller once for the model-server Deployments: reads each one's
    /// `spec.replicas` from the API server, starts pods up to it (each returned once Ready),
    /// and deletes the newest pods down to it. Status follows (see the module docs).
    pub async fn follow_replicas(&mut self) -> Result<Followed, KubeStackError> {
        let api: Api<Deployment> = Api::namespaced(self.client.clone(), &self.config.namespace);
        let mut followed = Followed::default();
        for deployment in self.model_server_deployments() {
            let scale = api.get_scale(&deployment).await?;
            let want = scale
                .spec
                .and_then(|s| s.replicas)
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(0);
            let mut running = self.pods_of(&deployment).len();
            while running < want {
                let name = self
                    .start_pod(PodKind::ModelServer(deployment.clone()))
                    .await?;
                tracing::info!(pod = %name, %deployment, replicas = want, "scaled up: pod started");
                followed.started.push(name);
                running += 1;
            }
            while running > want {
                let Some((newest, _)) = self.pods_of(&deployment).pop() else {
                    break;
                };
                self.delete_pod(&newest).await?;
                tracing::info!(pod = %newest, %deployment, replicas = want, "scaled down: pod deleted");
                followed.deleted.push(newest);
                running -= 1;
            }
        }
        Ok(followed)
    }

    /// Starts one more model-server pod of the first model-server Deployment (a scale-up);
    /// returns its name once it is Ready.
    pub async fn add_model_server(&mut self) -> Result<String, KubeStackError> {
        let deployment = self
            .model_server_deployments()
            .into_iter()
            .next()
            .ok_or_else(|| KubeStackError::Manifest("no model-server Deployment".into()))?;
        self.start_pod(PodKind::ModelServer(deployment)).await
    }

    /// Deletes a pod as Kubernetes would: the object gets its deletion timestamp, the
    /// processes get SIGTERM (and SIGKILL after the grace period), then the object goes.
    pub async fn delete_pod(&mut self, name: &str) -> Result<(), KubeStackError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.config.namespace);
        api.delete(name, &DeleteParams::default()).await?;
        self.refresher.remove_pod(name);
        let deployment = match self.pods.remove(name) {
            Some(run) => {
                let grace = self.config.stop_grace;
                tokio::task::block_in_place(|| {
                    for (_, proc) in run.procs.into_iter().rev() {
                        proc.stop(grace);
                    }
                });
                run.deployment
            }
            None => None,
        };
        match api
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
        if let Some(d) = deployment {
            self.sync_deployment_status(&d).await?;
        }
        Ok(())
    }

    /// Crashes a pod: its processes are killed (SIGKILL) and the Pod object stays, as when a
    /// node's container runtime loses them; nothing restarts them.
    pub fn kill_pod(&mut self, name: &str) -> Result<(), KubeStackError> {
        let run = self
            .pods
            .remove(name)
            .ok_or_else(|| KubeStackError::Manifest(format!("no running pod {name}")))?;
        tokio::task::block_in_place(|| {
            for (_, proc) in run.procs.into_iter().rev() {
                proc.kill();
            }
        });
        Ok(())
    }

    /// Flips a pod's `Ready` condition (its processes keep running).
    pub async fn set_ready(&self, name: &str, ready: bool) -> Result<(), KubeStackError> {
        pods::set_ready(&self.client, &self.config.namespace, name, ready).await?;
        Ok(())
    }

    /// `helm upgrade` with the stack's values plus `extra`; returns the new manifests. Pods
    /// keep running (the tests restart what they need).
    pub fn upgrade(&mut self, extra: &[String]) -> Result<&Rendered, KubeStackError> {
        let mut values = self.values.clone();
        values.extend(extra.iter().cloned());
        self.helm
            .upgrade(&self.config.release, &self.config.namespace, &refs(&values))?;
        self.values = values;
        self.manifest = self
            .helm
            .manifest(&self.config.release, &self.config.namespace)?;
        Ok(&self.manifest)
    }

    /// The first process that exited on its own, as an error naming it and its log.
    pub fn check(&mut self) -> Result<(), StackError> {
        for proc in self
            .pods
            .values_mut()
            .flat_map(|p| p.procs.iter_mut().map(|(_, pr)| pr))
            .chain(self.nats.iter_mut())
            .chain(self.envoy.iter_mut())
        {
            if let Some(status) = proc.exited() {
                return Err(proc.exited_error(status));
            }
        }
        Ok(())
    }

    /// Stops the operator, Envoy, the EPPs, the model servers, the block manager and NATS, in
    /// that order; the API server stops when the stack is dropped.
    pub fn stop(mut self) {
        self.refresher.stop();
        let grace = self.config.stop_grace;
        let stop_run = |run: PodRun| {
            for (_, proc) in run.procs.into_iter().rev() {
                proc.stop(grace);
            }
        };
        let (operators, mut rest): (Vec<PodRun>, Vec<PodRun>) = std::mem::take(&mut self.pods)
            .into_values()
            .partition(|r| matches!(r.kind, PodKind::Operator(_)));
        operators.into_iter().for_each(stop_run);
        if let Some(e) = self.envoy.take() {
            e.stop(grace);
        }
        rest.sort_by_key(|r| match r.kind {
            PodKind::Operator(_) | PodKind::Epp(_) => 0,
            PodKind::ModelServer(_) => 1,
            PodKind::Kvbm => 2,
        });
        rest.into_iter().for_each(stop_run);
        if let Some(n) = self.nats.take() {
            n.stop(grace);
        }
    }

    fn start_nats(&mut self) -> Result<(), KubeStackError> {
        let spec = Spec {
            component: Component::Nats,
            program: self.programs.nats.clone(),
            args: vec![
                "-a".into(),
                self.nats_addr.ip().to_string(),
                "-p".into(),
                self.nats_addr.port().to_string(),
            ],
            env: Vec::new(),
            log: self.log(Component::Nats),
        };
        let mut proc = Proc::spawn(spec)?;
        let addr = self.nats_addr;
        proc.wait_ready(self.config.ready_timeout, || {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)).is_ok()
        })?;
        self.nats = Some(proc);
        Ok(())
    }

    fn start_envoy(&mut self) -> Result<(), KubeStackError> {
        let ext_proc = self.epp_port("grpc-ext-proc").unwrap_or(9002);
        self.gateway.epp = self
            .pods
            .values()
            .filter(|p| matches!(p.kind, PodKind::Epp(_)))
            .map(|p| SocketAddr::from((p.ctx.ip, ext_proc)))
            .collect();
        // The chart's response-observer layout: the EPP pods' observer port.
        self.gateway.observer = match self.epp_port("grpc-observer") {
            Some(port) => self
                .pods
                .values()
                .filter(|p| matches!(p.kind, PodKind::Epp(_)))
                .map(|p| SocketAddr::from((p.ctx.ip, port)))
                .collect(),
            None => Vec::new(),
        };
        let epp = self.epp_deployment()?;
        let args = self.container(&epp, "epp")?["args"].clone();
        self.gateway.epp_tls = !args
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| a == "--plaintext");
        self.gateway.paths = match self.manifest.of_kind("HTTPRoute").next() {
            Some(route) => route["spec"]["rules"][0]["matches"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["path"]["value"].as_str().map(str::to_owned))
                .collect(),
            // No HTTPRoute in the release: the chart's default paths.
            None => ["/v1/completions", "/v1/chat/completions", "/v1/models"]
                .map(String::from)
                .to_vec(),
        };
        let path = self.run_dir.join("envoy.yaml");
        std::fs::write(&path, envoy_yaml(&self.gateway)).map_err(|source| StackError::Io {
            what: format!("writing {}", path.display()),
            source,
        })?;
        let spec = Spec {
            component: Component::Envoy,
            program: self.programs.envoy.clone(),
            args: vec![
                "-c".into(),
                path.display().to_string(),
                "--log-level".into(),
                "warn".into(),
                "--disable-hot-restart".into(),
                "--concurrency".into(),
                "2".into(),
            ],
            env: Vec::new(),
            log: self.log(Component::Envoy),
        };
        let mut proc = Proc::spawn(spec)?;
        let admin = SocketAddr::from((self.gateway.listen.ip(), self.gateway.admin_port));
        tokio::task::block_in_place(|| {
            proc.wait_ready(self.config.ready_timeout, || {
                matches!(
                    probe::http_request_at(admin, "GET", "/ready", Duration::from_millis(500)),
                    Ok((200, _))
                )
            })
        })?;
        self.envoy = Some(proc);
        Ok(())
    }

    fn model_server_deployments(&self) -> Vec<String> {
        self.manifest
            .of_kind("Deployment")
            .filter(|d| {
                d["metadata"]["labels"]["app.kubernetes.io/component"]
                    .as_str()
                    .is_some_and(|c| c.starts_with("model-server-"))
            })
            .filter_map(|d| d["metadata"]["name"].as_str().map(str::to_owned))
            .collect()
    }

    fn operator_deployment(&self) -> Result<String, KubeStackError> {
        operator_of(&self.manifest)
            .ok_or_else(|| KubeStackError::Manifest("no operator Deployment".into()))
    }

    fn epp_deployment(&self) -> Result<String, KubeStackError> {
        self.manifest
            .of_kind("Deployment")
            .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "epp")
            .and_then(|d| d["metadata"]["name"].as_str().map(str::to_owned))
            .ok_or_else(|| KubeStackError::Manifest("no EPP Deployment".into()))
    }

    fn replicas(&self, kind: &str, name: &str) -> Result<usize, KubeStackError> {
        let obj = self
            .manifest
            .get(kind, name)
            .ok_or_else(|| KubeStackError::Manifest(format!("no {kind} {name}")))?;
        Ok(obj["spec"]["replicas"].as_u64().unwrap_or(1) as usize)
    }

    fn workload(&self, kind: &PodKind) -> Result<Value, KubeStackError> {
        let (k, name) = match kind {
            PodKind::ModelServer(d) => ("Deployment", d.clone()),
            PodKind::Epp(_) => ("Deployment", self.epp_deployment()?),
            PodKind::Operator(_) => ("Deployment", self.operator_deployment()?),
            PodKind::Kvbm => (
                "DaemonSet",
                self.manifest
                    .of_kind("DaemonSet")
                    .next()
                    .and_then(|d| d["metadata"]["name"].as_str().map(str::to_owned))
                    .ok_or_else(|| KubeStackError::Manifest("no DaemonSet".into()))?,
            ),
        };
        self.manifest
            .get(k, &name)
            .cloned()
            .ok_or_else(|| KubeStackError::Manifest(format!("no {k} {name}")))
    }

    fn container(&self, deployment: &str, name: &str) -> Result<Value, KubeStackError> {
        self.manifest
            .get("Deployment", deployment)
            .and_then(|d| {
                d["spec"]["template"]["spec"]["containers"]
                    .as_array()?
                    .iter()
                    .find(|c| c["name"] == name)
                    .cloned()
            })
            .ok_or_else(|| KubeStackError::Manifest(format!("no container {name} in {deployment}")))
    }

    fn epp_port(&self, name: &str) -> Option<u16> {
        let epp = self.epp_deployment().ok()?;
        podexec::ports(&self.container(&epp, "epp").ok()?)
            .get(name)
            .copied()
    }

    fn target_ports(&self) -> Vec<u16> {
        self.manifest
            .of_kind("InferencePool")
            .next()
            .and_then(|p| p["spec"]["targetPorts"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|p| p["number"].as_u64().and_then(|n| u16::try_from(n).ok()))
            .collect()
    }

    /// Registers and starts one pod of `kind`; returns its name once Ready.
    async fn start_pod(&mut self, kind: PodKind) -> Result<String, KubeStackError> {
        let workload = self.workload(&kind)?;
        let template = &workload["spec"]["template"];
        let spec = &template["spec"];
        let index = self.next_pod;
        self.next_pod += 1;
        let base = workload["metadata"]["name"].as_str().unwrap_or("pod");
        let name = match &kind {
            PodKind::Epp(n) | PodKind::Operator(n) => format!("{base}-{n}"),
            PodKind::Kvbm => format!("{base}-{NODE}"),
            PodKind::ModelServer(_) => format!("{base}-{index}"),
        };
        let deployment = (workload["kind"] == "Deployment").then(|| base.to_owned());
        let ip = self.net.next();
        let ctx = PodContext {
            name: name.clone(),
            namespace: self.config.namespace.clone(),
            node: NODE.to_owned(),
            ip,
            service_account: spec["serviceAccountName"]
                .as_str()
                .unwrap_or("default")
                .to_owned(),
        };
        let labels: BTreeMap<String, String> = template["metadata"]["labels"]
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
            .collect();
        let containers: Vec<Value> = spec["containers"].as_array().cloned().unwrap_or_default();
        let registered = containers
            .iter()
            .map(registered_container)
            .collect::<Result<Vec<Container>, _>>()?;
        pods::create_with_containers(
            &self.client,
            &self.config.namespace,
            &PodInfo {
                name: name.clone(),
                labels,
                node: NODE.to_owned(),
                ip: ip.into(),
                ready: false,
            },
            &registered,
        )
        .await?;
        let pod_dir = self.run_dir.join("pods").join(&name);
        let (volume_dirs, config_maps) = self.materialize_volumes(&name, spec, &pod_dir).await?;
        let lookup = self.prefetch(spec).await?;
        let mut run = PodRun {
            ctx,
            kind: kind.clone(),
            seq: index,
            deployment: deployment.clone(),
            ports: containers.iter().flat_map(podexec::ports).collect(),
            procs: Vec::new(),
        };
        for container in &containers {
            let mounts = podexec::mounts(container, |v| {
                volume_dirs
                    .get(v)
                    .cloned()
                    .unwrap_or_else(|| pod_dir.join("volumes").join(v))
            });
            let mut launch = podexec::launch(
                container,
                &run.ctx,
                &self.programs.bin_dir,
                &mounts,
                &lookup,
            )?;
            if spec["automountServiceAccountToken"].as_bool() == Some(true) {
                let kubeconfig = self.kapi.kubeconfig_for(
                    &format!("sa-{}", run.ctx.service_account),
                    &sa_token(&run.ctx.service_account),
                )?;
                launch
                    .env
                    .push(("KUBECONFIG".into(), kubeconfig.display().to_string()));
            }
            let (component, log) = match (&kind, launch.container.as_str()) {
                (PodKind::Epp(n), _) => {
                    let c = Component::EppReplica(*n);
                    (c, self.log(c))
                }
                (PodKind::Kvbm, _) => (Component::Kvbm, self.log(Component::Kvbm)),
                (PodKind::ModelServer(_), "kvgate-sidecar") => {
                    let c = Component::Sidecar(index);
                    (c, self.log(c))
                }
                (PodKind::ModelServer(_), _) => {
                    let c = Component::Engine(index);
                    (c, self.log(c))
                }
                // `stack::Component` has no operator variant: its errors name `router`, and
                // its log is the operator's own (`operator-<n>.log`).
                (PodKind::Operator(n), _) => (Component::Router, self.operator_log(*n)),
            };
            let proc = self.spawn(component, log, &launch, container, ip, &kind)?;
            run.procs.push((component, proc));
        }
        pods::set_status(&self.client, &self.config.namespace, &name, ip.into(), true).await?;
        tracing::info!(pod = %name, %ip, kind = ?kind, "pod ready");
        self.refresher.add(config_maps);
        self.pods.insert(name.clone(), run);
        if let Some(d) = deployment {
            self.sync_deployment_status(&d).await?;
        }
        Ok(name)
    }

    /// Sets the Deployment's status replica counts to its pods running here, as the
    /// Deployment controller would once they are Ready.
    async fn sync_deployment_status(&self, deployment: &str) -> Result<(), KubeStackError> {
        let api: Api<Deployment> = Api::namespaced(self.client.clone(), &self.config.namespace);
        let generation = api.get(deployment).await?.metadata.generation;
        let n = self.pods_of(deployment).len();
        let patch = json!({"status": {
            "observedGeneration": generation,
            "replicas": n,
            "readyReplicas": n,
            "availableReplicas": n,
            "updatedReplicas": n,
        }});
        api.patch_status(deployment, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    fn spawn(
        &self,
        component: Component,
        log: PathBuf,
        launch: &Launch,
        container: &Value,
        ip: Ipv4Addr,
        kind: &PodKind,
    ) -> Result<Proc, KubeStackError> {
        let spec = Spec {
            component,
            program: launch.program.clone(),
            args: launch.args.clone(),
            env: launch.env.clone(),
            log,
        };
        let mut proc = Proc::spawn(spec)?;
        let ports = podexec::ports(container);
        let probe_path = container["readinessProbe"]["httpGet"]["path"]
            .as_str()
            .map(str::to_owned);
        let probe_port = container["readinessProbe"]["httpGet"]["port"].clone();
        let probe_port = match &probe_port {
            Value::Number(n) => n.as_u64().and_then(|n| u16::try_from(n).ok()),
            Value::String(s) => ports.get(s).copied(),
            _ => None,
        };
        let nats = self.nats_addr;
        let expect_ready = self.ready_endpoint_count();
        let is_epp = matches!(kind, PodKind::Epp(_));
        let engine_port = ports.get("http-engine").copied();
        let ready = move || -> bool {
            let get = |port: u16, path: &str| {
                probe::http_request_at(
                    SocketAddr::from((ip, port)),
                    "GET",
                    path,
                    Duration::from_millis(500),
                )
            };
            if is_epp {
                // gRPC readiness is discovery synced; here: the pool's ready endpoints are
                // all known and the KV-event subscription is up.
                let port = ports.get("http-metrics").copied().unwrap_or(9090);
                return get(port, "/metrics").is_ok_and(|(s, page)| {
                    s == 200
                        && probe::metric_sum(&page, "kvgate_epp_nats_connected")
                            .is_some_and(|v| v >= 1.0)
                        && probe::metric_sum(&page, "inference_pool_ready_pods")
                            .is_some_and(|v| v as usize == expect_ready)
                        && std::net::TcpStream::connect_timeout(&nats, Duration::from_millis(200))
                            .is_ok()
                });
            }
            match (&probe_path, probe_port, engine_port) {
                (Some(path), Some(port), _) => matches!(get(port, path), Ok((200, _))),
                (None, _, Some(port)) => matches!(get(port, "/health"), Ok((200, _))),
                _ => true,
            }
        };
        tokio::task::block_in_place(|| proc.wait_ready(self.config.ready_timeout, ready))?;
        Ok(proc)
    }

    /// Ready model-server endpoints: pods × target ports.
    fn ready_endpoint_count(&self) -> usize {
        self.pods
            .values()
            .filter(|p| matches!(p.kind, PodKind::ModelServer(_)))
            .count()
            * self.target_ports().len().max(1)
    }

    /// Writes each Secret, ConfigMap, hostPath and scratch volume of the pod into a directory;
    /// returns the directories by volume name, and the ConfigMap volumes to keep current.
    /// hostPath volumes are shared by the node's pods. A missing Secret or ConfigMap is an
    /// error unless the volume says `optional: true` (then the directory stays empty).
    async fn materialize_volumes(
        &self,
        pod: &str,
        spec: &Value,
        pod_dir: &Path,
    ) -> Result<(BTreeMap<String, PathBuf>, Vec<ConfigMapVolume>), KubeStackError> {
        let mut dirs = BTreeMap::new();
        let mut config_maps = Vec::new();
        let ns = &self.config.namespace;
        for v in spec["volumes"].as_array().into_iter().flatten() {
            let Some(name) = v["name"].as_str() else {
                continue;
            };
            let dir = if let Some(path) = v["hostPath"]["path"].as_str() {
                self.run_dir
                    .join("nodes")
                    .join(NODE)
                    .join(path.trim_start_matches('/'))
            } else {
                pod_dir.join("volumes").join(name)
            };
            std::fs::create_dir_all(&dir).map_err(|source| {
                KubeStackError::Stack(StackError::Io {
                    what: format!("creating {}", dir.display()),
                    source,
                })
            })?;
            let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
            if let Some(secret) = v["secret"]["secretName"].as_str() {
                let optional = v["secret"]["optional"].as_bool() == Some(true);
                match Api::<Secret>::namespaced(self.client.clone(), ns)
                    .get_opt(secret)
                    .await?
                {
                    Some(s) => files.extend(
                        s.data
                            .unwrap_or_default()
                            .into_iter()
                            .map(|(k, v)| (k, v.0)),
                    ),
                    None if optional => {}
                    None => {
                        return Err(KubeStackError::Manifest(format!(
                            "pod {pod}: volume {name}: Secret {secret} not found"
                        )));
                    }
                }
            }
            if let Some(cm) = v["configMap"]["name"].as_str() {
                let optional = v["configMap"]["optional"].as_bool() == Some(true);
                match Api::<ConfigMap>::namespaced(self.client.clone(), ns)
                    .get_opt(cm)
                    .await?
                {
                    Some(c) => files.extend(config_map_files(c)),
                    None if optional => {}
                    None => {
                        return Err(KubeStackError::Manifest(format!(
                            "pod {pod}: volume {name}: ConfigMap {cm} not found"
                        )));
                    }
                }
                config_maps.push(ConfigMapVolume {
                    pod: pod.to_owned(),
                    config_map: cm.to_owned(),
                    optional,
                    dir: dir.clone(),
                });
            }
            // Only Secret and ConfigMap volumes are the objects' keys and nothing else
            // (hostPath and scratch volumes keep what is in them).
            if v["secret"].is_object() || v["configMap"].is_object() {
                write_files(&dir, &files).map_err(KubeStackError::Stack)?;
            }
            dirs.insert(name.to_owned(), dir);
        }
        Ok((dirs, config_maps))
    }

    /// Every Secret and ConfigMap key the pod's env references, read now.
    async fn prefetch(&self, spec: &Value) -> Result<Objects, KubeStackError> {
        let mut wanted: BTreeSet<(bool, String)> = BTreeSet::new();
        for c in spec["containers"].as_array().into_iter().flatten() {
            for e in c["env"].as_array().into_iter().flatten() {
                if let Some(n) = e["valueFrom"]["secretKeyRef"]["name"].as_str() {
                    wanted.insert((true, n.to_owned()));
                }
                if let Some(n) = e["valueFrom"]["configMapKeyRef"]["name"].as_str() {
                    wanted.insert((false, n.to_owned()));
                }
            }
        }
        let ns = &self.config.namespace;
        let mut objects = Objects::default();
        for (secret, name) in wanted {
            if secret {
                match Api::<Secret>::namespaced(self.client.clone(), ns)
                    .get(&name)
                    .await
                {
                    Ok(s) => {
                        let data = s
                            .data
                            .unwrap_or_default()
                            .into_iter()
                            .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
                            .collect();
                        objects.secrets.insert(name, data);
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            } else {
                match Api::<ConfigMap>::namespaced(self.client.clone(), ns)
                    .get(&name)
                    .await
                {
                    Ok(c) => {
                        objects.config_maps.insert(name, c.data.unwrap_or_default());
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(objects)
    }
}

impl std::fmt::Debug for KubeStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeStack")
            .field("run_dir", &self.run_dir)
            .field("api", &self.kapi.server_url())
            .field("pods", &self.pods.keys().collect::<Vec<_>>())
            .field("gateway", &self.gateway.listen)
            .finish_non_exhaustive()
    }
}

impl Drop for KubeStack {
    fn drop(&mut self) {
        self.refresher.stop();
        let (operators, others): (Vec<PodRun>, Vec<PodRun>) = std::mem::take(&mut self.pods)
            .into_values()
            .partition(|r| matches!(r.kind, PodKind::Operator(_)));
        for run in operators {
            for (_, proc) in run.procs {
                proc.kill();
            }
        }
        if let Some(e) = self.envoy.take() {
            e.kill();
        }
        for run in others {
            for (_, proc) in run.procs {
                proc.kill();
            }
        }
        if let Some(n) = self.nats.take() {
            n.kill();
        }
    }
}

/// The Deployment of the chart's operator (component `operator`), if it renders one.
fn operator_of(rendered: &Rendered) -> Option<String> {
    rendered
        .of_kind("Deployment")
        .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "operator")
        .and_then(|d| d["metadata"]["name"].as_str().map(str::to_owned))
}

/// A container as the Pod object lists it: name, image and ports as rendered (the ports are
/// what a Service's named `targetPort` resolves against).
fn registered_container(rendered: &Value) -> Result<Container, KubeStackError> {
    let c = json!({
        "name": rendered["name"],
        "image": rendered["image"],
        "ports": rendered["ports"],
    });
    serde_json::from_value(c)
        .map_err(|e| KubeStackError::Manifest(format!("container {}: {e}", rendered["name"])))
}

/// A ConfigMap's keys as files: `data` as UTF-8, `binaryData` as is.
fn config_map_files(c: ConfigMap) -> BTreeMap<String, Vec<u8>> {
    let mut files: BTreeMap<String, Vec<u8>> = c
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.into_bytes()))
        .collect();
    files.extend(
        c.binary_data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0)),
    );
    files
}

/// Makes `dir` hold exactly `files` as a kubelet's atomic writer would: each changed key is
/// written to a temporary file and renamed over the old one (a reader sees the old content or
/// the new, never a part), and files of keys no longer present are removed. Hidden files are
/// left alone. Returns whether anything changed.
fn write_files(dir: &Path, files: &BTreeMap<String, Vec<u8>>) -> Result<bool, StackError> {
    let io = |what: String| move |source| StackError::Io { what, source };
    let mut changed = false;
    for (key, bytes) in files {
        let path = dir.join(key);
        if std::fs::read(&path).is_ok_and(|old| old == *bytes) {
            continue;
        }
        let tmp = dir.join(format!(".{key}.tmp"));
        std::fs::write(&tmp, bytes).map_err(io(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(io(format!("renaming to {}", path.display())))?;
        changed = true;
    }
    let entries = std::fs::read_dir(dir).map_err(io(format!("reading {}", dir.display())))?;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let stale = !name.starts_with('.') && !files.contains_key(&name);
        if stale && entry.file_type().is_ok_and(|t| t.is_file()) {
            std::fs::remove_file(entry.path())
                .map_err(io(format!("removing {}", entry.path().display())))?;
            changed = true;
        }
    }
    Ok(changed)
}

/// Every [`CONFIG_MAP_REFRESH`], re-reads each ConfigMap mounted by a running pod and brings its
/// volumes up to date ([`write_files`]). An optional ConfigMap that is missing empties its
/// volumes (a kubelet writes an empty payload); a required one that is missing, or a failed
/// read, leaves them as they are.
async fn refresh_config_maps(
    client: kube::Client,
    namespace: String,
    volumes: Arc<Mutex<Vec<ConfigMapVolume>>>,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let mut tick = tokio::time::interval(CONFIG_MAP_REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let current: Vec<ConfigMapVolume> = volumes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let names: BTreeSet<&str> = current.iter().map(|v| v.config_map.as_str()).collect();
        for name in names {
            let found = match api.get_opt(name).await {
                Ok(found) => found,
                Err(e) => {
                    tracing::debug!(config_map = name, error = %e, "ConfigMap not re-read");
                    continue;
                }
            };
            let files = found.map(config_map_files);
            for v in current.iter().filter(|v| v.config_map == name) {
                let files = match (&files, v.optional) {
                    (Some(f), _) => f,
                    (None, true) => &BTreeMap::new(),
                    (None, false) => continue,
                };
                match write_files(&v.dir, files) {
                    Ok(true) => {
                        tracing::info!(pod = %v.pod, config_map = name, "ConfigMap volume updated");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(pod = %v.pod, config_map = name, error = %e, "ConfigMap volume not updated");
                    }
                }
            }
        }
    }
}

/// Secrets and ConfigMaps read for env references.
#[derive(Debug, Default)]
struct Objects {
    secrets: BTreeMap<String, BTreeMap<String, String>>,
    config_maps: BTreeMap<String, BTreeMap<String, String>>,
}

impl Lookup for Objects {
    fn config_map_key(&self, name: &str, key: &str) -> Option<String> {
        self.config_maps.get(name)?.get(key).cloned()
    }

    fn secret_key(&self, name: &str, key: &str) -> Option<String> {
        self.secrets.get(name)?.get(key).cloned()
    }
}

/// The static token of a ServiceAccount.
fn sa_token(name: &str) -> String {
    format!("kvgate-test-token-{name}")
}

fn refs(values: &[String]) -> Vec<&str> {
    values.iter().map(String::as_str).collect()
}

fn free_port() -> Result<u16, StackError> {
    std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| StackError::Io {
            what: "choosing a free port".into(),
            source,
        })
}

fn page(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    match probe::http_request_at(addr, "GET", path, Duration::from_secs(2))? {
        (200, body) => Ok(body),
        (status, _) => Err(std::io::Error::other(format!("{path}: HTTP {status}"))),
    }
}

fn make_run_dir(dir: Option<&Path>) -> Result<PathBuf, StackError> {
    let dir = match dir {
        Some(d) => d.to_path_buf(),
        None => std::env::temp_dir().join(format!(
            "kvgate-kube.{}.{}",
            std::process::id(),
            RUN_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        )),
    };
    std::fs::create_dir_all(&dir).map_err(|source| StackError::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    Ok(dir)
}

static RUN_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn loopback_addresses_are_distinct_and_skip_the_service() {
        let mut net = LoopbackNet::new();
        let service = net.service();
        let a = net.next();
        let b = net.next();
        assert_ne!(a, b);
        assert_ne!(a, service);
        assert!(a.is_loopback() && service.is_loopback());
    }

    #[test]
    fn volume_files_are_replaced_whole_and_stale_keys_removed() {
        let dir = std::env::temp_dir().join(format!("kvgate-volume-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let files = |pairs: &[(&str, &str)]| -> BTreeMap<String, Vec<u8>> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
                .collect()
        };
        assert!(write_files(&dir, &files(&[("a", "1"), ("b", "2")])).unwrap());
        assert!(!write_files(&dir, &files(&[("a", "1"), ("b", "2")])).unwrap());
        assert!(write_files(&dir, &files(&[("a", "3")])).unwrap());
        assert_eq!(std::fs::read_to_string(dir.join("a")).unwrap(), "3");
        assert!(!dir.join("b").exists(), "a key that went away is removed");
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["a"], "no temporary file is left");
        assert!(write_files(&dir, &BTreeMap::new()).unwrap());
        assert!(
            !dir.join("a").exists(),
            "an empty payload empties the volume"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn containers_register_with_their_named_ports() {
        let rendered = json!({"name": "epp", "image": "ghcr.io/kvgate/kvgate-epp:0.1.0",
            "args": ["--x"], "ports": [{"name": "http-metrics", "containerPort": 9090, "protocol": "TCP"}]});
        let c = registered_container(&rendered).unwrap();
        assert_eq!(c.name, "epp");
        assert!(c.args.is_none(), "only name, image and ports");
        let ports = c.ports.unwrap();
        assert_eq!(ports[0].name.as_deref(), Some("http-metrics"));
        assert_eq!(ports[0].container_port, 9090);
        let bare = registered_container(&json!({"name": "x", "image": "y"})).unwrap();
        assert!(bare.ports.is_none());
    }

    #[test]
    fn base_values_pass_the_chart_schema_shape() {
        let v = KubeStackConfig::default().base_values("127.9.9.1:4222".parse().unwrap());
        let parsed: serde_json::Value = serde_yaml_ng::from_str(&v).unwrap();
        assert_eq!(parsed["nats"]["url"], "nats://127.9.9.1:4222");
        assert_eq!(parsed["modelServers"][0]["args"][0], "--time-scale=10");
        assert_eq!(parsed["inferencePool"]["selector"]["app"], "kvgate-sim");
    }
}
