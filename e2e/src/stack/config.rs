//! The stack's typed configuration ([`StackConfig`]) and the names of its components
//! ([`Component`]). Pure: no I/O.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use scheduler::{Policy, SchedulerConfig};

/// How Envoy follows the EPP's pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EnvoyLb {
    /// `override_host`: follows the EPP's whole fallback list (`x-gateway-destination-endpoint`
    /// in `envoy.lb` metadata) and round-robins when there is none (fail-open).
    #[default]
    OverrideHost,
    /// An `ORIGINAL_DST` cluster keyed by the `x-gateway-destination-endpoint` header: one
    /// endpoint only, so the EPP is configured with `fallbacks: 0`.
    OriginalDst,
}

/// Where the EPP takes KV events from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KvEventsPath {
    /// Through the sidecars over NATS (`--nats-url`).
    #[default]
    Nats,
    /// Straight from each engine's ZMQ PUB socket (the endpoints file's `events`/`replay`).
    Direct,
}

/// What routes the stack's requests to the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Router {
    /// Envoy with `kvgate-epp` (ext_proc).
    #[default]
    EnvoyEpp,
    /// vLLM's router (PyPI `vllm-router`) over the sidecars' proxy ports, no Envoy and no EPP.
    VllmRouter,
    /// The Shepherd Model Gateway (PyPI `smg`, `smg launch`) over the sidecars' proxy ports.
    Smg,
}

impl Router {
    /// The program name.
    pub const fn program(self) -> &'static str {
        match self {
            Router::EnvoyEpp => "envoy",
            Router::VllmRouter => "vllm-router",
            Router::Smg => "smg",
        }
    }
}

/// Everything `Stack::start` needs. Every field has a working default.
#[derive(Debug, Clone, PartialEq)]
pub struct StackConfig {
    /// Simulated engines (each behind its own sidecar).
    pub engines: usize,
    /// Data-parallel ranks per engine pod: each rank is its own `kvgate-sim` process
    /// (`--data-parallel-rank`) on the pod's ports + rank, one sidecar bridges and proxies them
    /// all (`--dp-size`), and the EPP lists one endpoint per rank (GIE's `targetPorts`).
    pub dp_ranks: u16,
    /// `kvgate-sim --preset`.
    pub preset: String,
    /// `kvgate-sim --time-scale` (above 1 runs faster than the modelled hardware).
    pub time_scale: f64,
    /// Served model name (engines, sidecars, EPP).
    pub model: String,
    /// KV block size in tokens (engines, sidecars, EPP).
    pub block_size: u32,
    /// Extra arguments for every engine (for example `--max-waiting 2`).
    pub engine_args: Vec<String>,
    /// The EPP's scheduler configuration (its `policy` is what [`Stack::set_policy`] changes).
    ///
    /// [`Stack::set_policy`]: super::Stack::set_policy
    pub scheduler: SchedulerConfig,
    /// Where the EPP's KV events come from.
    pub kv_events: KvEventsPath,
    /// How Envoy follows the EPP.
    pub envoy_lb: EnvoyLb,
    /// Envoy's ext_proc `failure_mode_allow`: keep serving (round robin) when the EPP is away.
    /// GIE's default is fail-closed. Fail-open makes Envoy buffer request bodies (see
    /// [`render::envoy_yaml`](super::render::envoy_yaml)).
    pub fail_open: bool,
    /// Let clients send the subset hint as the `x-gateway-destination-endpoint-subset` request
    /// header (Envoy turns it into the `envoy.lb.subset_hint` metadata). For tests that pin
    /// requests to an endpoint (the conformance tests, the offload test) only: in GIE the
    /// subset comes from the data plane, and a client allowed to set it pins a pool member of
    /// its choice. Off: the header is stripped by the EPP, unread.
    pub subset_header: bool,
    /// What routes requests: Envoy + EPP, or a peer router in their place.
    pub router: Router,
    /// EPP replicas (active-active, each with its own index from the same events); Envoy
    /// health-checks them over gRPC and stops sending to one that is down. `Component::Epp` is
    /// replica 0, `Component::EppReplica(i)` replica `i`.
    pub epp_replicas: usize,
    /// A peer router's `--policy` (`cache_aware`, `round_robin`, …).
    pub router_policy: String,
    /// A peer router's program; found in `.venv/bin`, `$KVGATE_ROUTERS_VENV/bin` or on the
    /// `PATH` when `None`.
    pub router_bin: Option<PathBuf>,
    /// Pool name (NATS subjects, EPP metrics).
    pub pool: String,
    /// Namespace token of the NATS subjects.
    pub namespace: String,
    /// `RUST_LOG` for the Rust components.
    pub log_level: String,
    /// Where configs and logs go; a fresh `/tmp/kvgate-stack.*` when `None`.
    pub run_dir: Option<PathBuf>,
    /// Directory of `kvgate-sim`, `kvgate-sidecar`, `kvgate-epp`; next to the running executable
    /// when `None`.
    pub bin_dir: Option<PathBuf>,
    /// The Envoy binary; the workspace venv's when `None`.
    pub envoy: Option<PathBuf>,
    /// The NATS server binary.
    pub nats_server: PathBuf,
    /// Run the KV block manager (`kvgate-kvbm`, one for the machine as its node) with Redis
    /// as its remote tier; the endpoints file then puts every endpoint on that node.
    pub kvbm: Option<KvbmConfig>,
    /// The Redis server binary (with `kvbm`).
    pub redis_server: PathBuf,
    /// How long each component may take to become ready.
    pub ready_timeout: Duration,
    /// How long a stopped component may take to exit after SIGTERM before it is killed.
    pub stop_grace: Duration,
    /// An OTLP/gRPC collector for the EPP's and the sidecars' request traces (every trace
    /// sampled); no tracing when `None`.
    pub otlp_endpoint: Option<String>,
}

impl Default for StackConfig {
    fn default() -> Self {
        Self {
            engines: 3,
            dp_ranks: 1,
            preset: "small".into(),
            time_scale: 10.0,
            model: "m".into(),
            block_size: 16,
            engine_args: Vec::new(),
            scheduler: SchedulerConfig::default(),
            kv_events: KvEventsPath::Nats,
            router: Router::EnvoyEpp,
            epp_replicas: 1,
            router_policy: "cache_aware".into(),
            router_bin: None,
            envoy_lb: EnvoyLb::OverrideHost,
            fail_open: false,
            subset_header: false,
            pool: "local".into(),
            namespace: "default".into(),
            log_level: "info".into(),
            run_dir: None,
            bin_dir: None,
            envoy: None,
            nats_server: PathBuf::from("nats-server"),
            kvbm: None,
            redis_server: PathBuf::from("redis-server"),
            ready_timeout: Duration::from_secs(30),
            stop_grace: Duration::from_secs(5),
            otlp_endpoint: None,
        }
    }
}

/// The KV block manager of a stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvbmConfig {
    /// The node name (the block manager's NATS source and every endpoint's `node`).
    pub node: String,
    /// Host-memory tier bytes.
    pub host_bytes: u64,
    /// Disk tier bytes (in `kvbm-disk/` of the run directory); 0: no disk tier.
    pub disk_bytes: u64,
    /// Bytes the node may keep in Redis (Redis's own `maxmemory` is set half again above,
    /// see [`redis_maxmemory`](super::render::redis_maxmemory)).
    pub remote_bytes: u64,
}

impl Default for KvbmConfig {
    fn default() -> Self {
        Self {
            node: "local".into(),
            host_bytes: 1 << 30,
            disk_bytes: 0,
            remote_bytes: 4 << 30,
        }
    }
}

/// Most engines one stack starts (each costs four ports and two processes).
pub const MAX_ENGINES: usize = 64;
/// Most data-parallel ranks per engine pod (GIE's limit on an InferencePool's target ports).
pub const MAX_DP_RANKS: u16 = 8;

impl StackConfig {
    /// Checks the values that would otherwise fail late, inside a component.
    pub fn validate(&self) -> Result<(), String> {
        if self.engines == 0 || self.engines > MAX_ENGINES {
            return Err(format!("engines must be in 1..={MAX_ENGINES}"));
        }
        if self.dp_ranks == 0 || self.dp_ranks > MAX_DP_RANKS {
            return Err(format!("data-parallel ranks must be in 1..={MAX_DP_RANKS}"));
        }
        if self.dp_ranks > 1 && self.kv_events == KvEventsPath::Direct {
            return Err(
                "data-parallel ranks need the sidecars (their proxies serve the ranks' ports): \
                 drop the direct KV-event path"
                    .into(),
            );
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err("time scale must be a positive number".into());
        }
        if self.block_size == 0 {
            return Err("block size must be at least 1".into());
        }
        for (what, value) in [
            ("model", &self.model),
            ("pool", &self.pool),
            ("namespace", &self.namespace),
        ] {
            if value.is_empty()
                || !value
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_/".contains(c))
            {
                return Err(format!(
                    "{what} `{value}`: use letters, digits, `-`, `_` or `/`"
                ));
            }
        }
        if let Some(k) = &self.kvbm {
            if k.node.is_empty()
                || !k
                    .node
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c))
            {
                return Err(format!(
                    "kvbm node `{}`: use letters, digits, `-` or `_`",
                    k.node
                ));
            }
            if k.host_bytes == 0 && k.disk_bytes == 0 && k.remote_bytes == 0 {
                return Err("kvbm: give host, disk or remote bytes".into());
            }
        }
        if self.epp_replicas == 0 {
            return Err("epp replicas: at least 1".into());
        }
        if self.epp_replicas > 1 && self.router != Router::EnvoyEpp {
            return Err("epp replicas: a peer router runs in place of Envoy and the EPP".into());
        }
        if self.envoy_lb == EnvoyLb::OriginalDst && self.scheduler.fallbacks != 0 {
            return Err(
                "--envoy-lb original-dst follows one endpoint only: set fallbacks to 0".into(),
            );
        }
        self.scheduler.validate().map_err(|e| e.to_string())
    }

    /// The components this configuration runs, in start order.
    pub fn components(&self) -> Vec<Component> {
        let mut all = vec![Component::Nats];
        if self.kvbm.is_some() {
            all.extend([Component::Redis, Component::Kvbm]);
        }
        all.extend((0..self.engine_processes()).map(Component::Engine));
        all.extend((0..self.engines).map(Component::Sidecar));
        if self.router == Router::EnvoyEpp {
            all.extend(self.epps());
            all.push(Component::Envoy);
        } else {
            all.push(Component::Router);
        }
        all
    }

    /// The EPP replicas' components: [`Component::Epp`], then `EppReplica(1..)`.
    pub fn epps(&self) -> Vec<Component> {
        (0..self.epp_replicas.max(1)).map(Component::epp).collect()
    }

    /// Engine processes: one per data-parallel rank of each pod, pod-major
    /// (`Component::Engine(i)` is pod `i / dp_ranks`, rank `i % dp_ranks`).
    pub fn engine_processes(&self) -> usize {
        self.engines * usize::from(self.dp_ranks.max(1))
    }

    /// Engine process `i`'s pod and rank.
    pub fn engine_rank(&self, i: usize) -> (usize, u16) {
        let dp = usize::from(self.dp_ranks.max(1));
        (i / dp, u16::try_from(i % dp).unwrap_or(0))
    }

    /// The configuration with another scheduling policy.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.scheduler.policy = policy;
        self
    }
}

/// One process of the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// `nats-server`.
    Nats,
    /// `redis-server`, the KV block manager's remote tier.
    Redis,
    /// `kvgate-kvbm`, the node's KV block manager.
    Kvbm,
    /// `kvgate-sim` process `i` (pod `i / dp_ranks`, rank `i % dp_ranks`; without data
    /// parallelism, engine pod `i`).
    Engine(usize),
    /// The `kvgate-sidecar` of engine pod `i` (all its ranks).
    Sidecar(usize),
    /// `kvgate-epp` (in the local stack, replica 0).
    Epp,
    /// EPP replica `i`: of the local stack `i ≥ 1` (replica 0 is [`Component::Epp`]), of the
    /// Kubernetes stack (`crate::kube`) every replica.
    EppReplica(usize),
    /// Envoy.
    Envoy,
    /// A peer router in place of Envoy and the EPP.
    Router,
}

impl Component {
    /// EPP replica `i` of the local stack: [`Component::Epp`] for 0.
    pub fn epp(i: usize) -> Component {
        if i == 0 {
            Component::Epp
        } else {
            Component::EppReplica(i)
        }
    }

    /// The EPP replica this component is, if it is one.
    pub fn epp_replica(self) -> Option<usize> {
        match self {
            Component::Epp => Some(0),
            Component::EppReplica(i) => Some(i),
            _ => None,
        }
    }

    /// The pod name of engine pod `i` (its endpoint name in the EPP).
    pub fn pod_name(i: usize) -> String {
        format!("sim-{i}")
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Component::Nats => f.write_str("nats"),
            Component::Redis => f.write_str("redis"),
            Component::Kvbm => f.write_str("kvbm"),
            Component::Engine(i) => write!(f, "engine-{i}"),
            Component::Sidecar(i) => write!(f, "sidecar-{i}"),
            Component::Epp => f.write_str("epp"),
            Component::EppReplica(i) => write!(f, "epp-{i}"),
            Component::Envoy => f.write_str("envoy"),
            Component::Router => f.write_str("router"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        StackConfig::default().validate().unwrap();
        let bad = [
            StackConfig {
                engines: 0,
                ..StackConfig::default()
            },
            StackConfig {
                time_scale: 0.0,
                ..StackConfig::default()
            },
            StackConfig {
                time_scale: f64::NAN,
                ..StackConfig::default()
            },
            StackConfig {
                block_size: 0,
                ..StackConfig::default()
            },
            StackConfig {
                pool: "a b".into(),
                ..StackConfig::default()
            },
            StackConfig {
                envoy_lb: EnvoyLb::OriginalDst,
                ..StackConfig::default()
            },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
        let mut ok = StackConfig {
            envoy_lb: EnvoyLb::OriginalDst,
            ..StackConfig::default()
        };
        ok.scheduler.fallbacks = 0;
        ok.validate().unwrap();
    }

    #[test]
    fn start_order_starts_nats_first_and_the_router_last() {
        let c = StackConfig {
            engines: 2,
            ..StackConfig::default()
        };
        let order = c.components();
        assert_eq!(order.first(), Some(&Component::Nats));
        assert_eq!(order.last(), Some(&Component::Envoy));
        assert_eq!(order.len(), 7);
        let names: Vec<String> = order.iter().map(ToString::to_string).collect();
        assert_eq!(
            names[1..6],
            ["engine-0", "engine-1", "sidecar-0", "sidecar-1", "epp"]
        );
        let with_kvbm = StackConfig {
            kvbm: Some(KvbmConfig::default()),
            ..c.clone()
        };
        let order = with_kvbm.components();
        assert_eq!(
            order[..3],
            [Component::Nats, Component::Redis, Component::Kvbm],
            "the block manager is up before the engines and the EPP"
        );
        let bad = StackConfig {
            kvbm: Some(KvbmConfig {
                node: "a.b".into(),
                ..KvbmConfig::default()
            }),
            ..c.clone()
        };
        assert!(bad.validate().is_err());
        let two_epps = StackConfig {
            epp_replicas: 2,
            ..c.clone()
        };
        let names: Vec<String> = two_epps.components()[5..]
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(names, ["epp", "epp-1", "envoy"]);
        assert!(
            StackConfig {
                epp_replicas: 0,
                ..c.clone()
            }
            .validate()
            .is_err()
        );
        let peer = StackConfig {
            router: Router::Smg,
            ..c
        };
        let order = peer.components();
        assert_eq!(order.last(), Some(&Component::Router));
        assert!(!order.contains(&Component::Epp) && !order.contains(&Component::Envoy));
    }
}
