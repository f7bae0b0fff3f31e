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
        Self::spawn_env(bin, args, &[])
    }

    /// Starts `bin` with `args` and the variables `env` added to its environment, its output
    /// discarded.
    pub fn spawn_env(bin: &str, args: &[String], env: &[(&str, &str)]) -> Proc {
        Proc(
            Command::new(bin)
                .args(args)
                .env("RUST_LOG", "error")
                .envs(env.iter().copied())
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

/// The daemon's `/metrics` page on `port` (its status must be 200).
pub async fn metrics(port: u16) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: kvbm\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200"),
        "{text}"
    );
    text.split_once("\r\n\r\n").unwrap().1.to_owned()
}

/// The value of the first line of `text` starting with `line_prefix`.
pub fn metric(text: &str, line_prefix: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line_prefix} in metrics"))
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

/// The workspace's `.venv` (scripts/bootstrap.sh).
fn venv_bin(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../.venv/bin")
        .join(name)
}

/// An S3 server: moto (`moto[server]` in `.venv`, installed by `scripts/bootstrap.sh`;
/// `KVGATE_MOTO_SERVER` points elsewhere) with request authentication on, its account holding
/// one IAM user allowed `s3:*` and the bucket `bucket`. Signatures are checked by moto against
/// the user's key as AWS would (botocore's SigV4), so a wrongly signed request is refused.
pub struct S3Server {
    /// The server.
    pub proc: Proc,
    /// Its port.
    pub port: u16,
    /// The user's access key id.
    pub access_key: String,
    /// Its secret.
    pub secret_key: String,
}

/// Starts an [`S3Server`] on `port` with `bucket` created.
pub fn s3_server(port: u16, bucket: &str) -> S3Server {
    let bin = std::env::var("KVGATE_MOTO_SERVER")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| venv_bin("moto_server"));
    // The first three requests (the IAM set-up below) are not authenticated; every later one is.
    let proc = Proc::spawn_env(
        &bin.display().to_string(),
        &[
            "-H".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
        ],
        &[("INITIAL_NO_AUTH_ACTION_COUNT", "3")],
    );
    wait_port(port, "moto_server");
    let python = bin.with_file_name("python");
    let script = format!(
        r#"
import json, boto3
url = "http://127.0.0.1:{port}"
kw = dict(endpoint_url=url, region_name="us-east-1")
iam = boto3.client("iam", aws_access_key_id="setup", aws_secret_access_key="setup", **kw)
iam.create_user(UserName="kvbm")
iam.put_user_policy(UserName="kvbm", PolicyName="s3", PolicyDocument=json.dumps(
    {{"Version": "2012-10-17", "Statement": [{{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}}]}}))
key = iam.create_access_key(UserName="kvbm")["AccessKey"]
s3 = boto3.client("s3", aws_access_key_id=key["AccessKeyId"],
                  aws_secret_access_key=key["SecretAccessKey"], **kw)
s3.create_bucket(Bucket="{bucket}")
print(key["AccessKeyId"], key["SecretAccessKey"])
"#
    );
    let out = Command::new(&python)
        .args(["-c", &script])
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "S3 set-up failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut words = text.split_whitespace();
    let (access_key, secret_key) = (
        words.next().unwrap().to_owned(),
        words.next().unwrap().to_owned(),
    );
    S3Server {
        proc,
        port,
        access_key,
        secret_key,
    }
}
