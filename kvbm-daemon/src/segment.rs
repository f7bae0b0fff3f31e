//! A connector's shared-memory segment: the `memfd` it passed at the handshake, read and
//! written at offsets with `pread`/`pwrite` (no mapping, so no `unsafe`; the kernel copies
//! between the shared pages and the daemon's buffers, as `memcpy` from a mapping would).

use std::os::fd::OwnedFd;

use bytes::Bytes;
use rustix::fs::FileType;

/// Why a segment was refused or an access failed.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    /// The descriptor is not a memfd (a file on a network or FUSE file system could block
    /// the daemon's reads for ever).
    #[error("the segment descriptor is not a memfd ({0})")]
    NotAMemfd(String),
    /// The file is smaller than the connector declared.
    #[error("the segment has {size} bytes; the connector declared {declared}")]
    TooSmall {
        /// Its size.
        size: u64,
        /// What was declared.
        declared: u64,
    },
    /// The declared size is above the daemon's bound.
    #[error("a segment of {declared} bytes exceeds the limit of {limit}")]
    TooLarge {
        /// What was declared.
        declared: u64,
        /// The bound.
        limit: u64,
    },
    /// A slot lies outside the declared bytes.
    #[error("slot [{offset}, {offset}+{len}) lies outside the segment's {size} bytes")]
    OutOfBounds {
        /// The slot's offset.
        offset: u64,
        /// The block size.
        len: u64,
        /// The declared size.
        size: u64,
    },
    /// The read or write failed or came up short.
    #[error("segment I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// A connector's segment.
#[derive(Debug)]
pub struct Segment {
    fd: OwnedFd,
    len: u64,
}

impl Segment {
    /// Accepts `fd` as a segment of `declared` bytes: it must be a regular file (memfds are)
    /// at least that large, and `declared ≤ limit`.
    pub fn new(fd: OwnedFd, declared: u64, limit: u64) -> Result<Self, SegmentError> {
        if declared > limit {
            return Err(SegmentError::TooLarge { declared, limit });
        }
        let stat = rustix::fs::fstat(&fd).map_err(std::io::Error::from)?;
        let kind = FileType::from_raw_mode(stat.st_mode);
        if kind != FileType::RegularFile {
            return Err(SegmentError::NotAMemfd(format!("a {kind:?}")));
        }
        // Only memfds (shmem) answer F_GET_SEALS.
        if rustix::fs::fcntl_get_seals(&fd).is_err() {
            return Err(SegmentError::NotAMemfd("a regular file".into()));
        }
        let size = u64::try_from(stat.st_size).unwrap_or(0);
        if size < declared {
            return Err(SegmentError::TooSmall { size, declared });
        }
        Ok(Self { fd, len: declared })
    }

    /// The declared size.
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// Whether the declared size is 0.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks that `[offset, offset + len)` lies inside the declared bytes.
    pub fn check(&self, offset: u64, len: u64) -> Result<(), SegmentError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(SegmentError::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Reads `len` bytes at `offset`.
    pub fn read(&self, offset: u64, len: u64) -> Result<Bytes, SegmentError> {
        self.check(offset, len)?;
        let mut buf = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX)];
        let mut done = 0usize;
        while let Some(rest) = buf.get_mut(done..).filter(|r| !r.is_empty()) {
            let n = rustix::io::pread(&self.fd, rest, offset + done as u64)
                .map_err(std::io::Error::from)?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            done += n;
        }
        Ok(Bytes::from(buf))
    }

    /// Writes `data` at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), SegmentError> {
        self.check(offset, data.len() as u64)?;
        let mut done = 0usize;
        while let Some(rest) = data.get(done..).filter(|r| !r.is_empty()) {
            let n = rustix::io::pwrite(&self.fd, rest, offset + done as u64)
                .map_err(std::io::Error::from)?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into());
            }
            done += n;
        }
        Ok(())
    }
}

/// Creates a segment of `len` bytes (what a connector does; the daemon's tests and the
/// reference client use it).
pub fn create(name: &str, len: u64) -> std::io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)?;
    rustix::fs::ftruncate(&fd, len)?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_was_written_within_bounds_only() {
        let s = Segment::new(create("t", 64).unwrap(), 32, 1 << 20).unwrap();
        s.write(8, b"abcdefgh").unwrap();
        assert_eq!(&s.read(8, 8).unwrap()[..], b"abcdefgh");
        assert!(matches!(
            s.read(30, 8),
            Err(SegmentError::OutOfBounds { .. })
        ));
        assert!(matches!(
            s.write(u64::MAX, b"x"),
            Err(SegmentError::OutOfBounds { .. })
        ));
    }

    #[test]
    fn refuses_small_large_and_non_file_descriptors() {
        assert!(matches!(
            Segment::new(create("t", 16).unwrap(), 32, 1 << 20),
            Err(SegmentError::TooSmall { .. })
        ));
        assert!(matches!(
            Segment::new(create("t", 16).unwrap(), 16, 8),
            Err(SegmentError::TooLarge { .. })
        ));
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(matches!(
            Segment::new(OwnedFd::from(a), 0, 8),
            Err(SegmentError::NotAMemfd(_))
        ));
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        assert!(matches!(
            Segment::new(OwnedFd::from(file), 0, 8),
            Err(SegmentError::NotAMemfd(_))
        ));
    }
}
