//! `kvgate-bench up`: the command-line options of the local stack, and the foreground run that
//! prints where to send requests and stops everything on Ctrl-C, SIGTERM or a component's death.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use scheduler::Policy;

use super::config::{EnvoyLb, KvEventsPath, KvbmConfig, Router, StackConfig};
use super::error::StackError;
use super::handle::Stack;

/// Options of `kvgate-bench up`.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Simulated engines, each behind its own sidecar.
    #[arg(long, default_value_t = 3)]
    pub engines: usize,
    /// Data-parallel ranks per engine (1–8): each rank is its own simulator on the pod's ports
    /// + rank, its sidecar serves every rank's port, and the EPP lists one endpoint per rank.
    #[arg(long, default_value_t = 1)]
    pub dp_ranks: u16,
    /// Engine preset (`kvgate-sim --preset`).
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Engine time scale: above 1 runs faster than the modelled hardware.
    #[arg(long, default_value_t = 10.0)]
    pub time_scale: f64,
    /// Served model name.
    #[arg(long, default_value = "m")]
    pub model: String,
    /// KV block size in tokens.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// The EPP's scheduling policy: kv, prefix-only, least-load, round-robin or random.
    #[arg(long, default_value = "kv")]
    pub policy: Policy,
    /// A scheduler configuration file for the EPP (its `policy` is replaced by --policy).
    #[arg(long)]
    pub scheduler_config: Option<PathBuf>,
    /// What routes requests: Envoy + kvgate-epp, or a peer router from PyPI in their place.
    #[arg(long, value_enum, default_value_t = Router::EnvoyEpp)]
    pub router: Router,
    /// The peer router's policy (`--router vllm-router|smg`).
    #[arg(long, default_value = "cache_aware")]
    pub router_policy: String,
    /// The peer router's program (default: .venv/bin, $KVGATE_ROUTERS_VENV/bin, or PATH).
    #[arg(long)]
    pub router_bin: Option<PathBuf>,
    /// Where the EPP takes KV events from.
    #[arg(long, value_enum, default_value_t = KvEventsPath::Nats)]
    pub kv_events: KvEventsPath,
    /// How Envoy follows the EPP's pick (`original-dst` sets the EPP's fallbacks to 0).
    #[arg(long, value_enum, default_value_t = EnvoyLb::OverrideHost)]
    pub envoy_lb: EnvoyLb,
    /// Envoy keeps serving (round robin) while the EPP is unreachable (request bodies are then
    /// buffered: Envoy 1.40 cannot fail open once it has streamed a body chunk to the EPP).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub fail_open: bool,
    /// An extra argument for every engine (repeat it), e.g. `--engine-arg=--max-waiting=8`.
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    /// Run directory for configs and logs (default: a fresh /tmp/kvgate-stack.*).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// `RUST_LOG` of the kvgate components.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Seconds each component may take to become ready.
    #[arg(long, default_value_t = 30)]
    pub ready_timeout_s: u64,
    /// Directory of kvgate-sim, kvgate-sidecar and kvgate-epp (default: next to kvgate-bench).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Envoy binary (default: $KVGATE_ENVOY, else the workspace's .venv).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Start the KV block manager (`kvgate-kvbm`, this machine as its node) with Redis as its
    /// remote tier; every endpoint is then on that node. Engine connectors use its socket
    /// (printed at start).
    #[arg(long)]
    pub kvbm: bool,
    /// The block manager's host-memory tier, MiB.
    #[arg(long, default_value_t = 1024)]
    pub kvbm_host_mib: u64,
    /// The block manager's disk tier, MiB, in `kvbm-disk/` of the run directory (0: none).
    #[arg(long, default_value_t = 0)]
    pub kvbm_disk_mib: u64,
    /// What the block manager may keep in Redis, MiB.
    #[arg(long, default_value_t = 4096)]
    pub kvbm_remote_mib: u64,
    /// The Redis server binary (default: `redis-server` on the PATH).
    #[arg(long, default_value = "redis-server")]
    pub redis_server: PathBuf,
    /// Kubernetes mode: install kvgate's Helm chart into a local Kubernetes API server (kapi,
    /// `scripts/bootstrap.sh` installs it) and run the chart's rendered containers here, each
    /// pod on a loopback address of its own; the EPP discovers the engines through the
    /// InferencePool and its Pods, and Envoy is configured as Envoy AI Gateway would. Takes
    /// --engines, --model, --preset, --time-scale, --policy, --engine-arg, --kvbm and the
    /// paths; prints a kubeconfig for kubectl.
    #[arg(long)]
    pub kube: bool,
    /// Restart a component that dies (on its ports, with its arguments) instead of stopping the
    /// stack; a restart that fails still stops it. Local stack only.
    #[arg(long)]
    pub supervise: bool,
    /// EPP replicas, active-active: each builds its own index from the same KV events. In the
    /// local stack Envoy health-checks them over gRPC and stops sending to one that is down;
    /// with --kube the chart's Deployment runs them. Not with --router (a peer router runs in
    /// place of Envoy and the EPP).
    #[arg(long, default_value_t = 1)]
    pub epp_replicas: usize,
    /// Send the EPP's and the sidecars' request traces to this OTLP/gRPC collector (e.g.
    /// `http://127.0.0.1:4317`), every trace sampled. Local stack only.
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

impl UpArgs {
    /// The stack configuration these options describe.
    pub fn config(&self) -> Result<StackConfig, StackError> {
        let mut scheduler = match &self.scheduler_config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| StackError::Io {
                    what: format!("reading {}", path.display()),
                    source,
                })?;
                scheduler::SchedulerConfig::from_yaml(&text)
                    .map_err(|e| StackError::Config(format!("{}: {e}", path.display())))?
            }
            None => scheduler::SchedulerConfig::default(),
        };
        scheduler.policy = self.policy;
        if self.envoy_lb == EnvoyLb::OriginalDst {
            scheduler.fallbacks = 0;
        }
        Ok(StackConfig {
            engines: self.engines,
            dp_ranks: self.dp_ranks,
            preset: self.preset.clone(),
            time_scale: self.time_scale,
            model: self.model.clone(),
            block_size: self.block_size,
            engine_args: self.engine_args.clone(),
            scheduler,
            kv_events: self.kv_events,
            router: self.router,
            epp_replicas: self.epp_replicas,
            router_policy: self.router_policy.clone(),
            router_bin: self.router_bin.clone(),
            envoy_lb: self.envoy_lb,
            fail_open: self.fail_open,
            log_level: self.log_level.clone(),
            run_dir: self.run_dir.clone(),
            bin_dir: self.bin_dir.clone(),
            envoy: self.envoy.clone(),
            ready_timeout: Duration::from_secs(self.ready_timeout_s),
            kvbm: self.kvbm.then(|| KvbmConfig {
                host_bytes: self.kvbm_host_mib << 20,
                disk_bytes: self.kvbm_disk_mib << 20,
                remote_bytes: self.kvbm_remote_mib << 20,
                ..KvbmConfig::default()
            }),
            redis_server: self.redis_server.clone(),
            otlp_endpoint: self.otlp_endpoint.clone(),
            ..StackConfig::default()
        })
    }

    /// The Kubernetes mode's configuration; options it does not take are refused.
    pub fn kube_config(&self) -> Result<crate::kube::KubeStackConfig, StackError> {
        let unsupported = [
            ("--router", self.router != Router::EnvoyEpp),
            ("--kv-events", self.kv_events != KvEventsPath::Nats),
            ("--envoy-lb", self.envoy_lb != EnvoyLb::OverrideHost),
            ("--fail-open", self.fail_open),
            ("--dp-ranks", self.dp_ranks != 1),
            ("--scheduler-config", self.scheduler_config.is_some()),
            ("--kvbm-disk-mib", self.kvbm_disk_mib != 0),
        ];
        if let Some((flag, _)) = unsupported.iter().find(|(_, set)| *set) {
            return Err(StackError::Config(format!(
                "{flag} is not available with --kube (the chart and the Envoy AI Gateway recipe decide it)"
            )));
        }
        if self.engines == 0 || self.epp_replicas == 0 {
            return Err(StackError::Config(
                "--engines and --epp-replicas must be at least 1".into(),
            ));
        }
        let mut engine_args = vec![
            format!("--time-scale={}", self.time_scale),
            format!("--preset={}", self.preset),
        ];
        engine_args.extend(self.engine_args.iter().cloned());
        Ok(crate::kube::KubeStackConfig {
            model: self.model.clone(),
            engines: self.engines,
            epp_replicas: self.epp_replicas,
            engine_args,
            values: vec![format!(
                "model: {{blockSize: {}}}\nepp: {{scheduler: {{policy: {}}}}}\n",
                self.block_size, self.policy
            )],
            kvbm: self.kvbm,
            bin_dir: self.bin_dir.clone(),
            envoy: self.envoy.clone(),
            run_dir: self.run_dir.clone(),
            ready_timeout: Duration::from_secs(self.ready_timeout_s),
            log_level: self.log_level.clone(),
            ..crate::kube::KubeStackConfig::default()
        })
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVGATE_BENCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Starts the stack, prints its addresses, and runs until Ctrl-C or SIGTERM (success) or until
/// a component dies (its error, naming the component and its log).
pub fn run(args: &UpArgs) -> Result<(), StackError> {
    if args.kube {
        return run_kube(args);
    }
    let config = args.config()?;
    init_logging();
    let mut stack = Stack::start(config)?;
    announce(&stack);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| StackError::Io {
            what: "starting the signal runtime".into(),
            source,
        })?;
    let outcome: Result<(), StackError> = runtime.block_on(async {
        let signal = cli_support::shutdown_signal();
        tokio::pin!(signal);
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tokio::select! {
                () = &mut signal => return Ok(()),
                _ = tick.tick() => if args.supervise {
                    stack.supervise()?;
                } else {
                    stack.check()?;
                },
            }
        }
    });
    if let Err(e) = &outcome {
        let component = e.component().map(|c| c.to_string()).unwrap_or_default();
        tracing::error!(%component, "a component died; stopping the stack");
    }
    stack.stop();
    outcome
}

/// `up --kube`: the chart installed into a local API server, its containers run here.
fn run_kube(args: &UpArgs) -> Result<(), StackError> {
    let config = args.kube_config()?;
    init_logging();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| StackError::Io {
            what: "starting the runtime".into(),
            source,
        })?;
    let kube = |e| StackError::Kube(Box::new(e));
    runtime.block_on(async {
        let mut stack = crate::kube::KubeStack::start(config).await.map_err(kube)?;
        announce_kube(&stack);
        let signal = cli_support::shutdown_signal();
        tokio::pin!(signal);
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let outcome = loop {
            tokio::select! {
                () = &mut signal => break Ok(()),
                _ = tick.tick() => if let Err(e) = stack.check() { break Err(e) },
            }
        };
        if let Err(e) = &outcome {
            let component = e.component().map(|c| c.to_string()).unwrap_or_default();
            tracing::error!(%component, "a component died; stopping the stack");
        }
        tokio::task::block_in_place(|| stack.stop());
        outcome
    })
}

fn announce_kube(stack: &crate::kube::KubeStack) {
    let c = stack.config();
    let pods: Vec<String> = stack
        .pods()
        .iter()
        .map(|(name, _, ip)| format!("{name} {ip}"))
        .collect();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "kvgate on Kubernetes ready ({} engines, {} EPP replicas; helm release {} in namespace {})\n  \
         OpenAI base URL: {}\n  run dir:         {}\n  kubeconfig:      {}\n  \
         EPP metrics:     {}\n  pods:            {}\n\
         Ctrl-C stops it.",
        c.engines,
        c.epp_replicas,
        c.release,
        c.namespace,
        stack.base_url(),
        stack.run_dir().display(),
        stack.kapi().kubeconfig().display(),
        stack.epp_metrics_url(0).unwrap_or_default(),
        pods.join(", "),
    );
    let _ = out.flush();
}

fn announce(stack: &Stack) {
    let p = stack.ports();
    let c = stack.config();
    let routing = match c.router {
        Router::EnvoyEpp => format!(
            "Envoy + kvgate-epp, policy {}\n  EPP metrics:     {}\n  \
             Envoy admin:     http://127.0.0.1:{}/",
            c.scheduler.policy,
            (0..c.epp_replicas)
                .filter_map(|r| p.epp(r))
                .map(|e| format!("http://127.0.0.1:{}/metrics", e.metrics))
                .collect::<Vec<_>>()
                .join(" "),
            p.envoy_admin
        ),
        r => format!(
            "{} in place of Envoy + kvgate-epp, policy {}\n  router metrics:  http://127.0.0.1:{}/metrics",
            r.program(),
            c.router_policy,
            p.envoy_admin
        ),
    };
    let kvbm = match (&c.kvbm, stack.kvbm_socket()) {
        (Some(k), Some(socket)) => format!(
            "\n  kvbm:            node {}, socket {}, metrics http://127.0.0.1:{}/metrics, \
             Redis redis://127.0.0.1:{}{}",
            k.node,
            socket.display(),
            p.kvbm_metrics,
            p.redis,
            if k.disk_bytes > 0 {
                format!(
                    ", disk {} ({} MiB)",
                    stack.run_dir().join("kvbm-disk").display(),
                    k.disk_bytes >> 20
                )
            } else {
                String::new()
            }
        ),
        _ => String::new(),
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "kvgate stack ready ({} engines × {} data-parallel ranks)\n  OpenAI base URL: {}\n  \
         run dir:         {}\n  routing:         {routing}\n  NATS:            \
         nats://127.0.0.1:{}{kvbm}\nCtrl-C stops it.",
        c.engines,
        c.dp_ranks,
        stack.base_url(),
        stack.run_dir().display(),
        p.nats,
    );
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use clap::Parser as _;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    #[test]
    fn options_map_to_the_config() {
        let cli = Cli::try_parse_from([
            "x",
            "--engines",
            "2",
            "--policy",
            "round-robin",
            "--envoy-lb",
            "original-dst",
            "--fail-open",
            "true",
            "--engine-arg=--max-waiting=4",
        ])
        .unwrap();
        let c = cli.up.config().unwrap();
        assert_eq!(c.engines, 2);
        assert_eq!(c.scheduler.policy, Policy::RoundRobin);
        assert_eq!(c.scheduler.fallbacks, 0);
        assert!(c.fail_open);
        assert_eq!(c.engine_args, ["--max-waiting=4"]);
        c.validate().unwrap();
    }

    #[test]
    fn kvbm_options_map_to_the_config() {
        let c = Cli::try_parse_from(["x"]).unwrap().up.config().unwrap();
        assert_eq!(c.kvbm, None);
        let cli = Cli::try_parse_from(["x", "--kvbm", "--kvbm-host-mib", "64"]).unwrap();
        let c = cli.up.config().unwrap();
        let k = c.kvbm.clone().unwrap();
        assert_eq!((k.host_bytes, k.remote_bytes), (64 << 20, 4096 << 20));
        c.validate().unwrap();
        assert!(c.components().contains(&super::super::Component::Kvbm));
    }
}
