//! The routing path of the real-vLLM tier: the `kvgate-epp` binary (file discovery, NATS, the
//! real tokenizer) and a real Envoy 1.40 (the bootstrap venv's) in front of the endpoints, each a
//! sidecar's proxy port. Both are killed on drop; their logs go to a temporary directory removed with
//! them, and are shown when a start-up wait times out.
#![allow(unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::http_support::{Response, TempDir, free_ports, metric, request};

/// A routable endpoint: the pod name the sidecar publishes under and its proxy port.
pub struct Endpoint<'a> {
    pub pod: &'a str,
    pub port: u16,
}

static BUILD: Mutex<()> = Mutex::new(());

/// The `kvgate-epp` binary: `$KVGATE_EPP_BIN`, else the one beside this crate's binaries
/// (another package's, so built on first use; `scripts/test-real-engine.sh` builds it
/// beforehand).
pub fn epp_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("KVGATE_EPP_BIN") {
        return PathBuf::from(p);
    }
    let _guard = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let bin = Path::new(env!("CARGO_BIN_EXE_kvgate-sidecar")).with_file_name("kvgate-epp");
    if !bin.is_file() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "-p", "kvgate-epp", "--bin", "kvgate-epp"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build for kvgate-epp");
        assert!(status.success(), "building kvgate-epp failed");
    }
    bin
}

/// The Envoy binary: `$KVGATE_ENVOY`, else the bootstrap venv's.
pub fn envoy_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("KVGATE_ENVOY") {
        return PathBuf::from(p);
    }
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/lib");
    std::fs::read_dir(&lib)
        .ok()
        .and_then(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| {
            panic!(
                "Envoy not found under {} (run scripts/bootstrap.sh, or set KVGATE_ENVOY)",
                lib.display()
            )
        })
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Envoy → EPP → endpoints.
pub struct Gateway {
    _envoy: Proc,
    _epp: Proc,
    pub listen: u16,
    pub epp_metrics: u16,
    pub dir: TempDir,
}

impl Gateway {
    /// Starts the EPP on `endpoints` (model `tiny`, block size 32, tokenizer `tokenizer`,
    /// subjects `kvgate.*.ns.pool`) and Envoy in front; waits until both serve.
    pub fn start(nats_url: &str, tokenizer: &Path, endpoints: &[Endpoint<'_>]) -> Gateway {
        let dir = TempDir::new("real-vllm-gw");
        let mut yaml = String::from("endpoints:\n");
        for e in endpoints {
            yaml.push_str(&format!(
                "  - {{name: {}, address: 127.0.0.1, ports: [{}]}}\n",
                e.pod, e.port
            ));
        }
        let file = dir.write("endpoints.yaml", &yaml);
        let [grpc, health, metrics, listen, admin] = free_ports::<5>();
        let log = |name: &str| std::fs::File::create(dir.0.join(name)).unwrap();
        let (epp_log, envoy_log) = (log("epp.log"), log("envoy.log"));
        let epp = Command::new(epp_binary())
            .args(["--pool-name", "pool", "--pool-namespace", "ns"])
            .args(["--discovery", "file", "--endpoints-file"])
            .arg(&file)
            .args(["--plaintext", "--nats-url", nats_url])
            .args(["--grpc-port", &grpc.to_string()])
            .args(["--grpc-health-port", &health.to_string()])
            .args(["--metrics-port", &metrics.to_string()])
            .args(["--model", "tiny", "--block-size", "32", "--tokenizer-dir"])
            .arg(tokenizer)
            .env("RUST_LOG", "info")
            .stdout(epp_log.try_clone().unwrap())
            .stderr(epp_log)
            .spawn()
            .expect("spawn kvgate-epp");
        let epp = Proc(epp);
        wait(&dir, "EPP NATS connection", Duration::from_secs(20), || {
            request(metrics, "GET", "/metrics", &[], b"").is_ok()
                && metric(metrics, "kvgate_epp_nats_connected") == 1.0
        });
        let upstreams: String = endpoints
            .iter()
            .map(|e| {
                format!(
                    "        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }} }}\n",
                    e.port
                )
            })
            .collect();
        let config = include_str!("envoy.yaml.in")
            .replace("@ADMIN@", &admin.to_string())
            .replace("@LISTEN@", &listen.to_string())
            .replace("@EXTPROC@", &grpc.to_string())
            .replace("@UPSTREAMS@\n", &upstreams);
        let config = dir.write("envoy.yaml", &config);
        let envoy = Command::new(envoy_binary())
            .arg("-c")
            .arg(&config)
            // Without hot restart Envoy needs no shared-memory base id, so it runs beside others.
            .args(["--log-level", "warn", "--disable-hot-restart"])
            .stdout(envoy_log.try_clone().unwrap())
            .stderr(envoy_log)
            .spawn()
            .expect("spawn envoy");
        let envoy = Proc(envoy);
        wait(&dir, "Envoy /ready", Duration::from_secs(20), || {
            request(admin, "GET", "/ready", &[], b"").is_ok_and(|r| r.status == 200)
        });
        Gateway {
            _envoy: envoy,
            _epp: epp,
            listen,
            epp_metrics: metrics,
            dir,
        }
    }

    /// POSTs `body` to `path` through Envoy.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> Response {
        request(self.listen, "POST", path, &[], body.to_string().as_bytes()).unwrap()
    }

    /// The last `n` lines of the EPP's log.
    pub fn epp_log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(self.dir.0.join("epp.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

fn wait(dir: &TempDir, what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        if Instant::now() > deadline {
            let epp = std::fs::read_to_string(dir.0.join("epp.log")).unwrap_or_default();
            let envoy = std::fs::read_to_string(dir.0.join("envoy.log")).unwrap_or_default();
            panic!("timed out waiting for {what}\nEPP log:\n{epp}\nEnvoy log:\n{envoy}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
