//! Pulls between nodes: two (or three) `kvgate-kvbm` binaries on one real `nats-server`, each
//! serving pulls on loopback, with the crate's reference connector on each node.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvgate_kvbm::client::{Client, Onboarded};
use kvgate_kvbm::protocol::{Request, Response, Slot};
use kvgate_kvbm::store::Layout;
use support::{Proc, free_port, metric, metrics, nats_server, wait_port};

const BLOCK: u64 = 8192;

struct Node {
    proc: Option<Proc>,
    socket: PathBuf,
    metrics_port: u16,
    peer_port: u16,
    dir: PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        drop(self.proc.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A daemon for `node`, pulling and serving with the secret in `secret`.
fn node(node: &str, nats_url: &str, secret: &std::path::Path) -> Node {
    node_with(node, nats_url, secret, &[])
}

/// As [`node`], with `extra` arguments.
fn node_with(node: &str, nats_url: &str, secret: &std::path::Path, extra: &[String]) -> Node {
    let dir = std::env::temp_dir().join(format!(
        "kvgate-kvbm-peers-{}-{node}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (metrics_port, peer_port) = (free_port(), free_port());
    let socket = dir.join("kvbm.sock");
    let args: Vec<String> = [
        "--node",
        node,
        "--model",
        "qwen3",
        "--block-size",
        "16",
        "--namespace",
        "ns",
        "--metrics-bind",
        "127.0.0.1",
        // Forgotten after 6 s of silence: long enough not to expire a live peer on a busy
        // test machine.
        "--peer-announce-interval-s",
        "2",
        "--peer-timeout-ms",
        "2000",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([
        "--socket".into(),
        socket.display().to_string(),
        "--metrics-port".into(),
        metrics_port.to_string(),
        "--nats-url".into(),
        nats_url.into(),
        "--host-bytes".into(),
        (256 * BLOCK).to_string(),
        "--peer-listen".into(),
        format!("127.0.0.1:{peer_port}"),
        "--peer-secret-file".into(),
        secret.display().to_string(),
    ])
    .chain(extra.iter().cloned())
    .collect();
    let proc = Proc::spawn(env!("CARGO_BIN_EXE_kvgate-kvbm"), &args);
    wait_port(metrics_port, "kvgate-kvbm");
    wait_port(peer_port, "kvgate-kvbm's peer port");
    Node {
        proc: Some(proc),
        socket,
        metrics_port,
        peer_port,
        dir,
    }
}

fn secret_file(dir: &std::path::Path, name: &str, secret: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, format!("{secret}\n")).unwrap();
    path
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
        .map(|i| (key as u8).wrapping_mul(31).wrapping_add(i as u8))
        .collect()
}

async fn connector(n: &Node) -> Client {
    Client::connect(&n.socket, layout(), 16 * BLOCK)
        .await
        .unwrap()
}

/// Offloads the chain `keys` after `parent`.
async fn offload(c: &mut Client, parent: Option<u64>, keys: &[u64]) {
    let slots: Vec<Slot> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let offset = i as u64 * BLOCK;
            c.segment().write(offset, &block(*k)).unwrap();
            Slot { key: *k, offset }
        })
        .collect();
    let (stored, _, _) = c.offload(parent, slots).await.unwrap();
    assert_eq!(stored as usize, keys.len());
}

/// (host, any, peer) of a lookup.
async fn lookup(c: &mut Client, keys: &[u64]) -> (u32, u32, u32) {
    match c
        .call(&Request::Lookup {
            keys: keys.to_vec(),
            pin_ms: 0,
        })
        .await
        .unwrap()
    {
        Response::Found {
            host, any, peer, ..
        } => (host, any, peer),
        other => panic!("{other:?}"),
    }
}

/// Polls the lookup of `keys` until it answers `want`.
async fn lookup_until(c: &mut Client, keys: &[u64], want: (u32, u32, u32), what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = lookup(c, keys).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: lookup {got:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Onboards `keys` into zeroed slots; checks the bytes of what came.
async fn onboard(c: &mut Client, keys: &[u64]) -> Onboarded {
    let slots: Vec<Slot> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let offset = i as u64 * BLOCK;
            c.segment().write(offset, &vec![0; BLOCK as usize]).unwrap();
            Slot { key: *k, offset }
        })
        .collect();
    let got = c.onboard(slots.clone()).await.unwrap();
    for slot in slots.iter().take(got.blocks as usize) {
        assert_eq!(
            &c.segment().read(slot.offset, BLOCK).unwrap()[..],
            &block(slot.key)[..],
            "block {} onboarded intact",
            slot.key
        );
    }
    got
}

/// The parent of the first `stored` event for `key` the node publishes (within 10 s).
async fn parent_of_stored(
    events: &mut async_nats::Subscriber,
    key: u64,
) -> Option<kv_events::BlockKey> {
    use tokio_stream::StreamExt as _;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let msg = tokio::time::timeout_at(deadline.into(), events.next())
            .await
            .expect("a stored event in time")
            .unwrap();
        let e = kv_events::Envelope::decode(&msg.payload, &Default::default()).unwrap();
        for event in e.events {
            if let kv_events::KvEvent::Stored { keys, parent, .. } = event
                && keys.first() == Some(&kv_events::BlockKey(key))
            {
                return parent;
            }
        }
    }
}

/// A `pull` frame sent straight away, without the `auth` the server waits for.
fn skip_the_proof() -> Vec<u8> {
    use kvgate_kvbm::peers::wire::{Frame, encode};
    let mut out = Vec::new();
    encode(
        &Frame::Pull {
            layout: layout(),
            keys: vec![1, 2],
            fabrics: Vec::new(),
        },
        &mut out,
    );
    out
}

fn onboarded(blocks: u32, host: u32, peer: u32) -> Onboarded {
    Onboarded {
        blocks,
        host,
        disk: 0,
        remote: 0,
        peer,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_another_node_holds_is_pulled_instead_of_recomputed() {
    let nats_port = free_port();
    let _nats = nats_server(nats_port);
    let nats_url = format!("nats://127.0.0.1:{nats_port}");
    let tmp = std::env::temp_dir().join(format!("kvgate-kvbm-peers-{}", free_port()));
    let secret = secret_file(&tmp, "secret", "a shared secret of the mesh");
    let (a, b) = (
        node("node-a", &nats_url, &secret),
        node("node-b", &nats_url, &secret),
    );
    let (mut ca, mut cb) = (connector(&a).await, connector(&b).await);

    offload(&mut ca, None, &[1, 2, 3, 4]).await;
    // Node b learns what node a holds (announce, snapshot or envelopes) and counts it.
    lookup_until(
        &mut cb,
        &[1, 2, 3, 4, 5],
        (0, 4, 4),
        "node a's blocks seen from b",
    )
    .await;
    // An onboard from the middle of the chain (the engine has 1 and 2 on its GPU): b keeps
    // what it pulled where it belongs in the chain, after 2.
    let nats = async_nats::connect(&nats_url).await.unwrap();
    let mut events = nats
        .subscribe(kv_events::subject::kvbm("ns", "node-b"))
        .await
        .unwrap();
    nats.flush().await.unwrap();
    assert_eq!(onboard(&mut cb, &[3, 4]).await, onboarded(2, 0, 2));
    let parent = parent_of_stored(&mut events, 3).await;
    assert_eq!(parent, Some(kv_events::BlockKey(2)), "stored after block 2");
    assert_eq!(onboard(&mut cb, &[1, 2, 3, 4, 5]).await, onboarded(4, 0, 4));
    // Now node b holds them itself.
    assert_eq!(lookup(&mut cb, &[1, 2, 3, 4]).await, (4, 4, 0));

    // A chain b holds the start of and a holds the rest of: the run continues on a.
    offload(&mut ca, Some(4), &[5, 6]).await;
    lookup_until(&mut cb, &[1, 2, 3, 4, 5, 6, 7], (4, 6, 2), "the rest on a").await;
    assert_eq!(
        onboard(&mut cb, &[1, 2, 3, 4, 5, 6, 7]).await,
        onboarded(6, 4, 2)
    );

    let (ma, mb) = (metrics(a.metrics_port).await, metrics(b.metrics_port).await);
    assert_eq!(metric(&mb, "kvgate_kvbm_peer_pulled_blocks_total "), 8.0);
    assert_eq!(
        metric(&mb, "kvgate_kvbm_peer_pulled_bytes_total "),
        (8 * BLOCK) as f64
    );
    assert_eq!(metric(&mb, "kvgate_kvbm_peer_pulls_total "), 3.0);
    assert_eq!(metric(&mb, "kvgate_kvbm_peers "), 1.0);
    assert_eq!(metric(&ma, "kvgate_kvbm_peer_served_blocks_total "), 8.0);
    assert_eq!(metric(&ma, "kvgate_kvbm_peer_auth_failures_total "), 0.0);

    // A client that skips the proof, and one that sends garbage, are cut off; pulls go on.
    for bytes in [skip_the_proof(), vec![0, 0, 0, 3, 0xc1, 0xc1, 0xc1]] {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", a.peer_port))
            .await
            .unwrap();
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        s.write_all(&bytes).await.unwrap();
        let mut rest = Vec::new();
        // Closed at once, not after a handshake deadline (1 s).
        let read = tokio::time::timeout(Duration::from_millis(800), s.read_to_end(&mut rest)).await;
        assert!(read.is_ok(), "the connection is closed at once");
        assert!(
            !String::from_utf8_lossy(&rest).contains("blocks"),
            "no blocks answered"
        );
    }
    offload(&mut ca, Some(6), &[7]).await;
    lookup_until(
        &mut cb,
        &[1, 2, 3, 4, 5, 6, 7],
        (6, 7, 1),
        "the next block on a",
    )
    .await;
    assert_eq!(
        onboard(&mut cb, &[1, 2, 3, 4, 5, 6, 7]).await,
        onboarded(7, 6, 1)
    );
    let ma = metrics(a.metrics_port).await;
    assert_eq!(metric(&ma, "kvgate_kvbm_peer_served_blocks_total "), 9.0);

    // Another layout of the model (another dtype), which no connector of a registered: b
    // neither counts a's blocks for it nor tries a pull.
    let mut other = Client::connect(
        &b.socket,
        Layout {
            dtype: "fp8".into(),
            ..layout()
        },
        4 * BLOCK,
    )
    .await
    .unwrap();
    assert_eq!(lookup(&mut other, &[5]).await, (0, 0, 0));
    assert_eq!(onboard(&mut other, &[5]).await.blocks, 0);
    let mb = metrics(b.metrics_port).await;
    assert_eq!(metric(&mb, "kvgate_kvbm_peer_pulls_total "), 4.0);
    let _ = std::fs::remove_dir_all(&tmp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_secret_pulls_nothing_and_a_dead_peer_is_forgotten() {
    let nats_port = free_port();
    let _nats = nats_server(nats_port);
    let nats_url = format!("nats://127.0.0.1:{nats_port}");
    let tmp = std::env::temp_dir().join(format!("kvgate-kvbm-peers-{}", free_port()));
    let secret = secret_file(&tmp, "secret", "a shared secret of the mesh");
    let wrong = secret_file(&tmp, "wrong", "not the secret of this mesh");
    let mut a = node("node-a", &nats_url, &secret);
    let (b, c) = (
        node("node-b", &nats_url, &secret),
        node("node-c", &nats_url, &wrong),
    );
    let mut ca = connector(&a).await;
    let (mut cb, mut cc) = (connector(&b).await, connector(&c).await);
    offload(&mut ca, None, &[1, 2]).await;

    // Node c sees a's announce and stream (NATS is not where the secret is checked) but
    // cannot pull: the engine computes the blocks, and a counts the refusal.
    lookup_until(&mut cc, &[1, 2], (0, 2, 2), "a's blocks seen from c").await;
    assert_eq!(onboard(&mut cc, &[1, 2]).await, onboarded(0, 0, 0));
    let mc = metrics(c.metrics_port).await;
    assert_eq!(
        metric(
            &mc,
            "kvgate_kvbm_peer_pull_failures_total{kind=\"protocol\"} "
        ),
        1.0
    );
    // ...and passes a over for a while rather than failing every onboard the same way.
    assert_eq!(lookup(&mut cc, &[1, 2]).await, (0, 0, 0));
    let ma = metrics(a.metrics_port).await;
    assert!(metric(&ma, "kvgate_kvbm_peer_auth_failures_total ") >= 1.0);
    assert_eq!(metric(&ma, "kvgate_kvbm_peer_served_blocks_total "), 0.0);

    // Node a dies without a word (no final Cleared): b's pull fails and the engine computes
    // the blocks; b passes a over from then on, and forgets it within three announce
    // intervals.
    lookup_until(&mut cb, &[1, 2], (0, 2, 2), "a's blocks seen from b").await;
    drop(a.proc.take());
    assert_eq!(onboard(&mut cb, &[1, 2]).await, onboarded(0, 0, 0));
    let mb = metrics(b.metrics_port).await;
    assert_eq!(
        metric(&mb, "kvgate_kvbm_peer_pull_failures_total{kind=\"io\"} "),
        1.0
    );
    // Passed over at once (not asked again on every onboard until it expires)...
    assert_eq!(lookup(&mut cb, &[1, 2]).await, (0, 0, 0));
    // ...and forgotten after three of its announce intervals.
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(
        &metrics(b.metrics_port).await,
        "kvgate_kvbm_peers_expired_total ",
    ) < 1.0
    {
        assert!(Instant::now() < deadline, "a forgotten in time");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Node c stays: it announces like any peer (the secret is checked at pulls).
    assert_eq!(
        metric(&metrics(b.metrics_port).await, "kvgate_kvbm_peers "),
        1.0
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

/// NIXL's C API, which scripts/bootstrap.sh unpacks (from the `nixl-cu12` wheel) and
/// scripts/test.sh names; the NIXL test fails without it.
fn nixl_library() -> String {
    std::env::var("KVGATE_TEST_NIXL_LIBRARY").unwrap_or_else(|_| {
        panic!("KVGATE_TEST_NIXL_LIBRARY is not set: run scripts/bootstrap.sh, then the tests through scripts/test.sh")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_travel_through_nixl_between_nodes_that_both_have_it() {
    let nats_port = free_port();
    let _nats = nats_server(nats_port);
    let nats_url = format!("nats://127.0.0.1:{nats_port}");
    let tmp = std::env::temp_dir().join(format!("kvgate-kvbm-peers-{}", free_port()));
    let secret = secret_file(&tmp, "secret", "a shared secret of the mesh");
    let nixl: Vec<String> = ["--peer-fabric", "nixl", "--nixl-library", &nixl_library()]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    let a = node_with("node-a", &nats_url, &secret, &nixl);
    let b = node_with("node-b", &nats_url, &secret, &nixl);
    // Node c pulls over TCP only.
    let c = node("node-c", &nats_url, &secret);
    let mut ca = connector(&a).await;
    // A chain for each puller, so that each can only come from a.
    offload(&mut ca, None, &[1, 2, 3, 4]).await;
    offload(&mut ca, None, &[11, 12, 13, 14]).await;
    for (n, chain, what) in [
        (&b, [1, 2, 3, 4], "b reads through NIXL"),
        (&c, [11, 12, 13, 14], "c over TCP"),
    ] {
        let mut cn = connector(n).await;
        lookup_until(&mut cn, &chain, (0, 4, 4), what).await;
        // `onboard` checks every block's bytes.
        assert_eq!(onboard(&mut cn, &chain).await, onboarded(4, 0, 4), "{what}");
    }
    let (ma, mb, mc) = (
        metrics(a.metrics_port).await,
        metrics(b.metrics_port).await,
        metrics(c.metrics_port).await,
    );
    assert_eq!(
        metric(
            &ma,
            r#"kvgate_kvbm_peer_fabric_served_total{outcome="read"}"#
        ),
        1.0
    );
    assert_eq!(
        metric(
            &ma,
            r#"kvgate_kvbm_peer_fabric_served_total{outcome="fell_back"}"#
        ),
        0.0
    );
    assert_eq!(
        metric(
            &ma,
            r#"kvgate_kvbm_peer_fabric_served_total{outcome="not_exposed"}"#
        ),
        0.0
    );
    assert_eq!(metric(&ma, "kvgate_kvbm_peer_served_blocks_total "), 8.0);
    assert_eq!(
        metric(&mb, r#"kvgate_kvbm_peer_fabric_reads_total{outcome="ok"}"#),
        1.0
    );
    assert_eq!(metric(&mb, "kvgate_kvbm_peer_pulled_blocks_total "), 4.0);
    assert_eq!(metric(&mb, "kvgate_kvbm_peer_fabric_leaked_buffers "), 0.0);
    assert_eq!(
        metric(&mc, r#"kvgate_kvbm_peer_fabric_reads_total{outcome="ok"}"#),
        0.0
    );
    assert_eq!(metric(&mc, "kvgate_kvbm_peer_pulled_blocks_total "), 4.0);
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn a_node_asked_for_nixl_without_it_does_not_start_and_says_why() {
    let tmp = std::env::temp_dir().join(format!("kvgate-kvbm-no-nixl-{}", free_port()));
    let secret = secret_file(&tmp, "secret", "a shared secret of the mesh");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-kvbm"))
        .args([
            "--node",
            "n",
            "--model",
            "m",
            "--socket",
            "/tmp/kvgate-kvbm-no-nixl.sock",
            "--peer-listen",
            "127.0.0.1:1",
            "--peer-secret-file",
            secret.to_str().unwrap(),
            "--peer-fabric",
            "nixl",
            "--nixl-library",
            "/nonexistent/libnixl_capi.so",
        ])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "a runtime failure, not a usage error"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("libnixl_capi.so could not be loaded"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}
