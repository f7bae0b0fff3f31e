//! Test support: real `kvgate-sim` engines and the real `kvgate-sidecar` binary on free ports,
//! and a small HTTP/1.1 client that records when each piece of a response arrives.

#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// `N` distinct free loopback ports.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|i| held[i].local_addr().unwrap().port())
}

static BUILD: Mutex<()> = Mutex::new(());

/// The `kvgate-sim` binary next to this test's target directory, built on first use (it lives
/// in another package, so Cargo does not build it for this one's tests).
pub fn sim_binary() -> PathBuf {
    let _guard = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test> → target/<profile>/kvgate-sim
    let dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
    let bin = dir.join("kvgate-sim");
    if !bin.is_file() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "-p", "kvgate-e2e", "--bin", "kvgate-sim"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build for kvgate-sim");
        assert!(status.success(), "building kvgate-sim failed");
    }
    assert!(bin.is_file(), "kvgate-sim not found at {}", bin.display());
    bin
}

/// Waits until `GET path` on `port` answers `want`; false if `child` exited first.
fn wait_status(child: &mut Child, port: u16, path: &str, want: u16, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        if let Ok(r) = request(port, "GET", path, &[], b"")
            && r.status == want
        {
            return true;
        }
        assert!(
            Instant::now() < deadline,
            "port {port} {path} never answered {want}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A running simulator, killed on drop.
pub struct Sim {
    pub child: Child,
    pub port: u16,
}

impl Sim {
    /// Starts a simulator (retrying on another port if it dies during start-up).
    pub fn start(name: &str, extra: &[&str]) -> Sim {
        for _ in 0..3 {
            let [port] = free_ports::<1>();
            let mut child = Command::new(sim_binary())
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--model", "m", "--pod-name", name])
                .args(extra)
                .env_remove("PYTHONHASHSEED")
                .env_remove("KVGATE_TOKENIZER_DIR")
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn kvgate-sim");
            if wait_status(&mut child, port, "/health", 200, Duration::from_secs(30)) {
                return Sim { child, port };
            }
        }
        panic!("kvgate-sim did not start");
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Sum of every sample of `name` in /metrics (0 when absent).
    pub fn metric(&self, name: &str) -> f64 {
        metric(self.port, name)
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sum of every sample of `name` (any labels) on `port`'s /metrics.
pub fn metric(port: u16, name: &str) -> f64 {
    metric_where(port, name, "")
}

/// Sum of the samples of `name` whose label set contains `labels`.
pub fn metric_where(port: u16, name: &str, labels: &str) -> f64 {
    let text = request(port, "GET", "/metrics", &[], b"").unwrap().text();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(k, _)| k.split('{').next() == Some(name) && k.contains(labels))
        .map(|(_, v)| v.parse::<f64>().unwrap())
        .sum()
}

/// A running sidecar, killed on drop unless it already exited.
pub struct Sidecar {
    pub child: Child,
    pub port: u16,
    pub health_port: u16,
}

impl Sidecar {
    /// Starts the sidecar in front of `engine` and waits for `/health` (and `/ready` if asked).
    pub fn start(engine: u16, extra: &[&str], wait_ready: bool) -> Sidecar {
        let [port, health_port] = free_ports::<2>();
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate-sidecar"))
            .args(["--engine-url", &format!("http://127.0.0.1:{engine}")])
            .args(["--proxy-port", &port.to_string()])
            .args(["--metrics-port", &health_port.to_string()])
            .args(["--model", "m", "--pool", "pool", "--pod", "decode-0"])
            .args(["--engine-health-interval-ms", "100"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvgate-sidecar");
        let (path, want) = if wait_ready {
            ("/ready", 200)
        } else {
            ("/health", 200)
        };
        assert!(
            wait_status(&mut child, health_port, path, want, Duration::from_secs(30)),
            "kvgate-sidecar exited during start-up"
        );
        Sidecar {
            child,
            port,
            health_port,
        }
    }

    pub fn metric(&self, name: &str) -> f64 {
        metric(self.health_port, name)
    }

    pub fn metric_where(&self, name: &str, labels: &str) -> f64 {
        metric_where(self.health_port, name, labels)
    }

    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &serde_json::Value) -> Response {
        request(
            self.port,
            "POST",
            path,
            headers,
            body.to_string().as_bytes(),
        )
        .unwrap()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let [n] = free_ports::<1>();
        let dir =
            std::env::temp_dir().join(format!("kvgate-sidecar-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A response and when its bytes arrived.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// (time since the request was sent, bytes) for each read after the head.
    pub reads: Vec<(Duration, Vec<u8>)>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    /// Checks a disaggregated, non-streaming chat answer: 200, a `chat.completion` with
    /// `completion_tokens` tokens whose prompt the decode engine found cached (the KV the
    /// prefill leg moved). Returns the body.
    pub fn assert_pd_chat(&self, completion_tokens: u64) -> serde_json::Value {
        assert_eq!(self.status, 200, "{}", self.text());
        let v = self.json();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["usage"]["completion_tokens"], completion_tokens);
        assert!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                > 0
        );
        v
    }
    /// The `data:` payloads of an SSE body.
    pub fn sse(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|ev| ev.trim_start().strip_prefix("data: ").map(str::to_owned))
            .collect()
    }
    /// When the first raw read containing `needle` arrived.
    pub fn arrival_of(&self, needle: &str) -> Option<Duration> {
        let mut seen = Vec::new();
        for (t, bytes) in &self.reads {
            seen.extend_from_slice(bytes);
            if String::from_utf8_lossy(&seen).contains(needle) {
                return Some(*t);
            }
        }
        None
    }
}

/// One HTTP/1.1 request on a fresh connection (`connection: close`), reading to the end.
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Response> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let sent = Instant::now();
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    read_response(&mut s, sent)
}

/// Reads a whole response from `s`, timing each read.
pub fn read_response(s: &mut TcpStream, sent: Instant) -> std::io::Result<Response> {
    let mut raw = Vec::new();
    let mut reads = Vec::new();
    let mut buf = [0u8; 16384];
    let mut head_len = None;
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        match head_len {
            Some(_) => reads.push((sent.elapsed(), buf[..n].to_vec())),
            None => {
                if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                    head_len = Some(i);
                    if raw.len() > i + 4 {
                        reads.push((sent.elapsed(), raw[i + 4..].to_vec()));
                    }
                }
            }
        }
    }
    let split = head_len.ok_or_else(|| std::io::Error::other("no header end"))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut rest = raw[split + 4..].to_vec();
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("bad status line"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    if headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
    {
        rest = dechunk(&rest);
    }
    Ok(Response {
        status,
        headers,
        body: rest,
        reads,
    })
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size =
            usize::from_str_radix(std::str::from_utf8(&raw[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[eol + 2..eol + 2 + size]);
        raw = &raw[eol + 2 + size + 2..];
    }
}

/// The header naming the prefiller of a P/D request.
pub const PREFILLER: &str = "x-prefiller-host-port";

/// A prompt of `words` distinct words (`w0 w1 …`).
pub fn prompt(words: usize) -> String {
    (0..words).map(|i| format!("w{i} ")).collect()
}

/// The text (completions `text` or chat `delta.content`) and the usage of an SSE stream that
/// ends in `[DONE]` and carries no error event.
pub fn stream_text_and_usage(sse: &[String]) -> (String, Option<serde_json::Value>) {
    use serde_json::Value;
    assert_eq!(sse.last().map(String::as_str), Some("[DONE]"), "{sse:?}");
    let mut text = String::new();
    let mut usage = None;
    for ev in &sse[..sse.len() - 1] {
        let v: Value = serde_json::from_str(ev).unwrap();
        assert!(v.get("error").is_none(), "error in the stream: {v}");
        for pointer in ["/choices/0/text", "/choices/0/delta/content"] {
            if let Some(t) = v.pointer(pointer).and_then(Value::as_str) {
                text.push_str(t);
            }
        }
        if !v["usage"].is_null() {
            usage = Some(v["usage"].clone());
        }
    }
    (text, usage)
}
