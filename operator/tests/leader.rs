//! Two `kvgate-operator` processes against kapi: one leads and acts, the other waits; killed
//! with SIGKILL, the leader is replaced within the lease time; stopped with SIGTERM, it
//! releases the lease on its way out.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use support::*;

const LEASE_S: u64 = 4;
const RENEW_S: u64 = 3;
const RETRY_S: u64 = 1;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Replica {
    port: u16,
    child: Child,
}

impl Replica {
    fn start(kubeconfig: &Path, dir: &Path, identity: &'static str) -> Replica {
        let port = free_port();
        let log = std::fs::File::create(dir.join(format!("{identity}.log"))).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kvgate-operator"))
            .args([
                "--namespace",
                NS,
                "--lease-namespace",
                NS,
                "--identity",
                identity,
            ])
            .args([
                "--listen-address",
                "127.0.0.1",
                "--metrics-port",
                &port.to_string(),
            ])
            .args(["--lease-duration-seconds", &LEASE_S.to_string()])
            .args(["--renew-deadline-seconds", &RENEW_S.to_string()])
            .args(["--retry-period-seconds", &RETRY_S.to_string()])
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Replica { port, child }
    }

    /// `kvgate_operator_leader` from its `/metrics` (None while it does not answer).
    fn leading(&self) -> Option<bool> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        use std::io::{Read as _, Write as _};
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .ok()?;
        let mut page = String::new();
        s.read_to_string(&mut page).ok()?;
        page.lines()
            .find_map(|l| l.strip_prefix("kvgate_operator_leader "))
            .map(|v| v.trim() == "1")
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn holder(client: &kube::Client) -> Option<String> {
    Api::<Lease>::namespaced(client.clone(), NS)
        .get_opt("kvgate-operator")
        .await
        .unwrap()?
        .spec?
        .holder_identity
}

async fn acted_as(client: &kube::Client, identity: &str) -> bool {
    events(client, "qwen")
        .await
        .iter()
        .any(|(_, r, _, i)| r == "TargetMissing" && i == identity)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_acts_and_the_other_takes_over_within_the_lease() {
    let (kapi, client) = cluster().await;
    let dir = kapi.dir().to_path_buf();
    let kubeconfig = kapi.kubeconfig();
    // An autoscaler whose target is missing: whoever leads says so in an Event every interval.
    let epp = FakeEpp::start(None).await;
    pool(&client, epp.port).await;
    autoscaler(&client, "qwen", load_mode_spec(1, 4)).await;

    let a = Replica::start(&kubeconfig, &dir, "op-a");
    until(Duration::from_secs(20), "op-a leading", || async {
        (holder(&client).await.as_deref() == Some("op-a") && a.leading() == Some(true))
            .then_some(())
    })
    .await;
    let mut b = Replica::start(&kubeconfig, &dir, "op-b");
    until(Duration::from_secs(20), "op-b serving", || async {
        b.leading().map(|_| ())
    })
    .await;
    until(Duration::from_secs(20), "op-a acting", || async {
        acted_as(&client, "op-a").await.then_some(())
    })
    .await;
    // Two intervals with both running: only op-a acts.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(b.leading(), Some(false));
    assert_eq!(holder(&client).await.as_deref(), Some("op-a"));
    assert!(!acted_as(&client, "op-b").await, "the follower acted");

    // SIGKILL: no release; op-b takes over once the lease expires.
    let mut a = a;
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let killed = Instant::now();
    until(
        Duration::from_secs(20),
        "op-b holding the lease",
        || async { (holder(&client).await.as_deref() == Some("op-b")).then_some(()) },
    )
    .await;
    let took = killed.elapsed();
    eprintln!("hand-over after SIGKILL: {took:?} (lease {LEASE_S} s, retry {RETRY_S} s)");
    assert!(
        took <= Duration::from_secs(LEASE_S + RETRY_S + 1),
        "hand-over took {took:?}"
    );
    until(Duration::from_secs(10), "op-b leading", || async {
        (b.leading() == Some(true)).then_some(())
    })
    .await;
    until(Duration::from_secs(20), "op-b acting", || async {
        acted_as(&client, "op-b").await.then_some(())
    })
    .await;
    let lease = Api::<Lease>::namespaced(client.clone(), NS)
        .get("kvgate-operator")
        .await
        .unwrap();
    assert_eq!(lease.spec.unwrap().lease_transitions, Some(1));

    // SIGTERM: op-b releases the lease and exits cleanly.
    let pid = b.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = b.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(holder(&client).await, None, "released on SIGTERM");
    // A new replica takes the released lease at once, not after it expires.
    let started = Instant::now();
    let _c = Replica::start(&kubeconfig, &dir, "op-c");
    until(
        Duration::from_secs(20),
        "op-c holding the lease",
        || async { (holder(&client).await.as_deref() == Some("op-c")).then_some(()) },
    )
    .await;
    eprintln!(
        "a new replica took the released lease {:?} after it started",
        started.elapsed()
    );
}
