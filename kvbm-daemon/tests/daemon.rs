//! The `kvgate-kvbm` binary against real parts: a connector (the crate's reference client)
//! passing a memfd segment over the socket, a real `nats-server` receiving the envelopes and
//! answering snapshot requests, and a real `redis-server` (or an S3 server, moto) as the
//! remote tier.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_events::snapshot::{SnapshotChunk, SnapshotRequest};
use kv_events::{Envelope, KvEvent, Tier};
use kvgate_kvbm::client::{Client, ClientError, Onboarded};
use kvgate_kvbm::protocol::{ErrorCode, Slot};
use kvgate_kvbm::store::Layout;
use support::{Proc, free_port, metric, metrics, nats_server, redis_server, s3_server, wait_port};
use tokio_stream::StreamExt as _;

const BLOCK: u64 = 4096;

struct Stack {
    _nats: Proc,
    _remote: Proc,
    kvbm: Option<Proc>,
    nats_url: String,
    socket: PathBuf,
    metrics_port: u16,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// nats-server, redis-server and kvgate-kvbm with a host tier of `host_bytes`.
fn stack(host_bytes: u64) -> Stack {
    stack_in(test_dir(), host_bytes, &[])
}

/// A fresh directory for one test's stack.
fn test_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvgate-kvbm-test-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The daemon's arguments for a stack in `dir`.
fn kvbm_args(
    dir: &std::path::Path,
    nats_url: &str,
    remote_url: &str,
    metrics_port: u16,
    host_bytes: u64,
) -> Vec<String> {
    [
        "--node",
        "node-a",
        "--model",
        "qwen3",
        "--block-size",
        "16",
        "--namespace",
        "ns",
        "--metrics-bind",
        "127.0.0.1",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([
        "--socket".into(),
        dir.join("kvbm.sock").display().to_string(),
        "--metrics-port".into(),
        metrics_port.to_string(),
        "--nats-url".into(),
        nats_url.into(),
        "--host-bytes".into(),
        host_bytes.to_string(),
        "--remote-url".into(),
        remote_url.into(),
        "--remote-bytes".into(),
        (64 * BLOCK).to_string(),
    ])
    .collect()
}

/// A stack in `dir`, the daemon given `extra` arguments too.
fn stack_in(dir: PathBuf, host_bytes: u64, extra: &[String]) -> Stack {
    let nats_port = free_port();
    let nats = nats_server(nats_port);
    let redis_port = free_port();
    let redis = redis_server(redis_port, None);
    let remote_url = format!("redis://127.0.0.1:{redis_port}");
    start_stack(
        dir,
        nats_port,
        nats,
        (redis, &remote_url),
        host_bytes,
        extra,
        &[],
    )
}

/// A stack whose remote tier is the bucket `kvgate` of an S3 server (moto, checking
/// signatures), under the prefix `node-a`.
fn stack_s3(host_bytes: u64) -> Stack {
    let nats_port = free_port();
    let nats = nats_server(nats_port);
    let s3 = s3_server(free_port(), "kvgate");
    let endpoint = format!("http://127.0.0.1:{}", s3.port);
    let extra = ["--s3-endpoint".to_owned(), endpoint];
    let env = [
        ("AWS_ACCESS_KEY_ID", s3.access_key.as_str()),
        ("AWS_SECRET_ACCESS_KEY", s3.secret_key.as_str()),
    ];
    start_stack(
        test_dir(),
        nats_port,
        nats,
        (s3.proc, "s3://kvgate/node-a"),
        host_bytes,
        &extra,
        &env,
    )
}

/// Starts kvgate-kvbm beside a running NATS and remote store.
fn start_stack(
    dir: PathBuf,
    nats_port: u16,
    nats: Proc,
    (remote, remote_url): (Proc, &str),
    host_bytes: u64,
    extra: &[String],
    env: &[(&str, &str)],
) -> Stack {
    let metrics_port = free_port();
    let socket = dir.join("kvbm.sock");
    let nats_url = format!("nats://127.0.0.1:{nats_port}");
    let mut args = kvbm_args(&dir, &nats_url, remote_url, metrics_port, host_bytes);
    args.extend_from_slice(extra);
    let kvbm = Proc::spawn_env(env!("CARGO_BIN_EXE_kvgate-kvbm"), &args, env);
    wait_port(metrics_port, "kvgate-kvbm");
    Stack {
        _nats: nats,
        _remote: remote,
        kvbm: Some(kvbm),
        nats_url,
        socket,
        metrics_port,
        _dir: TempDir(dir),
    }
}

fn layout() -> Layout {
    Layout {
        model: "qwen3".into(),
        dtype: "bf16".into(),
        layers: 2,
        block_size: 16,
        block_bytes: BLOCK,
        shard: 0,
        shards: 1,
    }
}

fn block(key: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (key as u8).wrapping_add(i as u8))
        .collect()
}

/// Checks that each slot of the segment holds its block's bytes.
fn assert_intact(client: &Client, slots: &[Slot]) {
    for slot in slots {
        assert_eq!(
            &client.segment().read(slot.offset, BLOCK).unwrap()[..],
            &block(slot.key)[..],
            "block {} onboarded intact",
            slot.key
        );
    }
}

/// Writes blocks `keys` into slots 0.. of the segment and returns their slots.
fn stage(client: &Client, keys: &[u64]) -> Vec<Slot> {
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            let offset = i as u64 * BLOCK;
            client.segment().write(offset, &block(*k)).unwrap();
            Slot { key: *k, offset }
        })
        .collect()
}

/// Onboards the chain `keys` (6 blocks) into zeroed slots shifted by `shift`, expecting 4
/// from host memory and 2 from the remote store, and checks the bytes.
async fn onboard_two_remote_four_host(c: &mut Client, keys: &[u64], shift: u64) {
    for i in 0..8 {
        c.segment()
            .write(i * BLOCK, &vec![0; BLOCK as usize])
            .unwrap();
    }
    let into: Vec<Slot> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| Slot {
            key: *k,
            offset: (i as u64 + shift) % 8 * BLOCK,
        })
        .collect();
    let got = c.onboard(into.clone()).await.unwrap();
    let want = Onboarded {
        blocks: 6,
        host: 4,
        disk: 0,
        remote: 2,
        peer: 0,
    };
    assert_eq!(got, want);
    assert_intact(c, &into);
}

/// The next envelope on `events`, waiting until `deadline` at most.
async fn next_envelope(
    events: &mut async_nats::Subscriber,
    deadline: Instant,
    what: &str,
) -> Envelope {
    let msg = tokio::time::timeout_at(deadline.into(), events.next())
        .await
        .unwrap_or_else(|_| panic!("{what} in time"))
        .unwrap();
    Envelope::decode(&msg.payload, &Default::default()).unwrap()
}

/// Applies envelopes to a resident set, checking they are contiguous.
fn apply(resident: &mut HashSet<(u64, Tier)>, seq: &mut Option<u64>, e: &Envelope) {
    if let Some(s) = seq {
        assert_eq!(e.seq, *s + 1, "contiguous seq");
    }
    *seq = Some(e.seq);
    for ev in &e.events {
        match ev {
            KvEvent::Stored { keys, tier, .. } => {
                resident.extend(keys.iter().map(|k| (k.0, *tier)));
            }
            KvEvent::Removed { keys, tier } => {
                for k in keys {
                    resident.remove(&(k.0, *tier));
                }
            }
            KvEvent::Cleared { tier: None } => resident.clear(),
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offload_demote_onboard_publish_and_snapshot() {
    let mut s = stack(4 * BLOCK);
    let nats = async_nats::connect(&s.nats_url).await.unwrap();
    let mut events = nats.subscribe("kvgate.kvbm.ns.node-a").await.unwrap();
    nats.flush().await.unwrap();

    let mut c = Client::connect(&s.socket, layout(), 8 * BLOCK)
        .await
        .unwrap();
    // A chain of 6 blocks into a 4-block host tier: the first two are demoted to Redis.
    let keys = [11, 12, 13, 14, 15, 16];
    let slots = stage(&c, &keys);
    assert_eq!(c.offload(None, slots.clone()).await.unwrap(), (6, 0, 0));
    assert_eq!(
        c.offload(None, slots[4..].to_vec()).await.unwrap(),
        (0, 2, 0)
    );
    assert_eq!(c.lookup(keys.to_vec()).await.unwrap(), (0, 6));

    // The envelopes say the same.
    let mut resident = HashSet::new();
    let mut seq = None;
    let mut first: Option<Envelope> = None;
    let deadline = Instant::now() + Duration::from_secs(5);
    while resident.len() < 6 {
        let e = next_envelope(&mut events, deadline, "envelopes").await;
        apply(&mut resident, &mut seq, &e);
        first.get_or_insert(e);
    }
    let first = first.unwrap();
    assert_eq!(first.source.node.as_deref(), Some("node-a"));
    assert_eq!(
        (first.source.pod.as_deref(), first.source.model.as_str()),
        (None, "qwen3")
    );
    let want: HashSet<(u64, Tier)> = [(11, Tier::Remote), (12, Tier::Remote)]
        .into_iter()
        .chain(keys[2..].iter().map(|k| (*k, Tier::Host)))
        .collect();
    assert_eq!(resident, want);

    // Onboard into fresh slots: 11 and 12 come back from Redis, the rest from host memory.
    onboard_two_remote_four_host(&mut c, &keys, 2).await;
    // A chain that starts with an unknown block onboards nothing.
    let unknown = vec![Slot { key: 99, offset: 0 }];
    assert_eq!(c.onboard(unknown).await.unwrap(), Onboarded::default());

    // A snapshot naming the model matches the stream.
    let req = SnapshotRequest {
        model: Some("qwen3".into()),
        ..SnapshotRequest::new(0)
    };
    let reply = nats
        .request(
            "kvgate.snapshot.ns.node-a",
            Bytes::from(req.encode().unwrap()),
        )
        .await
        .unwrap();
    let chunk = SnapshotChunk::decode(&reply.payload, 1 << 20).unwrap();
    assert!(chunk.last);
    assert_eq!(chunk.epoch, first.epoch);
    let snap: HashSet<(u64, Tier)> = chunk
        .tiers
        .iter()
        .flat_map(|t| t.keys.iter().map(move |k| (k.0, t.tier)))
        .collect();
    // Promoting 11 and 12 evicted 13 and 14 from host memory, which were demoted in turn.
    let after: HashSet<(u64, Tier)> = [11, 12, 15, 16]
        .iter()
        .map(|k| (*k, Tier::Host))
        .chain([11, 12, 13, 14].iter().map(|k| (*k, Tier::Remote)))
        .collect();
    assert_eq!(snap, after);
    let unknown_model = SnapshotRequest {
        model: Some("other".into()),
        ..SnapshotRequest::new(0)
    };
    let none = tokio::time::timeout(
        Duration::from_millis(500),
        nats.request(
            "kvgate.snapshot.ns.node-a",
            Bytes::from(unknown_model.encode().unwrap()),
        ),
    )
    .await;
    assert!(
        !matches!(none, Ok(Ok(_))),
        "a model the node does not serve gets no snapshot"
    );

    // Metrics saw it all.
    let text = metrics(s.metrics_port).await;
    assert_eq!(metric(&text, "kvgate_kvbm_tier_blocks{tier=\"host\"}"), 4.0);
    assert!(metric(&text, "kvgate_kvbm_demoted_blocks_total") >= 2.0);
    assert_eq!(
        metric(&text, "kvgate_kvbm_onboarded_blocks_total{tier=\"remote\"}"),
        2.0
    );
    assert_eq!(
        metric(&text, "kvgate_kvbm_tier_capacity_bytes{tier=\"disk\"}"),
        0.0
    );
    assert_eq!(
        metric(&text, "kvgate_kvbm_requests_total{op=\"offload\"}"),
        2.0
    );
    assert_eq!(metric(&text, "kvgate_kvbm_nats_connected"), 1.0);
    assert!(metric(&text, "kvgate_kvbm_snapshot_errors_total") >= 1.0);

    // SIGTERM: the node's tiers are cleared on the wire, and the socket is removed.
    let kvbm = s.kvbm.take().unwrap();
    let pid = kvbm.0.id();
    Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let e = next_envelope(&mut events, deadline, "the final Cleared").await;
        // (seq 0 is the start-of-life Cleared.)
        if e.seq > 0 && e.events.contains(&KvEvent::Cleared { tier: None }) {
            break;
        }
    }
    let mut kvbm = kvbm;
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(status) = kvbm.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "kvgate-kvbm did not exit on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "exit status {status}");
    assert!(!s.socket.exists(), "socket removed on shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_violations_are_refused_and_the_daemon_keeps_serving() {
    let s = stack(4 * BLOCK);
    let mut c = Client::connect(&s.socket, layout(), 4 * BLOCK)
        .await
        .unwrap();
    // A slot past the declared segment.
    let err = c
        .offload(
            None,
            vec![Slot {
                key: 1,
                offset: 4 * BLOCK,
            }],
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Refused {
                code: ErrorCode::Slot,
                ..
            }
        ),
        "{err}"
    );
    // The connection still works after a refused request.
    stage(&c, &[1]);
    assert_eq!(
        c.offload(None, vec![Slot { key: 1, offset: 0 }])
            .await
            .unwrap(),
        (1, 0, 0)
    );
    // A layout whose blocks fit no tier (4 blocks of host memory, 64 of Redis) is refused at
    // registration.
    let mut huge = layout();
    huge.block_bytes = 128 * BLOCK;
    let err = Client::connect(&s.socket, huge, 128 * BLOCK)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Refused {
                code: ErrorCode::Layout,
                ..
            }
        ),
        "{err}"
    );
    // A connection without the handshake is closed; the daemon serves the next one.
    {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut raw = tokio::net::UnixStream::connect(&s.socket).await.unwrap();
        raw.write_all(b"\x00\x00\x00\x01x").await.unwrap();
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut buf)).await;
    }
    let mut again = Client::connect(&s.socket, layout(), 4 * BLOCK)
        .await
        .unwrap();
    assert_eq!(again.lookup(vec![1]).await.unwrap(), (1, 1));
    let text = metrics(s.metrics_port).await;
    assert_eq!(
        metric(&text, "kvgate_kvbm_request_errors_total{code=\"slot\"}"),
        1.0
    );
    assert!(metric(&text, "kvgate_kvbm_connections_refused_total") >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_run_in_chunks_and_keep_the_chain() {
    // 20 blocks of 4 MiB are 80 MiB: more than one 64 MiB chunk.
    const BIG: u64 = 4 << 20;
    let s = stack(32 * BIG);
    let nats = async_nats::connect(&s.nats_url).await.unwrap();
    let mut events = nats.subscribe("kvgate.kvbm.ns.node-a").await.unwrap();
    nats.flush().await.unwrap();
    let big = Layout {
        block_bytes: BIG,
        ..layout()
    };
    let mut c = Client::connect(&s.socket, big, 20 * BIG).await.unwrap();
    let slots: Vec<Slot> = (0..20u64)
        .map(|i| {
            c.segment()
                .write(i * BIG, &vec![i as u8 + 1; BIG as usize])
                .unwrap();
            Slot {
                key: 100 + i,
                offset: i * BIG,
            }
        })
        .collect();
    assert_eq!(
        c.offload(Some(99), slots.clone()).await.unwrap(),
        (20, 0, 0)
    );
    // The Stored events chain from the given parent through every chunk.
    let mut chain = vec![99u64];
    let deadline = Instant::now() + Duration::from_secs(5);
    while chain.len() < 21 {
        let e = next_envelope(&mut events, deadline, "envelopes").await;
        for ev in e.events {
            if let KvEvent::Stored { keys, parent, .. } = ev {
                assert_eq!(parent.map(|p| p.0), chain.last().copied(), "chained");
                chain.extend(keys.iter().map(|k| k.0));
            }
        }
    }
    assert_eq!(chain, (99..120).collect::<Vec<u64>>());
    for i in 0..20 {
        c.segment().write(i * BIG, &[0u8; 16]).unwrap();
    }
    let got = c.onboard(slots.clone()).await.unwrap();
    assert_eq!((got.blocks, got.host), (20, 20));
    for slot in [&slots[0], &slots[16], &slots[19]] {
        let head = c.segment().read(slot.offset, 16).unwrap();
        assert!(
            head.iter().all(|b| u64::from(*b) == slot.key - 99),
            "block {}",
            slot.key
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_start_announces_itself_with_cleared_and_answers_snapshots_at_once() {
    let s = stack(4 * BLOCK);
    let nats = async_nats::connect(&s.nats_url).await.unwrap();
    // Before any connector: the node's (empty) snapshot is answered.
    let req = SnapshotRequest {
        model: Some("qwen3".into()),
        ..SnapshotRequest::new(0)
    };
    // (The daemon subscribes once NATS is up, just after it starts serving: retry until then.)
    let deadline = Instant::now() + Duration::from_secs(5);
    let reply = loop {
        let asked = nats
            .request(
                "kvgate.snapshot.ns.node-a",
                Bytes::from(req.encode().unwrap()),
            )
            .await;
        match asked {
            Ok(reply) => break reply,
            Err(e) => {
                assert!(Instant::now() < deadline, "no snapshot reply: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let chunk = SnapshotChunk::decode(&reply.payload, 1 << 20).unwrap();
    assert!(chunk.last && chunk.tiers.is_empty());
    assert_eq!(chunk.source.model, "qwen3");
    // The epoch's first envelope is a Cleared: published as soon as NATS is up.
    assert!(chunk.next_seq >= 1, "the start-of-life Cleared was sealed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disk_tier_keeps_demoted_blocks_and_serves_them_first() {
    let dir = test_dir();
    let disk = dir.join("disk");
    std::fs::create_dir_all(&disk).unwrap();
    // A block file an earlier version left: unindexed, so removed at start.
    let stale = disk.join("00000000000000ab-0000000000000001.blk");
    std::fs::write(&stale, b"old").unwrap();
    let disk_args: Vec<String> = vec![
        "--disk-dir".into(),
        disk.display().to_string(),
        "--disk-bytes".into(),
        (4 * BLOCK).to_string(),
    ];
    let s = stack_in(dir.clone(), 2 * BLOCK, &disk_args);
    assert!(!stale.exists(), "the previous run's block file is removed");
    let nats = async_nats::connect(&s.nats_url).await.unwrap();
    let mut events = nats.subscribe("kvgate.kvbm.ns.node-a").await.unwrap();
    nats.flush().await.unwrap();

    let mut c = Client::connect(&s.socket, layout(), 8 * BLOCK)
        .await
        .unwrap();
    // Six blocks into two host slots: 11–14 are demoted to both the disk and Redis.
    let keys = [11, 12, 13, 14, 15, 16];
    let slots = stage(&c, &keys);
    assert_eq!(c.offload(None, slots).await.unwrap(), (6, 0, 0));
    let want: HashSet<(u64, Tier)> = keys[..4]
        .iter()
        .flat_map(|k| [(*k, Tier::Disk), (*k, Tier::Remote)])
        .chain([(15, Tier::Host), (16, Tier::Host)])
        .collect();
    let mut resident = HashSet::new();
    let mut seq = None;
    let deadline = Instant::now() + Duration::from_secs(5);
    while resident != want {
        let e = next_envelope(&mut events, deadline, "the disk tier's envelopes").await;
        apply(&mut resident, &mut seq, &e);
    }
    // The blocks land in one slab file (the write queue drains in the background).
    let slab = disk.join(format!("slab-{BLOCK}.dat"));
    support::wait_for("four blocks in the slab file", || {
        std::fs::metadata(&slab).is_ok_and(|m| m.len() == 4 * BLOCK)
    });
    let entries = std::fs::read_dir(&disk).unwrap().count();
    assert_eq!(entries, 2, "the lock and the slab file");

    // Onboard 11 and 12 into zeroed slots: the disk serves them, not Redis.
    for i in 0..8 {
        c.segment()
            .write(i * BLOCK, &vec![0; BLOCK as usize])
            .unwrap();
    }
    let into: Vec<Slot> = [11, 12]
        .iter()
        .enumerate()
        .map(|(i, k)| Slot {
            key: *k,
            offset: (i as u64 + 4) * BLOCK,
        })
        .collect();
    let got = c.onboard(into.clone()).await.unwrap();
    assert_eq!(
        got,
        Onboarded {
            blocks: 2,
            host: 0,
            disk: 2,
            remote: 0,
            peer: 0,
        }
    );
    assert_intact(&c, &into);
    let text = metrics(s.metrics_port).await;
    assert_eq!(
        metric(&text, "kvgate_kvbm_onboarded_blocks_total{tier=\"disk\"}"),
        2.0
    );
    assert_eq!(
        metric(&text, "kvgate_kvbm_tier_capacity_bytes{tier=\"disk\"}"),
        (4 * BLOCK) as f64
    );
    assert_eq!(metric(&text, "kvgate_kvbm_tier_blocks{tier=\"disk\"}"), 4.0);
    assert_eq!(
        metric(&text, "kvgate_kvbm_disk_file_bytes"),
        (4 * BLOCK) as f64
    );
    // 4 KiB blocks: direct I/O wherever the file system takes it (either value is fine, but
    // the gauge is there).
    let direct = metric(&text, "kvgate_kvbm_disk_direct_io");
    assert!(direct == 0.0 || direct == 1.0);

    // A second daemon on the same directory is refused with the configuration exit code.
    let mut second = kvbm_args(
        &dir.join("second"),
        "nats://127.0.0.1:1",
        "redis://127.0.0.1:1",
        free_port(),
        BLOCK,
    );
    second.extend_from_slice(&disk_args);
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate-kvbm"))
        .args(&second)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("lock"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_bucket_keeps_demoted_blocks_and_serves_them_back() {
    let s = stack_s3(4 * BLOCK);
    let mut c = Client::connect(&s.socket, layout(), 8 * BLOCK)
        .await
        .unwrap();
    // A chain of 6 blocks into a 4-block host tier: the first two are demoted to the bucket.
    let keys = [21, 22, 23, 24, 25, 26];
    let slots = stage(&c, &keys);
    assert_eq!(c.offload(None, slots).await.unwrap(), (6, 0, 0));
    // Wait until both puts are in the bucket (not merely queued, which would serve them too).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics(s.metrics_port).await;
        if metric(&text, "kvgate_kvbm_writes_total{tier=\"remote\"}") >= 2.0 {
            assert_eq!(
                metric(&text, "kvgate_kvbm_write_queued_bytes{tier=\"remote\"}"),
                0.0
            );
            assert!(
                !text.contains("kvgate_kvbm_tier_errors_total{tier=\"remote\""),
                "{text}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "remote writes in time: {text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Onboard into fresh slots: 21 and 22 come back from S3, the rest from host memory.
    onboard_two_remote_four_host(&mut c, &keys, 3).await;
}

/// At start a `HEAD` of the bucket checks it: a bucket the store does not have, or a key it
/// refuses, is a configuration error (exit 2), before NATS is tried.
#[test]
fn a_missing_bucket_or_a_refused_key_exits_2_at_start() {
    let s3 = s3_server(free_port(), "kvgate");
    let endpoint = format!("http://127.0.0.1:{}", s3.port);
    for (url, secret, says) in [
        ("s3://no-such-bucket", s3.secret_key.as_str(), "HTTP 404"),
        ("s3://kvgate", "not-the-secret", "HTTP 403"),
    ] {
        let mut args = kvbm_args(&test_dir(), "nats://127.0.0.1:1", url, free_port(), BLOCK);
        args.extend(["--s3-endpoint".to_owned(), endpoint.clone()]);
        let out = Command::new(env!("CARGO_BIN_EXE_kvgate-kvbm"))
            .args(&args)
            .env("AWS_ACCESS_KEY_ID", &s3.access_key)
            .env("AWS_SECRET_ACCESS_KEY", secret)
            .env_remove("AWS_SESSION_TOKEN")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {stderr}");
        assert!(stderr.contains(says), "{url}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_blocks_stay_until_released_or_expired() {
    let s = stack(4 * BLOCK);
    let mut c = Client::connect(&s.socket, layout(), 8 * BLOCK)
        .await
        .unwrap();
    let offload =
        |keys: &[u64]| -> Vec<Slot> { keys.iter().map(|k| Slot { key: *k, offset: 0 }).collect() };
    c.segment().write(0, &block(1)).unwrap();
    assert_eq!(
        c.offload(None, offload(&[1, 2, 3, 4])).await.unwrap(),
        (4, 0, 0)
    );
    // Pin 1 and 2 (and ask about 9, which is not held: the pin stops there).
    assert_eq!(
        c.lookup_and_pin(vec![1, 2, 9], 60_000).await.unwrap(),
        (2, 2, 2)
    );
    // Four more blocks into the 4-block host tier: 3 and 4 go, then 5 and 6; 1 and 2 stay.
    assert_eq!(
        c.offload(None, offload(&[5, 6, 7, 8])).await.unwrap(),
        (4, 0, 0)
    );
    assert_eq!(c.lookup(vec![1, 2]).await.unwrap(), (2, 2));
    assert_eq!(
        c.lookup(vec![3]).await.unwrap(),
        (0, 1),
        "3 was demoted to Redis"
    );
    // Released, they age out like any block.
    assert_eq!(c.unpin(vec![1, 2, 3]).await.unwrap(), 2);
    assert_eq!(
        c.offload(None, offload(&[10, 11, 12, 13])).await.unwrap(),
        (4, 0, 0)
    );
    assert_eq!(c.lookup(vec![1]).await.unwrap(), (0, 1));
    // A host tier full of pinned blocks sends new ones straight to Redis until the pins
    // expire.
    assert_eq!(
        c.lookup_and_pin(vec![10, 11, 12, 13], 300).await.unwrap(),
        (4, 4, 4)
    );
    assert_eq!(c.offload(None, offload(&[20])).await.unwrap(), (1, 0, 0));
    assert_eq!(
        c.lookup(vec![20]).await.unwrap(),
        (0, 1),
        "20 went to Redis"
    );
    let text = metrics(s.metrics_port).await;
    assert_eq!(metric(&text, "kvgate_kvbm_pinned_blocks"), 4.0);
    assert_eq!(
        metric(&text, "kvgate_kvbm_offload_skipped_blocks_total"),
        0.0
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(c.offload(None, offload(&[21])).await.unwrap(), (1, 0, 0));
    assert_eq!(
        c.lookup(vec![21]).await.unwrap(),
        (1, 1),
        "21 in host memory"
    );
    let text = metrics(s.metrics_port).await;
    assert_eq!(metric(&text, "kvgate_kvbm_pinned_blocks"), 0.0);
    assert_eq!(metric(&text, "kvgate_kvbm_pins_expired_total"), 4.0);

    // A connection releases only its own pins, and its pins go when it closes.
    assert_eq!(c.lookup_and_pin(vec![21], 60_000).await.unwrap(), (1, 1, 1));
    let mut other = Client::connect(&s.socket, layout(), BLOCK).await.unwrap();
    assert_eq!(other.unpin(vec![21]).await.unwrap(), 0, "not its pin");
    assert_eq!(
        metric(&metrics(s.metrics_port).await, "kvgate_kvbm_pinned_blocks"),
        1.0
    );
    drop(c);
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(&metrics(s.metrics_port).await, "kvgate_kvbm_pinned_blocks") != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the closed connection's pin released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(other.lookup(vec![21]).await.unwrap(), (1, 1));
}

/// Tenancy: a connector sees only the blocks of its own layout. Another dtype of the same
/// model (another KV format) finds nothing under the same keys, and onboards nothing into its
/// segment; a layout of another model is refused at registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connector_sees_only_the_blocks_of_its_own_layout() {
    let s = stack(8 * BLOCK);
    let mut bf16 = Client::connect(&s.socket, layout(), 8 * BLOCK)
        .await
        .unwrap();
    let slots = stage(&bf16, &[1, 2, 3]);
    assert_eq!(bf16.offload(None, slots.clone()).await.unwrap(), (3, 0, 0));
    let fp8 = Layout {
        dtype: "fp8".into(),
        ..layout()
    };
    let mut other = Client::connect(&s.socket, fp8, 8 * BLOCK).await.unwrap();
    assert_ne!(other.layout_id(), bf16.layout_id());
    assert_eq!(other.lookup(vec![1, 2, 3]).await.unwrap(), (0, 0));
    for i in 0..3 {
        other
            .segment()
            .write(i * BLOCK, &vec![0xee; BLOCK as usize])
            .unwrap();
    }
    assert_eq!(other.onboard(slots.clone()).await.unwrap().blocks, 0);
    assert_eq!(
        &other.segment().read(0, BLOCK).unwrap()[..],
        &vec![0xee; BLOCK as usize][..],
        "nothing of the other layout was written into its segment"
    );
    // The owner still gets its blocks back.
    assert_eq!(bf16.onboard(slots.clone()).await.unwrap().blocks, 3);
    assert_intact(&bf16, &slots);
    let foreign = Layout {
        model: "another-model".into(),
        ..layout()
    };
    assert!(matches!(
        Client::connect(&s.socket, foreign, 8 * BLOCK).await,
        Err(ClientError::Refused { .. })
    ));
}

/// With `--connector-offload-bytes-per-s`, a connector that floods stores one second's worth
/// of blocks at once and the rest is `skipped`; another connection has a budget of its own, so
/// the flood neither starves it nor evicts what it stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_connector_is_held_to_its_offload_budget() {
    let budget = [
        "--connector-offload-bytes-per-s".to_owned(),
        (4 * BLOCK).to_string(),
    ];
    let s = stack_in(test_dir(), 8 * BLOCK, &budget);
    let mut calm = Client::connect(&s.socket, layout(), 8 * BLOCK)
        .await
        .unwrap();
    let mine = stage(&calm, &[1, 2]);
    assert_eq!(calm.offload(None, mine.clone()).await.unwrap(), (2, 0, 0));

    let mut flood = Client::connect(&s.socket, layout(), 16 * BLOCK)
        .await
        .unwrap();
    let keys: Vec<u64> = (100..116).collect();
    let slots = stage(&flood, &keys);
    // Four blocks' worth of budget: the chain's first four are stored, twelve skipped.
    assert_eq!(
        flood.offload(None, slots.clone()).await.unwrap(),
        (4, 0, 12)
    );
    assert_eq!(flood.lookup(keys.clone()).await.unwrap(), (4, 4));
    // At once again: nothing left of the budget.
    let rest: Vec<Slot> = slots.get(4..).unwrap().to_vec();
    assert_eq!(
        flood.offload(Some(103), rest.clone()).await.unwrap(),
        (0, 0, 12)
    );
    // The host tier (8 blocks) still holds the calm connector's blocks.
    assert_eq!(calm.lookup(vec![1, 2]).await.unwrap(), (2, 2));
    assert_eq!(calm.onboard(mine.clone()).await.unwrap().blocks, 2);
    assert_intact(&calm, &mine);
    // Six tenths of a second refill two blocks' worth (three if this machine stalls).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (stored, present, skipped) = flood.offload(Some(103), rest).await.unwrap();
    assert!((2..=3).contains(&stored), "{stored} stored");
    assert_eq!((present, stored + skipped), (0, 12));
    let text = metrics(s.metrics_port).await;
    assert_eq!(
        metric(&text, "kvgate_kvbm_offload_throttled_blocks_total"),
        f64::from(24 + skipped)
    );
}
