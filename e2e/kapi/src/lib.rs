//! The test Kubernetes API server: `kapi` (the Kubernetes 1.36 API server libraries) over a real
//! `etcd`, both from `../shared/tools/kapi`, run on loopback for kvgate's tests and for the
//! local stack's Kubernetes mode.
//!
//! [`Kapi::start`] picks free ports, starts etcd and the API server, and waits for `/readyz`.
//! The API server and etcd can each be stopped and started again on the **same** ports (clients
//! holding a kubeconfig reconnect, as they would after a control-plane outage), and etcd's data
//! can be backed up and restored (an etcd restore, with resource versions going back in time).
//! With [`Authorization::Rbac`] requests are authorised by the stored RBAC objects and static
//! bearer tokens ([`Kapi::kubeconfig_for`] writes a kubeconfig for one).
//!
//! The binaries (and `kubectl`, `helm`) come from [`Tools::locate`]: `$KVGATE_KUBE_BIN`, else
//! the workspace's `.cache/kube/bin` that `scripts/bootstrap.sh` fills. A missing binary is an
//! error naming the bootstrap, never a skipped test.
//!
//! kapi runs no controllers: nothing turns Deployments into Pods. Tests create Pods and set their
//! status themselves ([`pods`]).

pub mod crds;
mod error;
pub mod pods;
mod server;
mod tools;

pub use error::KapiError;
pub use server::{Authorization, EtcdBackup, Kapi, KapiOptions, Token};
pub use tools::Tools;
