//! The block manager's data path, measured against a baseline in the same run:
//!
//! - **baseline**: one process reading the same bytes from a memfd into kept heap buffers and
//!   writing them back to another memfd (`pread`/`pwrite`: the daemon's kernel copies with no
//!   protocol, socket or store around them);
//! - **host**: a connector offloading to and onboarding from the daemon's host tier through
//!   the socket (`kvgate-kvbm` as a separate process);
//! - **remote**: the same with a host tier of 4 blocks, so blocks are demoted to a real
//!   `redis-server` and onboarded back from it.
//!
//! `cargo bench -p kvgate-kvbm --bench connector`; `KVGATE_BENCH_BLOCKS` (default 256) blocks of
//! `KVGATE_BENCH_BLOCK_MIB` (default 2: Llama-3.1-8B BF16, 16 tokens) in requests of 16.
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

use kvgate_kvbm::client::Client;
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

/// `kvgate-kvbm` with `host_bytes` of host memory and, with `redis`, a remote tier.
fn daemon(dir: &Path, host_bytes: u64, redis: Option<u16>) -> (Proc, PathBuf) {
    let socket = dir.join(format!("kvbm-{host_bytes}.sock"));
    let mut args = vec![
        "--node".to_owned(),
        "bench".into(),
        "--model".into(),
        "bench".into(),
        "--block-size".into(),
        "16".into(),
        "--socket".into(),
        socket.display().to_string(),
        "--metrics-bind".into(),
        "127.0.0.1".into(),
        "--metrics-port".into(),
        free_port().to_string(),
        // Nobody listens there: the daemon serves connectors while it retries NATS.
        "--nats-url".into(),
        format!("nats://127.0.0.1:{}", free_port()),
        "--host-bytes".into(),
        host_bytes.to_string(),
    ];
    if let Some(port) = redis {
        args.extend([
            "--remote-url".into(),
            format!("redis://127.0.0.1:{port}"),
            "--remote-bytes".into(),
            (64u64 << 30).to_string(),
        ]);
    }
    let proc = Proc::spawn(env!("CARGO_BIN_EXE_kvgate-kvbm"), &args);
    let s = socket.clone();
    wait_for("kvgate-kvbm", || s.exists());
    (proc, socket)
}

/// GB/s of `bytes` moved in `d`.
fn rate(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Offloads `blocks` blocks in requests of [`PER_REQUEST`], then onboards them back in
/// requests of the same size: (offload GB/s, onboard GB/s, blocks from remote).
async fn round_trip(socket: &Path, block: u64, blocks: u64) -> (f64, f64, u32) {
    let layout = Layout {
        model: "bench".into(),
        dtype: "bf16".into(),
        layers: 32,
        block_size: 16,
        block_bytes: block,
        shard: 0,
        shards: 1,
    };
    let mut c = Client::connect(socket, layout, PER_REQUEST * block)
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
        let (stored, _) = c.offload(None, slots(r * PER_REQUEST)).await.unwrap();
        assert_eq!(u64::from(stored), PER_REQUEST);
    }
    let offload = t.elapsed();
    // Let the remote writer drain before reading back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = Instant::now();
    let mut remote = 0;
    for r in 0..blocks / PER_REQUEST {
        let got = c.onboard(slots(r * PER_REQUEST)).await.unwrap();
        let (n, from_remote) = (got.blocks, got.remote);
        assert_eq!(u64::from(n), PER_REQUEST, "request {r}");
        remote += from_remote;
    }
    let onboard = t.elapsed();
    let bytes = blocks / PER_REQUEST * PER_REQUEST * block;
    (rate(bytes, offload), rate(bytes, onboard), remote)
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
    let block = env_u64("KVGATE_BENCH_BLOCK_MIB", 2) << 20;
    let blocks = env_u64("KVGATE_BENCH_BLOCKS", 256).max(PER_REQUEST);
    let dir = std::env::temp_dir().join(format!("kvgate-kvbm-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "{blocks} blocks of {} MiB, {PER_REQUEST} per request",
        block >> 20
    );
    let (read, write) = baseline(block, blocks);
    println!(
        "baseline  pread into kept buffers {read:6.2} GB/s   pwrite from them {write:6.2} GB/s (one process)"
    );

    let (_host, socket) = daemon(&dir, (blocks + PER_REQUEST) * block, None);
    let (off, on, remote) = runtime.block_on(round_trip(&socket, block, blocks));
    assert_eq!(remote, 0);
    println!(
        "host      offload {off:6.2} GB/s ({:.2}× pread)      onboard {on:6.2} GB/s ({:.2}× pwrite)",
        off / read,
        on / write
    );

    let redis_port = free_port();
    let _redis = redis_server(redis_port, None);
    let (_remote_daemon, socket) = daemon(&dir, 4 * block, Some(redis_port));
    let (off, on, remote) = runtime.block_on(round_trip(&socket, block, blocks));
    println!(
        "remote    offload {off:6.2} GB/s ({:.2}× pread)      onboard {on:6.2} GB/s ({:.2}× pwrite), {remote} of {blocks} blocks from Redis",
        off / read,
        on / write
    );
    let _ = std::fs::remove_dir_all(&dir);
}
