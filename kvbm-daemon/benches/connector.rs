//! The block manager's data path, measured against a baseline in the same run:
//!
//! - **baseline**: one process reading the same bytes from a memfd into kept heap buffers and
//!   writing them back to another memfd (`pread`/`pwrite`: the daemon's kernel copies with no
//!   protocol, socket or store around them);
//! - **host**: a connector offloading to and onboarding from the daemon's host tier through
//!   the socket (`kvgate-kvbm` as a separate process);
//! - **remote**: the same with a host tier of 4 blocks, so blocks are demoted to a real
//!   `redis-server` and onboarded back from it;
//! - **remote TLS**: the same through `rediss://` (Redis's TLS port, a CA made for the run),
//!   against plain Redis in the same run;
//! - **disk**: the same with a disk tier instead of Redis (in the system temp directory),
//!   against the disk module itself in one process (`DiskDir::write`/`read` of the same
//!   blocks, the same `O_DIRECT` probe): the time until the daemon's disk queue has drained
//!   against the module's writes, and onboards from disk against its reads;
//! - **peer**: two daemons on one `nats-server`, pulls on: the blocks offloaded to one are
//!   onboarded through the other, which pulls them over loopback TCP, against the same bytes
//!   sent over one loopback TCP connection by this process (no protocol) and against the
//!   holder's own host onboard; then the same between two nodes with `--peer-fabric nixl`
//!   (NIXL READs over UCX on loopback, with `KVGATE_TEST_NIXL_LIBRARY` naming NIXL's
//!   `libnixl_capi.so`; skipped, and said so, without it).
//!
//! `cargo bench -p kvgate-kvbm --bench connector`; `KVGATE_BENCH_BLOCKS` (default 256) blocks of
//! `KVGATE_BENCH_BLOCK_MIB` (default 2: Llama-3.1-8B BF16, 16 tokens; or `KVGATE_BENCH_BLOCK_KIB`
//! for smaller ones) in requests of 16;
//! `KVGATE_BENCH_ONLY` (`host`, `remote`, `disk` or `peer`) runs one part (and the baseline).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout
)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvgate_kvbm::client::{Client, Onboarded};
use kvgate_kvbm::disk::{DirectIo, DiskDir, block_name};
use kvgate_kvbm::protocol::Slot;
use kvgate_kvbm::segment::{self, Segment};
use kvgate_kvbm::store::Layout;
use support::{Proc, free_port, redis_server, wait_for};

const PER_REQUEST: u64 = 16;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A running daemon: the process, its socket and its metrics port.
struct Daemon {
    _proc: Proc,
    socket: PathBuf,
    metrics_port: u16,
}

/// The daemon arguments of a remote tier at `url` (with a CA bundle for `rediss://`).
fn remote_args(url: &str, ca: Option<&Path>) -> Vec<String> {
    let mut args = vec![
        "--remote-url".to_owned(),
        url.to_owned(),
        "--remote-bytes".into(),
        (64u64 << 30).to_string(),
    ];
    if let Some(ca) = ca {
        args.extend(["--remote-ca-file".into(), ca.display().to_string()]);
    }
    args
}

/// The daemon arguments of a disk tier in `dir`.
fn disk_args(dir: &Path) -> Vec<String> {
    vec![
        "--disk-dir".to_owned(),
        dir.display().to_string(),
        "--disk-bytes".into(),
        (64u64 << 30).to_string(),
    ]
}

/// `kvgate-kvbm` with `host_bytes` of host memory, and the tiers `extra` names.
fn daemon(dir: &Path, host_bytes: u64, extra: &[String]) -> Daemon {
    // Nobody listens there: the daemon serves connectors while it retries NATS.
    let nats = format!("nats://127.0.0.1:{}", free_port());
    daemon_on(dir, host_bytes, extra, "bench", &nats)
}

/// The same, as node `node` on the NATS server at `nats`.
fn daemon_on(dir: &Path, host_bytes: u64, extra: &[String], node: &str, nats: &str) -> Daemon {
    let socket = dir.join(format!("kvbm-{host_bytes}-{}.sock", free_port()));
    let metrics_port = free_port();
    let mut args = vec![
        "--node".to_owned(),
        node.into(),
        "--model".into(),
        "bench".into(),
        "--block-size".into(),
        "16".into(),
        "--socket".into(),
        socket.display().to_string(),
        "--metrics-bind".into(),
        "127.0.0.1".into(),
        "--metrics-port".into(),
        metrics_port.to_string(),
        "--nats-url".into(),
        nats.into(),
        "--host-bytes".into(),
        host_bytes.to_string(),
    ];
    args.extend_from_slice(extra);
    let proc = Proc::spawn(env!("CARGO_BIN_EXE_kvgate-kvbm"), &args);
    let s = socket.clone();
    wait_for("kvgate-kvbm", || s.exists());
    Daemon {
        _proc: proc,
        socket,
        metrics_port,
    }
}

/// The sum of a metric's samples on the daemon's `/metrics`.
fn scrape(port: u16, name: &str) -> f64 {
    scrape_where(port, |l| l.split(['{', ' ']).next() == Some(name))
}

/// The value of the sample whose line starts with `series` (a name and its labels).
fn scrape_series(port: u16, series: &str) -> f64 {
    scrape_where(port, |l| l.starts_with(&format!("{series} ")))
}

fn scrape_where(port: u16, keep: impl Fn(&str) -> bool) -> f64 {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    page.lines()
        .filter(|l| keep(l))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// A CA and a certificate for `localhost` it signed, as PEM files in `dir`: (CA, cert, key).
fn tls_material(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let paths = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

/// GB/s of `bytes` moved in `d`.
fn rate(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// What a round trip measured.
struct Trip {
    /// Offload GB/s, as the connector saw it.
    offload: f64,
    /// GB/s from the first offload until the daemon's write queues were empty.
    drained: f64,
    /// Onboard GB/s.
    onboard: f64,
    /// Where the onboarded blocks came from.
    from: Onboarded,
}

fn layout(block: u64) -> Layout {
    Layout {
        model: "bench".into(),
        dtype: "bf16".into(),
        layers: 32,
        block_size: 16,
        block_bytes: block,
        shard: 0,
        shards: 1,
    }
}

/// Offloads `blocks` blocks in requests of [`PER_REQUEST`], waits for the daemon's write
/// queues to drain, then onboards them back in requests of the same size.
async fn round_trip(d: &Daemon, block: u64, blocks: u64) -> Trip {
    round_trip_via(d, d, block, blocks).await
}

/// The same, offloading to `holder` and onboarding through `asker` (another node's daemon:
/// it pulls from `holder` once it sees every block there).
async fn round_trip_via(holder: &Daemon, asker: &Daemon, block: u64, blocks: u64) -> Trip {
    let d = holder;
    let mut c = Client::connect(&d.socket, layout(block), PER_REQUEST * block)
        .await
        .unwrap();
    for i in 0..PER_REQUEST {
        c.segment()
            .write(i * block, &vec![i as u8; block as usize])
            .unwrap();
    }
    let slots = |base: u64| -> Vec<Slot> {
        (0..PER_REQUEST)
            .map(|i| Slot {
                key: base + i,
                offset: i * block,
            })
            .collect()
    };
    let t = Instant::now();
    for r in 0..blocks / PER_REQUEST {
        let (stored, present, _) = c.offload(None, slots(r * PER_REQUEST)).await.unwrap();
        assert_eq!(u64::from(stored + present), PER_REQUEST);
    }
    let offload = t.elapsed();
    // Read back only what the tiers hold, not what is still queued in memory.
    while scrape(d.metrics_port, "kvgate_kvbm_write_queued_bytes") > 0.0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let drained = t.elapsed();
    let mut c = if std::ptr::eq(holder, asker) {
        c
    } else {
        let mut other = Client::connect(&asker.socket, layout(block), PER_REQUEST * block)
            .await
            .unwrap();
        let n = blocks / PER_REQUEST * PER_REQUEST;
        let (first, last): (Vec<u64>, Vec<u64>) =
            ((0..PER_REQUEST).collect(), (n - PER_REQUEST..n).collect());
        let deadline = Instant::now() + Duration::from_secs(30);
        // Each request's run is a chain of its own (offloaded without a parent).
        while other.lookup(first.clone()).await.unwrap().1 < PER_REQUEST as u32
            || other.lookup(last.clone()).await.unwrap().1 < PER_REQUEST as u32
        {
            assert!(Instant::now() < deadline, "the peer never saw the blocks");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        other
    };
    let t = Instant::now();
    let mut from = Onboarded::default();
    for r in 0..blocks / PER_REQUEST {
        let got = c.onboard(slots(r * PER_REQUEST)).await.unwrap();
        assert_eq!(u64::from(got.blocks), PER_REQUEST, "request {r}");
        from.blocks += got.blocks;
        from.host += got.host;
        from.disk += got.disk;
        from.remote += got.remote;
        from.peer += got.peer;
    }
    let onboard = t.elapsed();
    let bytes = blocks / PER_REQUEST * PER_REQUEST * block;
    Trip {
        offload: rate(bytes, offload),
        drained: rate(bytes, drained),
        onboard: rate(bytes, onboard),
        from,
    }
}

/// The disk module alone, in this process: every block written one at a time (each its own
/// call, into its own slot), then read back one at a time, then by 16 threads at once. (write GB/s,
/// read GB/s, parallel read GB/s, O_DIRECT in use).
fn disk_baseline(dir: &Path, block: u64, blocks: u64) -> (f64, f64, f64, bool) {
    let disk = DiskDir::open(dir, DirectIo::Auto).unwrap();
    let n = blocks / PER_REQUEST * PER_REQUEST;
    let data: Vec<Vec<u8>> = (0..PER_REQUEST)
        .map(|i| vec![i as u8; block as usize])
        .collect();
    let name = |i: u64| block_name(0xbe4c, kv_events::BlockKey(i));
    let t = Instant::now();
    for (i, d) in (0..n).zip(data.iter().cycle()) {
        disk.write(&name(i), d).unwrap();
    }
    let write = rate(n * block, t.elapsed());
    let t = Instant::now();
    for i in 0..n {
        assert!(disk.read(&name(i), block).unwrap().is_some());
    }
    let read = rate(n * block, t.elapsed());
    let t = Instant::now();
    std::thread::scope(|scope| {
        for first in 0..16 {
            let (disk, name) = (&disk, &name);
            scope.spawn(move || {
                for i in (first..n).step_by(16) {
                    assert!(disk.read(&name(i), block).unwrap().is_some());
                }
            });
        }
    });
    (write, read, rate(n * block, t.elapsed()), disk.direct())
}

/// `bytes` sent over one loopback TCP connection in writes of `chunk`, read back by a second
/// thread into one kept buffer per chunk: GB/s.
fn tcp_baseline(bytes: u64, chunk: u64) -> f64 {
    use std::io::{Read as _, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let chunk = usize::try_from(chunk).unwrap();
    let chunks = usize::try_from(bytes).unwrap() / chunk;
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut kept = Vec::with_capacity(chunks);
        for _ in 0..chunks {
            let mut buf = vec![0u8; chunk];
            s.read_exact(&mut buf).unwrap();
            kept.push(buf);
        }
        kept.len()
    });
    let data = vec![7u8; chunk];
    let t = Instant::now();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    for _ in 0..chunks {
        s.write_all(&data).unwrap();
    }
    assert_eq!(reader.join().unwrap(), chunks);
    rate((chunks * chunk) as u64, t.elapsed())
}

/// The same volume moved by one process with no protocol: `pread` of every block into a fresh
/// buffer that is kept (as the host tier keeps it), then `pwrite` of every kept buffer into a
/// second memfd. (read GB/s, write GB/s).
fn baseline(block: u64, blocks: u64) -> (f64, f64) {
    let n = blocks / PER_REQUEST * PER_REQUEST;
    let seg = |name| {
        Segment::new(
            segment::create(name, PER_REQUEST * block).unwrap(),
            PER_REQUEST * block,
            u64::MAX,
        )
        .unwrap()
    };
    let (src, dst) = (seg("src"), seg("dst"));
    for i in 0..PER_REQUEST {
        src.write(i * block, &vec![i as u8; block as usize])
            .unwrap();
    }
    let t = Instant::now();
    let kept: Vec<bytes::Bytes> = (0..n)
        .map(|i| src.read(i % PER_REQUEST * block, block).unwrap())
        .collect();
    let read = rate(n * block, t.elapsed());
    let t = Instant::now();
    for (i, data) in kept.iter().enumerate() {
        dst.write(i as u64 % PER_REQUEST * block, data).unwrap();
    }
    (read, rate(n * block, t.elapsed()))
}

fn main() {
    // nextest lists tests with `--list` (there are none); `cargo test --all-targets` runs the
    // binary without `--bench`: only `cargo bench` measures.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if !std::env::args().any(|a| a == "--bench") {
        println!("connector: skipped outside `cargo bench`");
        return;
    }
    let block = match env_u64("KVGATE_BENCH_BLOCK_KIB", 0) {
        0 => env_u64("KVGATE_BENCH_BLOCK_MIB", 2) << 20,
        kib => kib << 10,
    };
    let blocks = env_u64("KVGATE_BENCH_BLOCKS", 256).max(PER_REQUEST);
    let dir = std::env::temp_dir().join(format!("kvgate-kvbm-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "{blocks} blocks of {} KiB, {PER_REQUEST} per request",
        block >> 10
    );
    let (read, write) = baseline(block, blocks);
    println!(
        "baseline  pread into kept buffers {read:6.2} GB/s   pwrite from them {write:6.2} GB/s (one process)"
    );

    let only = std::env::var("KVGATE_BENCH_ONLY").ok();
    let run = |part: &str| only.as_deref().is_none_or(|o| o == part);
    if run("host") {
        host_part(&runtime, &dir, block, blocks, read, write);
    }
    if run("remote") {
        remote_part(&runtime, &dir, block, blocks, read, write);
    }
    if run("disk") {
        disk_part(&runtime, &dir, block, blocks);
    }
    if run("peer") {
        peer_part(&runtime, &dir, block, blocks);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

type Runtime = tokio::runtime::Runtime;

fn host_part(runtime: &Runtime, dir: &Path, block: u64, blocks: u64, read: f64, write: f64) {
    let host = daemon(dir, (blocks + PER_REQUEST) * block, &[]);
    let trip = runtime.block_on(round_trip(&host, block, blocks));
    assert_eq!(trip.from.host, trip.from.blocks);
    println!(
        "host      offload {:6.2} GB/s ({:.2}× pread)      onboard {:6.2} GB/s ({:.2}× pwrite)",
        trip.offload,
        trip.offload / read,
        trip.onboard,
        trip.onboard / write
    );
    drop(host);
}

fn remote_part(runtime: &Runtime, dir: &Path, block: u64, blocks: u64, read: f64, write: f64) {
    let redis_port = free_port();
    let _redis = redis_server(redis_port, None);
    let plain_url = format!("redis://127.0.0.1:{redis_port}");
    let remote = daemon(dir, 4 * block, &remote_args(&plain_url, None));
    let trip = runtime.block_on(round_trip(&remote, block, blocks));
    println!(
        "remote    offload {:6.2} GB/s ({:.2}× pread)      onboard {:6.2} GB/s ({:.2}× pwrite), {} of {blocks} blocks from Redis",
        trip.offload,
        trip.offload / read,
        trip.onboard,
        trip.onboard / write,
        trip.from.remote
    );
    drop(remote);
    let plain = trip;

    // The same through TLS (rediss://, a CA made here, Redis's TLS port).
    let (ca, cert, key) = tls_material(dir);
    let tls_port = free_port();
    let _redis_tls = support::redis_tls_server(tls_port, &cert, &key);
    let tls_url = format!("rediss://localhost:{tls_port}");
    let remote = daemon(dir, 4 * block, &remote_args(&tls_url, Some(&ca)));
    let trip = runtime.block_on(round_trip(&remote, block, blocks));
    println!(
        "remote TLS offload {:6.2} GB/s ({:.2}× plain)      onboard {:6.2} GB/s ({:.2}× plain), {} of {blocks} blocks from Redis",
        trip.offload,
        trip.offload / plain.offload,
        trip.onboard,
        trip.onboard / plain.onboard,
        trip.from.remote
    );
    drop(remote);
}

fn disk_part(runtime: &Runtime, dir: &Path, block: u64, blocks: u64) {
    let (disk_write, disk_read, disk_par, direct) =
        disk_baseline(&dir.join("disk-baseline"), block, blocks);
    let _ = std::fs::remove_dir_all(dir.join("disk-baseline"));
    println!(
        "disk baseline ({}) write {disk_write:6.2} GB/s   read {disk_read:6.2} GB/s, 16 threads {disk_par:6.2} GB/s (the disk module in one process)",
        if direct { "O_DIRECT" } else { "page cache" }
    );
    let disk = daemon(dir, 4 * block, &disk_args(&dir.join("disk")));
    let trip = runtime.block_on(round_trip(&disk, block, blocks));
    println!(
        "disk      offload {:6.2} GB/s, drained {:6.2} GB/s ({:.2}× write)   onboard {:6.2} GB/s ({:.2}× read, {:.2}× 16 threads), {} of {blocks} blocks from disk",
        trip.offload,
        trip.drained,
        trip.drained / disk_write,
        trip.onboard,
        trip.onboard / disk_read,
        trip.onboard / disk_par,
        trip.from.disk
    );
    drop(disk);
}

/// Pulls from a peer: node b onboards what node a holds.
fn peer_part(runtime: &Runtime, dir: &Path, block: u64, blocks: u64) {
    let nats_port = free_port();
    let _nats = support::nats_server(nats_port);
    let nats = format!("nats://127.0.0.1:{nats_port}");
    let secret = dir.join("peer-secret");
    std::fs::write(&secret, "a secret for the bench run").unwrap();
    let peer = |node: &str, fabric: &[String]| {
        let extra: Vec<String> = [
            "--peer-listen".to_owned(),
            format!("127.0.0.1:{}", free_port()),
            "--peer-secret-file".into(),
            secret.display().to_string(),
        ]
        .into_iter()
        .chain(fabric.iter().cloned())
        .collect();
        daemon_on(dir, (blocks + PER_REQUEST) * block, &extra, node, &nats)
    };
    let (a, b) = (peer("node-a", &[]), peer("node-b", &[]));
    let n = blocks / PER_REQUEST * PER_REQUEST;
    let tcp = tcp_baseline(n * block, PER_REQUEST * block);
    println!(
        "tcp baseline one loopback connection, {} MiB writes {tcp:6.2} GB/s (one process, two threads)",
        (PER_REQUEST * block) >> 20
    );
    let local = runtime.block_on(round_trip(&a, block, blocks));
    let pulled = runtime.block_on(round_trip_via(&a, &b, block, blocks));
    assert_eq!(
        u64::from(pulled.from.peer),
        n,
        "every block pulled from the peer"
    );
    println!(
        "peer      onboard through a peer {:6.2} GB/s ({:.2}× tcp, {:.2}× the holder's own host onboard at {:.2} GB/s), {} of {n} blocks pulled",
        pulled.onboard,
        pulled.onboard / tcp,
        pulled.onboard / local.onboard,
        local.onboard,
        pulled.from.peer
    );
    drop((a, b));

    // The same between two nodes with `--peer-fabric nixl` (NIXL's UCX backend on loopback).
    let Ok(library) = std::env::var("KVGATE_TEST_NIXL_LIBRARY") else {
        println!(
            "peer nixl skipped: KVGATE_TEST_NIXL_LIBRARY (NIXL's libnixl_capi.so, which scripts/bootstrap.sh unpacks) is not set"
        );
        return;
    };
    let nixl = [
        "--peer-fabric".to_owned(),
        "nixl".into(),
        "--nixl-library".into(),
        library,
    ];
    let (c, d) = (peer("node-c", &nixl), peer("node-d", &nixl));
    let fabric = runtime.block_on(round_trip_via(&c, &d, block, blocks));
    assert_eq!(
        u64::from(fabric.from.peer),
        n,
        "every block pulled through NIXL"
    );
    let reads = scrape_series(
        d.metrics_port,
        r#"kvgate_kvbm_peer_fabric_reads_total{outcome="ok"}"#,
    );
    println!(
        "peer nixl onboard through a peer {:6.2} GB/s ({:.2}× tcp, {:.2}× the TCP pull), {reads} of {} answers read through NIXL",
        fabric.onboard,
        fabric.onboard / tcp,
        fabric.onboard / pulled.onboard,
        n / PER_REQUEST
    );
    drop((c, d));
}
