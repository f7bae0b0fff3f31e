//! The prefiller allow-list (SSRF protection): the only addresses the prefill leg may contact.
//!
//! Two file formats are accepted:
//!
//! - the EPP's discovery file (`epp/src/discovery/file.rs`): a YAML map with `endpoints`, each
//!   with `address` and `ports` (other fields are read by the EPP and ignored here); every
//!   `address:port` pair is allowed;
//! - a plain list of `ip:port`, one per line (or separated by commas or spaces), `#` comments.
//!
//! In Kubernetes the list is the InferencePool's endpoints (pod IP × target port), the same set
//! the EPP picks prefillers from; the file is projected into the pod and re-read on change.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;

/// Most addresses one file may allow (bounded input).
pub const MAX_ADDRESSES: usize = 65_536;

/// A set of allowed prefiller addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList {
    addrs: HashSet<SocketAddr>,
}

impl AllowList {
    /// Whether `addr` may be contacted.
    pub fn allows(&self, addr: &SocketAddr) -> bool {
        self.addrs.contains(addr)
    }

    /// How many addresses are allowed.
    pub fn len(&self) -> usize {
        self.addrs.len()
    }

    /// Whether nothing is allowed.
    pub fn is_empty(&self) -> bool {
        self.addrs.is_empty()
    }
}

impl FromIterator<SocketAddr> for AllowList {
    fn from_iter<I: IntoIterator<Item = SocketAddr>>(iter: I) -> Self {
        Self {
            addrs: iter.into_iter().collect(),
        }
    }
}

/// Why an allow-list file was refused (the previous list stays in force).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllowListError {
    /// The YAML does not have the discovery file's shape.
    #[error("not a discovery file: {0}")]
    Yaml(String),
    /// A list entry is not an `ip:port`.
    #[error("line {line}: {entry:?} is not an ip:port")]
    Entry {
        /// 1-based line number.
        line: usize,
        /// The entry (truncated).
        entry: String,
    },
    /// Too many addresses.
    #[error("more than {MAX_ADDRESSES} addresses")]
    TooMany,
}

#[derive(Debug, Deserialize)]
struct DiscoveryFile {
    endpoints: Vec<DiscoveryEndpoint>,
}

#[derive(Debug, Deserialize)]
struct DiscoveryEndpoint {
    address: IpAddr,
    ports: Vec<u16>,
}

/// Parses either format (a text whose first meaningful line starts `endpoints:` is YAML).
pub fn parse(text: &str) -> Result<AllowList, AllowListError> {
    let yaml = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#') && l != &"---")
        .is_some_and(|l| l.starts_with("endpoints:"));
    if yaml {
        parse_discovery(text)
    } else {
        parse_list(text)
    }
}

fn parse_discovery(text: &str) -> Result<AllowList, AllowListError> {
    let file: DiscoveryFile =
        serde_yaml_ng::from_str(text).map_err(|e| AllowListError::Yaml(e.to_string()))?;
    let mut addrs = HashSet::new();
    for e in file.endpoints {
        for port in e.ports {
            addrs.insert(SocketAddr::new(e.address, port));
            if addrs.len() > MAX_ADDRESSES {
                return Err(AllowListError::TooMany);
            }
        }
    }
    Ok(AllowList { addrs })
}

fn parse_list(text: &str) -> Result<AllowList, AllowListError> {
    let mut addrs = HashSet::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("");
        for entry in line.split(|c: char| c == ',' || c.is_whitespace()) {
            if entry.is_empty() {
                continue;
            }
            let addr = entry
                .parse::<SocketAddr>()
                .map_err(|_| AllowListError::Entry {
                    line: i + 1,
                    entry: entry.chars().take(64).collect(),
                })?;
            addrs.insert(addr);
            if addrs.len() > MAX_ADDRESSES {
                return Err(AllowListError::TooMany);
            }
        }
    }
    Ok(AllowList { addrs })
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

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn discovery_yaml_allows_every_address_port_pair() {
        let text = "# pool\nendpoints:\n  - name: p0\n    address: 10.0.0.1\n    ports: [8000, 8001]\n    role: prefill\n    events: tcp://10.0.0.1:5557\n  - name: d0\n    address: 10.0.0.2\n    ports: [8000]\n";
        let l = parse(text).unwrap();
        assert_eq!(l.len(), 3);
        assert!(l.allows(&a("10.0.0.1:8001")));
        assert!(l.allows(&a("10.0.0.2:8000")));
        assert!(!l.allows(&a("10.0.0.2:8001")));
    }

    #[test]
    fn plain_list_with_comments_and_separators() {
        let l =
            parse("# prefillers\n10.0.0.1:8000\n10.0.0.2:8000, [::1]:9000 # local\n\n").unwrap();
        assert_eq!(l.len(), 3);
        assert!(l.allows(&a("[::1]:9000")));
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn bad_entries_are_errors_with_their_line() {
        assert_eq!(
            parse("10.0.0.1:8000\nhost.example:80\n"),
            Err(AllowListError::Entry {
                line: 2,
                entry: "host.example:80".into()
            })
        );
        assert!(matches!(
            parse("endpoints: 3"),
            Err(AllowListError::Yaml(_))
        ));
        assert!(matches!(
            parse("endpoints:\n  - address: nope\n    ports: [1]\n"),
            Err(AllowListError::Yaml(_))
        ));
    }
}
