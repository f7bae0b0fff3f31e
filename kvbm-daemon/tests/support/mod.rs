//! Test support shared by the daemon's integration tests and its bench: free ports, child
//! processes killed on drop, and real `redis-server` and `nats-server` instances (Debian's,
//! installed by `scripts/bootstrap.sh`; `KVGATE_REDIS_SERVER` and `KVGATE_NATS_SERVER` point
//! elsewhere).
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::panic)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free loopback port, never one this process handed out before (tests run in parallel
/// threads, and the system can give a just-released port to the next caller; another process
/// may still take it before it is bound).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut given = GIVEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A child process, killed when dropped.
#[derive(Debug)]
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// Starts `bin` with `args`, its output discarded.
    pub fn spawn(bin: &str, args: &[String]) -> Proc {
        Proc(
            Command::new(bin)
                .args(args)
                .env("RUST_LOG", "error")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("spawn {bin}: {e}")),
        )
    }
}

/// Waits up to 10 s until `cond` holds.
pub fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until something listens on `port`.
pub fn wait_port(port: u16, what: &str) {
    wait_for(what, || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
}

/// A `redis-server` on `port` with no persistence, optionally requiring `password`.
pub fn redis_server(port: u16, password: Option<&str>) -> Proc {
    let bin =
        std::env::var("KVGATE_REDIS_SERVER").unwrap_or_else(|_| "/usr/bin/redis-server".into());
    let mut args: Vec<String> = ["--port", &port.to_string(), "--bind", "127.0.0.1"]
        .into_iter()
        .chain(["--save", "", "--appendonly", "no"])
        .map(String::from)
        .collect();
    if let Some(p) = password {
        args.extend(["--requirepass".into(), p.into()]);
    }
    let proc = Proc::spawn(&bin, &args);
    wait_port(port, "redis-server (apt-get install redis-server)");
    proc
}

/// A `redis-server` speaking only TLS on `port`, with the PEM files `cert` and `key` (clients
/// are not asked for certificates).
pub fn redis_tls_server(port: u16, cert: &std::path::Path, key: &std::path::Path) -> Proc {
    let bin =
        std::env::var("KVGATE_REDIS_SERVER").unwrap_or_else(|_| "/usr/bin/redis-server".into());
    let args: Vec<String> = [
        "--port",
        "0",
        "--tls-port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--tls-auth-clients",
        "no",
    ]
    .into_iter()
    .map(String::from)
    .chain([
        "--tls-cert-file".into(),
        cert.display().to_string(),
        "--tls-key-file".into(),
        key.display().to_string(),
    ])
    .collect();
    let proc = Proc::spawn(&bin, &args);
    wait_port(port, "redis-server with TLS (Debian's is built with it)");
    proc
}

/// A `nats-server` on `port`.
pub fn nats_server(port: u16) -> Proc {
    let bin =
        std::env::var("KVGATE_NATS_SERVER").unwrap_or_else(|_| "/usr/sbin/nats-server".into());
    let proc = Proc::spawn(
        &bin,
        &[
            "-a".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
        ],
    );
    wait_port(port, "nats-server (apt-get install nats-server)");
    proc
}
