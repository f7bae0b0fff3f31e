//! The disk tier (G3) at the edge: one file per block in a directory the daemon owns, written
//! and read with plain synchronous std I/O. Callers run these methods from blocking contexts (a
//! dedicated writer thread, or `tokio::task::block_in_place`); the pure store decides what is
//! on disk, this module only moves bytes.
//!
//! # Layout
//!
//! Every block is one file, `<dir>/<layout fingerprint>-<block key>.blk` (both 16 hex digits,
//! see [`block_file_name`]). Besides the blocks the directory holds `.lock` (the directory's
//! lock) and, briefly, temp files `<name>.<n>.tmp` and the O_DIRECT probe file.
//!
//! # Atomicity
//!
//! A block is written to a temp file unique to the write, fully, then renamed onto its name,
//! so a reader sees either no file or the whole block (a reader also treats a file of the
//! wrong size as missing). Nothing is `fsync`ed: the tier is a cache whose files are wiped on
//! restart, so what a crash leaves behind never matters.
//!
//! # O_DIRECT
//!
//! With [`DirectIo::Auto`], [`DiskDir::open`] writes and reads back one 4096-byte aligned block
//! with `O_DIRECT` in a probe file (removed afterwards). When the file system refuses it
//! (`EINVAL`, unsupported) the tier falls back to page-cache I/O; the chosen mode is logged.
//! With `O_DIRECT` in use, blocks whose size is a multiple of 4096 go through a 4096-aligned
//! buffer with `O_DIRECT`; other sizes use the page cache.
//!
//! # Ownership
//!
//! [`DiskDir::open`] refuses a directory that another user owns and makes its own private
//! (mode 0700), so nobody else can plant files where blocks are read. It takes an exclusive,
//! non-blocking lock on `<dir>/.lock`, held until the [`DiskDir`] is dropped, so two daemons
//! never share a directory. It then removes every block file, temp file and probe file (by
//! their exact name patterns) a previous run left: the store's index starts empty, so those
//! files are unindexed and would only take space. Nothing else in the directory is touched.
//!
//! Block files are opened with `O_NOFOLLOW | O_NONBLOCK` and must be regular files: a symlink
//! or a FIFO in a block's place reads as missing rather than redirecting or hanging a read.

use std::fs::{DirBuilder, File, OpenOptions, TryLockError};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use kv_events::BlockKey;

/// The alignment (of buffers, offsets and lengths) used with `O_DIRECT`.
const ALIGN: usize = 4096;
/// The lock file's name.
const LOCK_FILE: &str = ".lock";
/// The O_DIRECT probe file's name (a `.tmp`, so a crashed probe is removed at the next open).
const PROBE_FILE: &str = ".odirect-probe.tmp";
/// The suffix of block files.
const BLOCK_SUFFIX: &str = ".blk";
/// The suffix of temp files.
const TEMP_SUFFIX: &str = ".tmp";
/// Hex digits in each half of a block name.
const HEX_DIGITS: usize = 16;

/// Whether to use O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectIo {
    /// Probe at open; use it when the file system accepts it.
    Auto,
    /// Never (page-cache I/O).
    Off,
}

/// Why the directory could not be opened or a block operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// Another process holds the directory's lock.
    #[error("the disk tier directory {} is locked by another process", dir.display())]
    Locked {
        /// The directory.
        dir: PathBuf,
    },
    /// A file operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A block name that is not one this module makes (defence: names never contain '/').
    #[error("not a block file name: {0:?}")]
    BadName(String),
}

impl DiskError {
    /// A bounded label for metrics: "locked", "no_space" (ENOSPC/EDQUOT), "io", "bad_name".
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Locked { .. } => "locked",
            Self::Io { source, .. }
                if matches!(
                    source.kind(),
                    ErrorKind::StorageFull | ErrorKind::QuotaExceeded
                ) =>
            {
                "no_space"
            }
            Self::Io { .. } => "io",
            Self::BadName(_) => "bad_name",
        }
    }

    fn io(what: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// The name of a block's file: `<layout fingerprint as 16 hex>-<key as 16 hex>.blk`.
pub fn block_file_name(layout_fingerprint: u64, key: BlockKey) -> String {
    format!("{layout_fingerprint:016x}-{:016x}{BLOCK_SUFFIX}", key.0)
}

/// Whether `name` is exactly what [`block_file_name`] makes: 16 lowercase hex digits, '-',
/// 16 lowercase hex digits, ".blk".
fn is_block_name(name: &str) -> bool {
    let is_hex = |s: &str| {
        s.len() == HEX_DIGITS && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    name.strip_suffix(BLOCK_SUFFIX)
        .and_then(|stem| stem.split_once('-'))
        .is_some_and(|(fingerprint, key)| is_hex(fingerprint) && is_hex(key))
}

/// A zeroed buffer of `len + ALIGN` bytes and the offset at which `len` bytes start on a
/// 4096-byte boundary; `None` when the allocator's address gives no usable offset.
fn aligned_buffer(len: usize) -> Option<(Vec<u8>, usize)> {
    let buf = vec![0u8; len.checked_add(ALIGN)?];
    let off = buf.as_ptr().align_offset(ALIGN);
    (off < ALIGN).then_some((buf, off))
}

/// An open flag as the C `int` `custom_flags` takes.
fn flag(f: rustix::fs::OFlags) -> i32 {
    i32::from_ne_bytes(f.bits().to_ne_bytes())
}

/// `O_DIRECT`.
fn o_direct() -> i32 {
    flag(rustix::fs::OFlags::DIRECT)
}

/// `O_NOFOLLOW`.
fn o_nofollow() -> i32 {
    flag(rustix::fs::OFlags::NOFOLLOW)
}

/// `O_NONBLOCK` (opening a FIFO does not wait for a writer; no effect on regular files).
fn o_nonblock() -> i32 {
    flag(rustix::fs::OFlags::NONBLOCK)
}

/// Whether `name` is a file this module makes: a block, a block's temp file
/// (`<block>.<n>.tmp`), or the probe file.
fn is_own_file(name: &str) -> bool {
    if is_block_name(name) || name == PROBE_FILE {
        return true;
    }
    name.strip_suffix(TEMP_SUFFIX)
        .and_then(|stem| stem.rsplit_once('.'))
        .is_some_and(|(block, n)| {
            is_block_name(block) && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())
        })
}

/// Whether an error means the file system does not do `O_DIRECT` (as opposed to a failure of
/// the directory itself).
fn is_unsupported(err: &std::io::Error) -> bool {
    err.kind() == ErrorKind::InvalidInput
        || err.kind() == ErrorKind::Unsupported
        || err.raw_os_error() == Some(rustix::io::Errno::OPNOTSUPP.raw_os_error())
}

/// Reads into `buf` at file offset 0 until it is full or the file ends; returns the bytes read.
fn read_full(file: &File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0usize;
    while let Some(rest) = buf.get_mut(done..).filter(|r| !r.is_empty()) {
        match file.read_at(rest, done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The tier's directory, locked by this process while the value lives.
#[derive(Debug)]
pub struct DiskDir {
    dir: PathBuf,
    direct: bool,
    removed_at_open: u64,
    next_temp: AtomicU64,
    /// Holds the exclusive lock on `.lock`; dropping it releases the lock.
    _lock: File,
}

impl DiskDir {
    /// Opens (creating it, mode 0700, with parents) `dir` as the tier's directory: takes an
    /// exclusive non-blocking lock on `dir/.lock` (refused → [`DiskError::Locked`]), removes
    /// every `*.blk` and `*.tmp` file left in it by a previous run (nothing else is touched;
    /// subdirectories are ignored), and, with [`DirectIo::Auto`], probes `O_DIRECT` by
    /// writing and reading back one 4096-byte aligned block in a probe file (removed
    /// afterwards); when the file system refuses it, falls back to page-cache I/O.
    pub fn open(dir: &Path, direct: DirectIo) -> Result<Self, DiskError> {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| DiskError::io("creating the directory", dir, e))?;
        Self::make_private(dir)?;
        let lock = Self::lock(dir)?;
        let removed_at_open = Self::remove_stale(dir)?;
        let direct = match direct {
            DirectIo::Off => false,
            DirectIo::Auto => Self::probe_direct(dir)?,
        };
        tracing::info!(
            dir = %dir.display(),
            direct,
            removed_at_open,
            "disk tier opened with {} I/O",
            if direct { "O_DIRECT" } else { "page-cache" },
        );
        Ok(Self {
            dir: dir.to_path_buf(),
            direct,
            removed_at_open,
            next_temp: AtomicU64::new(0),
            _lock: lock,
        })
    }

    /// Whether O_DIRECT is in use.
    pub const fn direct(&self) -> bool {
        self.direct
    }

    /// How many stale files [`open`](Self::open) removed.
    pub const fn removed_at_open(&self) -> u64 {
        self.removed_at_open
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Writes a block: to a temp file `<name>.<n>.tmp` unique to this write (mode 0600),
    /// fully, then renames it onto `<name>`, so a reader sees either no file or the whole
    /// block. Nothing is `fsync`ed (the tier is a cache wiped at the next open). With
    /// `O_DIRECT` in use and a length that is a multiple of 4096, the data goes through an
    /// aligned buffer with `O_DIRECT`; otherwise through the page cache. On error the temp
    /// file is removed (best effort).
    pub fn write(&self, name: &str, data: &[u8]) -> Result<(), DiskError> {
        let path = self.block_path(name)?;
        let n = self.next_temp.fetch_add(1, Ordering::Relaxed);
        let temp = self.dir.join(format!("{name}.{n}{TEMP_SUFFIX}"));
        let result = Self::write_file(&temp, data, self.direct)
            .map_err(|e| DiskError::io("writing block temp file", &temp, e))
            .and_then(|()| {
                std::fs::rename(&temp, &path)
                    .map_err(|e| DiskError::io("renaming block temp file onto", &path, e))
            });
        if result.is_err()
            && let Err(e) = std::fs::remove_file(&temp)
            && e.kind() != ErrorKind::NotFound
        {
            tracing::warn!(path = %temp.display(), error = %e, "could not remove a temp file");
        }
        result
    }

    /// Reads a block of `len` bytes: `None` when its file does not exist or its size is not
    /// `len` (a torn or foreign file is treated as missing); otherwise its bytes. With
    /// `O_DIRECT` in use and `len` a multiple of 4096 the read goes through an aligned buffer
    /// with `O_DIRECT` (the result is a slice of it, no extra copy).
    pub fn read(&self, name: &str, len: u64) -> Result<Option<Bytes>, DiskError> {
        let path = self.block_path(name)?;
        let size = usize::try_from(len)
            .map_err(|_| DiskError::io("reading block", &path, ErrorKind::FileTooLarge.into()))?;
        let direct = self.direct && size > 0 && size.is_multiple_of(ALIGN);
        let Some(file) = Self::open_block(&path, direct)? else {
            return Ok(None);
        };
        // The size is checked before reading: an O_DIRECT read of a file whose size is not
        // a multiple of 4096 is never attempted.
        let meta = file
            .metadata()
            .map_err(|e| DiskError::io("reading block metadata", &path, e))?;
        if !meta.is_file() || meta.len() != len {
            return Ok(None);
        }
        let (mut buf, off) = if direct {
            aligned_buffer(size).ok_or_else(|| {
                DiskError::io(
                    "aligning a buffer for",
                    &path,
                    ErrorKind::OutOfMemory.into(),
                )
            })?
        } else {
            (vec![0u8; size], 0)
        };
        let target = buf.get_mut(off..off + size).unwrap_or_default();
        let got = read_full(&file, target).map_err(|e| DiskError::io("reading block", &path, e))?;
        if got != size {
            return Ok(None);
        }
        Ok(Some(Bytes::from(buf).slice(off..off + size)))
    }

    /// Deletes a block's file; a missing file is fine.
    pub fn delete(&self, name: &str) -> Result<(), DiskError> {
        let path = self.block_path(name)?;
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != ErrorKind::NotFound => {
                Err(DiskError::io("deleting block", &path, e))
            }
            _ => Ok(()),
        }
    }

    /// Opens a block's file for reading (with `O_DIRECT` when `direct`), never through a
    /// symlink and without waiting on a FIFO; `None` when there is none, or something other
    /// than a regular file is in its place.
    fn open_block(path: &Path, direct: bool) -> Result<Option<File>, DiskError> {
        let mut options = OpenOptions::new();
        let flags = o_nofollow() | o_nonblock() | if direct { o_direct() } else { 0 };
        options.read(true).custom_flags(flags);
        match options.open(path) {
            Ok(file) => Ok(Some(file)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            // A symlink (ELOOP), or a directory (EISDIR; EINVAL with O_DIRECT).
            Err(_) if std::fs::symlink_metadata(path).is_ok_and(|m| !m.is_file()) => Ok(None),
            Err(e) => Err(DiskError::io("opening block", path, e)),
        }
    }

    /// The path of a block's file, after checking its name.
    fn block_path(&self, name: &str) -> Result<PathBuf, DiskError> {
        if is_block_name(name) {
            Ok(self.dir.join(name))
        } else {
            Err(DiskError::BadName(name.to_owned()))
        }
    }

    /// Checks that this process's user owns `dir` (a directory) and sets its mode to 0700.
    fn make_private(dir: &Path) -> Result<(), DiskError> {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let meta = std::fs::metadata(dir)
            .map_err(|e| DiskError::io("inspecting the directory", dir, e))?;
        let euid = rustix::process::geteuid().as_raw();
        if !meta.is_dir() || meta.uid() != euid {
            return Err(DiskError::io(
                "using the directory (it must be a directory owned by the daemon's user)",
                dir,
                ErrorKind::PermissionDenied.into(),
            ));
        }
        if meta.mode() & 0o777 != 0o700 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| DiskError::io("making the directory private (0700)", dir, e))?;
        }
        Ok(())
    }

    /// Opens `dir/.lock` (not through a symlink) and takes its exclusive lock without waiting.
    fn lock(dir: &Path) -> Result<File, DiskError> {
        let path = dir.join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(o_nofollow())
            .open(&path)
            .map_err(|e| DiskError::io("opening the lock file", &path, e))?;
        match file.try_lock() {
            Ok(()) => Ok(file),
            Err(TryLockError::WouldBlock) => Err(DiskError::Locked {
                dir: dir.to_path_buf(),
            }),
            Err(TryLockError::Error(e)) => Err(DiskError::io("locking", &path, e)),
        }
    }

    /// Removes this module's files (blocks, temps, the probe; not directories) in `dir`;
    /// returns how many.
    fn remove_stale(dir: &Path) -> Result<u64, DiskError> {
        let entries =
            std::fs::read_dir(dir).map_err(|e| DiskError::io("listing the directory", dir, e))?;
        let mut removed = 0u64;
        for entry in entries {
            let entry = entry.map_err(|e| DiskError::io("listing the directory", dir, e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if !is_own_file(name) {
                continue;
            }
            let path = entry.path();
            let kind = entry
                .file_type()
                .map_err(|e| DiskError::io("inspecting a stale file", &path, e))?;
            if kind.is_dir() {
                continue;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(DiskError::io("removing a stale file", &path, e)),
            }
        }
        Ok(removed)
    }

    /// Whether `O_DIRECT` works in `dir`: writes one aligned block to the probe file with it,
    /// reads it back, compares, and removes the file. A refusal (`EINVAL`, unsupported) or a
    /// mismatch means no; other errors are the directory's and are returned.
    fn probe_direct(dir: &Path) -> Result<bool, DiskError> {
        let path = dir.join(PROBE_FILE);
        let outcome = Self::probe_file(&path);
        if let Err(e) = std::fs::remove_file(&path)
            && e.kind() != ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), error = %e, "could not remove the probe file");
        }
        match outcome {
            Ok(true) => Ok(true),
            Ok(false) => {
                tracing::warn!(dir = %dir.display(), "O_DIRECT read back other bytes; not using it");
                Ok(false)
            }
            Err(e) if is_unsupported(&e) => {
                tracing::info!(dir = %dir.display(), error = %e, "O_DIRECT refused by the file system");
                Ok(false)
            }
            Err(e) => Err(DiskError::io("probing O_DIRECT in", &path, e)),
        }
    }

    /// The probe's I/O: whether the block read back equals the block written.
    fn probe_file(path: &Path) -> std::io::Result<bool> {
        let (mut buf, off) = aligned_buffer(ALIGN).ok_or(ErrorKind::Unsupported)?;
        let block = buf
            .get_mut(off..off + ALIGN)
            .ok_or(ErrorKind::Unsupported)?;
        for (i, b) in block.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let expected = block.to_vec();
        // A new file (never through a symlink: the stale-file pass removed an old probe).
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(o_direct())
            .open(path)?;
        file.write_all(block)?;
        block.fill(0);
        let got = read_full(&file, block)?;
        Ok(got == ALIGN && *block == *expected)
    }

    /// Creates `temp` (mode 0600, must not exist) and writes all of `data` to it.
    fn write_file(temp: &Path, data: &[u8], direct: bool) -> std::io::Result<()> {
        let aligned = if direct && !data.is_empty() && data.len().is_multiple_of(ALIGN) {
            aligned_buffer(data.len())
        } else {
            None
        };
        let mut options = OpenOptions::new();
        options.write(true).create_new(true).mode(0o600);
        let Some((mut buf, off)) = aligned else {
            return options.open(temp)?.write_all(data);
        };
        let block = buf
            .get_mut(off..off + data.len())
            .ok_or(ErrorKind::InvalidInput)?;
        block.copy_from_slice(data);
        options
            .custom_flags(o_direct())
            .open(temp)?
            .write_all(block)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::os::unix::fs::PermissionsExt;

    use proptest::prelude::*;

    use super::*;

    static NEXT_DIR: AtomicU64 = AtomicU64::new(0);

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            let n = NEXT_DIR.fetch_add(1, Ordering::Relaxed);
            let path =
                std::env::temp_dir().join(format!("kvgate-disk-test-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            Self(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn data(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn name(n: u64) -> String {
        block_file_name(0xfeed, BlockKey(n))
    }

    fn files_ending(dir: &Path, suffix: &str) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(suffix))
            .collect()
    }

    #[test]
    fn names_are_fixed_width_and_round_trip_the_check() {
        assert_eq!(
            block_file_name(0xab, BlockKey(1)),
            "00000000000000ab-0000000000000001.blk"
        );
        assert_eq!(
            block_file_name(u64::MAX, BlockKey(u64::MAX)),
            "ffffffffffffffff-ffffffffffffffff.blk"
        );
        assert!(is_block_name(&block_file_name(0, BlockKey(0))));
        assert!(is_block_name(&block_file_name(
            0x0123_4567_89ab_cdef,
            BlockKey(42)
        )));
        assert_ne!(name(1), block_file_name(0xbeef, BlockKey(1)));
    }

    #[test]
    fn round_trips_with_both_modes_and_sizes() {
        for mode in [DirectIo::Off, DirectIo::Auto] {
            let tmp = TempDir::new();
            let disk = DiskDir::open(&tmp.0, mode).unwrap();
            println!("{mode:?}: O_DIRECT in use = {}", disk.direct());
            if mode == DirectIo::Off {
                assert!(!disk.direct());
            }
            for (i, len) in [4096usize, 3 * 4096, 5000, 1, 0, 1 << 20]
                .into_iter()
                .enumerate()
            {
                let bytes = data(len, i as u8);
                disk.write(&name(i as u64), &bytes).unwrap();
                let got = disk.read(&name(i as u64), len as u64).unwrap();
                assert_eq!(got.as_deref(), Some(&bytes[..]), "{mode:?}, {len} bytes");
            }
        }
    }

    #[test]
    fn missing_or_wrong_size_reads_are_none() {
        let tmp = TempDir::new();
        let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
        assert!(disk.read(&name(1), 4096).unwrap().is_none());
        disk.write(&name(1), &data(4096, 1)).unwrap();
        assert!(disk.read(&name(1), 8192).unwrap().is_none());
        assert!(disk.read(&name(1), 4095).unwrap().is_none());
        assert!(disk.read(&name(1), 0).unwrap().is_none());
        disk.write(&name(2), &data(5000, 2)).unwrap();
        // A multiple of 4096 asked of a file that is not: no O_DIRECT read is attempted.
        assert!(disk.read(&name(2), 4096).unwrap().is_none());
        assert!(disk.read(&name(2), 8192).unwrap().is_none());
        // A directory where a block would be is not a block.
        std::fs::create_dir(tmp.0.join(name(3))).unwrap();
        assert!(disk.read(&name(3), 4096).unwrap().is_none());
    }

    #[test]
    fn delete_is_idempotent_and_removes_the_block() {
        let tmp = TempDir::new();
        let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
        disk.delete(&name(1)).unwrap();
        disk.write(&name(1), &data(8192, 1)).unwrap();
        assert!(disk.read(&name(1), 8192).unwrap().is_some());
        disk.delete(&name(1)).unwrap();
        assert!(disk.read(&name(1), 8192).unwrap().is_none());
        assert!(!tmp.0.join(name(1)).exists());
        disk.delete(&name(1)).unwrap();
    }

    #[test]
    fn overwrite_leaves_the_second_data() {
        let tmp = TempDir::new();
        let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
        for len in [4096usize, 5000] {
            disk.write(&name(1), &data(len, 1)).unwrap();
            disk.write(&name(1), &data(len, 2)).unwrap();
            assert_eq!(
                disk.read(&name(1), len as u64).unwrap().as_deref(),
                Some(&data(len, 2)[..])
            );
        }
        // A longer block over a shorter one and back.
        disk.write(&name(1), &data(3 * 4096, 3)).unwrap();
        disk.write(&name(1), &data(100, 4)).unwrap();
        assert!(disk.read(&name(1), 3 * 4096).unwrap().is_none());
        assert_eq!(
            disk.read(&name(1), 100).unwrap().as_deref(),
            Some(&data(100, 4)[..])
        );
    }

    #[test]
    fn concurrent_writes_of_one_name_do_not_tear() {
        let tmp = TempDir::new();
        let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
        let bytes = data(64 * 1024, 9);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..8 {
                        disk.write(&name(1), &bytes).unwrap();
                        let got = disk.read(&name(1), bytes.len() as u64).unwrap();
                        assert_eq!(got.as_deref(), Some(&bytes[..]));
                    }
                });
            }
        });
        assert!(files_ending(&tmp.0, TEMP_SUFFIX).is_empty());
    }

    #[test]
    fn a_second_open_is_locked_until_the_first_is_dropped() {
        let tmp = TempDir::new();
        let first = DiskDir::open(&tmp.0, DirectIo::Off).unwrap();
        first.write(&name(1), &data(10, 1)).unwrap();
        let err = DiskDir::open(&tmp.0, DirectIo::Off).unwrap_err();
        assert!(
            matches!(&err, DiskError::Locked { dir } if *dir == tmp.0),
            "{err}"
        );
        assert_eq!(err.metric_label(), "locked");
        // The refused open touched nothing.
        assert!(first.read(&name(1), 10).unwrap().is_some());
        drop(first);
        let second = DiskDir::open(&tmp.0, DirectIo::Off).unwrap();
        assert_eq!(second.removed_at_open(), 1);
        assert!(second.read(&name(1), 10).unwrap().is_none());
    }

    #[test]
    fn open_removes_stale_blocks_and_temps_only() {
        let tmp = TempDir::new();
        std::fs::create_dir_all(tmp.0.join("sub.blk")).unwrap();
        std::fs::write(tmp.0.join("sub.blk").join(name(7)), b"x").unwrap();
        std::fs::write(tmp.0.join(name(1)), b"old").unwrap();
        std::fs::write(tmp.0.join(name(2)), b"old").unwrap();
        std::fs::write(tmp.0.join(format!("{}.3.tmp", name(1))), b"torn").unwrap();
        std::fs::write(tmp.0.join(PROBE_FILE), b"probe").unwrap();
        std::fs::write(tmp.0.join("notes.txt"), b"keep").unwrap();
        std::fs::write(tmp.0.join("blk"), b"keep").unwrap();
        // Other programs' files with the same suffixes (a shared directory) are not ours.
        std::fs::write(tmp.0.join("other.blk"), b"keep").unwrap();
        std::fs::write(tmp.0.join("session.tmp"), b"keep").unwrap();
        std::fs::write(tmp.0.join(format!("{}.x.tmp", name(1))), b"keep").unwrap();
        let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
        assert_eq!(disk.removed_at_open(), 4);
        assert_eq!(disk.path(), tmp.0);
        let mut blk = files_ending(&tmp.0, BLOCK_SUFFIX);
        blk.sort();
        assert_eq!(blk, ["other.blk", "sub.blk"]);
        let mut tmps = files_ending(&tmp.0, TEMP_SUFFIX);
        tmps.sort();
        assert_eq!(tmps, [format!("{}.x.tmp", name(1)), "session.tmp".into()]);
        assert_eq!(std::fs::read(tmp.0.join("notes.txt")).unwrap(), b"keep");
        assert_eq!(std::fs::read(tmp.0.join("blk")).unwrap(), b"keep");
        assert!(tmp.0.join("sub.blk").join(name(7)).exists());
    }

    #[test]
    fn an_open_directory_is_made_private() {
        let tmp = TempDir::new();
        std::fs::create_dir_all(&tmp.0).unwrap();
        std::fs::set_permissions(&tmp.0, std::fs::Permissions::from_mode(0o777)).unwrap();
        let _disk = DiskDir::open(&tmp.0, DirectIo::Off).unwrap();
        let mode = std::fs::metadata(&tmp.0).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }

    #[test]
    fn a_symlink_or_fifo_in_a_blocks_place_reads_as_missing() {
        let tmp = TempDir::new();
        let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
        // A symlink to a file of the right size must not be followed.
        let secret = tmp.0.join("secret");
        std::fs::write(&secret, data(4096, 9)).unwrap();
        std::os::unix::fs::symlink(&secret, tmp.0.join(name(1))).unwrap();
        assert!(disk.read(&name(1), 4096).unwrap().is_none());
        // A FIFO must not hang the read.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            tmp.0.join(name(2)),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert!(disk.read(&name(2), 4096).unwrap().is_none());
        // Writing over either replaces it with a regular file.
        disk.write(&name(1), &data(4096, 1)).unwrap();
        assert_eq!(
            disk.read(&name(1), 4096).unwrap().as_deref(),
            Some(&data(4096, 1)[..])
        );
        assert_eq!(std::fs::read(&secret).unwrap(), data(4096, 9));
    }

    #[test]
    fn creates_a_private_directory_and_private_files() {
        let tmp = TempDir::new();
        let dir = tmp.0.join("a").join("b");
        let disk = DiskDir::open(&dir, DirectIo::Auto).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(disk.removed_at_open(), 0);
        disk.write(&name(1), &data(4096, 1)).unwrap();
        disk.write(&name(2), &data(10, 1)).unwrap();
        assert_eq!(mode(&dir.join(name(1))), 0o600);
        assert_eq!(mode(&dir.join(name(2))), 0o600);
    }

    #[test]
    fn bad_names_are_refused_everywhere() {
        let tmp = TempDir::new();
        let disk = DiskDir::open(&tmp.0, DirectIo::Off).unwrap();
        let long = "0".repeat(100) + ".blk";
        let bad = [
            "../x",
            "a/b.blk",
            "",
            "zz-00.blk",
            "00000000000000ab",
            "00000000000000ab-0000000000000001",
            "00000000000000AB-0000000000000001.blk",
            "00000000000000ab-000000000000001.blk",
            "00000000000000ab-0000000000000001.blk.tmp",
            "../00000000000000ab-0000000000000001.blk",
            "00000000000000ab/0000000000000001.blk",
            ".lock",
            long.as_str(),
        ];
        for name in bad {
            for err in [
                disk.write(name, b"x").unwrap_err(),
                disk.read(name, 1).unwrap_err(),
                disk.delete(name).unwrap_err(),
            ] {
                assert!(
                    matches!(&err, DiskError::BadName(n) if n == name),
                    "{name:?}: {err}"
                );
                assert_eq!(err.metric_label(), "bad_name");
            }
        }
        assert!(
            std::fs::read_dir(&tmp.0).unwrap().count() == 1,
            "only .lock"
        );
    }

    #[test]
    fn a_failed_write_leaves_no_temp_file() {
        let tmp = TempDir::new();
        let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
        // A directory where the block goes: the rename fails.
        std::fs::create_dir(tmp.0.join(name(1))).unwrap();
        for len in [4096usize, 10] {
            let err = disk.write(&name(1), &data(len, 1)).unwrap_err();
            assert!(matches!(err, DiskError::Io { .. }), "{err}");
            assert_eq!(err.metric_label(), "io");
        }
        assert!(files_ending(&tmp.0, TEMP_SUFFIX).is_empty());
    }

    #[test]
    fn successful_writes_leave_no_temp_file() {
        let tmp = TempDir::new();
        let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
        for i in 0..20u64 {
            disk.write(
                &name(i % 5),
                &data(4096 * (i as usize % 3) + 7 * (i as usize % 2), 1),
            )
            .unwrap();
        }
        assert!(files_ending(&tmp.0, TEMP_SUFFIX).is_empty());
        assert_eq!(files_ending(&tmp.0, BLOCK_SUFFIX).len(), 5);
    }

    #[test]
    fn no_space_errors_have_their_own_label() {
        let io = |errno: rustix::io::Errno| DiskError::Io {
            what: "writing",
            path: PathBuf::from("/x"),
            source: std::io::Error::from_raw_os_error(errno.raw_os_error()),
        };
        assert_eq!(io(rustix::io::Errno::NOSPC).metric_label(), "no_space");
        assert_eq!(io(rustix::io::Errno::DQUOT).metric_label(), "no_space");
        assert_eq!(io(rustix::io::Errno::IO).metric_label(), "io");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Write {
            name: u64,
            len: usize,
            seed: u8,
        },
        Delete {
            name: u64,
        },
        /// Reads with the stored length when `len` is `None`, else with `len`.
        Read {
            name: u64,
            len: Option<usize>,
        },
    }

    fn size() -> impl Strategy<Value = usize> {
        prop_oneof![
            (0usize..4).prop_map(|k| k * 4096),
            0usize..10_000,
            Just(4095usize),
            Just(4097usize),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..4, size(), any::<u8>()).prop_map(|(name, len, seed)| Op::Write {
                name,
                len,
                seed
            }),
            (0u64..4).prop_map(|name| Op::Delete { name }),
            (0u64..4, proptest::option::of(size())).prop_map(|(name, len)| Op::Read { name, len }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn behaves_like_a_map(
            ops in proptest::collection::vec(op(), 1..40),
            auto in any::<bool>(),
        ) {
            let tmp = TempDir::new();
            let mode = if auto { DirectIo::Auto } else { DirectIo::Off };
            let disk = DiskDir::open(&tmp.0, mode).unwrap();
            let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
            for op in ops {
                match op {
                    Op::Write { name: n, len, seed } => {
                        let bytes = data(len, seed);
                        disk.write(&name(n), &bytes).unwrap();
                        model.insert(n, bytes);
                    }
                    Op::Delete { name: n } => {
                        disk.delete(&name(n)).unwrap();
                        model.remove(&n);
                    }
                    Op::Read { name: n, len } => {
                        let stored = model.get(&n);
                        let len = len.or(stored.map(Vec::len)).unwrap_or(4096);
                        let expected = stored.filter(|s| s.len() == len);
                        let got = disk.read(&name(n), len as u64).unwrap();
                        prop_assert_eq!(got.as_deref(), expected.map(Vec::as_slice));
                    }
                }
            }
            for (n, bytes) in &model {
                let got = disk.read(&name(*n), bytes.len() as u64).unwrap();
                prop_assert_eq!(got.as_deref(), Some(bytes.as_slice()));
            }
            prop_assert!(files_ending(&tmp.0, TEMP_SUFFIX).is_empty());
        }
    }
}
