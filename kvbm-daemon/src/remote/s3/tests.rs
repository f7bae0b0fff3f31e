//! The client's configuration, its requests as the SDK builds them, and what its errors mean,
//! without a store (`tests/s3_server.rs` runs it against moto and scripted servers).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_s3::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_s3::error::{BoxError, ErrorMetadata, SdkError};
use aws_sdk_s3::operation::get_object::GetObjectError;
use aws_sdk_s3::primitives::SdkBody;
use bytes::Bytes;
use kv_events::BlockKey;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::config::MAX_PREFIX;
use super::*;

fn creds() -> Credentials {
    Credentials {
        access_key_id: "AKID".into(),
        secret_access_key: "SECRET".into(),
        session_token: None,
    }
}

fn config(url: &str, endpoint: Option<&str>, addressing: Addressing) -> S3Config {
    S3Config::from_url(
        url,
        &S3Options {
            endpoint: endpoint.map(str::to_owned),
            region: "eu-west-1".into(),
            addressing,
        },
        creds(),
        Duration::from_secs(1),
        1024,
    )
    .unwrap()
}

#[test]
fn aws_endpoints_are_virtual_hosted_and_given_ones_path_style() {
    let aws = config("s3://kv-cache/blocks/", None, Addressing::Auto);
    assert_eq!((aws.https, aws.port), (true, 443));
    assert_eq!(aws.host, "s3.eu-west-1.amazonaws.com");
    assert!(!aws.path_style && aws.aws_endpoint);
    assert_eq!(aws.endpoint_url(), None, "the SDK resolves AWS's endpoint");
    assert_eq!(aws.prefix, "blocks/");

    let dotted = config("s3://kv.cache", None, Addressing::Auto);
    assert!(
        dotted.path_style,
        "a dotted bucket breaks the wildcard cert"
    );

    let minio = config(
        "s3://kv-cache",
        Some("http://minio.kvgate:9000/"),
        Addressing::Auto,
    );
    assert_eq!(
        (minio.https, minio.host.as_str(), minio.port),
        (false, "minio.kvgate", 9000)
    );
    assert!(minio.path_style);
    assert_eq!(minio.prefix, "");
    assert_eq!(minio.endpoint(), "http://minio.kvgate:9000");
    assert_eq!(
        minio.endpoint_url().as_deref(),
        Some("http://minio.kvgate:9000")
    );

    let forced = config(
        "s3://kv-cache",
        Some("https://s3.local"),
        Addressing::Virtual,
    );
    assert!(!forced.path_style);
    assert_eq!(forced.port, 443);
    assert_eq!(forced.endpoint(), "https://s3.local");
    let v6 = config("s3://kv-cache", Some("http://[::1]:9000"), Addressing::Auto);
    assert_eq!(v6.endpoint(), "http://[::1]:9000");
    let path = config("s3://kv-cache", None, Addressing::Path);
    assert!(path.path_style);
}

/// Records the URI of each request the SDK would send, and sends none.
#[derive(Debug, Clone, Default)]
struct Seen(Arc<Mutex<Vec<String>>>);

impl Intercept for Seen {
    fn name(&self) -> &'static str {
        "seen"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        self.0
            .lock()
            .unwrap()
            .push(context.request().uri().to_owned());
        Err("recorded, not sent".into())
    }
}

/// The URI the SDK builds for `GET` of `key` with `config`, without its query (`x-id=…`).
async fn uri_of(mut config: S3Config, key: &str) -> String {
    // A private CA, so the test needs no system roots for `https`.
    let dir = std::env::temp_dir().join(format!("kvgate-s3-uri-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.pem");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    std::fs::write(&ca, cert.cert.pem()).unwrap();
    config.ca_file = Some(ca);
    let s3 = S3::new(config);
    s3.prepare_tls().unwrap();
    let seen = Seen::default();
    let result = s3
        .client()
        .unwrap()
        .get_object()
        .bucket(&s3.config.bucket)
        .key(key)
        .customize()
        .interceptor(seen.clone())
        .send()
        .await;
    assert!(result.is_err());
    let uri = seen.0.lock().unwrap().pop().unwrap();
    uri.split_once('?')
        .map_or(uri.clone(), |(path, _)| path.to_owned())
}

#[tokio::test]
async fn the_sdk_addresses_the_bucket_as_configured() {
    let aws = config("s3://kv-cache/blocks", None, Addressing::Auto);
    assert_eq!(
        uri_of(aws, "blocks/a b").await,
        "https://kv-cache.s3.eu-west-1.amazonaws.com/blocks/a%20b"
    );
    let aws_path = config("s3://kv-cache", None, Addressing::Path);
    assert_eq!(
        uri_of(aws_path, "k").await,
        "https://s3.eu-west-1.amazonaws.com/kv-cache/k"
    );
    let minio = config(
        "s3://kv-cache",
        Some("http://127.0.0.1:9000"),
        Addressing::Auto,
    );
    assert_eq!(uri_of(minio, "k").await, "http://127.0.0.1:9000/kv-cache/k");
    let forced = config(
        "s3://kv-cache",
        Some("https://s3.local:8443"),
        Addressing::Virtual,
    );
    assert_eq!(
        uri_of(forced, "k").await,
        "https://kv-cache.s3.local:8443/k"
    );
}

/// Answers one request with 200 and returns its head (request line and headers, lowercase).
async fn one_request_head(listener: tokio::net::TcpListener) -> String {
    let (mut conn, _) = listener.accept().await.unwrap();
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0; 4096];
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before the request head");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .map_or(0, |v| v.trim().parse().unwrap());
    while buf.len() < head_end + len {
        let mut chunk = [0; 4096];
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before the body");
        buf.extend_from_slice(&chunk[..n]);
    }
    conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    head
}

#[tokio::test]
async fn a_put_is_signed_with_the_sha256_it_stores() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(one_request_head(listener));
    let endpoint = format!("http://127.0.0.1:{port}");
    let s3 = S3::new(config("s3://kvgate", Some(&endpoint), Addressing::Auto));
    let block = Bytes::from(vec![7u8; 300 << 10]);
    s3.put("node-a/k", block.clone()).await.unwrap();
    let head = server.await.unwrap();
    let sha = sha256_hex(&block);
    assert!(head.starts_with("put /kvgate/node-a/k?"), "{head}");
    assert!(
        head.contains(&format!("x-amz-content-sha256: {sha}\r\n")),
        "{head}"
    );
    assert!(
        head.contains(&format!("x-amz-meta-kvgate-sha256: {sha}\r\n")),
        "{head}"
    );
    assert!(!head.contains("x-amz-checksum-"), "no CRC: {head}");
    assert!(head.contains("credential=akid/"), "{head}");
}

fn refusal(
    status: u16,
    code: Option<&str>,
    region: Option<&str>,
) -> SdkError<GetObjectError, HttpResponse> {
    let mut meta = ErrorMetadata::builder();
    if let Some(code) = code {
        meta = meta.code(code);
    }
    let mut raw = HttpResponse::new(status.try_into().unwrap(), SdkBody::empty());
    if let Some(region) = region {
        raw.headers_mut()
            .insert("x-amz-bucket-region", region.to_owned());
    }
    SdkError::service_error(GetObjectError::generic(meta.build()), raw)
}

#[test]
fn a_404_is_a_missing_key_unless_s3_says_the_bucket_is_missing() {
    assert!(errors::missing_key(&refusal(404, None, None)));
    assert!(errors::missing_key(&refusal(404, Some("NoSuchKey"), None)));
    assert!(errors::missing_key(&refusal(404, Some("NotFound"), None)));
    assert!(!errors::missing_key(&refusal(
        404,
        Some("NoSuchBucket"),
        None
    )));
    assert!(!errors::missing_key(&refusal(
        403,
        Some("AccessDenied"),
        None
    )));
    let timeout = Duration::from_secs(1);
    let bucket = errors::classify("GET", refusal(404, Some("NoSuchBucket"), None), timeout);
    assert_eq!(bucket.to_string(), "S3 refused GET: HTTP 404 NoSuchBucket");
    assert!(!bucket.is_transient() && bucket.is_config_refusal());
    let slow = errors::classify("GET", refusal(503, Some("SlowDown"), None), timeout);
    assert!(slow.is_transient());
    let moved = errors::classify("GET", refusal(301, None, Some("ap-south-1")), timeout);
    assert!(
        moved.to_string().contains("set --s3-region ap-south-1"),
        "{moved}"
    );
}

#[test]
fn failures_without_a_status_say_where_they_happened() {
    let timeout = Duration::from_secs(3);
    let e = errors::classify(
        "PUT",
        SdkError::<GetObjectError, HttpResponse>::construction_failure("no endpoint"),
        timeout,
    );
    assert_eq!(e.metric_label(), "request");
    assert!(!e.is_transient() && e.is_config_refusal());
    let e = errors::classify(
        "GET",
        SdkError::<GetObjectError, HttpResponse>::timeout_error("slow"),
        timeout,
    );
    assert!(matches!(e, RemoteError::Timeout(t) if t == timeout));
    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    let e = errors::classify(
        "GET",
        SdkError::<GetObjectError, HttpResponse>::dispatch_failure(
            aws_sdk_s3::error::ConnectorError::io(refused.into()),
        ),
        timeout,
    );
    assert_eq!(e.metric_label(), "io");
    assert!(e.is_transient() && !e.is_config_refusal());
    assert!(e.to_string().starts_with("S3 GET: connecting: "), "{e}");
    assert!(std::error::Error::source(&e).is_some());
    let tls = std::io::Error::other(rustls::Error::InvalidCertificate(
        rustls::CertificateError::UnknownIssuer,
    ));
    let e = errors::classify(
        "HEAD",
        SdkError::<GetObjectError, HttpResponse>::dispatch_failure(
            aws_sdk_s3::error::ConnectorError::io(tls.into()),
        ),
        timeout,
    );
    assert_eq!(e.metric_label(), "tls");
    assert!(e.is_transient());
}

#[test]
fn bad_urls_and_options_are_refused_with_the_reason() {
    let opts = |endpoint: Option<&str>, region: &str| S3Options {
        endpoint: endpoint.map(str::to_owned),
        region: region.into(),
        addressing: Addressing::Auto,
    };
    let parse = |url: &str, o: &S3Options| {
        S3Config::from_url(url, o, creds(), Duration::from_secs(1), 1)
            .unwrap_err()
            .to_string()
    };
    let ok = opts(None, "us-east-1");
    for (url, why) in [
        ("redis://h", "s3://"),
        ("s3://", "bucket"),
        ("s3://AB", "bucket"),
        ("s3://Upper-case", "bucket"),
        ("s3://-leading", "bucket"),
        ("s3://b_underscore", "bucket"),
        ("s3://bucket//x", "empty segment"),
        ("s3://bucket/a\nb", "control"),
    ] {
        let e = parse(url, &ok);
        assert!(e.contains(why), "{url}: {e}");
    }
    let long = format!("s3://bucket/{}", "p".repeat(MAX_PREFIX + 1));
    assert!(parse(&long, &ok).contains("longer"));
    for (endpoint, why) in [
        ("ftp://h", "http"),
        ("http://h/path", "scheme, host and port"),
        ("http://u:p@h", "scheme, host and port"),
        ("http://h:port", "port"),
        ("http://", "no host"),
        ("http://[::1", "'['"),
    ] {
        let e = parse("s3://bucket", &opts(Some(endpoint), "us-east-1"));
        assert!(e.contains(why), "{endpoint}: {e}");
    }
    let virtual_ip = S3Options {
        addressing: Addressing::Virtual,
        ..opts(Some("http://127.0.0.1:9000"), "us-east-1")
    };
    assert!(parse("s3://bucket", &virtual_ip).contains("host name"));
    assert!(parse("s3://bucket", &opts(None, "us east")).contains("region"));
    assert!(parse("s3://bucket", &opts(None, "")).contains("region"));
}

#[test]
fn block_names_are_fixed_width_under_the_prefix() {
    let s3 = S3::new(config("s3://kv-cache/node-a", None, Addressing::Auto));
    assert_eq!(
        s3.block_name(0xab, BlockKey(1)),
        "node-a/00000000000000ab/0000000000000001"
    );
    let bare = S3::new(config("s3://kv-cache", None, Addressing::Auto));
    assert_eq!(
        bare.block_name(0xab, BlockKey(u64::MAX)),
        "00000000000000ab/ffffffffffffffff"
    );
}

#[test]
fn credentials_and_region_come_from_the_environment() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    };
    let c = credentials_from(env(&[
        ("AWS_ACCESS_KEY_ID", "AK"),
        ("AWS_SECRET_ACCESS_KEY", "SK"),
        ("AWS_SESSION_TOKEN", "TOK"),
    ]))
    .unwrap();
    assert_eq!(c.access_key_id, "AK");
    assert_eq!(c.session_token.as_deref(), Some("TOK"));
    assert!(!format!("{c:?}").contains("SK"));
    let e = credentials_from(env(&[("AWS_ACCESS_KEY_ID", "AK")])).unwrap_err();
    assert_eq!(e.metric_label(), "credentials");
    assert!(
        credentials_from(env(&[
            ("AWS_ACCESS_KEY_ID", "AK"),
            ("AWS_SECRET_ACCESS_KEY", "")
        ]))
        .is_err()
    );
    assert_eq!(region_from(env(&[])), "us-east-1");
    assert_eq!(
        region_from(env(&[("AWS_DEFAULT_REGION", "eu-central-1")])),
        "eu-central-1"
    );
    assert_eq!(
        region_from(env(&[
            ("AWS_REGION", "ap-south-1"),
            ("AWS_DEFAULT_REGION", "x")
        ])),
        "ap-south-1"
    );
}
