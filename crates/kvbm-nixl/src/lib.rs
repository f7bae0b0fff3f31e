//! NIXL for the block manager's pulls between nodes.
//!
//! The holder of blocks [`Nixl::expose`]s them (one host buffer registered with its agent)
//! and sends the returned [`Offer`] (its agent's metadata and the buffer's address) over the
//! pull connection; the puller [`Nixl::read`]s them with a NIXL READ into a buffer of its own.
//! The pull connection's mutual authentication is the only way an offer reaches a puller;
//! NIXL's own metadata service (listen thread, etcd) is not used.
//!
//! Nothing links against NIXL: [`Nixl::load`] first opens `libnixl_capi.so` itself
//! ([`load`]), so a node without NIXL gets an error that says why instead of the `stub-api`
//! bindings aborting the process on their first call.
//!
//! The backend is UCX, which picks its transports itself (RDMA, shared memory, TCP; `UCX_TLS`
//! narrows them). Only host memory (`DRAM_SEG`) is exposed or read.

mod buffer;
pub mod load;
mod symbols;
mod transfer;

pub use load::{LoadError, ProbeError};
pub use transfer::{Exposed, Nixl, Offer, PoolConfig, ReadError, agent_name, metadata_agent};

/// The NIXL backend plugin every agent creates.
pub const BACKEND: &str = "UCX";

/// The C API's library, as the `stub-api` bindings open it.
pub const LIBRARY: &str = "libnixl_capi.so";
