#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]
//! A real Envoy 1.40 (from the bootstrap venv) in front of two local HTTP upstreams, with the EPP
//! server and a fake router deciding. Both request body modes; the config shape is the GIE
//! standalone one (`reference/feasibility.md` §1): ORIGINAL_DST on `x-gateway-destination-endpoint`.
//! Fails, not skips, when the Envoy binary is missing (`scripts/bootstrap.sh` installs it).

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use kvgate_epp::extproc::{Decision, Rejection, ResponseEvent, Router, StreamConfig};
use kvgate_epp::server::{self, Readiness, ServerConfig, TlsMode};
use support::{FakeRouter, Seen};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{TcpListener, TcpStream};

const LONG: Duration = Duration::from_secs(20);

fn envoy_binary() -> PathBuf {
    if let Ok(p) = std::env::var("KVGATE_ENVOY") {
        return PathBuf::from(p);
    }
    // Cargo sets the variable for the test run too; the compile-time value is the fallback.
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    let lib = manifest_dir.join("../.venv/lib");
    let found = std::fs::read_dir(&lib).ok().and_then(|entries| {
        entries
            .filter_map(Result::ok)
            .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "Envoy binary not found under {} (run scripts/bootstrap.sh, or set KVGATE_ENVOY)",
            lib.display()
        )
    })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A parsed HTTP/1.1 message.
#[derive(Debug)]
struct Message {
    start: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Message {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn status(&self) -> u16 {
        self.start.split(' ').nth(1).unwrap().parse().unwrap()
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Reads one message: head, then a body by content-length, chunked coding, or (responses) EOF.
async fn read_message<R: tokio::io::AsyncRead + Unpin>(
    r: &mut BufReader<R>,
    is_request: bool,
) -> Message {
    let mut start = String::new();
    r.read_line(&mut start).await.unwrap();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        r.read_line(&mut line).await.unwrap();
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (n, v) = line.split_once(':').unwrap();
        headers.push((n.trim().to_ascii_lowercase(), v.trim().to_owned()));
    }
    let mut msg = Message {
        start: start.trim_end().to_owned(),
        headers,
        body: Vec::new(),
    };
    if msg
        .header("transfer-encoding")
        .is_some_and(|t| t.contains("chunked"))
    {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).await.unwrap();
            let size = usize::from_str_radix(size.trim().split(';').next().unwrap(), 16).unwrap();
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk).await.unwrap();
            if size == 0 {
                break;
            }
            msg.body.extend_from_slice(&chunk[..size]);
        }
    } else if let Some(len) = msg.header("content-length") {
        let mut body = vec![0; len.parse().unwrap()];
        r.read_exact(&mut body).await.unwrap();
        msg.body = body;
    } else if !is_request {
        r.read_to_end(&mut msg.body).await.unwrap();
    }
    msg
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

const SSE: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":21,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n\
data: [DONE]\n\n";

/// An upstream that answers JSON describing what it received (or SSE on `/sse`).
async fn upstream(name: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (conn, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let (rd, mut wr) = conn.into_split();
                let mut rd = BufReader::new(rd);
                let req = read_message(&mut rd, true).await;
                let path = req.start.split(' ').nth(1).unwrap_or("").to_owned();
                let (content_type, body) = if path == "/sse" {
                    ("text/event-stream", SSE.as_bytes().to_vec())
                } else {
                    let echo = serde_json::json!({
                        "upstream": name,
                        "method": req.start.split(' ').next(),
                        "path": path,
                        "body_len": req.body.len(),
                        "body_fnv": fnv(&req.body).to_string(),
                        "body": String::from_utf8_lossy(&req.body[..req.body.len().min(200)]),
                        "destination": req.header("x-gateway-destination-endpoint"),
                        "content_length": req.header("content-length"),
                        "chunked": req.header("transfer-encoding").is_some(),
                        "request_id": req.header("x-request-id"),
                        "kvgate_header": req.header("x-kvgate-debug"),
                        "added": req.header("x-prefiller-host-port"),
                        "usage": {"prompt_tokens": 5, "completion_tokens": 1},
                    });
                    ("application/json", echo.to_string().into_bytes())
                };
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                wr.write_all(head.as_bytes()).await.unwrap();
                wr.write_all(&body).await.unwrap();
                wr.shutdown().await.unwrap();
            });
        }
    });
    addr
}

/// One request through Envoy, `connection: close`.
async fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Message {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n");
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    if method != "GET" {
        head.push_str(&format!(
            "content-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body).await.unwrap();
    let mut rd = BufReader::new(conn);
    tokio::time::timeout(LONG, read_message(&mut rd, false))
        .await
        .unwrap()
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Duplex,
    Buffered,
}

struct Envoy {
    child: tokio::process::Child,
    port: u16,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How the upstream cluster follows the pick.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Lb {
    /// GIE's standalone wiring: ORIGINAL_DST on the header (one endpoint only).
    OriginalDst,
    /// Envoy's override_host policy on the `envoy.lb` metadata (the fallback list, with retries),
    /// reporting the served endpoint back in `envoy.lb`.
    OverrideHost { upstreams: [SocketAddr; 3] },
}

fn cluster_yaml(lb: Lb) -> String {
    match lb {
        Lb::OriginalDst => r#"
  - name: pool
    type: ORIGINAL_DST
    connect_timeout: 5s
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint"#
            .to_owned(),
        Lb::OverrideHost { upstreams } => {
            let endpoints: String = upstreams
                .iter()
                .map(|a| {
                    format!(
                        "\n        - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}",
                        a.ip(),
                        a.port()
                    )
                })
                .collect();
            format!(
                r#"
  - name: pool
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:{endpoints}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {{ key: envoy.lb, path: [ {{ key: x-gateway-destination-endpoint }} ] }}
            selected_host_key: {{ key: envoy.lb, path: [ {{ key: x-gateway-destination-endpoint-served }} ] }}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"#
            )
        }
    }
}

fn envoy_yaml(mode: Mode, lb: Lb, port: u16, admin: u16, ext_proc: u16, tls: bool) -> String {
    let cluster = cluster_yaml(lb);
    let (req_mode, resp_mode, resp_trailers) = match mode {
        Mode::Duplex => ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "SEND"),
        Mode::Buffered => ("BUFFERED", "NONE", "SKIP"),
    };
    let transport = if tls {
        r#"
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: localhost
        common_tls_context: { alpn_protocols: ["h2"] }"#
    } else {
        ""
    };
    format!(
        r#"admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }} }}
static_resources:
  listeners:
  - name: llm
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: llm
          route_config:
            name: llm
            virtual_hosts:
            - name: default
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route:
                  cluster: pool
                  timeout: 60s
                  retry_policy: {{ retry_on: "connect-failure,reset", num_retries: 2 }}
          http_filters:
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-test-subset
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
                remove: true
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{ cluster_name: ext_proc, authority: "localhost" }}
                timeout: 10s
              failure_mode_allow: false
              metadata_options:
                forwarding_namespaces: {{ untyped: ["envoy.lb.subset_hint", "envoy.lb"] }}
                receiving_namespaces: {{ untyped: ["envoy.lb"] }}
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: {req_mode}
                response_body_mode: {resp_mode}
                request_trailer_mode: SEND
                response_trailer_mode: {resp_trailers}
              message_timeout: 10s
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
              suppress_envoy_headers: true
  clusters:{cluster}
  - name: ext_proc
    type: STATIC
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}{transport}
    load_assignment:
      cluster_name: ext_proc
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {ext_proc} }} }} }}
"#
    )
}

async fn start_envoy(mode: Mode, lb: Lb, ext_proc: u16, tls: bool) -> Envoy {
    let binary = envoy_binary();
    let dir = std::env::temp_dir().join(format!(
        "kvgate-envoy-{}-{mode:?}-{ext_proc}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (port, admin) = (free_port(), free_port());
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, envoy_yaml(mode, lb, port, admin, ext_proc, tls)).unwrap();
    let child = tokio::process::Command::new(binary)
        .args([
            "-c",
            config.to_str().unwrap(),
            "--disable-hot-restart",
            "--concurrency",
            "1",
            "-l",
            "warning",
        ])
        .arg("--log-path")
        .arg(dir.join("envoy.log"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        if let Ok(mut c) = TcpStream::connect(("127.0.0.1", admin)).await {
            c.write_all(b"GET /ready HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut out = String::new();
            let _ = c.read_to_string(&mut out).await;
            if out.starts_with("HTTP/1.1 200") {
                break;
            }
        }
        let log = std::fs::read_to_string(dir.join("envoy.log")).unwrap_or_default();
        assert!(
            tokio::time::Instant::now() < deadline,
            "Envoy not ready:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Envoy {
        child,
        port,
        _dir: TempDir(dir),
    }
}

/// Picks B when the body says `"user":"b"`, a dead endpoint then B for `"user":"fallback"`, the
/// first subset entry when there is one, A otherwise;
/// rejects bodies that are not JSON; rewrites `"model":"alias"`.
fn smoke_router(a: SocketAddr, b: SocketAddr, dead: SocketAddr) -> Arc<FakeRouter> {
    FakeRouter::new(move |seen: &Seen| {
        let body = seen.body.as_deref();
        let parsed = match body {
            Some(bytes) => Some(
                serde_json::from_slice::<serde_json::Value>(bytes)
                    .map_err(|e| Rejection::BadRequest(format!("invalid JSON body: {e}")))?,
            ),
            None => None,
        };
        let user = parsed
            .as_ref()
            .and_then(|v| v["user"].as_str())
            .unwrap_or("");
        let target = match (&seen.subset, user) {
            (Some(subset), _) => subset.first().cloned().unwrap_or_default(),
            (None, "b") => b.to_string(),
            (None, "fallback") => format!("{dead},{b}"),
            (None, _) => a.to_string(),
        };
        let mut new_body = None;
        if let Some(mut v) = parsed.filter(|v| v["model"] == "alias") {
            v["model"] = serde_json::Value::from("the-real-model-name");
            new_body = Some(v.to_string().into_bytes());
        }
        Ok(Decision {
            endpoints: target.split(',').map(str::to_owned).collect(),
            body: new_body,
            add_headers: vec![("x-prefiller-host-port".into(), "10.9.9.9:8000".into())],
            ticket: 0,
            response_model: None,
        })
    })
}

struct Stack {
    router: Arc<FakeRouter>,
    envoy: Envoy,
    a: SocketAddr,
    b: SocketAddr,
    dead: SocketAddr,
}

async fn stack(mode: Mode, tls: bool, override_host: bool) -> Stack {
    let (a, b) = (upstream("A").await, upstream("B").await);
    let dead: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let lb = if override_host {
        Lb::OverrideHost {
            upstreams: [a, b, dead],
        }
    } else {
        Lb::OriginalDst
    };
    let router = smoke_router(a, b, dead);
    let bound = server::bind(ServerConfig {
        ext_proc_addr: "127.0.0.1:0".parse().unwrap(),
        health_addr: "127.0.0.1:0".parse().unwrap(),
        observer_addr: None,
        tls: if tls {
            TlsMode::SelfSigned {
                names: vec!["localhost".into()],
            }
        } else {
            TlsMode::Plaintext
        },
        stream: StreamConfig::default(),
        drain_timeout: Duration::from_secs(1),
        http2_adaptive_window: false,
    })
    .await
    .unwrap();
    let ext_proc = bound.ext_proc_addr().unwrap().port();
    let r: Arc<dyn Router> = router.clone();
    tokio::spawn(bound.serve(r, Readiness::new(), std::future::pending()));
    let envoy = start_envoy(mode, lb, ext_proc, tls).await;
    Stack {
        router,
        envoy,
        a,
        b,
        dead,
    }
}

async fn exercise(mode: Mode, tls: bool) {
    let Stack {
        router,
        mut envoy,
        a,
        b,
        ..
    } = stack(mode, tls, false).await;
    let port = envoy.port;

    // The pick decides the upstream.
    let to_a = request(
        port,
        "POST",
        "/v1/completions",
        &[],
        br#"{"model":"m","prompt":"x","user":"a"}"#,
    )
    .await;
    assert_eq!(to_a.status(), 200, "{to_a:?}");
    let echo = to_a.json();
    assert_eq!(echo["upstream"], "A");
    assert_eq!(echo["destination"], a.to_string());
    assert_eq!(echo["added"], "10.9.9.9:8000");
    assert!(
        echo["request_id"].as_str().is_some_and(|id| id.len() == 36),
        "{echo}"
    );
    let to_b = request(
        port,
        "POST",
        "/v1/completions",
        &[("x-kvgate-debug", "1")],
        br#"{"model":"m","prompt":"x","user":"b"}"#,
    )
    .await;
    let echo = to_b.json();
    assert_eq!(echo["upstream"], "B");
    assert_eq!(
        echo["kvgate_header"],
        serde_json::Value::Null,
        "client x-kvgate-* headers are stripped"
    );

    // A 300 KB body arrives intact.
    let big =
        serde_json::json!({"model": "m", "user": "b", "prompt": "p".repeat(300_000)}).to_string();
    let resp = request(port, "POST", "/v1/completions", &[], big.as_bytes()).await;
    let echo = resp.json();
    assert_eq!(echo["upstream"], "B");
    assert_eq!(echo["body_len"], big.len());
    assert_eq!(echo["body_fnv"], fnv(big.as_bytes()).to_string());
    if let Some(cl) = echo["content_length"].as_str() {
        assert_eq!(cl, big.len().to_string(), "content-length matches the body");
    }

    // A rewritten body reaches the upstream with a consistent length.
    let resp = request(
        port,
        "POST",
        "/v1/completions",
        &[],
        br#"{"model":"alias","user":"a"}"#,
    )
    .await;
    let echo = resp.json();
    let forwarded = echo["body"].as_str().unwrap().to_owned();
    assert!(forwarded.contains("the-real-model-name"), "{echo}");
    assert_eq!(echo["body_len"], forwarded.len());
    if let Some(cl) = echo["content_length"].as_str() {
        assert_eq!(cl, forwarded.len().to_string());
    }

    // GET without a body.
    let get = request(port, "GET", "/v1/models", &[], b"").await;
    assert_eq!(get.status(), 200);
    assert_eq!(get.json()["upstream"], "A");

    // The subset hint (a header turned into metadata by Envoy) is obeyed.
    let subset = b.to_string();
    let resp = request(
        port,
        "POST",
        "/v1/completions",
        &[("x-test-subset", &subset)],
        br#"{"user":"a"}"#,
    )
    .await;
    assert_eq!(resp.json()["upstream"], "B");

    // Rejections come back as the router said.
    let bad = request(port, "POST", "/v1/completions", &[], b"{not json").await;
    assert_eq!(bad.status(), 400);
    assert_eq!(bad.header("x-kvgate-drop-reason"), Some("bad-request"));
    assert!(
        bad.json()["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("invalid JSON body")
    );

    // A client cannot pick the endpoint itself.
    let forged = request(
        port,
        "POST",
        "/v1/completions",
        &[("x-gateway-destination-endpoint", &subset)],
        br#"{"user":"a"}"#,
    )
    .await;
    assert_eq!(forged.json()["upstream"], "A");

    // Response phase: every routed ticket ends exactly once.
    let sse = request(port, "POST", "/sse", &[], br#"{"stream":true,"user":"a"}"#).await;
    assert_eq!(sse.status(), 200);
    assert_eq!(String::from_utf8_lossy(&sse.body), SSE);
    let tickets = router.tickets_issued();
    let mut by_ticket: HashMap<u64, Vec<ResponseEvent>> = HashMap::new();
    for t in 1..=tickets {
        by_ticket.insert(t, router.until_terminal(t).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for (t, events) in &by_ticket {
        let all: Vec<_> = router
            .events()
            .into_iter()
            .filter(|(id, _)| id == t)
            .map(|(_, e)| e)
            .collect();
        assert_eq!(
            all.iter().filter(|e| e.is_terminal()).count(),
            1,
            "ticket {t}: {all:?}"
        );
        assert_eq!(all.last(), Some(&ResponseEvent::End), "ticket {t}: {all:?}");
        assert!(
            matches!(events[0], ResponseEvent::Headers { status: 200, .. }),
            "ticket {t}: {events:?}"
        );
    }
    if mode == Mode::Duplex {
        let last = &by_ticket[&tickets];
        assert!(last.contains(&ResponseEvent::FirstByte), "{last:?}");
        assert!(
            last.contains(&ResponseEvent::Usage {
                prompt_tokens: 21,
                completion_tokens: 2,
                cached_tokens: Some(16)
            }),
            "{last:?}"
        );
    }
    envoy.child.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_full_duplex_streamed_over_tls() {
    exercise(Mode::Duplex, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_buffered_plaintext() {
    exercise(Mode::Buffered, false).await;
}

/// With ORIGINAL_DST only a single endpoint can be followed: a list in the header is no address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_original_dst_cannot_follow_a_fallback_list() {
    let Stack {
        router, mut envoy, ..
    } = stack(Mode::Duplex, false, false).await;
    let resp = request(
        envoy.port,
        "POST",
        "/v1/completions",
        &[],
        br#"{"user":"fallback"}"#,
    )
    .await;
    assert_eq!(resp.status(), 503);
    assert!(matches!(
        router.until_terminal(1).await[0],
        ResponseEvent::Headers { status: 503, .. }
    ));
    envoy.child.kill().await.unwrap();
}

/// Envoy's override_host policy follows the `envoy.lb` metadata list in order (retrying past a
/// dead endpoint) and reports the endpoint that served in `envoy.lb` /
/// `x-gateway-destination-endpoint-served`, which the EPP reads on the response path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_override_host_follows_the_list_and_reports_served() {
    let Stack {
        router,
        mut envoy,
        a,
        b,
        dead,
    } = stack(Mode::Duplex, false, true).await;
    let resp = request(
        envoy.port,
        "POST",
        "/v1/completions",
        &[],
        br#"{"user":"fallback"}"#,
    )
    .await;
    assert_eq!(resp.status(), 200, "{resp:?}");
    let echo = resp.json();
    assert_eq!(echo["upstream"], "B");
    // The header names the primary alone; Envoy found the fallback in the envoy.lb metadata.
    assert_eq!(echo["destination"], dead.to_string());
    assert_eq!(
        router.until_terminal(1).await[0],
        ResponseEvent::Headers {
            status: 200,
            served: Some(b.to_string())
        }
    );
    let resp = request(
        envoy.port,
        "POST",
        "/v1/completions",
        &[],
        br#"{"user":"a"}"#,
    )
    .await;
    assert_eq!(resp.json()["upstream"], "A");
    assert_eq!(
        router.until_terminal(2).await[0],
        ResponseEvent::Headers {
            status: 200,
            served: Some(a.to_string())
        }
    );
    envoy.child.kill().await.unwrap();
}
