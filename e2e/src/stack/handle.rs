//! [`Stack`]: the running local stack. Starts every component in dependency order (NATS,
//! engines, sidecars, EPP, Envoy), each waited for with a bounded readiness probe; lets callers
//! kill, stop, restart or freeze one component, change the EPP's policy, and notice a component
//! that died. Dropping a stack kills what is left; [`Stack::stop`] stops it gracefully.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use scheduler::Policy;

use super::bins::Binaries;
use super::config::{Component, KvEventsPath, Router, StackConfig};
use super::error::StackError;
use super::ports::{EppPorts, Ports};
use super::probe;
use super::process::{Proc, Spec};
use super::render;

const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// A running local stack.
#[derive(Debug)]
pub struct Stack {
    config: StackConfig,
    ports: Ports,
    run_dir: PathBuf,
    bins: Binaries,
    procs: BTreeMap<Component, Proc>,
}

impl Stack {
    /// Validates `config`, chooses ports, writes every config file into the run directory and
    /// starts the components, each waited for (bounded by `config.ready_timeout`). On failure
    /// what was started is killed and the error names the component and its log.
    pub fn start(config: StackConfig) -> Result<Stack, StackError> {
        config.validate().map_err(StackError::Config)?;
        let bins = Binaries::locate(&config)?;
        let run_dir = make_run_dir(config.run_dir.as_deref())?;
        let ports = Ports::allocate(config.engines, config.dp_ranks, config.epp_replicas).map_err(
            |source| StackError::Io {
                what: "choosing free ports".into(),
                source,
            },
        )?;
        let mut stack = Stack {
            config,
            ports,
            run_dir,
            bins,
            procs: BTreeMap::new(),
        };
        stack.write_configs()?;
        for component in stack.config.components() {
            stack.start_component(component)?;
        }
        tracing::info!(run_dir = %stack.run_dir.display(), base_url = %stack.base_url(), "stack ready");
        Ok(stack)
    }

    /// The OpenAI base URL (through Envoy, or the peer router), `http://127.0.0.1:<port>/v1`.
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.ports.envoy_listen)
    }

    /// Where configs and logs are.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Every port (with a peer router, `envoy_listen` is its port and `envoy_admin` its
    /// Prometheus port).
    pub fn ports(&self) -> &Ports {
        &self.ports
    }

    /// The configuration (with the current policy).
    pub fn config(&self) -> &StackConfig {
        &self.config
    }

    /// The endpoints the EPP lists, `127.0.0.1:<sidecar proxy port + rank>`, by engine process
    /// index (pod-major, then rank).
    pub fn endpoints(&self) -> Vec<String> {
        self.ports
            .endpoint_ports()
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect()
    }

    /// A component's log file.
    pub fn log(&self, component: Component) -> PathBuf {
        self.run_dir.join(format!("{component}.log"))
    }

    /// A running component's process id.
    pub fn pid(&self, component: Component) -> Option<u32> {
        self.procs.get(&component).map(Proc::pid)
    }

    /// Whether the component is running (started and not stopped or killed by the stack).
    pub fn is_running(&self, component: Component) -> bool {
        self.procs.contains_key(&component)
    }

    /// The (first) EPP's `/metrics` page; replica `i`'s is on `ports().epp(i)`.
    pub fn epp_metrics(&self) -> std::io::Result<String> {
        page(self.ports.epp_metrics, "/metrics")
    }

    /// The KV block manager's connector socket, when the stack runs one.
    pub fn kvbm_socket(&self) -> Option<PathBuf> {
        self.config
            .kvbm
            .as_ref()
            .map(|_| self.run_dir.join("kvbm.sock"))
    }

    /// The KV block manager's `/metrics` page.
    pub fn kvbm_metrics(&self) -> std::io::Result<String> {
        page(self.ports.kvbm_metrics, "/metrics")
    }

    /// Engine process `i`'s own `/metrics` page.
    pub fn engine_metrics(&self, i: usize) -> std::io::Result<String> {
        page(self.ports.engine_http(i).unwrap_or(0), "/metrics")
    }

    /// Kills a component abruptly (SIGKILL), as a crash would.
    pub fn kill(&mut self, component: Component) -> Result<(), StackError> {
        let proc = self.take(component)?;
        tracing::info!(%component, "killing");
        proc.kill();
        Ok(())
    }

    /// Stops a component gracefully (SIGTERM, SIGKILL after the grace period).
    pub fn stop_component(&mut self, component: Component) -> Result<(), StackError> {
        let proc = self.take(component)?;
        tracing::info!(%component, "stopping");
        proc.stop(self.config.stop_grace);
        Ok(())
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) a running component: it keeps its sockets open but
    /// answers nothing, like a hung process.
    pub fn freeze(&mut self, component: Component, frozen: bool) -> Result<(), StackError> {
        let proc = self
            .procs
            .get(&component)
            .ok_or(StackError::NoSuchComponent(component))?;
        proc.freeze(frozen).map_err(|source| StackError::Io {
            what: format!("signalling {component}"),
            source,
        })
    }

    /// Restarts a component on its ports (starting it if it was stopped or killed) and waits
    /// until it is ready.
    pub fn restart(&mut self, component: Component) -> Result<(), StackError> {
        if let Some(proc) = self.procs.remove(&component) {
            proc.stop(self.config.stop_grace);
        }
        self.start_component(component)
    }

    /// Puts another router in front of the same engines and sidecars: Envoy and the EPP (or the
    /// running peer router) stop, and `router` starts on the same listening port, so a
    /// comparison can run kvgate's policies and peer routers against one set of engines. The
    /// peer router's program is found as at start (`--router-bin` applies to the router the
    /// stack started with only).
    pub fn set_router(&mut self, router: Router) -> Result<(), StackError> {
        if router == self.config.router {
            return Ok(());
        }
        if router != Router::EnvoyEpp {
            let program = match (&self.config.router_bin, self.config.router) {
                (Some(p), r) if r == router => p.clone(),
                _ => super::bins::peer_router(router)?,
            };
            self.bins.router = Some(program);
        } else if self.bins.envoy.as_os_str().is_empty() {
            self.bins.envoy = Binaries::locate(&StackConfig {
                router: Router::EnvoyEpp,
                ..self.config.clone()
            })?
            .envoy;
        }
        let fronts = [Component::Envoy, Component::Router]
            .into_iter()
            .chain(self.config.epps());
        for front in fronts {
            if let Some(proc) = self.procs.remove(&front) {
                proc.stop(self.config.stop_grace);
            }
        }
        self.config.router = router;
        if router == Router::EnvoyEpp {
            self.write_configs()?;
            for epp in self.config.epps() {
                self.start_component(epp)?;
            }
            self.start_component(Component::Envoy)
        } else {
            self.start_component(Component::Router)
        }
    }

    /// Restarts the EPP (every replica) with another scheduling policy; the engines, their
    /// caches and the sidecars stay as they are, so policies can be compared on the same
    /// engines.
    pub fn set_policy(&mut self, policy: Policy) -> Result<(), StackError> {
        self.config.scheduler.policy = policy;
        self.write_file("scheduler.yaml", &self.scheduler_yaml()?)?;
        for epp in self.config.epps() {
            self.restart(epp)?;
        }
        Ok(())
    }

    /// Crashes a component (SIGKILL) but keeps watching it, as a supervisor would see a crash:
    /// [`Self::supervise`] restarts it, [`Self::check`] reports it.
    pub fn crash(&mut self, component: Component) -> Result<(), StackError> {
        let proc = self
            .procs
            .get(&component)
            .ok_or(StackError::NoSuchComponent(component))?;
        tracing::info!(%component, "crashing (SIGKILL)");
        proc.signal_kill();
        Ok(())
    }

    /// Restarts every component that exited on its own since the last call (on its ports, with
    /// its arguments, waiting until it is ready) and returns them; a restart that fails is an
    /// error naming the component and its log.
    pub fn supervise(&mut self) -> Result<Vec<Component>, StackError> {
        let died: Vec<(Component, std::process::ExitStatus)> = self
            .procs
            .iter_mut()
            .filter_map(|(c, p)| p.exited().map(|status| (*c, status)))
            .collect();
        let mut restarted = Vec::with_capacity(died.len());
        for (component, status) in died {
            self.procs.remove(&component);
            tracing::warn!(%component, %status, "component died; restarting it");
            let started = std::time::Instant::now();
            self.start_component(component)?;
            tracing::info!(%component, took_ms = started.elapsed().as_millis() as u64, "restarted");
            restarted.push(component);
        }
        Ok(restarted)
    }

    /// The first component that exited on its own since the last call, as an error naming it
    /// and its log; it is no longer tracked afterwards.
    pub fn check(&mut self) -> Result<(), StackError> {
        let died = self
            .procs
            .iter_mut()
            .find_map(|(c, p)| p.exited().map(|status| (*c, status)));
        match died {
            Some((component, status)) => {
                let err = self
                    .procs
                    .get(&component)
                    .map(|p| p.exited_error(status))
                    .unwrap_or(StackError::NoSuchComponent(component));
                self.procs.remove(&component);
                Err(err)
            }
            None => Ok(()),
        }
    }

    /// Stops every component gracefully, Envoy first and NATS last.
    pub fn stop(mut self) {
        self.stop_all();
    }

    /// Envoy, then the EPP replicas, then every sidecar at once (they drain in parallel), every
    /// engine, the block manager (its `Cleared` goes out while NATS is up) and Redis, and NATS
    /// last.
    fn stop_all(&mut self) {
        let tiers: [Vec<Component>; 7] = [
            vec![Component::Envoy, Component::Router],
            self.config.epps(),
            (0..self.config.engines).map(Component::Sidecar).collect(),
            (0..self.config.engine_processes())
                .map(Component::Engine)
                .collect(),
            vec![Component::Kvbm],
            vec![Component::Redis],
            vec![Component::Nats],
        ];
        for tier in tiers {
            let procs: Vec<Proc> = tier.iter().filter_map(|c| self.procs.remove(c)).collect();
            procs.iter().for_each(Proc::terminate);
            let deadline = std::time::Instant::now() + self.config.stop_grace;
            for proc in procs {
                proc.wait_or_kill(deadline);
            }
        }
        tracing::info!("stack stopped");
    }

    fn take(&mut self, component: Component) -> Result<Proc, StackError> {
        self.procs
            .remove(&component)
            .ok_or(StackError::NoSuchComponent(component))
    }

    fn start_component(&mut self, component: Component) -> Result<(), StackError> {
        if !self.config.components().contains(&component) {
            return Err(StackError::NoSuchComponent(component));
        }
        let spec = self.spec(component);
        let mut proc = Proc::spawn(spec)?;
        let probe = self.ready_probe(component);
        proc.wait_ready(self.config.ready_timeout, probe)?;
        self.procs.insert(component, proc);
        Ok(())
    }

    fn ready_probe(&self, component: Component) -> impl FnMut() -> bool + use<> {
        let ports = self.ports.clone();
        let nats_events = self.config.kv_events == KvEventsPath::Nats;
        move || match component {
            Component::Nats => probe::tcp_open(ports.nats, PROBE_TIMEOUT),
            Component::Redis => probe::tcp_open(ports.redis, PROBE_TIMEOUT),
            // Serving connectors and connected to NATS.
            Component::Kvbm => ok(ports.kvbm_metrics, "/readyz"),
            Component::Engine(i) => ports.engine_http(i).is_some_and(|p| ok(p, "/health")),
            Component::Sidecar(i) => ports
                .engines
                .get(i)
                .is_some_and(|p| ok(p.sidecar_metrics, "/ready")),
            // Serving, and (while NATS is up) subscribed to the KV events: an envelope
            // published before the EPP subscribes is lost to it until that source publishes
            // again, so a stack handed out earlier could route a prefix it was just told of
            // without knowing.
            Component::Epp | Component::EppReplica(_) => component
                .epp_replica()
                .and_then(|r| ports.epp(r))
                .and_then(|e| page(e.metrics, "/metrics").ok())
                .is_some_and(|p| {
                    !nats_events
                        || !probe::tcp_open(ports.nats, PROBE_TIMEOUT)
                        || probe::metric_sum(&p, "kvgate_epp_nats_connected")
                            .is_some_and(|v| v >= 1.0)
                }),
            Component::Envoy => ok(ports.envoy_admin, "/ready"),
            Component::Router => ok(ports.envoy_listen, "/health"),
        }
    }

    fn spec(&self, component: Component) -> Spec {
        let c = &self.config;
        let dir = &self.run_dir;
        let path = |name: &str| dir.join(name).display().to_string();
        let rust_env = vec![("RUST_LOG".to_owned(), c.log_level.clone())];
        let nats_url = format!("nats://127.0.0.1:{}", self.ports.nats);
        let (program, args, env) = match component {
            Component::Nats => (
                self.bins.nats.clone(),
                strings(&["-a", "127.0.0.1", "-p", &self.ports.nats.to_string()]),
                vec![],
            ),
            Component::Redis => {
                let remote = c.kvbm.as_ref().map_or(0, |k| k.remote_bytes);
                (
                    self.bins.kvbm.clone().map(|b| b.1).unwrap_or_default(),
                    render::redis_args(self.ports.redis, remote),
                    vec![],
                )
            }
            Component::Kvbm => {
                let k = c.kvbm.clone().unwrap_or_default();
                let mut args = strings(&[
                    "--node",
                    &k.node,
                    "--model",
                    &c.model,
                    "--block-size",
                    &c.block_size.to_string(),
                    "--namespace",
                    &c.namespace,
                    "--socket",
                    &path("kvbm.sock"),
                    "--metrics-bind",
                    "127.0.0.1",
                    "--metrics-port",
                    &self.ports.kvbm_metrics.to_string(),
                    "--nats-url",
                    &nats_url,
                    "--host-bytes",
                    &k.host_bytes.to_string(),
                    "--remote-url",
                    &format!("redis://127.0.0.1:{}", self.ports.redis),
                    "--remote-bytes",
                    &k.remote_bytes.to_string(),
                ]);
                if k.disk_bytes > 0 {
                    args.extend(strings(&[
                        "--disk-dir",
                        &path("kvbm-disk"),
                        "--disk-bytes",
                        &k.disk_bytes.to_string(),
                    ]));
                }
                (
                    self.bins.kvbm.clone().map(|b| b.0).unwrap_or_default(),
                    args,
                    rust_env.clone(),
                )
            }
            Component::Engine(i) => {
                let (pod, rank) = c.engine_rank(i);
                let p = self.ports.engines.get(pod).copied().unwrap_or(ZERO);
                let mut args = strings(&[
                    "--host",
                    "127.0.0.1",
                    "--port",
                    &p.http.saturating_add(rank).to_string(),
                    "--data-parallel-rank",
                    &rank.to_string(),
                    "--model",
                    &c.model,
                    "--pod-name",
                    &Component::pod_name(pod),
                    "--preset",
                    &c.preset,
                    "--time-scale",
                    &c.time_scale.to_string(),
                    "--block-size",
                    &c.block_size.to_string(),
                    "--seed",
                    &i.to_string(),
                    "--kv-events-config",
                    &render::kv_events_config(p.events, p.replay),
                ]);
                if c.kvbm.is_some() {
                    args.extend(strings(&["--kvbm-socket", &path("kvbm.sock")]));
                }
                args.extend(c.engine_args.iter().cloned());
                (self.bins.sim.clone(), args, rust_env)
            }
            Component::Sidecar(i) => {
                let p = self.ports.engines.get(i).copied().unwrap_or(ZERO);
                let mut args = strings(&[
                    "--engine-url",
                    &format!("http://127.0.0.1:{}", p.http),
                    "--engine",
                    "sim",
                    "--kv-events-endpoint",
                    &format!("tcp://127.0.0.1:{}", p.events),
                    "--replay-endpoint",
                    &format!("tcp://127.0.0.1:{}", p.replay),
                    "--model",
                    &c.model,
                    "--block-size",
                    &c.block_size.to_string(),
                    "--namespace",
                    &c.namespace,
                    "--pool",
                    &c.pool,
                    "--pod",
                    &Component::pod_name(i),
                    "--pod-ip",
                    "127.0.0.1",
                    "--nats-url",
                    &nats_url,
                    "--proxy-port",
                    &p.proxy.to_string(),
                    "--metrics-port",
                    &p.sidecar_metrics.to_string(),
                    "--drain-grace-seconds",
                    "2",
                    "--dp-size",
                    &c.dp_ranks.max(1).to_string(),
                    // The pool's endpoints: the only addresses a sidecar may send a prefill leg
                    // or a migrated stream's rest to (SSRF protection).
                    "--prefiller-allow-list",
                    &path("endpoints.yaml"),
                ]);
                args.extend(tracing_args(c));
                (self.bins.sidecar.clone(), args, rust_env)
            }
            Component::Epp | Component::EppReplica(_) => {
                let ports = component
                    .epp_replica()
                    .and_then(|r| self.ports.epp(r))
                    .unwrap_or(EppPorts {
                        grpc: 0,
                        health: 0,
                        metrics: 0,
                    });
                let mut args = strings(&[
                    "--pool-name",
                    &c.pool,
                    "--pool-namespace",
                    &c.namespace,
                    "--discovery",
                    "file",
                    "--endpoints-file",
                    &path("endpoints.yaml"),
                    "--config",
                    &path("scheduler.yaml"),
                    "--plaintext",
                    "--grpc-port",
                    &ports.grpc.to_string(),
                    "--grpc-health-port",
                    &ports.health.to_string(),
                    "--metrics-port",
                    &ports.metrics.to_string(),
                    "--model",
                    &c.model,
                    "--block-size",
                    &c.block_size.to_string(),
                    // The body limit Envoy's buffer is sized to (render::MAX_BODY_BYTES).
                    "--max-body-bytes",
                    &render::MAX_BODY_BYTES.to_string(),
                    // Envoy's config has the response observer filter (render.rs).
                    "--response-observer",
                    "true",
                ]);
                if c.kv_events == KvEventsPath::Nats {
                    args.extend(strings(&["--nats-url", &nats_url]));
                }
                args.extend(tracing_args(c));
                (self.bins.epp.clone(), args, rust_env)
            }
            Component::Envoy => (
                self.bins.envoy.clone(),
                strings(&[
                    "-c",
                    &path("envoy.yaml"),
                    "--log-level",
                    "warn",
                    "--disable-hot-restart",
                    "--concurrency",
                    "2",
                ]),
                vec![],
            ),
            Component::Router => {
                let mut args = strings(&[
                    "--host",
                    "127.0.0.1",
                    "--port",
                    &self.ports.envoy_listen.to_string(),
                    "--prometheus-port",
                    &self.ports.envoy_admin.to_string(),
                    "--policy",
                    &c.router_policy,
                    "--worker-urls",
                ]);
                if c.router == Router::Smg {
                    args.insert(0, "launch".into());
                }
                args.extend(
                    self.ports
                        .endpoint_ports()
                        .iter()
                        .map(|p| format!("http://127.0.0.1:{p}")),
                );
                let program = self.bins.router.clone().unwrap_or_default();
                (program, args, vec![])
            }
        };
        Spec {
            component,
            program,
            args,
            env,
            log: self.log(component),
        }
    }

    fn scheduler_yaml(&self) -> Result<String, StackError> {
        render::scheduler_yaml(&self.config).map_err(|e| StackError::Config(e.to_string()))
    }

    fn write_configs(&self) -> Result<(), StackError> {
        let live = vec![true; self.config.engines];
        self.write_file(
            "endpoints.yaml",
            &render::endpoints_yaml(&self.config, &self.ports, &live),
        )?;
        self.write_file("scheduler.yaml", &self.scheduler_yaml()?)?;
        self.write_file("envoy.yaml", &render::envoy_yaml(&self.config, &self.ports))
    }

    /// Writes a file of the run directory atomically (the EPP watches the endpoints file).
    fn write_file(&self, name: &str, text: &str) -> Result<(), StackError> {
        let target = self.run_dir.join(name);
        let tmp = self.run_dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &target))
            .map_err(|source| StackError::Io {
                what: format!("writing {}", target.display()),
                source,
            })
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // Envoy and the EPP first, so nothing routes to engines that are going away.
        for component in self.config.components().into_iter().rev() {
            if let Some(proc) = self.procs.remove(&component) {
                proc.kill();
            }
        }
    }
}

const ZERO: super::ports::EnginePorts = super::ports::EnginePorts {
    http: 0,
    events: 0,
    replay: 0,
    proxy: 0,
    sidecar_metrics: 0,
};

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

fn ok(port: u16, path: &str) -> bool {
    matches!(probe::http_get(port, path, PROBE_TIMEOUT), Ok((200, _)))
}

fn page(port: u16, path: &str) -> std::io::Result<String> {
    match probe::http_get(port, path, Duration::from_secs(2))? {
        (200, body) => Ok(body),
        (status, _) => Err(std::io::Error::other(format!("{path}: HTTP {status}"))),
    }
}

/// `dir` (created) or a fresh `/tmp/kvgate-stack.<pid>.<n>`.
fn make_run_dir(dir: Option<&Path>) -> Result<PathBuf, StackError> {
    let io = |what: String| move |source| StackError::Io { what, source };
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        return Ok(dir.to_path_buf());
    }
    let base = std::env::temp_dir();
    for n in 0..1000u32 {
        let candidate = base.join(format!("kvgate-stack.{}.{n}", std::process::id()));
        match std::fs::create_dir(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io(format!("creating {}", candidate.display()))(e)),
        }
    }
    Err(StackError::Io {
        what: format!("creating a run directory in {}", base.display()),
        source: std::io::Error::other("1000 names taken"),
    })
}

/// The EPP's and the sidecars' tracing flags: every trace to the stack's collector, if any.
fn tracing_args(c: &StackConfig) -> Vec<String> {
    match &c.otlp_endpoint {
        Some(url) => strings(&["--otlp-endpoint", url, "--trace-sample-ratio", "1"]),
        None => Vec::new(),
    }
}
