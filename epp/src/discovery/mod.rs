//! Where endpoints come from: a watched YAML file (running without Kubernetes) or the
//! InferencePool and its Pods through kube-rs ([`kubernetes`]). Both produce the same endpoint
//! list, installed by [`apply::apply`] into the synchronous [`Datastore`].

pub mod apply;
pub mod datastore;
pub mod file;
pub mod kubernetes;
mod wake;

pub use datastore::{Datastore, EndpointKey};
pub use wake::Wake;
