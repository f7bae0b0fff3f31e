//! Host buffers as NIXL memory descriptors.
#![allow(unsafe_code)]

use nixl_sys::{MemType, MemoryRegion, NixlDescriptor};

/// Bytes on the heap, described to NIXL as host memory (device 0). Moving the buffer does not
/// move its bytes, so an address handed to NIXL stays valid until the buffer is dropped.
#[derive(Debug)]
pub(crate) struct HostBuffer(Vec<u8>);

impl HostBuffer {
    pub(crate) fn new(bytes: Vec<u8>) -> Self {
        Self(bytes)
    }

    /// Where the bytes start.
    pub(crate) fn addr(&self) -> usize {
        self.0.as_ptr() as usize
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl MemoryRegion for HostBuffer {
    // SAFETY (of the contract): the pointer is valid for `size()` bytes while the buffer lives.
    // `transfer` deregisters a buffer before freeing it, and keeps a buffer its own read may
    // still write into out of use (quarantined, or leaked). What it cannot bound is a peer's
    // remote access: UCX serves those without this process's code, so a peer holding the
    // agent's metadata reaches registered buffers (and, over UCX's software RMA, any address)
    // for as long as the agent lives. docs/kvbm.md § The NIXL fabric states that trust.
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }

    fn size(&self) -> usize {
        self.0.len()
    }
}

impl NixlDescriptor for HostBuffer {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}
