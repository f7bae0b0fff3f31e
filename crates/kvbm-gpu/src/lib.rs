//! The block manager's GPU path (see the crate README).
//!
//! - [`layout`] and [`plan`] (pure): where an engine's paged KV cache is on the device and which
//!   strided copies move a batch of blocks between it and host slots, batched per layer.
//! - [`mover`]: issuing a plan in order with an event per layer, over any device layer; the
//!   host-memory one ([`mover::HostMover`]) is what the tests check plans against.
//! - [`cuda`]: the CUDA device layer (cudarc, the driver loaded at run time): page-locked host
//!   memory, device buffers, `cuMemcpy2DAsync` on a stream.
//! - [`gds`]: GPUDirect Storage reads through cuFile, loaded at run time.
//! - [`bandwidth`]: the benchmark behind `kvgate-kvbm-bandwidth`.
//!
//! Without a GPU, [`cuda::Cuda::open`] and [`gds::Gds::open`] return why, and nothing else
//! changes.

pub mod bandwidth;
pub mod cuda;
pub mod gds;
pub mod layout;
pub mod mover;
pub mod plan;
