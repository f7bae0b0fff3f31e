//! kvgate on Kubernetes, locally: the Helm chart installed into the test API server (kapi, from
//! `../shared/tools/kapi`) and its rendered containers run as local processes, with Envoy in
//! front as a gateway would configure it. The tests of the chart and `kvgate-bench up --kube`
//! use it.
//!
//! - [`chart`]: `helm` (lint, template, install, upgrade) and the rendered objects;
//! - [`podexec`]: a rendered container as a local process, and the emulation's rules (pure);
//! - [`gateway`]: Envoy's configuration as Envoy AI Gateway renders an InferencePool backend
//!   (pure);
//! - [`cluster`]: [`KubeStack`], the running installation.

pub mod chart;
pub mod cluster;
pub mod gateway;
pub mod podexec;

pub use cluster::{KubeStack, KubeStackConfig, KubeStackError, PodKind};
