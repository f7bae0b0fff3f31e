//! Where endpoints come from: a watched YAML file (running without Kubernetes) or, later, the
//! InferencePool and its Pods through kube-rs. Both write the same synchronous [`Datastore`].

pub mod apply;
pub mod datastore;
pub mod file;

pub use datastore::{Datastore, EndpointKey};
