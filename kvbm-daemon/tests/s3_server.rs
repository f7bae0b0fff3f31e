//! The remote tier's S3 client against a real S3 server: moto (`moto[server]` in `.venv`,
//! installed by `scripts/bootstrap.sh`; `KVGATE_MOTO_SERVER` points elsewhere) with request
//! authentication on, so every request's SigV4 signature is checked by an independent
//! implementation; against a scripted HTTP responder for what moto cannot be made to do
//! (closing kept-alive connections, never answering, damaged bodies, odd error bodies); and
//! against a TLS endpoint whose certificate a private CA signed.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_events::BlockKey;
use kvgate_kvbm::remote::RemoteError;
use kvgate_kvbm::remote::s3::{Addressing, Credentials, S3, S3Config, S3Options, sha256_hex};
use support::{S3Server, free_port, s3_server};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const MIB: usize = 1 << 20;

fn client_at(port: u16, url: &str, access: &str, secret: &str, timeout: Duration) -> S3 {
    let options = S3Options {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        region: "us-east-1".into(),
        addressing: Addressing::Auto,
    };
    let credentials = Credentials {
        access_key_id: access.to_owned(),
        secret_access_key: secret.to_owned(),
        session_token: None,
    };
    S3::new(S3Config::from_url(url, &options, credentials, timeout, 4 * MIB).unwrap())
}

fn client(server: &S3Server, url: &str, secret: &str) -> S3 {
    client_at(
        server.port,
        url,
        &server.access_key,
        secret,
        Duration::from_secs(5),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_round_trip_under_checked_signatures() {
    let server = s3_server(free_port(), "kvgate");
    let s3 = client(&server, "s3://kvgate/node-a", &server.secret_key);
    s3.ping().await.unwrap();

    let name = s3.block_name(0xab, BlockKey(7));
    assert_eq!(name, "node-a/00000000000000ab/0000000000000007");
    let block: Bytes = (0..MIB).map(|i| (i % 251) as u8).collect();
    s3.put(&name, block.clone()).await.unwrap();
    assert_eq!(s3.get(&name, MIB).await.unwrap(), Some(block.clone()));
    // Overwriting is a put like any other (two nodes write identical bytes under one name).
    s3.put(&name, block.clone()).await.unwrap();
    let other = s3.block_name(0xab, BlockKey(8));
    assert_eq!(s3.get(&other, MIB).await.unwrap(), None);
    s3.delete(&name).await.unwrap();
    assert_eq!(s3.get(&name, MIB).await.unwrap(), None);
    // Deleting what is not there is fine.
    s3.delete(&other).await.unwrap();
    // An empty object, and one whose key needs encoding, round-trip too.
    s3.put("node-a/odd key:+&=", Bytes::new()).await.unwrap();
    assert_eq!(
        s3.get("node-a/odd key:+&=", MIB).await.unwrap(),
        Some(Bytes::new())
    );
    // An object larger than the block asked for is refused, not read, and the client keeps
    // working.
    s3.put("big", Bytes::from(vec![7; 4096])).await.unwrap();
    match s3.get("big", 1024).await {
        Err(e @ RemoteError::TooLarge { limit: 1024, .. }) => assert!(!e.is_transient()),
        other => panic!("{other:?}"),
    }
    assert_eq!(s3.get("absent", 1024).await.unwrap(), None);

    // Many requests in parallel.
    let s3 = Arc::new(s3);
    let tasks: Vec<_> = (0..16u64)
        .map(|i| {
            let s3 = Arc::clone(&s3);
            tokio::spawn(async move {
                let name = s3.block_name(1, BlockKey(i));
                let value = Bytes::from(vec![i as u8; 4096 + i as usize]);
                s3.put(&name, value.clone()).await.unwrap();
                assert_eq!(s3.get(&name, 8192).await.unwrap(), Some(value));
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_carry_s3_error_codes() {
    let server = s3_server(free_port(), "kvgate");
    // A wrong secret: moto recomputes the signature and refuses it, for good.
    let forged = client(&server, "s3://kvgate", "not-the-secret");
    match forged.put("k", Bytes::from_static(b"v")).await {
        Err(e @ RemoteError::Status { status: 403, .. }) => {
            assert!(e.to_string().contains("SignatureDoesNotMatch"), "{e}");
            assert!(!e.is_transient() && e.is_config_refusal());
        }
        other => panic!("{other:?}"),
    }
    let e = forged.ping().await.unwrap_err();
    assert_eq!(e.metric_label(), "status");
    // A bucket that does not exist: an error for every operation, never a missing block.
    let missing = client(&server, "s3://no-such-bucket", &server.secret_key);
    for result in [
        missing.put("k", Bytes::from_static(b"v")).await,
        missing.get("k", 16).await.map(|_| ()),
        missing.delete("k").await,
    ] {
        match result {
            Err(e @ RemoteError::Status { status: 404, .. }) => {
                assert!(e.to_string().contains("NoSuchBucket"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(missing.ping().await.unwrap_err().is_config_refusal());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_goes_away_costs_requests_not_the_client() {
    let mut server = s3_server(free_port(), "kvgate");
    let s3 = client(&server, "s3://kvgate", &server.secret_key);
    s3.put("k", Bytes::from_static(b"v")).await.unwrap();
    server.proc.0.kill().unwrap();
    server.proc.0.wait().unwrap();
    let e = s3.get("k", 16).await.unwrap_err();
    assert!(e.is_transient(), "a closed endpoint: {e}");
}

/// What the scripted responder does with each request.
#[derive(Clone, Copy, PartialEq)]
enum Script {
    /// Answers `GET` with the body `kvgate` and its SHA-256, keeping the connection.
    Serve,
    /// The same, then closes the connection without saying so.
    ServeThenDrop,
    /// Answers with a body whose stored SHA-256 is wrong.
    Damaged,
    /// Answers without the SHA-256 header.
    Unhashed,
    /// 403 with `AccessDenied` and 64 KiB of padding after it.
    LongError,
    /// 301 naming the bucket's region, as S3 does for a wrong `--s3-region`.
    WrongRegion,
    /// Reads the request and never answers.
    Silent,
}

/// Reads from `conn` until `buf` holds a whole request head; false when the connection ended
/// (or failed) first.
async fn read_head(conn: &mut (impl tokio::io::AsyncRead + Unpin), buf: &mut Vec<u8>) -> bool {
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut chunk = [0; 4096];
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    true
}

/// A scripted HTTP/1.1 responder; counts the connections it accepted.
async fn responder(script: Script) -> (u16, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // One request head (these requests have no body).
                    if !read_head(&mut conn, &mut buf).await {
                        return;
                    }
                    buf.clear();
                    let body = b"kvgate";
                    let response = match script {
                        Script::Serve | Script::ServeThenDrop => ok(body, &sha256_hex(body)),
                        Script::Damaged => ok(body, &sha256_hex(b"other")),
                        Script::Unhashed => {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nkvgate".to_vec()
                        }
                        Script::LongError => {
                            let body = format!(
                                "<Error><Code>AccessDenied</Code>{}</Error>",
                                " ".repeat(64 << 10)
                            );
                            format!(
                                "HTTP/1.1 403 Forbidden\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            )
                            .into_bytes()
                        }
                        Script::WrongRegion => b"HTTP/1.1 301 Moved Permanently\r\n\
                              x-amz-bucket-region: eu-west-1\r\ncontent-length: 0\r\n\r\n"
                            .to_vec(),
                        Script::Silent => {
                            tokio::time::sleep(Duration::from_secs(30)).await;
                            return;
                        }
                    };
                    if conn.write_all(&response).await.is_err() {
                        return;
                    }
                    if script == Script::ServeThenDrop {
                        return;
                    }
                }
            });
        }
    });
    (port, accepted)
}

fn ok(body: &[u8], sha: &str) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nx-amz-meta-kvgate-sha256: {sha}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

fn scripted(port: u16) -> S3 {
    client_at(port, "s3://kvgate", "AK", "SK", Duration::from_millis(500))
}

#[tokio::test]
async fn kept_alive_connections_are_reused_and_dropped_ones_replaced() {
    let (port, accepted) = responder(Script::Serve).await;
    let s3 = scripted(port);
    for _ in 0..5 {
        assert_eq!(
            s3.get("k", 16).await.unwrap().as_deref(),
            Some(&b"kvgate"[..])
        );
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection, reused");

    // A server that closes each connection after answering, without saying so: every request
    // still succeeds, on a new connection each time.
    let (port, accepted) = responder(Script::ServeThenDrop).await;
    let s3 = scripted(port);
    for _ in 0..5 {
        assert_eq!(
            s3.get("k", 16).await.unwrap().as_deref(),
            Some(&b"kvgate"[..])
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 5);
}

#[tokio::test]
async fn damaged_or_unhashed_objects_are_refused_for_good() {
    for script in [Script::Damaged, Script::Unhashed] {
        let (port, _) = responder(script).await;
        match scripted(port).get("k", 16).await {
            Err(e @ RemoteError::Integrity(_)) => {
                assert_eq!(e.metric_label(), "integrity");
                assert!(!e.is_transient());
            }
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn refusals_keep_their_status_and_say_what_to_fix() {
    let (port, _) = responder(Script::LongError).await;
    match scripted(port).get("k", 16).await {
        Err(e @ RemoteError::Status { status: 403, .. }) => {
            assert!(e.to_string().contains("AccessDenied"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    let (port, _) = responder(Script::WrongRegion).await;
    let e = scripted(port).ping().await.unwrap_err();
    assert!(e.is_config_refusal());
    assert!(e.to_string().contains("--s3-region eu-west-1"), "{e}");
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let (port, _) = responder(Script::Silent).await;
    let started = Instant::now();
    let e = scripted(port).get("k", 16).await.unwrap_err();
    assert!(matches!(e, RemoteError::Timeout(_)), "{e:?}");
    assert!(e.is_transient());
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// An `https` endpoint whose certificate (for `localhost`) `cert` is, answering every request
/// with an empty 200.
async fn tls_endpoint(cert: &rcgen::CertifiedKey<rcgen::KeyPair>) -> u16 {
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![cert.cert.der().clone()], key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = Vec::new();
                loop {
                    if !read_head(&mut conn, &mut buf).await {
                        return;
                    }
                    buf.clear();
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                    if conn.write_all(ok).await.is_err() || conn.flush().await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

#[tokio::test]
async fn https_endpoints_are_verified_against_the_given_ca() {
    let dir = std::env::temp_dir().join(format!("kvgate-s3-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let port = tls_endpoint(&cert).await;
    let (ca, other, junk) = (
        dir.join("ca.pem"),
        dir.join("other.pem"),
        dir.join("junk.pem"),
    );
    std::fs::write(&ca, cert.cert.pem()).unwrap();
    let stranger = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    std::fs::write(&other, stranger.cert.pem()).unwrap();
    std::fs::write(&junk, b"not a certificate\n").unwrap();
    let client = |ca_file: &Path| {
        let options = S3Options {
            endpoint: Some(format!("https://localhost:{port}")),
            region: "us-east-1".into(),
            addressing: Addressing::Auto,
        };
        let credentials = Credentials {
            access_key_id: "AK".into(),
            secret_access_key: "SK".into(),
            session_token: None,
        };
        let mut config = S3Config::from_url(
            "s3://kvgate",
            &options,
            credentials,
            Duration::from_secs(5),
            MIB,
        )
        .unwrap();
        config.ca_file = Some(ca_file.to_path_buf());
        S3::new(config)
    };
    // Trusted through the bundle.
    let trusted = client(&ca);
    trusted.prepare_tls().unwrap();
    trusted.ping().await.unwrap();
    trusted.put("k", Bytes::from_static(b"v")).await.unwrap();
    // Another CA: the handshake fails, as a TLS failure the store may recover from.
    let e = client(&other).ping().await.unwrap_err();
    assert_eq!(e.metric_label(), "tls", "{e}");
    assert!(e.is_transient() && !e.is_config_refusal(), "{e}");
    // A bundle without a certificate fails at start.
    let e = client(&junk).prepare_tls().unwrap_err();
    assert_eq!(e.metric_label(), "tls", "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
