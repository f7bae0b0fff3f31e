//! The CUDA device layer, through cudarc's driver API loaded at run time.
//!
//! Nothing here links against CUDA: [`Cuda::open`] first checks that `libcuda` can be loaded
//! and reports [`Unavailable`] when it cannot, so the binaries run unchanged on machines
//! without a GPU. With a device: a page-locked host pool ([`PinnedBuffer`],
//! `cuMemHostAlloc`), device buffers, and [`CudaMover`], which issues a plan's copies as
//! `cuMemcpy2DAsync` on one stream with an event after each layer.
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
    /// A copy outside the buffers the mover was given (refused before reaching the driver).
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

    /// A new stream on the device.
    pub fn stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        self.ctx.new_stream().map_err(driver("cuStreamCreate"))
    }

    /// `bytes` of zeroed device memory.
    pub fn alloc(&self, stream: &Arc<CudaStream>, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        let slice = stream
            .alloc_zeros::<u8>(bytes)
            .map_err(driver("cuMemAlloc"))?;
        let address = {
            let (address, _sync) = slice.device_ptr(stream);
            address
        };
        Ok(DeviceBuffer {
            address,
            len: bytes,
            _slice: slice,
        })
    }

    /// `bytes` of page-locked host memory, zeroed, mapped for every context
    /// (`CU_MEMHOSTALLOC_PORTABLE`): the pool the GPU's DMA engines copy to and from directly.
    pub fn pinned(&self, bytes: usize) -> Result<PinnedBuffer, CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
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
        // SAFETY: `ptr` points to `len` bytes we own; zeroing makes every byte initialised.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedBuffer {
            ctx: self.ctx.clone(),
            ptr,
            len: bytes,
        })
    }

    /// A timing event recorded on `stream` now (for the benchmark).
    pub fn timing_event(&self, stream: &CudaStream) -> Result<CudaEvent, CudaError> {
        stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("cuEventRecord"))
    }

    /// One `cuMemcpyHtoDAsync`/`cuMemcpyDtoHAsync` of `bytes` between the start of `host` and
    /// the start of `device`: the benchmark's baseline for what the copy engine does with one
    /// large contiguous copy.
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
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        // SAFETY: both ranges were checked against buffers we own, which outlive the copy (the
        // caller synchronises the stream before dropping them: the benchmark waits on an event).
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
        r.result().map_err(driver("cuMemcpyAsync"))
    }
}

/// Device memory the benchmark allocates (an engine's KV cache stands in for it in production).
#[derive(Debug)]
pub struct DeviceBuffer {
    address: u64,
    len: usize,
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
}

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop.
#[derive(Debug)]
pub struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation; access goes through &/&mut like a Vec<u8>.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes we own; `&self` excludes writers, and
        // no copy is in flight (a `CudaMover` borrowing it mutably waits for its stream on drop).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
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
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed exactly once, here.
        if let Err(e) = unsafe { cudarc::driver::result::free_host(self.ptr.as_ptr().cast()) } {
            tracing::warn!(error = %e, "cuMemFreeHost failed");
        }
    }
}

/// Issues copies between a device range and a pinned buffer on one stream. It borrows the
/// buffer mutably and synchronises the stream when dropped, so no copy is in flight once the
/// buffer can be read again.
#[derive(Debug)]
pub struct CudaMover<'a> {
    cuda: Cuda,
    stream: Arc<CudaStream>,
    host: &'a mut PinnedBuffer,
    device_base: u64,
    device_len: u64,
}

impl<'a> CudaMover<'a> {
    /// A mover between `host` and `device`.
    pub fn new(
        cuda: &Cuda,
        stream: Arc<CudaStream>,
        host: &'a mut PinnedBuffer,
        device: &DeviceBuffer,
    ) -> Self {
        Self {
            cuda: cuda.clone(),
            stream,
            host,
            device_base: device.address,
            device_len: device.len as u64,
        }
    }

    fn check(&self, c: &Copy2d) -> Result<(), OutOfBounds> {
        let dev_ok = c.device >= self.device_base
            && c.device_end() <= self.device_base.saturating_add(self.device_len);
        if !dev_ok {
            return Err(OutOfBounds {
                layer: c.layer,
                side: "device",
                start: c.device,
                end: c.device_end(),
                len: self.device_len as usize,
            });
        }
        if c.host_end() > self.host.len as u64 {
            return Err(OutOfBounds {
                layer: c.layer,
                side: "host",
                start: c.host,
                end: c.host_end(),
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
        self.cuda
            .ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        // SAFETY: the host rows lie inside the pinned buffer this mover borrows mutably until it
        // is dropped (which synchronises the stream), and the device rows inside the device
        // range it was given; `desc` lives until the call returns (the driver copies it).
        unsafe { sys::cuMemcpy2DAsync_v2(&desc, self.stream.cu_stream()) }
            .result()
            .map_err(driver("cuMemcpy2DAsync"))
    }

    fn record(&mut self) -> Result<CudaEvent, CudaError> {
        self.stream
            .record_event(None)
            .map_err(driver("cuEventRecord"))
    }

    fn wait(&mut self, event: &CudaEvent) -> Result<(), CudaError> {
        event.synchronize().map_err(driver("cuEventSynchronize"))
    }
}

impl Drop for CudaMover<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(error = %e, "synchronising the copy stream failed");
        }
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
