//! GPUDirect Storage: NVMe → device reads through cuFile, loaded at run time.
//!
//! [`Gds::open`] checks that `libcufile` loads and that its driver opens; otherwise it says
//! why, and the disk tier keeps to `O_DIRECT` into host memory followed by a host → device
//! copy (the daemon's own path, and the benchmark's baseline row). With the `nvidia-fs`
//! kernel module the reads are DMA from the drive to the GPU; without it, where cuFile's
//! configuration allows its compatibility mode, the driver opens all the same and reads
//! through host memory, so a `cuFileRead` row is GPUDirect only on a machine set up for it.
#![allow(unsafe_code)]

use std::fs::File;
use std::sync::Arc;

use cudarc::cufile::result::CufileError;
use cudarc::cufile::{Cufile, FileHandle};

use crate::cuda::{Cuda, CudaError, DeviceBuffer};

/// Why GDS is not used on this machine.
#[derive(Debug, thiserror::Error)]
pub enum GdsUnavailable {
    /// `libcufile.so` could not be loaded.
    #[error(
        "the cuFile library (libcufile.so) cannot be loaded: GPUDirect Storage is not installed"
    )]
    NoLibrary,
    /// The device's context could not be bound to this thread.
    #[error("binding the CUDA context failed")]
    Context(#[source] CudaError),
    /// The library loaded but `cuFileDriverOpen` failed.
    #[error("cuFileDriverOpen failed: {0:?}")]
    Driver(CufileError),
}

/// A GDS read that failed.
#[derive(Debug, thiserror::Error)]
pub enum GdsError {
    /// Registering the file with cuFile failed (it must be opened with `O_DIRECT`).
    #[error("cuFileHandleRegister failed: {0:?}")]
    Register(CufileError),
    /// The read failed.
    #[error("cuFileRead of {len} bytes at offset {offset} failed: {source:?}")]
    Read {
        /// The file offset.
        offset: u64,
        /// The bytes asked for.
        len: usize,
        /// cuFile's error.
        source: CufileError,
    },
    /// The file offset does not fit cuFile's signed 64-bit `off_t`.
    #[error("file offset {0} is past what cuFile can address")]
    OffsetTooLarge(u64),
    /// Binding the device's context failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The read would run past the device buffer.
    #[error(
        "a read of {len} bytes at offset {offset} does not fit the {capacity}-byte device buffer"
    )]
    OutOfBounds {
        /// The file offset.
        offset: u64,
        /// The bytes asked for.
        len: usize,
        /// The device buffer's size.
        capacity: usize,
    },
}

/// An open cuFile driver, for one device.
#[derive(Debug, Clone)]
pub struct Gds {
    driver: Arc<Cufile>,
    cuda: Cuda,
}

/// A file registered with cuFile.
#[derive(Debug)]
pub struct GdsFile {
    handle: FileHandle,
    cuda: Cuda,
}

impl Gds {
    /// Opens the cuFile driver for `cuda`'s device, or says why GDS cannot be used here.
    pub fn open(cuda: &Cuda) -> Result<Self, GdsUnavailable> {
        // SAFETY: only tries to dlopen the library (and drops the handle); no symbol is called.
        if !unsafe { cudarc::cufile::sys::is_culib_present() } {
            return Err(GdsUnavailable::NoLibrary);
        }
        cuda.bind().map_err(GdsUnavailable::Context)?;
        let driver = Cufile::new().map_err(GdsUnavailable::Driver)?;
        Ok(Self {
            driver,
            cuda: cuda.clone(),
        })
    }

    /// Registers `file`, which must have been opened with `O_DIRECT`.
    pub fn register(&self, file: File) -> Result<GdsFile, GdsError> {
        self.cuda.bind()?;
        let handle = self.driver.register(file).map_err(GdsError::Register)?;
        Ok(GdsFile {
            handle,
            cuda: self.cuda.clone(),
        })
    }
}

impl GdsFile {
    /// Reads `len` bytes at `offset` of the file straight into the start of `dst`
    /// (synchronously: cuFile returns once the bytes are in device memory; it ignores stream
    /// order, so the copies this crate enqueued on `dst` are waited for first). Returns the
    /// bytes read, fewer at the end of the file.
    pub fn read(&self, offset: u64, dst: &mut DeviceBuffer, len: usize) -> Result<usize, GdsError> {
        if len > dst.len() {
            return Err(GdsError::OutOfBounds {
                offset,
                len,
                capacity: dst.len(),
            });
        }
        let file_offset = i64::try_from(offset).map_err(|_| GdsError::OffsetTooLarge(offset))?;
        self.cuda.bind()?;
        dst.settle();
        // SAFETY: `dst` is a live device allocation of at least `len` bytes (checked above)
        // that nothing else uses now (`&mut`, and its earlier copies are done); the handle is
        // registered and owned by `self`, on the bound context.
        let n = unsafe {
            cudarc::cufile::result::read(
                self.handle.cu(),
                dst.address() as *mut std::ffi::c_void,
                len,
                file_offset,
                0,
            )
        }
        .map_err(|source| GdsError::Read {
            offset,
            len,
            source,
        })?;
        Ok(usize::try_from(n).unwrap_or(0))
    }
}
