//! Test support: start a `kvgate-sim` process and talk HTTP/1.1 to it without a client crate.

#![allow(dead_code, unreachable_pub)]

pub mod gateway;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on loopback (racy by nature; good enough for tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `N` distinct free ports (all held until every one is chosen, so they differ).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|i| held[i].local_addr().unwrap().port())
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Qwen3 tokenizer installed by scripts/bootstrap.sh.
pub fn qwen3_dir() -> PathBuf {
    let dir = std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(".cache/tokenizers/qwen3/package/models"));
    assert!(
        dir.join("tokenizer.json").is_file(),
        "Qwen3 tokenizer missing at {} — run scripts/bootstrap.sh",
        dir.display()
    );
    dir
}

/// `../shared` (or `$KVGATE_SHARED`).
pub fn shared() -> PathBuf {
    std::env::var_os("KVGATE_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("../shared"))
}

/// A running simulator, killed on drop.
pub struct Sim {
    pub child: Child,
    pub port: u16,
}

impl Sim {
    /// Starts the simulator on a free port with extra arguments and waits for /health.
    pub fn start(extra: &[&str]) -> Sim {
        Self::start_env(extra, &[])
    }

    /// Starts the simulator, retrying on a fresh HTTP port if it exits during start-up (another
    /// process may take a "free" port between our probe and the simulator's bind).
    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Sim {
        for _ in 0..2 {
            if let Some(sim) = Self::try_start(extra, env) {
                return sim;
            }
            eprintln!("kvgate-sim exited during start-up; retrying on another port");
        }
        let mut sim =
            Self::try_start(extra, env).expect("kvgate-sim exited during start-up (3 tries)");
        sim.wait_ready(Duration::from_secs(30));
        sim
    }

    fn try_start(extra: &[&str], env: &[(&str, &str)]) -> Option<Sim> {
        let port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-sim"));
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(extra)
            .env_remove("PYTHONHASHSEED")
            .env_remove("KVGATE_TOKENIZER_DIR")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn kvgate-sim");
        let mut sim = Sim { child, port };
        sim.ready_or_exited(Duration::from_secs(30)).then_some(sim)
    }

    /// Waits for /health; false if the process exited first.
    fn ready_or_exited(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.child.try_wait().unwrap().is_some() {
                return false;
            }
            if let Ok(r) = try_request(self.port, "GET", "/health", None)
                && r.status == 200
            {
                return true;
            }
            assert!(Instant::now() < deadline, "kvgate-sim did not become ready");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn wait_ready(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("kvgate-sim exited during start-up: {status}");
            }
            if let Ok(r) = try_request(self.port, "GET", "/health", None)
                && r.status == 200
            {
                return;
            }
            assert!(Instant::now() < deadline, "kvgate-sim did not become ready");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn get(&self, path: &str) -> HttpResponse {
        try_request(self.port, "GET", path, None).unwrap()
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> HttpResponse {
        try_request(self.port, "POST", path, Some(body.to_string().as_bytes())).unwrap()
    }

    pub fn post_raw(&self, path: &str, body: &[u8]) -> HttpResponse {
        try_request(self.port, "POST", path, Some(body)).unwrap()
    }

    /// The value of an unlabelled-or-labelled sample in /metrics (first match of `name{` or `name `).
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").text();
        for line in text.lines() {
            if line.starts_with('#') {
                continue;
            }
            let (key, value) = line.rsplit_once(' ').unwrap();
            let base = key.split('{').next().unwrap();
            if base == name {
                return value.parse().unwrap();
            }
        }
        panic!("metric {name} not found in\n{text}");
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8(self.body.clone()).unwrap()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    /// The `data:` payloads of an SSE body.
    pub fn sse(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|ev| ev.strip_prefix("data: ").map(str::to_owned))
            .collect()
    }
}

pub fn try_request(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> std::io::Result<HttpResponse> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let body = body.unwrap_or(b"");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
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
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        rest = dechunk(&rest);
    }
    Ok(HttpResponse {
        status,
        headers,
        body: rest,
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

/// The sum over EPP `/metrics` pages of `kvgate_epp_response_handoffs_total{outcome}`.
pub fn handoff_outcome(pages: &[String], outcome: &str) -> f64 {
    let label = format!("outcome=\"{outcome}\"");
    pages
        .iter()
        .flat_map(|p| p.lines())
        .filter(|l| l.starts_with("kvgate_epp_response_handoffs_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}
