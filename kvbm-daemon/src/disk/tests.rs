//! The disk tier against real directories (both I/O modes), and as a map under property tests.
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicU64, Ordering};

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
    block_name(0xfeed, BlockKey(n))
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

/// `names` and `bytes` paired as `write_many` takes them.
fn pairs<'a>(names: &'a [String], bytes: &'a [Vec<u8>]) -> Vec<(&'a str, &'a [u8])> {
    names
        .iter()
        .zip(bytes)
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect()
}

/// The slot each named block lies in.
fn slots(disk: &DiskDir, names: &[String]) -> Vec<u64> {
    let state = disk.lock_state();
    names
        .iter()
        .map(|n| state.index.get(parse_name(n).unwrap()).unwrap().slot)
        .collect()
}

#[test]
fn names_are_fixed_width_and_parse_back() {
    assert_eq!(
        block_name(0xab, BlockKey(1)),
        "00000000000000ab-0000000000000001"
    );
    assert_eq!(
        block_name(u64::MAX, BlockKey(u64::MAX)),
        "ffffffffffffffff-ffffffffffffffff"
    );
    let n = block_name(0x0123_4567_89ab_cdef, BlockKey(42));
    assert_eq!(parse_name(&n).unwrap(), (0x0123_4567_89ab_cdef, 42));
    assert_ne!(name(1), block_name(0xbeef, BlockKey(1)));
    assert!(is_slab_name(&slab_file_name(16384)));
    for bad in [
        "slab-.dat",
        "slab-01.dat",
        "slab-1x.dat",
        "slab-1.dat.tmp",
        "xslab-1.dat",
    ] {
        assert!(!is_slab_name(bad), "{bad}");
    }
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
        let sizes = [4096usize, 3 * 4096, 5000, 1, 0, 1 << 20];
        for (i, len) in sizes.into_iter().enumerate() {
            let bytes = data(len, i as u8);
            disk.write(&name(i as u64), &bytes).unwrap();
            let got = disk.read(&name(i as u64), len as u64).unwrap();
            assert_eq!(got.as_deref(), Some(&bytes[..]), "{mode:?}, {len} bytes");
        }
        assert_eq!(disk.blocks(), sizes.len());
        // One file per size but the empty one, and the lock.
        assert_eq!(files(&tmp.0).len(), 1 + sizes.len() - 1);
    }
}

#[test]
fn blocks_written_together_lie_together_and_read_back_in_order() {
    for mode in [DirectIo::Off, DirectIo::Auto] {
        let tmp = TempDir::new();
        let disk = DiskDir::open(&tmp.0, mode).unwrap();
        let names: Vec<String> = (0..40).map(name).collect();
        let bytes: Vec<Vec<u8>> = (0..40).map(|i| data(4096, i as u8)).collect();
        let batch = pairs(&names, &bytes);
        assert!(disk.write_many(&batch).iter().all(Result::is_ok));
        assert_eq!(slots(&disk, &names), (0..40).collect::<Vec<_>>());
        // Free every other block's slot, then write 10 more: the free slots are single
        // ones, so the ten take five of them and…
        for n in names.iter().step_by(2) {
            disk.delete(n).unwrap();
        }
        let more: Vec<String> = (100..110).map(name).collect();
        let batch = pairs(&more, &bytes);
        assert!(disk.write_many(&batch).iter().all(Result::is_ok));
        let got = slots(&disk, &more);
        assert!(got.iter().all(|s| *s < 40), "{got:?}: freed slots first");
        assert_eq!(disk.file_bytes(), 40 * 4096, "the file did not grow");
        // Reading in any order, across runs and holes, gives each block its bytes.
        let mut ask: Vec<&str> = more.iter().map(String::as_str).collect();
        ask.extend(names.iter().map(String::as_str).rev());
        ask.push("0000000000000000-0000000000000000");
        let got = disk.read_many(&ask, 4096);
        for (i, (n, r)) in ask.iter().zip(got).enumerate() {
            let r = r.unwrap();
            let expected = if i < 10 {
                Some(bytes[i].as_slice())
            } else if i < 50 {
                let k = 49 - i;
                (k % 2 == 1).then(|| bytes[k].as_slice())
            } else {
                None
            };
            assert_eq!(r.as_deref(), expected, "{n}");
        }
    }
}

#[test]
fn a_name_twice_in_a_batch_keeps_its_last_bytes() {
    let tmp = TempDir::new();
    let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
    let (a, b) = (data(100, 1), data(4096, 2));
    let r = disk.write_many(&[(&name(1), &a), (&name(1), &b), (&name(1), &a)]);
    assert!(r.iter().all(Result::is_ok));
    assert_eq!(disk.read(&name(1), 100).unwrap().as_deref(), Some(&a[..]));
    assert!(disk.read(&name(1), 4096).unwrap().is_none());
    assert_eq!(disk.blocks(), 1);
}

#[test]
fn a_failed_run_fails_its_blocks_and_those_after_it_only() {
    let tmp = TempDir::new();
    let disk = DiskDir::open(&tmp.0, DirectIo::Off).unwrap();
    // Blocks of 8 MiB: two per call (MAX_IO_BYTES); the second call fails.
    let len = 8usize << 20;
    let names: Vec<String> = (0..6).map(name).collect();
    let bytes: Vec<Vec<u8>> = (0..6).map(|i| data(len, i as u8)).collect();
    let blocks = pairs(&names, &bytes);
    let group: Vec<(usize, Name)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (i, parse_name(n).unwrap()))
        .collect();
    let calls = AtomicU64::new(0);
    let results = disk.write_size(len as u64, &group, &blocks, &|slab, slot, data| {
        if calls.fetch_add(1, Ordering::Relaxed) == 1 {
            return Err(ErrorKind::StorageFull.into());
        }
        slab.write_run(slot, data)
    });
    assert_eq!(
        calls.load(Ordering::Relaxed),
        2,
        "nothing tried after the failure"
    );
    let ok: Vec<bool> = results.iter().map(Result::is_ok).collect();
    assert_eq!(ok, [true, true, false, false, false, false]);
    assert_eq!(results[2].as_ref().unwrap_err().metric_label(), "no_space");
    // The written blocks are readable; the others are not there, and their slots are free.
    for (i, n) in names.iter().enumerate() {
        let got = disk.read(n, len as u64).unwrap();
        assert_eq!(got.as_deref(), (i < 2).then(|| bytes[i].as_slice()), "{n}");
    }
    assert_eq!(disk.blocks(), 2);
    let again: Vec<(&str, &[u8])> = blocks[2..4].to_vec();
    assert!(disk.write_many(&again).iter().all(Result::is_ok));
    assert_eq!(
        disk.file_bytes(),
        6 * len as u64,
        "the freed slots were reused"
    );
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
    assert!(disk.read(&name(2), 4096).unwrap().is_none());
    assert!(disk.read(&name(2), 8192).unwrap().is_none());
}

#[test]
fn delete_is_idempotent_and_frees_the_slot() {
    let tmp = TempDir::new();
    let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
    disk.delete(&name(1)).unwrap();
    disk.write(&name(1), &data(8192, 1)).unwrap();
    assert!(disk.read(&name(1), 8192).unwrap().is_some());
    disk.delete(&name(1)).unwrap();
    assert!(disk.read(&name(1), 8192).unwrap().is_none());
    disk.delete(&name(1)).unwrap();
    disk.write(&name(2), &data(8192, 2)).unwrap();
    assert_eq!(slots(&disk, &[name(2)]), [0]);
    assert_eq!(disk.file_bytes(), 8192);
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

/// Each block's bytes: its name and a version, repeated; a reader that got a block
/// checks the bytes are one version of that block, whole.
fn stamped(n: u64, version: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        v.extend_from_slice(&n.to_le_bytes());
        v.extend_from_slice(&version.to_le_bytes());
    }
    v.truncate(len);
    v
}

#[test]
fn readers_never_see_another_blocks_bytes_while_slots_are_reused() {
    for mode in [DirectIo::Off, DirectIo::Auto] {
        let tmp = TempDir::new();
        let disk = DiskDir::open(&tmp.0, mode).unwrap();
        let len = 4096usize;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let seen = AtomicU64::new(0);
        std::thread::scope(|s| {
            // A writer rewrites and deletes 8 names in batches: slots are freed and
            // taken by other names all the time.
            s.spawn(|| {
                for version in 0..300u64 {
                    let names: Vec<String> = (0..8).map(name).collect();
                    let bytes: Vec<Vec<u8>> = (0..8).map(|n| stamped(n, version, len)).collect();
                    let mut batch = pairs(&names, &bytes);
                    if version % 3 == 2 {
                        batch.clear();
                    }
                    for r in disk.write_many(&batch) {
                        r.unwrap();
                    }
                    disk.delete(&name(version % 8)).unwrap();
                }
                stop.store(true, Ordering::Relaxed);
            });
            for _ in 0..3 {
                s.spawn(|| {
                    let names: Vec<String> = (0..8).map(name).collect();
                    let ask: Vec<&str> = names.iter().map(String::as_str).collect();
                    while !stop.load(Ordering::Relaxed) {
                        for (n, r) in disk.read_many(&ask, len as u64).into_iter().enumerate() {
                            let Some(b) = r.unwrap() else { continue };
                            let version = u64::from_le_bytes(b[8..16].try_into().unwrap());
                            assert_eq!(b.as_ref(), stamped(n as u64, version, len));
                            seen.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert!(seen.load(Ordering::Relaxed) > 0);
    }
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
    assert_eq!(second.removed_at_open(), 1, "the slab file");
    assert!(second.read(&name(1), 10).unwrap().is_none());
    second.write(&name(1), &data(10, 2)).unwrap();
    assert_eq!(
        second.read(&name(1), 10).unwrap().as_deref(),
        Some(&data(10, 2)[..])
    );
}

#[test]
fn open_removes_its_own_stale_files_only() {
    let tmp = TempDir::new();
    let legacy = format!("{}.blk", name(1));
    std::fs::create_dir_all(tmp.0.join("sub.blk")).unwrap();
    std::fs::write(tmp.0.join("sub.blk").join(&legacy), b"x").unwrap();
    std::fs::create_dir_all(tmp.0.join("slab-9.dat")).unwrap();
    std::fs::write(tmp.0.join(&legacy), b"old").unwrap();
    std::fs::write(tmp.0.join(format!("{}.blk", name(2))), b"old").unwrap();
    std::fs::write(tmp.0.join(format!("{legacy}.3.tmp")), b"torn").unwrap();
    std::fs::write(tmp.0.join(PROBE_FILE), b"probe").unwrap();
    std::fs::write(tmp.0.join(slab_file_name(4096)), b"old").unwrap();
    for keep in [
        "notes.txt",
        "blk",
        "other.blk",
        "session.tmp",
        "slab-x.dat",
        "slab-07.dat",
    ] {
        std::fs::write(tmp.0.join(keep), b"keep").unwrap();
    }
    std::fs::write(tmp.0.join(format!("{legacy}.x.tmp")), b"keep").unwrap();
    let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
    assert_eq!(disk.removed_at_open(), 5);
    assert_eq!(disk.path(), tmp.0);
    let mut expected: Vec<String> = [
        ".lock",
        "blk",
        "notes.txt",
        "other.blk",
        "session.tmp",
        "slab-07.dat",
        "slab-9.dat",
        "slab-x.dat",
        "sub.blk",
    ]
    .map(String::from)
    .to_vec();
    expected.push(format!("{legacy}.x.tmp"));
    expected.sort();
    assert_eq!(files(&tmp.0), expected);
    assert!(tmp.0.join("sub.blk").join(&legacy).exists());
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
fn something_in_a_slab_files_place_fails_writes_and_is_never_followed() {
    let tmp = TempDir::new();
    let disk = DiskDir::open(&tmp.0, DirectIo::Auto).unwrap();
    // Planted after the open: a symlink where the 4096-byte slab goes, a directory where
    // the 100-byte one goes.
    let secret = tmp.0.join("secret");
    std::fs::write(&secret, data(4096, 9)).unwrap();
    std::os::unix::fs::symlink(&secret, tmp.0.join(slab_file_name(4096))).unwrap();
    std::fs::create_dir(tmp.0.join(slab_file_name(100))).unwrap();
    for len in [4096usize, 100] {
        let err = disk.write(&name(1), &data(len, 1)).unwrap_err();
        assert!(matches!(err, DiskError::Io { .. }), "{err}");
        assert_eq!(err.metric_label(), "io");
        assert!(disk.read(&name(1), len as u64).unwrap().is_none());
    }
    assert_eq!(std::fs::read(&secret).unwrap(), data(4096, 9));
    assert_eq!(disk.blocks(), 0);
    assert_eq!(
        disk.file_bytes(),
        0,
        "the failed writes' slots were given back"
    );
    // Once the way is clear, the next write creates the file.
    std::fs::remove_file(tmp.0.join(slab_file_name(4096))).unwrap();
    disk.write(&name(1), &data(4096, 1)).unwrap();
    assert_eq!(
        disk.read(&name(1), 4096).unwrap().as_deref(),
        Some(&data(4096, 1)[..])
    );
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
    assert_eq!(mode(&dir.join(slab_file_name(4096))), 0o600);
    assert_eq!(mode(&dir.join(slab_file_name(10))), 0o600);
}

#[test]
fn bad_names_are_refused_everywhere() {
    let tmp = TempDir::new();
    let disk = DiskDir::open(&tmp.0, DirectIo::Off).unwrap();
    let long = "0".repeat(100);
    let bad = [
        "../x",
        "a/b",
        "",
        "zz-00",
        "00000000000000ab",
        "00000000000000AB-0000000000000001",
        "00000000000000ab-000000000000001",
        "00000000000000ab-0000000000000001.blk",
        "+0000000000000ab-0000000000000001",
        "00000000000000ab/0000000000000001",
        ".lock",
        long.as_str(),
    ];
    for name in bad {
        let many = disk.read_many(&[name, "0000000000000000-0000000000000000"], 1);
        assert!(
            matches!(many.last(), Some(Ok(None))),
            "a good name beside it"
        );
        for err in [
            disk.write(name, b"x").unwrap_err(),
            disk.read(name, 1).unwrap_err(),
            disk.delete(name).unwrap_err(),
            many.into_iter().next().unwrap().unwrap_err(),
        ] {
            assert!(
                matches!(&err, DiskError::BadName(n) if n == name),
                "{name:?}: {err}"
            );
            assert_eq!(err.metric_label(), "bad_name");
        }
    }
    assert_eq!(files(&tmp.0), [".lock"]);
}

#[test]
fn no_space_errors_have_their_own_label() {
    let io = |errno: rustix::io::Errno| {
        DiskError::io(
            "writing",
            Path::new("/x"),
            std::io::Error::from_raw_os_error(errno.raw_os_error()),
        )
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
    /// Several names of one size in one call.
    WriteMany {
        names: Vec<u64>,
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
    /// Reads several names of one size in one call.
    ReadMany {
        names: Vec<u64>,
        len: usize,
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
    let names = || proptest::collection::vec(0u64..6, 0..8);
    prop_oneof![
        (0u64..6, size(), any::<u8>()).prop_map(|(name, len, seed)| Op::Write { name, len, seed }),
        (names(), size(), any::<u8>()).prop_map(|(names, len, seed)| Op::WriteMany {
            names,
            len,
            seed
        }),
        (0u64..6).prop_map(|name| Op::Delete { name }),
        (0u64..6, proptest::option::of(size())).prop_map(|(name, len)| Op::Read { name, len }),
        (names(), size()).prop_map(|(names, len)| Op::ReadMany { names, len }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Against a map: every read gives what the map has at that size; the files span no
    /// more than the most blocks of each size held or being written at once.
    #[test]
    fn behaves_like_a_map(
        ops in proptest::collection::vec(op(), 1..40),
        auto in any::<bool>(),
    ) {
        let tmp = TempDir::new();
        let mode = if auto { DirectIo::Auto } else { DirectIo::Off };
        let disk = DiskDir::open(&tmp.0, mode).unwrap();
        let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut peak: HashMap<usize, u64> = HashMap::new();
        for op in ops {
            // While a write runs, the slots it takes and those its names had are in use.
            let writing = match &op {
                Op::Write { len, .. } => Some((*len, 1)),
                Op::WriteMany { names, len, .. } => Some((*len, names.len() as u64)),
                _ => None,
            };
            if let Some((len, n)) = writing {
                let held = model.values().filter(|o| o.len() == len).count() as u64;
                let p = peak.entry(len).or_default();
                *p = (*p).max(held + n);
            }
            match op {
                Op::Write { name: n, len, seed } => {
                    let bytes = data(len, seed);
                    disk.write(&name(n), &bytes).unwrap();
                    model.insert(n, bytes);
                }
                Op::WriteMany { names, len, seed } => {
                    let bytes: Vec<Vec<u8>> = names
                        .iter()
                        .map(|n| data(len, seed.wrapping_add(*n as u8)))
                        .collect();
                    let named: Vec<String> = names.iter().map(|n| name(*n)).collect();
                    let batch = pairs(&named, &bytes);
                    for r in disk.write_many(&batch) {
                        r.unwrap();
                    }
                    for (n, b) in names.iter().zip(bytes) {
                        model.insert(*n, b);
                    }
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
                Op::ReadMany { names, len } => {
                    let named: Vec<String> = names.iter().map(|n| name(*n)).collect();
                    let ask: Vec<&str> = named.iter().map(String::as_str).collect();
                    for (n, got) in names.iter().zip(disk.read_many(&ask, len as u64)) {
                        let expected = model.get(n).filter(|s| s.len() == len);
                        let got = got.unwrap();
                        prop_assert_eq!(got.as_deref(), expected.map(Vec::as_slice));
                    }
                }
            }
            for b in model.values() {
                let held = model.values().filter(|o| o.len() == b.len()).count() as u64;
                let p = peak.entry(b.len()).or_default();
                *p = (*p).max(held);
            }
            let bound: u64 = peak.iter().map(|(len, n)| *len as u64 * n).sum();
            prop_assert!(disk.file_bytes() <= bound, "{} > {}", disk.file_bytes(), bound);
        }
        for (n, bytes) in &model {
            let got = disk.read(&name(*n), bytes.len() as u64).unwrap();
            prop_assert_eq!(got.as_deref(), Some(bytes.as_slice()));
        }
        prop_assert_eq!(disk.blocks(), model.len());
    }
}
