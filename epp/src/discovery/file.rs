//! File discovery: endpoints from a YAML file, re-read when it changes.
//!
//! ```yaml
//! endpoints:
//!   - name: sim-0            # pod name (stable identity with the port)
//!     address: 127.0.0.1     # pod IP
//!     ports: [8000]          # target ports; one endpoint per port (data-parallel ranks)
//!     node: node-a           # optional: credits the node's host/disk tiers
//!     role: both             # both | prefill | decode
//!     ready: true            # default true
//!     models: []             # served model/LoRA names; empty = any
//!     events: tcp://127.0.0.1:5557   # optional, direct-ZMQ mode: the engine's KV-event PUB
//!     replay: tcp://127.0.0.1:5558   # optional: its replay ROUTER
//! ```
//!
//! With several ports (data-parallel ranks), rank *i* publishes on the events and replay ports
//! plus *i*, as vLLM offsets them.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use scheduler::{Endpoint, Role};
use serde::Deserialize;

use super::datastore::{Datastore, EndpointKey};

/// Most endpoints one file may declare (bounded input).
pub const MAX_ENDPOINTS: usize = 4096;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSpec {
    endpoints: Vec<EndpointSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointSpec {
    name: String,
    address: IpAddr,
    ports: Vec<u16>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    role: RoleSpec,
    #[serde(default = "yes")]
    ready: bool,
    #[serde(default)]
    models: BTreeSet<String>,
    #[serde(default)]
    events: Option<String>,
    #[serde(default)]
    replay: Option<String>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum RoleSpec {
    #[default]
    Both,
    Prefill,
    Decode,
}

/// Why an endpoints file was refused (the previous endpoints stay in force).
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// Unreadable.
    #[error("cannot read endpoints file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not the documented YAML.
    #[error("endpoints file {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// One parsed endpoint, ready for the datastore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    /// Identity.
    pub key: EndpointKey,
    /// Address.
    pub address: SocketAddr,
    /// Node name.
    pub node: Option<String>,
    /// Role.
    pub role: Role,
    /// Ready.
    pub ready: bool,
    /// Served models.
    pub models: BTreeSet<String>,
    /// The engine rank's KV-event PUB endpoint (direct-ZMQ mode).
    pub events: Option<String>,
    /// Its replay ROUTER endpoint.
    pub replay: Option<String>,
}

/// `tcp://host:port` with the port moved up by `rank`.
fn offset(endpoint: &str, rank: usize) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_owned());
    }
    let (host, port) = endpoint.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let port = port.checked_add(u16::try_from(rank).ok()?)?;
    Some(format!("{host}:{port}"))
}

/// Parses the file's text.
pub fn parse(path: &Path, text: &str) -> Result<Vec<Parsed>, FileError> {
    let invalid = |message: String| FileError::Invalid {
        path: path.to_owned(),
        message,
    };
    let spec: FileSpec = serde_yaml_ng::from_str(text).map_err(|e| invalid(e.to_string()))?;
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for e in spec.endpoints {
        if e.name.is_empty() {
            return Err(invalid("an endpoint has an empty name".into()));
        }
        if e.ports.is_empty() {
            return Err(invalid(format!("endpoint {:?} lists no ports", e.name)));
        }
        for (rank, &port) in e.ports.iter().enumerate() {
            let shifted = |ep: &Option<String>, what: &str| -> Result<Option<String>, FileError> {
                match ep {
                    None => Ok(None),
                    Some(ep) if !ep.starts_with("tcp://") && !ep.starts_with("ipc://") => {
                        Err(invalid(format!(
                            "endpoint {:?}: {what} {ep:?} is not tcp:// or ipc://",
                            e.name
                        )))
                    }
                    Some(ep) => offset(ep, rank).map(Some).ok_or_else(|| {
                        invalid(format!(
                            "endpoint {:?}: {what} {ep:?} has no usable port",
                            e.name
                        ))
                    }),
                }
            };
            let events = shifted(&e.events, "events")?;
            let replay = shifted(&e.replay, "replay")?;
            if port == 0 {
                return Err(invalid(format!("endpoint {:?} has port 0", e.name)));
            }
            let key = (e.name.clone(), port);
            if !seen.insert(key.clone()) {
                return Err(invalid(format!(
                    "endpoint {:?} port {port} is listed twice",
                    e.name
                )));
            }
            out.push(Parsed {
                key,
                address: SocketAddr::new(e.address, port),
                node: e.node.clone(),
                role: match e.role {
                    RoleSpec::Both => Role::Both,
                    RoleSpec::Prefill => Role::Prefill,
                    RoleSpec::Decode => Role::Decode,
                },
                ready: e.ready,
                models: e.models.clone(),
                events,
                replay,
            });
            if out.len() > MAX_ENDPOINTS {
                return Err(invalid(format!("more than {MAX_ENDPOINTS} endpoints")));
            }
        }
    }
    Ok(out)
}

/// Turns parsed endpoints into datastore entries (allocating ids); `node_id` maps node names.
pub fn to_endpoints(
    ds: &Datastore,
    parsed: Vec<Parsed>,
    node_id: impl Fn(&str) -> kv_index::NodeId,
) -> Vec<(EndpointKey, Endpoint)> {
    parsed
        .into_iter()
        .map(|p| {
            let id = ds.id_for(&p.key);
            let endpoint = Endpoint {
                id,
                address: p.address,
                node: p.node.as_deref().map(&node_id),
                ready: p.ready,
                role: p.role,
                models: p.models,
            };
            (p.key, endpoint)
        })
        .collect()
}

/// Watches a file by modification time and size.
#[derive(Debug)]
pub struct FileWatch {
    path: PathBuf,
    seen: Option<(SystemTime, u64)>,
}

impl FileWatch {
    /// A watch on `path`.
    pub fn new(path: PathBuf) -> Self {
        Self { path, seen: None }
    }

    /// The file's text when it changed since the last call (always on the first call).
    pub fn poll(&mut self) -> Result<Option<String>, FileError> {
        let read_err = |source| FileError::Read {
            path: self.path.clone(),
            source,
        };
        let meta = std::fs::metadata(&self.path).map_err(read_err)?;
        let stamp = (meta.modified().map_err(read_err)?, meta.len());
        if self.seen == Some(stamp) {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&self.path).map_err(read_err)?;
        self.seen = Some(stamp);
        Ok(Some(text))
    }

    /// The watched path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = "endpoints:\n  - name: a\n    address: 10.0.0.1\n    ports: [8000, 8001]\n    node: n1\n    role: decode\n    events: tcp://10.0.0.1:5557\n  - name: b\n    address: 10.0.0.2\n    ports: [8000]\n    ready: false\n    models: [m]\n";

    #[test]
    fn ports_become_endpoints() {
        let p = parse(Path::new("f"), OK).unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p[1].address, "10.0.0.1:8001".parse().unwrap());
        assert_eq!(p[0].role, Role::Decode);
        assert_eq!(p[0].events.as_deref(), Some("tcp://10.0.0.1:5557"));
        assert_eq!(
            p[1].events.as_deref(),
            Some("tcp://10.0.0.1:5558"),
            "rank 1 is offset"
        );
        assert_eq!(p[2].events, None);
        assert!(!p[2].ready);
        let ds = Datastore::new();
        let eps = to_endpoints(&ds, p, |_| kv_index::NodeId::new(7).unwrap());
        assert_eq!(eps[0].1.node, Some(kv_index::NodeId::new(7).unwrap()));
        assert_eq!(eps[2].1.node, None);
    }

    #[test]
    fn bad_files_name_the_problem() {
        for (text, want) in [
            (
                "endpoints: [{name: a, address: 1.2.3.4, ports: []}]",
                "no ports",
            ),
            (
                "endpoints: [{name: a, address: nope, ports: [1]}]",
                "address",
            ),
            (
                "endpoints: [{name: a, address: 1.2.3.4, ports: [1, 1]}]",
                "twice",
            ),
            (
                "endpoints: [{name: a, address: 1.2.3.4, ports: [1], colour: red}]",
                "unknown field",
            ),
            (
                "endpoints: [{name: a, address: 1.2.3.4, ports: [1], role: boss}]",
                "role",
            ),
        ] {
            let err = parse(Path::new("eps.yaml"), text).unwrap_err().to_string();
            assert!(
                err.contains(want) && err.contains("eps.yaml"),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn watch_reports_changes_only() {
        let dir = std::env::temp_dir().join(format!("kvgate-epp-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("eps.yaml");
        std::fs::write(&f, OK).unwrap();
        let mut w = FileWatch::new(f.clone());
        assert!(w.poll().unwrap().is_some());
        assert!(w.poll().unwrap().is_none());
        std::fs::write(&f, format!("{OK}\n")).unwrap();
        assert!(w.poll().unwrap().is_some());
        std::fs::remove_file(&f).unwrap();
        assert!(w.poll().is_err());
    }
}
