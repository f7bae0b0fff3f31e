//! The disk tier (G3) at the edge: slab files in a directory the daemon owns, written and
//! read with plain synchronous I/O. Callers run these methods from blocking contexts (a
//! dedicated writer thread, or the blocking pool); the pure store decides what is on disk,
//! this module only moves bytes and remembers where they lie.
//!
//! # Layout
//!
//! Blocks of one size share one file, `<dir>/slab-<block bytes>.dat`, as fixed-size slots
//! (a node usually serves one model, so one file). Where each block lies is kept in memory
//! (`index.rs`); the free slots of a file are runs (`extents.rs`), and a write of several
//! blocks takes one run when a free run holds them all, so the blocks of a chain that were
//! demoted together lie together and [`DiskDir::read_many`] reads them back in one
//! `preadv`. A file only grows when it has no free slot left: it spans at most the most
//! blocks of its size the tier held at once, counting those being written. Deleting a block only frees its slot (no I/O);
//! the space is reused, not returned to the file system, until the next start.
//!
//! A directory with millions of blocks therefore holds a handful of files, and a block's
//! read or write is one system call with no file to open, create, rename or unlink.
//!
//! # Atomicity
//!
//! A write goes to free slots and the block is indexed there only once the write finished,
//! so a reader sees the old bytes (the old slot stays in use until then) or the new ones.
//! A reader looks blocks up, reads their slots without the lock, and then checks that each
//! block still lies where it read it (a per-write id): a slot is only reused after its block
//! is deleted or written elsewhere, so a block whose id changed meanwhile reads as missing
//! rather than as another block's bytes. Nothing is `fsync`ed: the tier is a cache whose
//! files are wiped on restart, so what a crash leaves behind never matters.
//!
//! # O_DIRECT
//!
//! With [`DirectIo::Auto`], [`DiskDir::open`] writes and reads back one 4096-byte aligned block
//! with `O_DIRECT` in a probe file (removed afterwards). When the file system refuses it
//! (`EINVAL`, unsupported) the tier falls back to page-cache I/O; the chosen mode is logged.
//! With `O_DIRECT` in use, the slab files of sizes that are a multiple of 4096 are opened
//! with it (reads and writes go through 4096-aligned buffers); other sizes use the page cache.
//!
//! # Ownership
//!
//! [`DiskDir::open`] refuses a directory that another user owns and makes its own private
//! (mode 0700), so nobody else can plant files where blocks are read. It takes an exclusive,
//! non-blocking lock on `<dir>/.lock`, held until the [`DiskDir`] is dropped, so two daemons
//! never share a directory. It then removes every slab file, the probe file, and the block
//! and temp files of earlier versions (one file per block), by their exact name patterns: the
//! store's index starts empty, so those files are unindexed and would only take space.
//! Nothing else in the directory is touched. Slab files are created afresh (`O_EXCL`), never
//! through a symlink, mode 0600.

mod extents;
mod index;

use std::fs::{DirBuilder, File, OpenOptions, TryLockError};
use std::io::{ErrorKind, IoSlice, IoSliceMut, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use kv_events::BlockKey;

use extents::Run;
use index::{Index, Name};

/// The alignment (of buffers, offsets and lengths) used with `O_DIRECT`.
const ALIGN: usize = 4096;
/// The lock file's name.
const LOCK_FILE: &str = ".lock";
/// The O_DIRECT probe file's name (a `.tmp`, so a crashed probe is removed at the next open).
const PROBE_FILE: &str = ".odirect-probe.tmp";
/// The prefix of slab files: `slab-<block bytes>.dat`.
const SLAB_PREFIX: &str = "slab-";
/// The suffix of slab files.
const SLAB_SUFFIX: &str = ".dat";
/// The suffix of the block files earlier versions wrote (one per block).
const LEGACY_BLOCK_SUFFIX: &str = ".blk";
/// The suffix of temp files.
const TEMP_SUFFIX: &str = ".tmp";
/// Hex digits in each half of a block name.
const HEX_DIGITS: usize = 16;
/// The most bytes one `preadv`/`pwritev` moves; longer runs are split.
const MAX_IO_BYTES: u64 = 16 << 20;

/// Whether to use O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectIo {
    /// Probe at open; use it when the file system accepts it.
    Auto,
    /// Never (page-cache I/O).
    Off,
}

/// Why the directory could not be opened or a block operation failed.
#[derive(Debug, Clone, thiserror::Error)]
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
        /// The cause (shared by the blocks of one failed run).
        #[source]
        source: Arc<std::io::Error>,
    },
    /// A block name that is not one [`block_name`] makes.
    #[error("not a block name: {0:?}")]
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
            source: Arc::new(source),
        }
    }
}

/// A block's name in the tier: `<layout fingerprint as 16 hex>-<key as 16 hex>`.
pub fn block_name(layout_fingerprint: u64, key: BlockKey) -> String {
    format!("{layout_fingerprint:016x}-{:016x}", key.0)
}

/// The fingerprint and key of a name [`block_name`] makes (exactly: 16 lowercase hex
/// digits, '-', 16 lowercase hex digits).
fn parse_name(name: &str) -> Result<Name, DiskError> {
    let hex = |s: &str| {
        (s.len() == HEX_DIGITS && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| u64::from_str_radix(s, 16).ok())
            .flatten()
    };
    name.split_once('-')
        .and_then(|(f, k)| Some((hex(f)?, hex(k)?)))
        .ok_or_else(|| DiskError::BadName(name.to_owned()))
}

/// Whether `name` is a block file of earlier versions: a block name then ".blk".
fn is_legacy_block_name(name: &str) -> bool {
    name.strip_suffix(LEGACY_BLOCK_SUFFIX)
        .is_some_and(|stem| parse_name(stem).is_ok())
}

/// The name of the slab file of blocks of `block_bytes`.
fn slab_file_name(block_bytes: u64) -> String {
    format!("{SLAB_PREFIX}{block_bytes}{SLAB_SUFFIX}")
}

/// Whether `name` is exactly what [`slab_file_name`] makes.
fn is_slab_name(name: &str) -> bool {
    name.strip_prefix(SLAB_PREFIX)
        .and_then(|r| r.strip_suffix(SLAB_SUFFIX))
        .is_some_and(|n| {
            !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit())
                && n.parse::<u64>().is_ok_and(|v| slab_file_name(v) == name)
        })
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

/// Whether `name` is a file this module (or an earlier version of it) makes: a slab file,
/// the probe file, a block file or a block's temp file (`<block>.<n>.tmp`).
fn is_own_file(name: &str) -> bool {
    if is_slab_name(name) || is_legacy_block_name(name) || name == PROBE_FILE {
        return true;
    }
    name.strip_suffix(TEMP_SUFFIX)
        .and_then(|stem| stem.rsplit_once('.'))
        .is_some_and(|(block, n)| {
            is_legacy_block_name(block) && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())
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

/// How [`DiskDir::write_size`] writes a run of blocks into consecutive slots of a slab
/// (`Slab::write_run`; tests inject failures).
type WriteRun<'a> = dyn Fn(&Slab, u64, &[&[u8]]) -> std::io::Result<()> + 'a;

/// One block size's file.
#[derive(Debug)]
struct Slab {
    file: File,
    path: PathBuf,
    block_bytes: u64,
    /// Opened with `O_DIRECT` (so buffers, offsets and lengths are 4096-aligned).
    direct: bool,
}

impl Slab {
    /// Creates the slab file of `block_bytes` in `dir` (it must not exist: the stale-file
    /// pass removed the last run's), with `O_DIRECT` when `direct` and the size allows.
    fn create(dir: &Path, block_bytes: u64, direct: bool) -> Result<Self, DiskError> {
        let path = dir.join(slab_file_name(block_bytes));
        let direct = direct && block_bytes > 0 && block_bytes.is_multiple_of(ALIGN as u64);
        let flags = o_nofollow() | if direct { o_direct() } else { 0 };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(flags)
            .open(&path)
            .map_err(|e| DiskError::io("creating the slab file", &path, e))?;
        Ok(Self {
            file,
            path,
            block_bytes,
            direct,
        })
    }

    /// Writes `blocks` (each `block_bytes` long) into consecutive slots from `slot`.
    fn write_run(&self, slot: u64, blocks: &[&[u8]]) -> std::io::Result<()> {
        let offset = slot * self.block_bytes;
        if !self.direct {
            let mut slices: Vec<IoSlice<'_>> = blocks.iter().map(|b| IoSlice::new(b)).collect();
            let mut bufs = &mut slices[..];
            let mut at = offset;
            while !bufs.is_empty() {
                match rustix::io::pwritev(&self.file, bufs, at) {
                    Ok(0) => return Err(ErrorKind::WriteZero.into()),
                    Ok(n) => {
                        at += n as u64;
                        IoSlice::advance_slices(&mut bufs, n);
                    }
                    Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            return Ok(());
        }
        // O_DIRECT: through one aligned buffer.
        let total: usize = blocks.iter().map(|b| b.len()).sum();
        let (mut buf, off) = aligned_buffer(total).ok_or(ErrorKind::OutOfMemory)?;
        let mut at = off;
        for b in blocks {
            buf.get_mut(at..at + b.len())
                .ok_or(ErrorKind::InvalidInput)?
                .copy_from_slice(b);
            at += b.len();
        }
        let data = buf.get(off..off + total).ok_or(ErrorKind::InvalidInput)?;
        self.file.write_all_at(data, offset)
    }

    /// Reads `n` consecutive slots from `slot`, one buffer per block (aligned with
    /// `O_DIRECT`); blocks the file ends before are `None`.
    fn read_run(&self, slot: u64, n: usize) -> std::io::Result<Vec<Option<Bytes>>> {
        let len = usize::try_from(self.block_bytes).map_err(|_| ErrorKind::FileTooLarge)?;
        let mut bufs = Vec::with_capacity(n);
        for _ in 0..n {
            bufs.push(if self.direct {
                aligned_buffer(len).ok_or(ErrorKind::OutOfMemory)?
            } else {
                (vec![0u8; len], 0)
            });
        }
        let mut slices: Vec<IoSliceMut<'_>> = bufs
            .iter_mut()
            .map(|(b, off)| IoSliceMut::new(b.get_mut(*off..*off + len).unwrap_or_default()))
            .collect();
        let mut rest = &mut slices[..];
        let mut done = 0usize;
        let mut at = slot * self.block_bytes;
        while !rest.is_empty() {
            match rustix::io::preadv(&self.file, rest, at) {
                Ok(0) => break,
                Ok(got) => {
                    done += got;
                    at += got as u64;
                    IoSliceMut::advance_slices(&mut rest, got);
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        drop(slices);
        let whole = done / len.max(1);
        Ok(bufs
            .into_iter()
            .enumerate()
            .map(|(i, (b, off))| {
                (len == 0 || i < whole).then(|| Bytes::from(b).slice(off..off + len))
            })
            .collect())
    }
}

/// What the lock guards: the index and the slab files by class.
#[derive(Debug, Default)]
struct State {
    index: Index,
    slabs: Vec<Option<Arc<Slab>>>,
}

/// The tier's directory, locked by this process while the value lives.
#[derive(Debug)]
pub struct DiskDir {
    dir: PathBuf,
    direct: bool,
    removed_at_open: u64,
    state: Mutex<State>,
    /// Holds the exclusive lock on `.lock`; dropping it releases the lock.
    _lock: File,
}

impl DiskDir {
    /// Opens (creating it, mode 0700, with parents) `dir` as the tier's directory: takes an
    /// exclusive non-blocking lock on `dir/.lock` (refused → [`DiskError::Locked`]), removes
    /// the slab files, block files and temp files a previous run left in it (nothing else is
    /// touched; subdirectories are ignored), and, with [`DirectIo::Auto`], probes `O_DIRECT`
    /// by writing and reading back one 4096-byte aligned block in a probe file (removed
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
            state: Mutex::new(State::default()),
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

    /// Blocks held.
    pub fn blocks(&self) -> usize {
        self.lock_state().index.len()
    }

    /// Bytes the slab files span (freed slots included: they are reused, not returned).
    pub fn file_bytes(&self) -> u64 {
        self.lock_state().index.file_bytes()
    }

    /// Writes one block; see [`write_many`](Self::write_many).
    pub fn write(&self, name: &str, data: &[u8]) -> Result<(), DiskError> {
        self.write_many(&[(name, data)])
            .pop()
            .unwrap_or_else(|| Err(DiskError::BadName(name.to_owned())))
    }

    /// Writes blocks, each under its [`block_name`], and returns each one's outcome in
    /// order. Blocks of one size go to free slots of their slab file, together when a free
    /// run holds them all, in one `pwritev` per run of slots; a block is readable under its
    /// name once its run is written (until then, its previous bytes if it had any). A name
    /// given twice ends with its last bytes. On error the run's slots are freed again and
    /// the blocks keep what they had.
    pub fn write_many(&self, blocks: &[(&str, &[u8])]) -> Vec<Result<(), DiskError>> {
        let names: Vec<Result<Name, DiskError>> =
            blocks.iter().map(|(name, _)| parse_name(name)).collect();
        // A name given twice: only its last bytes are written.
        let last: std::collections::HashMap<Name, usize> = names
            .iter()
            .enumerate()
            .filter_map(|(i, n)| Some((*n.as_ref().ok()?, i)))
            .collect();
        let mut out: Vec<Result<(), DiskError>> = Vec::with_capacity(blocks.len());
        // By size, in order.
        let mut sizes: Vec<(u64, Vec<(usize, Name)>)> = Vec::new();
        for (i, (name, (_, data))) in names.into_iter().zip(blocks).enumerate() {
            match name {
                Err(e) => out.push(Err(e)),
                Ok(n) => {
                    out.push(Ok(()));
                    if last.get(&n) != Some(&i) {
                        continue;
                    }
                    let len = data.len() as u64;
                    match sizes.iter_mut().find(|(l, _)| *l == len) {
                        Some((_, v)) => v.push((i, n)),
                        None => sizes.push((len, vec![(i, n)])),
                    }
                }
            }
        }
        for (len, group) in sizes {
            let results = self.write_size(len, &group, blocks, &|slab, slot, data| {
                slab.write_run(slot, data)
            });
            for ((i, _), r) in group.iter().zip(results) {
                if let Some(slot) = out.get_mut(*i) {
                    *slot = r;
                }
            }
        }
        out
    }

    /// Writes `group` (indices into `blocks`, all `len` bytes, distinct names) with `write`
    /// (one call per run of slots, at most `MAX_IO_BYTES`), and returns each member's outcome:
    /// the blocks of runs written are indexed; the first error fails its run and the runs
    /// after it (not tried: a full or failing disk rarely recovers within a batch), whose
    /// slots are freed again.
    fn write_size(
        &self,
        len: u64,
        group: &[(usize, Name)],
        blocks: &[(&str, &[u8])],
        write: &WriteRun<'_>,
    ) -> Vec<Result<(), DiskError>> {
        let (class, slab, runs) = {
            let mut state = self.lock_state();
            match self.class(&mut state, len) {
                Ok((class, slab)) => {
                    let runs = state.index.reserve(class, group.len() as u64);
                    (class, slab, runs)
                }
                Err(e) => return group.iter().map(|_| Err(e.clone())).collect(),
            }
        };
        let per_io = (MAX_IO_BYTES / len.max(1)).max(1);
        let mut out: Vec<Result<(), DiskError>> = Vec::with_capacity(group.len());
        let mut failed: Option<DiskError> = None;
        for run in runs {
            let mut start = run.start;
            while start < run.end() {
                let n = per_io.min(run.end() - start);
                let part = Run { start, len: n };
                let members = group
                    .get(out.len()..out.len() + n as usize)
                    .unwrap_or_default();
                start += n;
                let written = match (&failed, &slab) {
                    (Some(e), _) => Err(e.clone()),
                    (None, Some(slab)) => {
                        let data: Vec<&[u8]> = members
                            .iter()
                            .filter_map(|(i, _)| blocks.get(*i).map(|b| b.1))
                            .collect();
                        write(slab, part.start, &data)
                            .map_err(|e| DiskError::io("writing blocks to", &slab.path, e))
                    }
                    (None, None) => Ok(()),
                };
                let mut state = self.lock_state();
                match written {
                    Ok(()) => {
                        for (k, (_, name)) in members.iter().enumerate() {
                            state.index.publish(*name, class, part.start + k as u64);
                        }
                        out.extend(members.iter().map(|_| Ok(())));
                    }
                    Err(e) => {
                        state.index.unreserve(class, part);
                        out.extend(members.iter().map(|_| Err(e.clone())));
                        failed = Some(e);
                    }
                }
            }
        }
        out
    }

    /// The class of blocks of `len` and its slab file (none for empty blocks), created on
    /// first use; a file that could not be created is tried again on the next write.
    fn class(&self, state: &mut State, len: u64) -> Result<(usize, Option<Arc<Slab>>), DiskError> {
        let class = state.index.class(len);
        if state.slabs.len() <= class {
            state.slabs.resize(class + 1, None);
        }
        if len == 0 {
            return Ok((class, None));
        }
        if let Some(slab) = state.slabs.get(class).cloned().flatten() {
            return Ok((class, Some(slab)));
        }
        let slab = Arc::new(Slab::create(&self.dir, len, self.direct)?);
        if let Some(s) = state.slabs.get_mut(class) {
            *s = Some(Arc::clone(&slab));
        }
        Ok((class, Some(slab)))
    }

    /// Reads one block; see [`read_many`](Self::read_many).
    pub fn read(&self, name: &str, len: u64) -> Result<Option<Bytes>, DiskError> {
        self.read_many(&[name], len).pop().unwrap_or(Ok(None))
    }

    /// Reads blocks of `len` bytes by name: each one's bytes, `None` when the tier does not
    /// hold it at that size (or it was written or deleted while being read), or the error
    /// that failed its read. Blocks in consecutive slots are read with one `preadv` (the
    /// buffers are the blocks': no copy).
    pub fn read_many(&self, names: &[&str], len: u64) -> Vec<Result<Option<Bytes>, DiskError>> {
        let mut out: Vec<Result<Option<Bytes>, DiskError>> = Vec::with_capacity(names.len());
        // (index into names, name, slot, write id) of the blocks the index has at `len`.
        let mut found: Vec<(usize, Name, u64, u64)> = Vec::new();
        let slab = {
            let state = self.lock_state();
            let class = state.index.find_class(len);
            for (i, name) in names.iter().enumerate() {
                match parse_name(name) {
                    Err(e) => out.push(Err(e)),
                    Ok(n) => {
                        out.push(Ok(None));
                        if let Some(p) = state.index.get(n).filter(|p| Some(p.class) == class) {
                            found.push((i, n, p.slot, p.id));
                        }
                    }
                }
            }
            class.and_then(|c| state.slabs.get(c).cloned().flatten())
        };
        let mut read: Vec<(usize, Name, u64, Option<Bytes>)> = Vec::with_capacity(found.len());
        if len == 0 {
            read.extend(
                found
                    .iter()
                    .map(|&(i, n, _, id)| (i, n, id, Some(Bytes::new()))),
            );
        } else if let Some(slab) = slab {
            let per_io = usize::try_from(MAX_IO_BYTES / len).unwrap_or(1).max(1);
            for run in consecutive(&found, per_io) {
                let Some(&(_, _, first, _)) = run.first() else {
                    continue;
                };
                match slab.read_run(first, run.len()) {
                    Ok(bytes) => read.extend(
                        run.iter()
                            .zip(bytes)
                            .map(|(&(i, n, _, id), b)| (i, n, id, b)),
                    ),
                    Err(e) => {
                        let e = DiskError::io("reading blocks from", &slab.path, e);
                        for (i, ..) in run {
                            if let Some(o) = out.get_mut(*i) {
                                *o = Err(e.clone());
                            }
                        }
                    }
                }
            }
        }
        let state = self.lock_state();
        for (i, n, id, bytes) in read {
            if let Some(o) = out.get_mut(i) {
                *o = Ok(bytes.filter(|_| state.index.unchanged(n, id)));
            }
        }
        out
    }

    /// Deletes a block (frees its slot; no I/O); a missing block is fine.
    pub fn delete(&self, name: &str) -> Result<(), DiskError> {
        let name = parse_name(name)?;
        self.lock_state().index.remove(name);
        Ok(())
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        // The state is consistent between statements: a panic elsewhere cannot tear it.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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

    /// Removes this module's files (slab files, the probe, earlier versions' block and temp
    /// files; not directories) in `dir`; returns how many.
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
}

/// Splits `found` (in the caller's order) into runs of consecutive slots, at most `max` each.
fn consecutive(found: &[(usize, Name, u64, u64)], max: usize) -> Vec<&[(usize, Name, u64, u64)]> {
    let mut runs = Vec::new();
    let mut start = 0usize;
    for i in 1..=found.len() {
        let breaks = match (found.get(i - 1), found.get(i)) {
            (Some(a), Some(b)) => b.2 != a.2 + 1 || i - start >= max,
            _ => true,
        };
        if breaks {
            if let Some(run) = found.get(start..i) {
                runs.push(run);
            }
            start = i;
        }
    }
    runs
}

#[cfg(test)]
mod tests;
