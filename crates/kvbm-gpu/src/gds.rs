//! GPUDirect Storage: NVMe → device reads through cuFile, loaded at run time.
//!
//! [`Gds::open`] checks that `libcufile` loads and that its driver opens (it needs the
//! `nvidia-fs` kernel module, or runs in cuFile's compatibility mode where the library's
//! configuration allows it); otherwise it says why, and the disk tier keeps to `O_DIRECT`
//! into host memory followed by a host → device copy (the daemon's own path, and the
//! benchmark's baseline row).
#![allow(unsafe_code)]

use std::fs::File;
use std::sync::Arc;

use cudarc::cufile::result::CufileError;
use cudarc::cufile::{Cufile, FileHandle};

use crate::cuda::DeviceBuffer;

/// Why GDS is not used on this machine.
#[derive(Debug, thiserror::Error)]
pub enum GdsUnavailable {
    /// `libcufile.so` could not be loaded.
    #[error(
        "the cuFile library (libcufile.so) cannot be loaded: GPUDirect Storage is not installed"
    )]
    NoLibrary,
    /// The library loaded but `cuFileDriverOpen` failed (commonly: no `nvidia-fs` module).
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
    /// The read would run past the device buffer, or an offset does not fit cuFile's `off_t`.
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

/// An open cuFile driver.
#[derive(Debug, Clone)]
pub struct Gds {
    driver: Arc<Cufile>,
}

/// A file registered with cuFile.
#[derive(Debug)]
pub struct GdsFile {
    handle: FileHandle,
}

impl Gds {
    /// Opens the cuFile driver, or says why GDS cannot be used here. Call after
    /// [`crate::cuda::Cuda::open`] succeeded (cuFile needs a CUDA context).
    pub fn open() -> Result<Self, GdsUnavailable> {
        // SAFETY: only tries to dlopen the library (and drops the handle); no symbol is called.
        if !unsafe { cudarc::cufile::sys::is_culib_present() } {
            return Err(GdsUnavailable::NoLibrary);
        }
        let driver = Cufile::new().map_err(GdsUnavailable::Driver)?;
        Ok(Self { driver })
    }

    /// Registers `file`, which must have been opened with `O_DIRECT`.
    pub fn register(&self, file: File) -> Result<GdsFile, GdsError> {
        let handle = self.driver.register(file).map_err(GdsError::Register)?;
        Ok(GdsFile { handle })
    }
}

impl GdsFile {
    /// Reads `len` bytes at `offset` of the file straight into the start of `dst`
    /// (synchronously: cuFile returns once the bytes are in device memory). Returns the bytes
    /// read, fewer at the end of the file.
    pub fn read(&self, offset: u64, dst: &DeviceBuffer, len: usize) -> Result<usize, GdsError> {
        let oob = || GdsError::OutOfBounds {
            offset,
            len,
            capacity: dst.len(),
        };
        if len > dst.len() {
            return Err(oob());
        }
        let file_offset = i64::try_from(offset).map_err(|_| oob())?;
        // SAFETY: `dst` is a live device allocation of at least `len` bytes (checked above);
        // the handle is registered and owned by `self`.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Without libcufile, `open` says so instead of panicking in cudarc's loader.
    #[test]
    fn opening_without_cufile_says_so() {
        match Gds::open() {
            Ok(_) => {}
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}
