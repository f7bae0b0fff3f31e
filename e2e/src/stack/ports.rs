//! The stack's ports, all chosen free on loopback at start and kept across component restarts.
//! With data-parallel ranks, an engine pod's HTTP, event, replay and proxy ports are each a run
//! of consecutive ports (rank r at base + r), as vLLM and the sidecar offset them.

use std::net::TcpListener;

/// Ports of one engine pod and its sidecar; with data-parallel ranks, each of `http`, `events`,
/// `replay` and `proxy` is rank 0's, and rank r uses it + r.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnginePorts {
    /// The engine's OpenAI HTTP port.
    pub http: u16,
    /// The engine's ZMQ KV-event PUB port.
    pub events: u16,
    /// The engine's ZMQ replay ROUTER port.
    pub replay: u16,
    /// The sidecar's proxy port: the endpoint the EPP lists and Envoy sends to.
    pub proxy: u16,
    /// The sidecar's metrics, health and readiness port.
    pub sidecar_metrics: u16,
}

/// Ports of one EPP replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EppPorts {
    /// ext_proc gRPC.
    pub grpc: u16,
    /// gRPC health.
    pub health: u16,
    /// `/metrics` and `/debug/index`.
    pub metrics: u16,
}

/// Every port of a stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ports {
    /// Data-parallel ranks per engine pod (1 without data parallelism).
    pub dp_ranks: u16,
    /// NATS client port.
    pub nats: u16,
    /// Per engine.
    pub engines: Vec<EnginePorts>,
    /// The (first) EPP's ext_proc gRPC port.
    pub epp_grpc: u16,
    /// The (first) EPP's gRPC health port.
    pub epp_health: u16,
    /// The (first) EPP's `/metrics` port.
    pub epp_metrics: u16,
    /// EPP replicas 1.. (replica 0's ports are the three above); see [`Ports::epp`].
    pub more_epps: Vec<EppPorts>,
    /// Envoy's listener: the OpenAI base URL's port.
    pub envoy_listen: u16,
    /// Envoy's admin port.
    pub envoy_admin: u16,
    /// Redis (the KV block manager's remote tier), when the stack runs one.
    pub redis: u16,
    /// The KV block manager's metrics and health port.
    pub kvbm_metrics: u16,
}

const PER_ENGINE: usize = 5;
const FIXED: usize = 8;
const PER_EPP: usize = 3;

impl Ports {
    /// Distinct free loopback ports for a stack of `engines` engine pods of `dp_ranks` ranks
    /// each and `epp_replicas` EPPs (at least one is laid out). All listeners are held until
    /// every port is chosen, so no two coincide; another process may still take one before
    /// its component binds it (the component then fails readiness with its log).
    pub fn allocate(engines: usize, dp_ranks: u16, epp_replicas: usize) -> std::io::Result<Ports> {
        let more_epps = epp_replicas.saturating_sub(1);
        let engine_end = FIXED + PER_ENGINE * engines;
        let mut held = Vec::new();
        let mut list = Vec::with_capacity(engine_end + PER_EPP * more_epps);
        for i in 0..engine_end + PER_EPP * more_epps {
            // The last port of each engine (the sidecar's metrics) is single, as is every
            // port after the engines' (the further EPPs'); the others are runs.
            let run = if i >= FIXED && i < engine_end && (i - FIXED) % PER_ENGINE != PER_ENGINE - 1
            {
                dp_ranks.max(1)
            } else {
                1
            };
            let (base, listeners) = free_run(run)?;
            held.extend(listeners);
            list.push(base);
        }
        Ok(Ports::from_list(&list, engines, dp_ranks.max(1), more_epps))
    }

    /// Lays out `list` ([`FIXED`] + [`PER_ENGINE`] × `engines` + [`PER_EPP`] × `more_epps`
    /// ports; missing ones read as 0, which the caller never produces).
    fn from_list(list: &[u16], engines: usize, dp_ranks: u16, more_epps: usize) -> Ports {
        let at = |i: usize| list.get(i).copied().unwrap_or(0);
        let epp_base = FIXED + PER_ENGINE * engines;
        Ports {
            dp_ranks,
            nats: at(0),
            epp_grpc: at(1),
            epp_health: at(2),
            epp_metrics: at(3),
            envoy_listen: at(4),
            envoy_admin: at(5),
            redis: at(6),
            kvbm_metrics: at(7),
            engines: (0..engines)
                .map(|e| {
                    let b = FIXED + PER_ENGINE * e;
                    EnginePorts {
                        http: at(b),
                        events: at(b + 1),
                        replay: at(b + 2),
                        proxy: at(b + 3),
                        sidecar_metrics: at(b + 4),
                    }
                })
                .collect(),
            more_epps: (0..more_epps)
                .map(|r| {
                    let b = epp_base + PER_EPP * r;
                    EppPorts {
                        grpc: at(b),
                        health: at(b + 1),
                        metrics: at(b + 2),
                    }
                })
                .collect(),
        }
    }

    /// EPP replica `i`'s ports (replica 0 is the stack's first EPP).
    pub fn epp(&self, i: usize) -> Option<EppPorts> {
        match i.checked_sub(1) {
            None => Some(EppPorts {
                grpc: self.epp_grpc,
                health: self.epp_health,
                metrics: self.epp_metrics,
            }),
            Some(more) => self.more_epps.get(more).copied(),
        }
    }

    /// Every endpoint the pool serves, pod-major: each pod's proxy port + rank.
    pub fn endpoint_ports(&self) -> Vec<u16> {
        self.engines
            .iter()
            .flat_map(|e| (0..self.dp_ranks).map(move |r| e.proxy.saturating_add(r)))
            .collect()
    }

    /// Engine process `i`'s (pod `i / dp_ranks`, rank `i % dp_ranks`) HTTP port.
    pub fn engine_http(&self, i: usize) -> Option<u16> {
        let dp = usize::from(self.dp_ranks.max(1));
        let rank = u16::try_from(i % dp).ok()?;
        self.engines
            .get(i / dp)
            .map(|e| e.http.saturating_add(rank))
    }

    /// Every port, for uniqueness checks.
    pub fn all(&self) -> Vec<u16> {
        let mut all = vec![
            self.nats,
            self.epp_grpc,
            self.epp_health,
            self.epp_metrics,
            self.envoy_listen,
            self.envoy_admin,
            self.redis,
            self.kvbm_metrics,
        ];
        for e in &self.engines {
            for r in 0..self.dp_ranks {
                all.extend([e.http, e.events, e.replay, e.proxy].map(|p| p.saturating_add(r)));
            }
            all.push(e.sidecar_metrics);
        }
        for e in &self.more_epps {
            all.extend([e.grpc, e.health, e.metrics]);
        }
        all
    }
}

/// How many times [`free_run`] tries before giving up.
const RUN_ATTEMPTS: usize = 200;

/// `len` consecutive free loopback ports, held: the first is chosen by the kernel, the rest are
/// bound explicitly; a taken neighbour starts over.
fn free_run(len: u16) -> std::io::Result<(u16, Vec<TcpListener>)> {
    for _ in 0..RUN_ATTEMPTS {
        let first = TcpListener::bind("127.0.0.1:0")?;
        let base = first.local_addr()?.port();
        let mut run = vec![first];
        for r in 1..len {
            let Some(port) = base.checked_add(r) else {
                break;
            };
            match TcpListener::bind(("127.0.0.1", port)) {
                Ok(l) => run.push(l),
                Err(_) => break,
            }
        }
        if run.len() == usize::from(len) {
            return Ok((base, run));
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no run of {len} consecutive free ports in {RUN_ATTEMPTS} attempts"),
    ))
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
    fn data_parallel_ranks_get_consecutive_ports() {
        let p = Ports::allocate(2, 3, 1).unwrap();
        let mut all = p.all();
        assert_eq!(all.len(), FIXED + 2 * (4 * 3 + 1));
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), FIXED + 2 * (4 * 3 + 1), "ports coincide");
        let e = p.endpoint_ports();
        assert_eq!(e.len(), 6);
        assert_eq!(e[..3], [0, 1, 2].map(|r| p.engines[0].proxy + r));
        assert_eq!(e[3..], [0, 1, 2].map(|r| p.engines[1].proxy + r));
        assert_eq!(p.engine_http(4), Some(p.engines[1].http + 1));
        assert_eq!(p.engine_http(6), None);
    }

    #[test]
    fn allocated_ports_are_distinct_and_nonzero() {
        let p = Ports::allocate(4, 1, 3).unwrap();
        let mut all = p.all();
        let n = FIXED + PER_ENGINE * 4 + PER_EPP * 2;
        assert_eq!(all.len(), n);
        assert!(all.iter().all(|&x| x != 0));
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n);
        assert_eq!(p.epp(0).map(|e| e.grpc), Some(p.epp_grpc));
        assert_eq!(p.epp(2), p.more_epps.get(1).copied());
        assert_eq!(p.epp(3), None);
    }
}
