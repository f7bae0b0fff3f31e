//! The local stack (`kvgate-bench up`): NATS, N `kvgate-sim` engines each behind a
//! `kvgate-sidecar`, `kvgate-epp` with file discovery, and a real Envoy in front, all on free
//! loopback ports with configs and logs in one run directory. No Kubernetes.
//!
//! - [`config`]: [`StackConfig`] and [`Component`] (pure);
//! - [`ports`]: the free ports;
//! - [`render`]: the endpoints file, the scheduler file, Envoy's bootstrap (pure);
//! - [`bins`]: where the programs are;
//! - [`process`]: one process, its log, readiness and stop;
//! - [`probe`]: TCP/HTTP readiness probes;
//! - [`handle`]: [`Stack`], the running stack;
//! - [`up`]: the command.

pub mod bins;
pub mod config;
pub mod error;
pub mod handle;
pub mod ports;
pub mod probe;
pub mod process;
pub mod render;
pub mod up;

pub use config::{Component, EnvoyLb, KvEventsPath, KvbmConfig, Router, StackConfig};
pub use error::StackError;
pub use handle::Stack;
pub use up::UpArgs;
