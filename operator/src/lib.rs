//! `kvgate-operator` reconciles `PoolAutoscaler` resources (`kvgate.io/v1alpha1`): once per
//! planner interval it reads the pool's load and latency (from its EPP replicas' `/metrics` or
//! a Prometheus), asks the planner (`crates/planner`) for each role's replicas, and scales the
//! prefill, decode or aggregated workloads through their `/scale` subresource within the GPU
//! budget, with status, conditions and Events saying why. It also keeps the ConfigMap of
//! prefill endpoints the decode pods' sidecars may call. Replicas elect a leader on a Lease;
//! only the leader acts.
//!
//! Layers, pure first: [`observe`] (two scrapes → load and latency), [`plan`] (CRD → planner
//! configuration), [`allowlist::render`], [`leader::decide`]; then the adapters: [`source`]
//! (scrapes, Prometheus), [`scale`] (`/scale`), [`allowlist::sync`], [`leader::Elector`],
//! [`events`], [`controller`] (kube-runtime), [`metrics`] (:9093) and [`app`] (wiring).

pub mod allowlist;
pub mod app;
mod args;
pub mod controller;
pub mod events;
pub mod leader;
pub mod metrics;
pub mod observe;
pub mod plan;
pub mod scale;
pub mod source;

pub use args::Args;

/// Runs the operator until SIGINT/SIGTERM (see [`app`]).
pub fn run(args: Args) -> Result<(), app::AppError> {
    cli_support::init_tracing();
    app::run(args)
}
