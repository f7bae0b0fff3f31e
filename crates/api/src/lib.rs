//! Kubernetes API types kvgate reads, as Rust types with `kube::CustomResource`:
//!
//! - [`pool::v1::InferencePool`] (`inference.networking.k8s.io/v1`, the GA Gateway API Inference
//!   Extension pool) and [`pool::v1alpha2::InferencePool`] (`inference.networking.x-k8s.io/
//!   v1alpha2`, the pre-GA shape still found in clusters);
//! - [`objective::llm_d::InferenceObjective`] (`llm-d.ai/v1alpha2`, the current home) and
//!   [`objective::x_k8s::InferenceObjective`] (`inference.networking.x-k8s.io/v1alpha2`, GIE's
//!   former home), which give requests a priority by name.
//!
//! The serde shapes follow the upstream YAML field for field (camelCase names, optional fields
//! omitted when unset, unknown fields ignored so newer servers do not break older readers).
//! [`pool::PoolView`] and [`objective::ObjectiveView`] are the version-independent views the EPP
//! works with.
//!
//! [`autoscaler::PoolAutoscaler`] (`kvgate.io/v1alpha1`) is kvgate's own CRD, the operator's
//! input.
//!
//! Pure: no async runtime, no client, no I/O. Only `kube`'s `derive` feature (kube-core), the
//! `k8s-openapi` object metadata, `schemars` and `serde`.

pub mod autoscaler;
pub mod objective;
pub mod pool;
pub mod shared;
