//! The stack's ports, all chosen free on loopback at start and kept across component restarts.

use std::net::TcpListener;

/// Ports of one engine and its sidecar.
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

/// Every port of a stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ports {
    /// NATS client port.
    pub nats: u16,
    /// Per engine.
    pub engines: Vec<EnginePorts>,
    /// The EPP's ext_proc gRPC port.
    pub epp_grpc: u16,
    /// The EPP's gRPC health port.
    pub epp_health: u16,
    /// The EPP's `/metrics` port.
    pub epp_metrics: u16,
    /// Envoy's listener: the OpenAI base URL's port.
    pub envoy_listen: u16,
    /// Envoy's admin port.
    pub envoy_admin: u16,
}

const PER_ENGINE: usize = 5;
const FIXED: usize = 6;

impl Ports {
    /// Distinct free loopback ports for a stack of `engines` engines. All listeners are held
    /// until every port is chosen, so no two coincide; another process may still take one
    /// before its component binds it (the component then fails readiness with its log).
    pub fn allocate(engines: usize) -> std::io::Result<Ports> {
        let held = (0..FIXED + PER_ENGINE * engines)
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<Result<Vec<_>, _>>()?;
        let ports = held
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Ports::from_list(&ports, engines))
    }

    /// Lays out `list` (at least [`FIXED`] + [`PER_ENGINE`] × `engines` ports; missing ones
    /// read as 0, which the caller never produces).
    fn from_list(list: &[u16], engines: usize) -> Ports {
        let at = |i: usize| list.get(i).copied().unwrap_or(0);
        Ports {
            nats: at(0),
            epp_grpc: at(1),
            epp_health: at(2),
            epp_metrics: at(3),
            envoy_listen: at(4),
            envoy_admin: at(5),
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
        }
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
        ];
        for e in &self.engines {
            all.extend([e.http, e.events, e.replay, e.proxy, e.sidecar_metrics]);
        }
        all
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
    fn allocated_ports_are_distinct_and_nonzero() {
        let p = Ports::allocate(4).unwrap();
        let mut all = p.all();
        assert_eq!(all.len(), FIXED + PER_ENGINE * 4);
        assert!(all.iter().all(|&x| x != 0));
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), FIXED + PER_ENGINE * 4);
    }
}
