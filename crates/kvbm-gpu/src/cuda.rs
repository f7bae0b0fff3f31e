//! The CUDA device layer, through cudarc's driver API loaded at run time.
//!
//! Nothing here links against CUDA: [`Cuda::open`] first checks that `libcuda` can be loaded
//! and reports [`Unavailable`] when it cannot, so the binaries run unchanged on machines
//! without a GPU. With a device: a page-locked host pool ([`PinnedBuffer`],
//! `cuMemHostAlloc`), device buffers, and [`CudaMover`], which issues a plan's copies as
//! `cuMemcpy2DAsync` on one stream with an event after each layer.
//!
//! Copies are asynchronous, so a [`PinnedBuffer`] carries a last-use event recorded after
//! every copy enqueued on it; reading, writing and freeing it wait for that event. Safe code
//! (a mover dropped early or forgotten included) therefore never touches bytes a DMA engine is
//! still moving.
//!
//! This module and [`crate::gds`] are the only places in the crate with `unsafe`: raw driver
//! calls on pointers the types here own and bound-check.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUmemorytype};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};

use crate::mover::{Mover, OutOfBounds};
use crate::plan::{Copy2d, Direction};

/// Why the CUDA path is not used on this machine.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    /// `libcuda.so` could not be loaded (no NVIDIA driver, or not on the library path).
    #[error(
        "the CUDA driver library (libcuda.so) cannot be loaded: no NVIDIA driver on this machine or not on LD_LIBRARY_PATH"
    )]
    NoDriver,
    /// The driver loaded but refused: no device, the ordinal past the devices, a driver too old.
    #[error("the CUDA driver refused device {ordinal}")]
    Device {
        /// The device asked for.
        ordinal: usize,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
}

/// A CUDA call that failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The driver returned an error.
    #[error("CUDA {what} failed")]
    Driver {
        /// The call.
        what: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// A copy outside the buffers it was given (refused before reaching the driver).
    #[error(transparent)]
    OutOfBounds(#[from] OutOfBounds),
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

/// One CUDA device, its primary context retained.
#[derive(Debug, Clone)]
pub struct Cuda {
    ctx: Arc<CudaContext>,
}

impl Cuda {
    /// Opens device `ordinal`, or says why CUDA cannot be used here.
    pub fn open(ordinal: usize) -> Result<Self, Unavailable> {
        // SAFETY: only tries to dlopen the library (and drops the handle); no symbol is called.
        if !unsafe { sys::is_culib_present() } {
            return Err(Unavailable::NoDriver);
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|source| Unavailable::Device { ordinal, source })?;
        Ok(Self { ctx })
    }

    /// The device's name, as the driver reports it.
    pub fn name(&self) -> Result<String, CudaError> {
        self.ctx.name().map_err(driver("cuDeviceGetName"))
    }

    /// Binds the device's context to the calling thread (raw driver calls need it).
    pub(crate) fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))
    }

    /// A new stream on the device.
    pub fn stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        self.ctx.new_stream().map_err(driver("cuStreamCreate"))
    }

    /// `bytes` of zeroed device memory, ready for use on any stream.
    pub fn alloc(&self, stream: &Arc<CudaStream>, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        let last_use = self.ctx.new_event(None).map_err(driver("cuEventCreate"))?;
        let slice = stream
            .alloc_zeros::<u8>(bytes)
            .map_err(driver("cuMemAlloc"))?;
        let address = {
            let (address, _sync) = slice.device_ptr(stream);
            address
        };
        // The allocation and its zeroing are ordered on `stream` only: wait for them, so any
        // stream (a mover's, cuFile) may use the memory.
        stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        Ok(DeviceBuffer {
            address,
            len: bytes,
            last_use,
            _slice: slice,
        })
    }

    /// `bytes` of page-locked host memory, zeroed, mapped for every context
    /// (`CU_MEMHOSTALLOC_PORTABLE`): the pool the GPU's DMA engines copy to and from directly.
    pub fn pinned(&self, bytes: usize) -> Result<PinnedBuffer, CudaError> {
        // The event first: nothing to free if it fails.
        let last_use = self.ctx.new_event(None).map_err(driver("cuEventCreate"))?;
        self.bind()?;
        let len = bytes.max(1);
        // SAFETY: a plain allocation; the pointer is owned by the returned buffer and freed once
        // in its Drop.
        let ptr =
            unsafe { cudarc::driver::result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(driver("cuMemHostAlloc"))?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(CudaError::Driver {
            what: "cuMemHostAlloc",
            source: DriverError(sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY),
        })?;
        // SAFETY: `ptr` points to `len` bytes we own and nothing else uses yet; zeroing makes
        // every byte initialised.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedBuffer {
            ctx: self.ctx.clone(),
            ptr,
            len: bytes,
            last_use,
        })
    }

    /// A timing event recorded on `stream` now (for the benchmark).
    pub fn timing_event(&self, stream: &CudaStream) -> Result<CudaEvent, CudaError> {
        stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("cuEventCreate/cuEventRecord"))
    }

    /// One `cuMemcpyHtoDAsync`/`cuMemcpyDtoHAsync` of `bytes` between the start of `host` and
    /// the start of `device`, on `stream`: the benchmark's baseline for what the copy engine
    /// does with one large contiguous copy.
    pub fn copy_whole(
        &self,
        stream: &CudaStream,
        direction: Direction,
        host: &mut PinnedBuffer,
        device: &DeviceBuffer,
        bytes: usize,
    ) -> Result<(), CudaError> {
        if bytes > host.len || bytes > device.len {
            return Err(OutOfBounds {
                layer: 0,
                side: "host or device",
                start: 0,
                end: bytes as u64,
                len: host.len.min(device.len),
            }
            .into());
        }
        self.bind()?;
        // SAFETY: both ranges were checked against the buffers. The host buffer is not read,
        // written or freed before this copy completes: its last-use event is recorded right
        // after it, and every access and its Drop wait for that event. The device buffer was
        // allocated and synchronised before; the caller keeps it alive until its copies are
        // done (`&DeviceBuffer` here; the benchmark synchronises the stream before dropping
        // it).
        let r = unsafe {
            match direction {
                Direction::ToDevice => sys::cuMemcpyHtoDAsync_v2(
                    device.address,
                    host.ptr.as_ptr().cast::<c_void>(),
                    bytes,
                    stream.cu_stream(),
                ),
                Direction::ToHost => sys::cuMemcpyDtoHAsync_v2(
                    host.ptr.as_ptr().cast::<c_void>(),
                    device.address,
                    bytes,
                    stream.cu_stream(),
                ),
            }
        };
        r.result().map_err(driver("cuMemcpyAsync"))?;
        device.used_on(stream)?;
        host.used_on(stream)
    }
}

/// Device memory the benchmark allocates (an engine's KV cache stands in for it in
/// production). Like [`PinnedBuffer`] it carries a last-use event, recorded after each copy,
/// and is freed only once those copies are done.
#[derive(Debug)]
pub struct DeviceBuffer {
    address: u64,
    len: usize,
    last_use: CudaEvent,
    _slice: CudaSlice<u8>,
}

impl DeviceBuffer {
    /// The device address of byte 0.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Its size.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Records that work now enqueued on `stream` uses the buffer.
    fn used_on(&self, stream: &CudaStream) -> Result<(), CudaError> {
        self.last_use
            .record(stream)
            .map_err(driver("cuEventRecord"))
    }

    /// Waits until no copy enqueued on it through this crate is still running.
    pub(crate) fn settle(&self) {
        if let Err(e) = self.last_use.synchronize() {
            tracing::warn!(error = %e, "waiting for the device buffer's copies failed");
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // The allocation is freed after this (its field's drop, ordered on its own stream);
        // copies issued on other streams must be done first.
        self.settle();
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop, with its last-use event.
#[derive(Debug)]
pub struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: NonNull<u8>,
    len: usize,
    last_use: CudaEvent,
}

// SAFETY: the buffer owns its allocation; access goes through &/&mut like a Vec<u8>, and the
// event and context it holds are Send.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// Records that work now enqueued on `stream` uses the buffer.
    fn used_on(&mut self, stream: &CudaStream) -> Result<(), CudaError> {
        self.last_use
            .record(stream)
            .map_err(driver("cuEventRecord"))
    }

    /// Waits until no enqueued copy uses the buffer. A failure means the context is broken
    /// and its copies stopped with it; it is logged.
    fn settle(&self) {
        if let Err(e) = self.last_use.synchronize() {
            tracing::warn!(error = %e, "waiting for the pinned buffer's copies failed");
        }
    }

    /// The bytes, once the copies that use them have completed.
    pub fn as_slice(&self) -> &[u8] {
        self.settle();
        // SAFETY: `ptr` points to `len` initialised bytes we own. No copy is in flight: settled
        // above, and enqueueing a new one needs `&mut self`, which `&self` excludes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably, once the copies that use them have completed.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.settle();
        // SAFETY: as above, with `&mut self` excluding every other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Its size.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        self.settle();
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `cuMemHostAlloc`, no copy uses it any more (settled above),
        // and it is freed exactly once, here.
        if let Err(e) = unsafe { cudarc::driver::result::free_host(self.ptr.as_ptr().cast()) } {
            tracing::warn!(error = %e, "cuMemFreeHost failed");
        }
    }
}

/// Issues copies between a device buffer and a pinned buffer on one stream, borrowing both for
/// its life. Dropping it does not wait: the pinned buffer's own event does.
#[derive(Debug)]
pub struct CudaMover<'a> {
    cuda: Cuda,
    stream: Arc<CudaStream>,
    host: &'a mut PinnedBuffer,
    device: &'a DeviceBuffer,
}

impl<'a> CudaMover<'a> {
    /// A mover between `host` and `device`, issuing on `stream`.
    pub fn new(
        cuda: &Cuda,
        stream: Arc<CudaStream>,
        host: &'a mut PinnedBuffer,
        device: &'a DeviceBuffer,
    ) -> Self {
        Self {
            cuda: cuda.clone(),
            stream,
            host,
            device,
        }
    }

    fn check(&self, c: &Copy2d) -> Result<(), OutOfBounds> {
        let base = self.device.address;
        let limit = base.checked_add(self.device.len as u64);
        let dev_ok = c.device >= base
            && matches!((c.device_end(), limit), (Some(end), Some(limit)) if end <= limit);
        if !dev_ok {
            return Err(OutOfBounds {
                layer: c.layer,
                side: "device",
                start: c.device,
                end: c.device_end().unwrap_or(u64::MAX),
                len: self.device.len,
            });
        }
        if c.host_end().is_none_or(|end| end > self.host.len as u64) {
            return Err(OutOfBounds {
                layer: c.layer,
                side: "host",
                start: c.host,
                end: c.host_end().unwrap_or(u64::MAX),
                len: self.host.len,
            });
        }
        Ok(())
    }
}

impl Mover for CudaMover<'_> {
    type Event = CudaEvent;
    type Error = CudaError;

    fn copy(&mut self, direction: Direction, c: &Copy2d) -> Result<(), CudaError> {
        self.check(c)?;
        let host = self
            .host
            .ptr
            .as_ptr()
            .wrapping_add(c.host as usize)
            .cast::<c_void>();
        let (src_host, dst_host, src_dev, dst_dev, src_type, dst_type, src_pitch, dst_pitch) =
            match direction {
                Direction::ToDevice => (
                    host.cast_const(),
                    std::ptr::null_mut(),
                    0,
                    c.device,
                    CUmemorytype::CU_MEMORYTYPE_HOST,
                    CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    c.host_pitch,
                    c.device_pitch,
                ),
                Direction::ToHost => (
                    std::ptr::null(),
                    host,
                    c.device,
                    0,
                    CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    CUmemorytype::CU_MEMORYTYPE_HOST,
                    c.device_pitch,
                    c.host_pitch,
                ),
            };
        let desc = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: src_type,
            srcHost: src_host,
            srcDevice: src_dev,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: dst_type,
            dstHost: dst_host,
            dstDevice: dst_dev,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch as usize,
            WidthInBytes: c.width as usize,
            Height: c.height as usize,
        };
        self.cuda.bind()?;
        // SAFETY: the host rows lie inside the pinned buffer (checked above, without overflow),
        // which is not touched or freed before this copy completes: its last-use event is
        // recorded right after it, and every access and its Drop wait for that event. The
        // device rows lie inside the device buffer this mover borrows, allocated and
        // synchronised before. `desc` lives until the call returns (the driver copies it).
        unsafe { sys::cuMemcpy2DAsync_v2(&desc, self.stream.cu_stream()) }
            .result()
            .map_err(driver("cuMemcpy2DAsync"))?;
        self.device.used_on(&self.stream)?;
        self.host.used_on(&self.stream)
    }

    fn record(&mut self) -> Result<CudaEvent, CudaError> {
        self.stream
            .record_event(None)
            .map_err(driver("cuEventCreate/cuEventRecord"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a CUDA driver `open` reports it instead of panicking inside cudarc's loader
    /// (which is what calling into cudarc without the check does). On a machine with a GPU
    /// this opens device 0 and checks its name.
    #[test]
    fn opening_says_why_cuda_is_unavailable_or_names_the_device() {
        match Cuda::open(0) {
            Ok(cuda) => assert!(!cuda.name().expect("name").is_empty()),
            Err(Unavailable::NoDriver) => {
                assert!(
                    std::env::var_os("KVGATE_EXPECT_GPU").is_none(),
                    "a GPU was expected"
                )
            }
            Err(e @ Unavailable::Device { .. }) => {
                assert!(std::env::var_os("KVGATE_EXPECT_GPU").is_none(), "{e}");
            }
        }
    }

    #[test]
    fn a_device_past_the_last_is_refused_or_the_driver_is_absent() {
        assert!(Cuda::open(10_000).is_err());
    }
}
