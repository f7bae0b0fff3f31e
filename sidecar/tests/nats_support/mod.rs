//! Test support: a real `nats-server`, the engine simulator (in-process, on its own thread),
//! the sidecar binary, and a NATS receiver that collects envelopes.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser as _;
use kv_events::envelope::EnvelopeLimits;
use kv_events::snapshot::{Snapshot, SnapshotAssembler, SnapshotChunk, SnapshotRequest};
use kv_events::{BlockKey, Envelope, KvEvent, Tier};
use tokio_stream::StreamExt as _;

/// `N` distinct free TCP ports on loopback.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|i| held[i].local_addr().unwrap().port())
}

/// `../shared` (or `$KVGATE_SHARED`).
pub fn shared() -> PathBuf {
    std::env::var_os("KVGATE_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"))
}

/// Waits until `f` holds, up to `limit`.
pub fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process killed on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `nats-server` on a free port.
pub struct Nats {
    pub proc: Proc,
    pub port: u16,
}

impl Nats {
    pub fn start() -> Nats {
        let [port] = free_ports::<1>();
        Self::start_on(port)
    }

    pub fn start_on(port: u16) -> Nats {
        let bin =
            std::env::var("KVGATE_NATS_SERVER").unwrap_or_else(|_| "/usr/sbin/nats-server".into());
        let child = Command::new(bin)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server");
        wait_for("nats-server", Duration::from_secs(10), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        Nats {
            proc: Proc(child),
            port,
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

/// Ports of one simulator.
#[derive(Debug, Clone, Copy)]
pub struct Sim {
    pub http: u16,
    pub publisher: u16,
    pub replay: u16,
}

/// Starts `kvgate-sim` (model `tiny`, block size 16) on its own thread; it runs until the test
/// process exits.
pub fn start_sim(extra: &[&str]) -> Sim {
    let [http, publisher, replay] = free_ports::<3>();
    let config = format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{publisher}","replay_endpoint":"tcp://*:{replay}"}}"#
    );
    let mut argv: Vec<String> = [
        "kvgate-sim",
        "--host",
        "127.0.0.1",
        "--port",
        &http.to_string(),
        "--model",
        "tiny",
        "--block-size",
        "16",
        "--max-model-len",
        "4096",
        "--time-scale",
        "50",
        "--kv-events-config",
        &config,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    argv.extend(extra.iter().map(|s| (*s).to_owned()));
    let args = kvgate_e2e::sim::Args::parse_from(argv);
    std::thread::spawn(move || {
        let _ = kvgate_e2e::sim::run(args);
    });
    wait_for("kvgate-sim /health", Duration::from_secs(30), || {
        http_request(http, "GET", "/health", None).is_ok_and(|(s, _)| s == 200)
    });
    Sim {
        http,
        publisher,
        replay,
    }
}

impl Sim {
    /// A sample's value from the simulator's /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        let (status, page) = http_request(self.http, "GET", "/metrics", None).unwrap();
        assert_eq!(status, 200, "{page}");
        sample(&page, name)
    }

    /// Sends a completion for `tokens` (one output token) and waits for it.
    pub fn complete(&self, tokens: &[u32]) {
        let body = serde_json::json!({"model": "tiny", "prompt": tokens, "max_tokens": 1});
        let (status, text) = http_request(
            self.http,
            "POST",
            "/v1/completions",
            Some(body.to_string().as_bytes()),
        )
        .unwrap();
        assert_eq!(status, 200, "{text}");
    }
}

/// A running sidecar binary.
pub struct Sidecar {
    pub proc: Proc,
    pub metrics_port: u16,
    /// The P/D proxy's port (the address routers send to).
    pub proxy_port: u16,
}

impl Sidecar {
    /// Starts the sidecar on `publisher`/`replay` with pod `pod`.
    pub fn start(
        nats: &str,
        engine_http: u16,
        publisher: &str,
        replay: &str,
        pod: &str,
        extra: &[&str],
    ) -> Sidecar {
        let [metrics_port, proxy_port] = free_ports::<2>();
        let engine_url = format!("http://127.0.0.1:{engine_http}");
        let (proxy, metrics) = (proxy_port.to_string(), metrics_port.to_string());
        let base: [(&str, &str); 13] = [
            ("--engine", "sim"),
            ("--engine-url", &engine_url),
            ("--kv-events-endpoint", publisher),
            ("--replay-endpoint", replay),
            ("--model", "tiny"),
            ("--block-size", "16"),
            ("--namespace", "ns"),
            ("--pool", "pool"),
            ("--pod", pod),
            ("--nats-url", nats),
            ("--proxy-port", &proxy),
            ("--metrics-port", &metrics),
            ("--load-interval-ms", "50"),
        ];
        // Flags given in `extra` replace the defaults.
        let base = base
            .iter()
            .filter(|(flag, _)| !extra.contains(flag))
            .flat_map(|(flag, value)| [*flag, *value]);
        let child = Command::new(env!("CARGO_BIN_EXE_kvgate-sidecar"))
            .args(base)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvgate-sidecar");
        let sc = Sidecar {
            proc: Proc(child),
            metrics_port,
            proxy_port,
        };
        wait_for("sidecar /metrics", Duration::from_secs(20), || {
            sc.metrics_text().is_some()
        });
        sc
    }

    pub fn metrics_text(&self) -> Option<String> {
        http_request(self.metrics_port, "GET", "/metrics", None)
            .ok()
            .filter(|(s, _)| *s == 200)
            .map(|(_, t)| t)
    }

    /// A sample's value from /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        sample(&self.metrics_text().unwrap_or_default(), name)
    }
}

/// An unlabelled sample's value from a Prometheus text page; panics when it is missing.
pub fn sample(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            (k == name).then(|| v.parse().unwrap())
        })
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// A minimal HTTP/1.1 request; returns (status, body).
pub fn http_request(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = body.unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(body)?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other("no status"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// Collects the envelopes published on a subject.
pub struct Receiver {
    pub envelopes: Vec<Envelope>,
    sub: async_nats::Subscriber,
    pub client: async_nats::Client,
}

impl Receiver {
    pub async fn connect(url: &str, subject: &str) -> Receiver {
        let client = async_nats::connect(url).await.unwrap();
        let sub = client.subscribe(subject.to_owned()).await.unwrap();
        client.flush().await.unwrap();
        Receiver {
            envelopes: Vec::new(),
            sub,
            client,
        }
    }

    /// Receives until `f` holds for the envelopes so far.
    pub async fn until(&mut self, what: &str, limit: Duration, f: impl Fn(&[Envelope]) -> bool) {
        let deadline = tokio::time::Instant::now() + limit;
        while !f(&self.envelopes) {
            let msg = tokio::time::timeout_at(deadline, self.sub.next())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "timed out waiting for {what}; got {} envelopes",
                        self.envelopes.len()
                    )
                })
                .unwrap();
            self.envelopes
                .push(Envelope::decode(&msg.payload, &EnvelopeLimits::default()).unwrap());
        }
    }

    /// Every (key, tier) stored in the envelopes so far.
    pub fn stored_keys(&self) -> Vec<BlockKey> {
        stored_keys(&self.envelopes)
    }
}

pub fn stored_keys(envs: &[Envelope]) -> Vec<BlockKey> {
    envs.iter()
        .flat_map(|e| &e.events)
        .filter_map(|ev| match ev {
            KvEvent::Stored {
                keys,
                tier: Tier::Gpu,
                ..
            } => Some(keys.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// Requests a snapshot of rank 0 of `pod` and assembles it.
pub async fn snapshot(client: &async_nats::Client, pod: &str) -> Snapshot {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await.unwrap();
    let mut req = SnapshotRequest::new(0);
    req.max_keys_per_chunk = Some(3);
    client
        .publish_with_reply(
            kv_events::subject::snapshot("ns", "pool", pod),
            inbox,
            req.encode().unwrap().into(),
        )
        .await
        .unwrap();
    let mut asm = SnapshotAssembler::new(1 << 20);
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), sub.next())
            .await
            .expect("snapshot reply")
            .unwrap();
        let chunk = SnapshotChunk::decode(&msg.payload, 1 << 20).unwrap();
        if let Some(s) = asm.push(chunk).unwrap() {
            return s;
        }
    }
}
