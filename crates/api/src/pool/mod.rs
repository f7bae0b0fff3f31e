//! The InferencePool: which pods serve a model and on which ports.
//!
//! [`PoolView`] is what the EPP needs from either version: the label selector (a plain map; both
//! versions only support equality on labels) and the target ports in order (the index of a port is
//! the data-parallel rank of the endpoints it yields).

use std::collections::BTreeMap;

pub mod v1;
pub mod v1alpha2;

/// The API group of InferencePool v1.
pub const GROUP_V1: &str = "inference.networking.k8s.io";
/// The API group of InferencePool v1alpha2 (and of GIE's former InferenceObjective).
pub const GROUP_V1ALPHA2: &str = "inference.networking.x-k8s.io";

/// A version-independent view of an InferencePool's spec.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolView {
    /// Pods whose labels contain all of these pairs belong to the pool.
    pub selector: BTreeMap<String, String>,
    /// Target ports, as written (rank = index); not yet range-checked.
    pub target_ports: Vec<i32>,
}

impl PoolView {
    /// Whether a pod with `labels` is selected (all selector pairs present; an empty selector
    /// selects nothing, see the EPP docs).
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        !self.selector.is_empty()
            && self
                .selector
                .iter()
                .all(|(k, v)| labels.get(k).is_some_and(|l| l == v))
    }

    /// The selector in Kubernetes' `labelSelector` query syntax (`k1=v1,k2=v2`), or `None` when
    /// it is empty.
    pub fn label_selector(&self) -> Option<String> {
        if self.selector.is_empty() {
            return None;
        }
        Some(
            self.selector
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(","),
        )
    }
}

impl From<&v1::InferencePoolSpec> for PoolView {
    fn from(spec: &v1::InferencePoolSpec) -> Self {
        Self {
            selector: spec.selector.match_labels.clone(),
            target_ports: spec.target_ports.iter().map(|p| p.number).collect(),
        }
    }
}

impl From<&v1alpha2::InferencePoolSpec> for PoolView {
    fn from(spec: &v1alpha2::InferencePoolSpec) -> Self {
        Self {
            selector: spec.selector.clone(),
            target_ports: vec![spec.target_port_number],
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

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn selection_needs_every_pair_and_a_non_empty_selector() {
        let view = PoolView {
            selector: labels(&[("app", "m"), ("tier", "gpu")]),
            target_ports: vec![8000],
        };
        assert!(view.selects(&labels(&[("app", "m"), ("tier", "gpu"), ("x", "y")])));
        assert!(!view.selects(&labels(&[("app", "m")])));
        assert!(!view.selects(&labels(&[("app", "m"), ("tier", "cpu")])));
        assert_eq!(view.label_selector().as_deref(), Some("app=m,tier=gpu"));
        let empty = PoolView::default();
        assert!(!empty.selects(&labels(&[("app", "m")])));
        assert_eq!(empty.label_selector(), None);
    }
}
