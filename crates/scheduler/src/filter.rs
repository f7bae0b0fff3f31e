//! Filters: which endpoints may take a request at all, before any scoring. In order: the
//! endpoint is ready, can decode (it will be the primary), serves the request's model or
//! LoRA adapter, and is in the data plane's subset hint when one is given. The first filter
//! that leaves nothing names the [`NoCandidateReason`].

use std::net::{IpAddr, SocketAddr};

use crate::endpoint::Endpoint;

/// Why no endpoint can take a request (the caller answers 503).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NoCandidateReason {
    /// No endpoint is ready.
    NoReadyEndpoints,
    /// The subset hint was given and empty: nothing is allowed.
    EmptySubset,
    /// No ready endpoint can decode (only prefill endpoints are up).
    NoDecodeEndpoints,
    /// No ready decode endpoint serves the requested model or LoRA adapter.
    ModelNotServed,
    /// The subset hint allows none of the remaining endpoints.
    SubsetMatchesNothing,
}

impl NoCandidateReason {
    /// A bounded label value for metrics and the `x-kvgate-drop-reason` header.
    pub const fn metric_label(self) -> &'static str {
        match self {
            NoCandidateReason::NoReadyEndpoints => "no_ready_endpoints",
            NoCandidateReason::EmptySubset => "empty_subset",
            NoCandidateReason::NoDecodeEndpoints => "no_decode_endpoints",
            NoCandidateReason::ModelNotServed => "model_not_served",
            NoCandidateReason::SubsetMatchesNothing => "subset_matches_nothing",
        }
    }
}

/// A parsed subset hint: `ip:port` entries allow that endpoint, bare IPs every port of the IP.
/// Entries that are neither are ignored (they match nothing); an entry may itself be a comma
/// list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Subset {
    addrs: Vec<SocketAddr>,
    ips: Vec<IpAddr>,
    given: usize,
}

impl Subset {
    /// Parses the hint's entries.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Self {
        let mut subset = Subset::default();
        for part in entries
            .iter()
            .flat_map(|e| e.as_ref().split(','))
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            subset.given += 1;
            if let Ok(addr) = part.parse::<SocketAddr>() {
                subset.addrs.push(addr);
            } else if let Ok(ip) = part.trim_start_matches('[').trim_end_matches(']').parse() {
                subset.ips.push(ip);
            }
        }
        subset
    }

    /// Whether the hint listed no entry at all.
    pub const fn is_empty(&self) -> bool {
        self.given == 0
    }

    /// Whether the hint allows `addr`.
    pub fn allows(&self, addr: SocketAddr) -> bool {
        self.addrs.contains(&addr) || self.ips.contains(&addr.ip())
    }
}

/// Appends to `out` the endpoints that may be a request's primary; fails with the reason when
/// none may.
pub fn decode_candidates<'a>(
    endpoints: &'a [Endpoint],
    model: &str,
    subset: Option<&[String]>,
    out: &mut Vec<&'a Endpoint>,
) -> Result<(), NoCandidateReason> {
    let subset = subset.map(Subset::parse);
    if subset.as_ref().is_some_and(Subset::is_empty) {
        return Err(NoCandidateReason::EmptySubset);
    }
    // Endpoints passing each filter in turn: ready, decode, model.
    let mut passed = [0usize; 3];
    let start = out.len();
    for e in endpoints {
        if !e.ready {
            continue;
        }
        passed[0] += 1;
        if !e.role.serves_decode() {
            continue;
        }
        passed[1] += 1;
        if !e.serves_model(model) {
            continue;
        }
        passed[2] += 1;
        if subset.as_ref().is_some_and(|s| !s.allows(e.address)) {
            continue;
        }
        out.push(e);
    }
    if out.len() > start {
        return Ok(());
    }
    Err(match passed {
        [0, _, _] => NoCandidateReason::NoReadyEndpoints,
        [_, 0, _] => NoCandidateReason::NoDecodeEndpoints,
        [_, _, 0] => NoCandidateReason::ModelNotServed,
        _ => NoCandidateReason::SubsetMatchesNothing,
    })
}

/// Appends to `out` the endpoints that may take a disaggregated request's prefill leg: ready,
/// prefill-role, serving the model. The subset hint does not apply (it constrains where Envoy
/// sends the request, i.e. the decode endpoint; the prefill leg is the decode sidecar's call).
pub fn prefill_candidates<'a>(endpoints: &'a [Endpoint], model: &str, out: &mut Vec<&'a Endpoint>) {
    out.extend(
        endpoints
            .iter()
            .filter(|e| e.ready && e.role.is_prefill() && e.serves_model(model)),
    );
}

#[cfg(test)]
mod tests {
    use kv_index::EndpointId;

    use super::*;
    use crate::endpoint::Role;

    fn ep(i: u32, addr: &str) -> Endpoint {
        Endpoint::new(EndpointId::new(i).unwrap(), addr.parse().unwrap())
    }

    fn ids(v: &[&Endpoint]) -> Vec<u32> {
        v.iter().map(|e| e.id.get()).collect()
    }

    fn run(
        eps: &[Endpoint],
        model: &str,
        subset: Option<&[String]>,
    ) -> Result<Vec<u32>, NoCandidateReason> {
        let mut out = Vec::new();
        decode_candidates(eps, model, subset, &mut out).map(|()| ids(&out))
    }

    fn pool() -> Vec<Endpoint> {
        vec![
            ep(0, "10.0.0.1:8000"),
            ep(1, "10.0.0.1:8001"),
            ep(2, "10.0.0.2:8000"),
            ep(3, "[fd00::3]:8000"),
        ]
    }

    #[test]
    fn ready_filter() {
        let mut eps = pool();
        eps[1].ready = false;
        assert_eq!(run(&eps, "m", None), Ok(vec![0, 2, 3]));
        for e in &mut eps {
            e.ready = false;
        }
        assert_eq!(
            run(&eps, "m", None),
            Err(NoCandidateReason::NoReadyEndpoints)
        );
        assert_eq!(
            run(&[], "m", None),
            Err(NoCandidateReason::NoReadyEndpoints)
        );
    }

    #[test]
    fn role_filter() {
        let mut eps = pool();
        eps[0].role = Role::Prefill;
        eps[1].role = Role::Decode;
        assert_eq!(run(&eps, "m", None), Ok(vec![1, 2, 3]));
        for e in &mut eps {
            e.role = Role::Prefill;
        }
        assert_eq!(
            run(&eps, "m", None),
            Err(NoCandidateReason::NoDecodeEndpoints)
        );
        let mut out = Vec::new();
        prefill_candidates(&eps, "m", &mut out);
        assert_eq!(ids(&out), vec![0, 1, 2, 3]);
    }

    #[test]
    fn model_filter() {
        let mut eps = pool();
        eps[0].models.insert("llama".into());
        eps[1].models.insert("qwen".into());
        eps[1].models.insert("qwen-sql-lora".into());
        assert_eq!(run(&eps, "qwen-sql-lora", None), Ok(vec![1, 2, 3]));
        for e in &mut eps[2..] {
            e.models.insert("mistral".into());
        }
        assert_eq!(
            run(&eps, "gemma", None),
            Err(NoCandidateReason::ModelNotServed)
        );
        let mut out = Vec::new();
        eps[1].role = Role::Prefill;
        prefill_candidates(&eps, "llama", &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn subset_filter() {
        let eps = pool();
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(run(&eps, "m", Some(&s(&["10.0.0.2:8000"]))), Ok(vec![2]));
        // A bare IP allows all its ports; a comma string is split; IPv6 with or without brackets.
        assert_eq!(run(&eps, "m", Some(&s(&["10.0.0.1"]))), Ok(vec![0, 1]));
        assert_eq!(
            run(&eps, "m", Some(&s(&[" 10.0.0.2:8000 , [fd00::3]:8000"]))),
            Ok(vec![2, 3])
        );
        assert_eq!(run(&eps, "m", Some(&s(&["[fd00::3]"]))), Ok(vec![3]));
        assert_eq!(run(&eps, "m", Some(&s(&["fd00::3"]))), Ok(vec![3]));
        assert_eq!(
            run(&eps, "m", Some(&[])),
            Err(NoCandidateReason::EmptySubset)
        );
        assert_eq!(
            run(&eps, "m", Some(&s(&[" , "]))),
            Err(NoCandidateReason::EmptySubset)
        );
        assert_eq!(
            run(&eps, "m", Some(&s(&["10.9.9.9:8000", "not-an-address"]))),
            Err(NoCandidateReason::SubsetMatchesNothing)
        );
        // The subset hint constrains only what the other filters left.
        let mut eps = eps;
        eps[2].ready = false;
        assert_eq!(
            run(&eps, "m", Some(&s(&["10.0.0.2:8000"]))),
            Err(NoCandidateReason::SubsetMatchesNothing)
        );
    }

    #[test]
    fn reasons_have_distinct_labels() {
        let all = [
            NoCandidateReason::NoReadyEndpoints,
            NoCandidateReason::EmptySubset,
            NoCandidateReason::NoDecodeEndpoints,
            NoCandidateReason::ModelNotServed,
            NoCandidateReason::SubsetMatchesNothing,
        ];
        let labels: std::collections::BTreeSet<_> = all.iter().map(|r| r.metric_label()).collect();
        assert_eq!(labels.len(), all.len());
    }
}
