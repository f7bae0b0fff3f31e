//! The remote tier's S3 client: objects in one bucket under one prefix, over HTTP/1.1 (plain
//! or TLS), every request signed with AWS Signature Version 4 ([`sigv4`](super::sigv4)) and
//! under a deadline.
//!
//! It speaks to AWS S3 and to S3-compatible stores (MinIO, Ceph RGW, SeaweedFS, …): `PUT`,
//! `GET`, `DELETE` of an object and `HEAD` of the bucket, nothing else. Keep-alive connections
//! are reused (a few are kept idle); a failed exchange drops its connection, so an endpoint
//! that restarts costs the requests that were in flight, never the daemon.
//!
//! Addressing is path-style (`https://endpoint/bucket/key`) for a given endpoint, and
//! virtual-hosted (`https://bucket.s3.<region>.amazonaws.com/key`) for AWS's own, unless
//! [`Addressing`] says otherwise. The payload is always signed (its SHA-256 is sent), so a
//! body altered in flight is refused even over plain HTTP.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use kv_events::BlockKey;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use super::RemoteError;
use super::sigv4::{self, Credentials};

/// Idle keep-alive connections kept for reuse.
const MAX_IDLE: usize = 8;
/// An idle connection older than this is closed rather than reused: servers and middleboxes
/// drop idle connections (S3 after about 20 s), and a silently dropped one costs a request its
/// whole deadline.
const MAX_IDLE_AGE: Duration = Duration::from_secs(15);
/// The most of an error response's body read for its `<Code>` (the rest is cut off), and of
/// a successful `PUT`'s, `DELETE`'s or `HEAD`'s body.
const MAX_SMALL_BODY: usize = 16 << 10;
/// Bodies hashed on the blocking pool rather than on the runtime's worker.
const HASH_INLINE_MAX: usize = 256 << 10;
/// The user-metadata header carrying a block's SHA-256, set at `PUT` and checked at `GET`: a
/// body altered in the store or on the way back reads as a damaged block.
const SHA256_HEADER: &str = "x-amz-meta-kvgate-sha256";
/// The longest object-key prefix (S3 keys are at most 1,024 bytes; a block's name takes 33).
const MAX_PREFIX: usize = 512;

/// How a bucket is addressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Addressing {
    /// Virtual-hosted for AWS's default endpoint (when the bucket name allows it), path-style
    /// for an endpoint given with `--s3-endpoint`.
    #[default]
    Auto,
    /// `https://endpoint/bucket/key`.
    Path,
    /// `https://bucket.endpoint/key`.
    Virtual,
}

/// Where and how to reach the bucket.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    /// `https` (true) or `http`.
    pub https: bool,
    /// The endpoint's host (without the bucket for virtual-hosted addressing).
    pub host: String,
    /// The endpoint's port.
    pub port: u16,
    /// The bucket.
    pub bucket: String,
    /// Prepended to every object key: empty, or ending in `/`.
    pub prefix: String,
    /// The signing region.
    pub region: String,
    /// Path-style (true) or virtual-hosted addressing, resolved.
    pub path_style: bool,
    /// Signing credentials.
    pub credentials: Credentials,
    /// Deadline of one request, connecting and reading the body included.
    pub timeout: Duration,
    /// The largest object read back.
    pub max_value_bytes: usize,
    /// PEM bundle of the CAs to trust for `https` (the system's roots when absent).
    pub ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint())
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("path_style", &self.path_style)
            .field("credentials", &self.credentials)
            .field("timeout", &self.timeout)
            .field("max_value_bytes", &self.max_value_bytes)
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

/// The options beside `--remote-url s3://bucket[/prefix]`.
#[derive(Debug, Clone, Default)]
pub struct S3Options {
    /// `http[s]://host[:port]`; AWS's endpoint of the region when absent.
    pub endpoint: Option<String>,
    /// The signing region.
    pub region: String,
    /// How the bucket is addressed.
    pub addressing: Addressing,
}

impl S3Config {
    /// Parses `s3://bucket[/prefix]` with its options.
    pub fn from_url(
        url: &str,
        options: &S3Options,
        credentials: Credentials,
        timeout: Duration,
        max_value_bytes: usize,
    ) -> Result<Self, RemoteError> {
        let bad = |why: String| RemoteError::Url(format!("{why}: {url}"));
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| bad("must start with s3://".into()))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        check_bucket(bucket).map_err(bad)?;
        let prefix = normalise_prefix(prefix).map_err(bad)?;
        if !valid_region(&options.region) {
            return Err(RemoteError::Url(format!(
                "--s3-region {:?} is not a region name (letters, digits and '-')",
                options.region
            )));
        }
        let (https, host, port, aws) = match &options.endpoint {
            Some(endpoint) => {
                let (https, host, port) = parse_endpoint(endpoint)
                    .map_err(|why| RemoteError::Url(format!("--s3-endpoint {endpoint}: {why}")))?;
                (https, host, port, false)
            }
            None => (
                true,
                format!("s3.{}.amazonaws.com", options.region),
                443,
                true,
            ),
        };
        // A dotted bucket name under a wildcard certificate fails verification: path-style.
        let ip_host = host.parse::<std::net::IpAddr>().is_ok();
        let path_style = match options.addressing {
            Addressing::Path => true,
            Addressing::Virtual if ip_host => {
                return Err(RemoteError::Url(format!(
                    "--s3-addressing virtual needs a host name, not the address {host}"
                )));
            }
            Addressing::Virtual => false,
            Addressing::Auto => !aws || bucket.contains('.'),
        };
        Ok(Self {
            https,
            host,
            port,
            bucket: bucket.to_owned(),
            prefix,
            region: options.region.clone(),
            path_style,
            credentials,
            timeout,
            max_value_bytes,
            ca_file: None,
        })
    }

    /// `scheme://host[:port]` (for logs).
    pub fn endpoint(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}", self.host_header_for(&self.host))
    }

    /// The `Host` header: the bucket's host for virtual-hosted addressing, with the port
    /// unless it is the scheme's default.
    fn host_header(&self) -> String {
        if self.path_style {
            self.host_header_for(&self.host)
        } else {
            self.host_header_for(&format!("{}.{}", self.bucket, self.host))
        }
    }

    fn host_header_for(&self, host: &str) -> String {
        let default = if self.https { 443 } else { 80 };
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        if self.port == default {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }

    /// The raw (unencoded) request path of `key`, or of the bucket when `None`.
    fn path(&self, key: Option<&str>) -> String {
        match (self.path_style, key) {
            (true, Some(key)) => format!("/{}/{key}", self.bucket),
            (true, None) => format!("/{}", self.bucket),
            (false, Some(key)) => format!("/{key}"),
            (false, None) => "/".to_owned(),
        }
    }

    /// The server name TLS verifies.
    fn tls_name(&self) -> String {
        if self.path_style {
            self.host.clone()
        } else {
            format!("{}.{}", self.bucket, self.host)
        }
    }
}

/// S3's bucket naming rules (3–63 of lowercase letters, digits, `.` and `-`, starting and
/// ending with a letter or digit).
fn check_bucket(bucket: &str) -> Result<(), String> {
    let ok_len = (3..=63).contains(&bucket.len());
    let ok_chars = bucket
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    let ends = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok_len && ok_chars && ends(bucket.bytes().next()) && ends(bucket.bytes().last()) {
        Ok(())
    } else {
        Err(format!(
            "bucket {bucket:?} is not a valid S3 bucket name (3–63 of a-z, 0-9, '.', '-')"
        ))
    }
}

/// The prefix as keys take it: empty, or ending in one `/`; no control characters, no `//`.
fn normalise_prefix(prefix: &str) -> Result<String, String> {
    let prefix = prefix.trim_end_matches('/');
    if prefix.is_empty() {
        return Ok(String::new());
    }
    if prefix.len() > MAX_PREFIX {
        return Err(format!("the prefix is longer than {MAX_PREFIX} bytes"));
    }
    if prefix.chars().any(char::is_control) || prefix.contains("//") || prefix.starts_with('/') {
        return Err("the prefix has a control character or an empty segment".into());
    }
    Ok(format!("{prefix}/"))
}

fn valid_region(region: &str) -> bool {
    !region.is_empty()
        && region.len() <= 64
        && region
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// `http[s]://host[:port]` with nothing after the authority but an optional `/`.
fn parse_endpoint(endpoint: &str) -> Result<(bool, String, u16), String> {
    let (https, rest) = if let Some(rest) = endpoint.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = endpoint.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err("must start with http:// or https://".into());
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains(['/', '@', '?', '#']) {
        return Err("give only scheme, host and port".into());
    }
    let default = if https { 443 } else { 80 };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or("unclosed '['")?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| "the port is not a number")?,
            None if after.is_empty() => default,
            None => return Err("junk after the host".into()),
        };
        (host, port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse().map_err(|_| "the port is not a number")?),
            None => (authority, default),
        }
    };
    if host.is_empty() {
        return Err("no host".into());
    }
    Ok((https, host.to_owned(), port))
}

/// An S3 client for the remote tier.
pub struct S3 {
    config: S3Config,
    /// Idle keep-alive connections and when each went idle.
    idle: std::sync::Mutex<Vec<(SendRequest<Full<Bytes>>, Instant)>>,
    /// The TLS connector, built once (by [`S3::prepare_tls`] or the first connect).
    tls: std::sync::OnceLock<(TlsConnector, ServerName<'static>)>,
}

impl std::fmt::Debug for S3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3")
            .field("config", &self.config)
            .field("tls_ready", &self.tls.get().is_some())
            .finish_non_exhaustive()
    }
}

/// A response: status, the stored SHA-256 (if any) and the (bounded) body.
struct Response {
    status: StatusCode,
    sha256: Option<String>,
    /// `x-amz-bucket-region`, which S3 sends with a wrong-region refusal.
    bucket_region: Option<String>,
    body: Bytes,
}

impl S3 {
    /// A client; nothing is connected until the first request.
    pub fn new(config: S3Config) -> Self {
        Self {
            config,
            idle: std::sync::Mutex::new(Vec::new()),
            tls: std::sync::OnceLock::new(),
        }
    }

    /// Builds the TLS connector now (for `https`), so a CA bundle that cannot be read fails
    /// at start rather than at the first request.
    pub fn prepare_tls(&self) -> Result<(), RemoteError> {
        self.tls_connector().map(|_| ())
    }

    fn tls_connector(&self) -> Result<Option<(TlsConnector, ServerName<'static>)>, RemoteError> {
        if !self.config.https {
            return Ok(None);
        }
        if let Some(tls) = self.tls.get() {
            return Ok(Some(tls.clone()));
        }
        let config = super::tls::client_config(self.config.ca_file.as_deref())?;
        let name = self.config.tls_name();
        let name = ServerName::try_from(name.clone())
            .map_err(|e| RemoteError::Tls(format!("server name {name}: {e}")))?;
        Ok(Some(
            self.tls
                .get_or_init(|| (TlsConnector::from(config), name))
                .clone(),
        ))
    }

    /// Where it sends requests (for logs): endpoint, bucket and prefix.
    pub fn address(&self) -> String {
        format!(
            "{}/{}/{}",
            self.config.endpoint(),
            self.config.bucket,
            self.config.prefix
        )
    }

    /// A block's object key: `<prefix><layout fingerprint>/<block key>`, both 16 hex digits.
    pub fn block_name(&self, layout_fingerprint: u64, key: BlockKey) -> String {
        format!(
            "{}{layout_fingerprint:016x}/{:016x}",
            self.config.prefix, key.0
        )
    }

    /// `HEAD` of the bucket: it exists and the credentials may use it.
    pub async fn ping(&self) -> Result<(), RemoteError> {
        let r = self
            .send(Method::HEAD, None, Body::empty(), MAX_SMALL_BODY)
            .await?;
        match r.status {
            StatusCode::OK => Ok(()),
            status => Err(status_error("HEAD", status, &r)),
        }
    }

    /// `PUT` of the object `key`, its SHA-256 signed and stored as metadata.
    pub async fn put(&self, key: &str, value: Bytes) -> Result<(), RemoteError> {
        let body = Body::of(value).await?;
        let r = self
            .send(Method::PUT, Some(key), body, MAX_SMALL_BODY)
            .await?;
        match r.status {
            StatusCode::OK => Ok(()),
            status => Err(status_error("PUT", status, &r)),
        }
    }

    /// `GET` of the object `key`, at most `limit` bytes (the block's size): `None` when the
    /// bucket does not have it. The body must match the SHA-256 stored with it.
    pub async fn get(&self, key: &str, limit: usize) -> Result<Option<Bytes>, RemoteError> {
        let limit = limit.min(self.config.max_value_bytes);
        let r = self
            .send(Method::GET, Some(key), Body::empty(), limit)
            .await?;
        match r.status {
            StatusCode::OK => {
                let Some(stored) = r.sha256 else {
                    return Err(RemoteError::Integrity(format!(
                        "{key} has no {SHA256_HEADER} (not written by kvgate-kvbm)"
                    )));
                };
                let body = r.body;
                let actual = hash(body.clone()).await?;
                if !stored.eq_ignore_ascii_case(&actual) {
                    return Err(RemoteError::Integrity(format!(
                        "{key}: the body's SHA-256 is {actual}, stored {stored}"
                    )));
                }
                Ok(Some(body))
            }
            StatusCode::NOT_FOUND if no_such_key(&r.body) => Ok(None),
            status => Err(status_error("GET", status, &r)),
        }
    }

    /// `DELETE` of the object `key` (one that is not there is deleted already).
    pub async fn delete(&self, key: &str) -> Result<(), RemoteError> {
        let r = self
            .send(Method::DELETE, Some(key), Body::empty(), MAX_SMALL_BODY)
            .await?;
        match r.status {
            StatusCode::OK | StatusCode::NO_CONTENT => Ok(()),
            StatusCode::NOT_FOUND if no_such_key(&r.body) => Ok(()),
            status => Err(status_error("DELETE", status, &r)),
        }
    }

    /// One signed request under the deadline; `limit` bounds a successful response's body.
    /// A keep-alive connection the server closed meanwhile fails before the request is
    /// written: it then goes once more, on a new connection. A request that was written is
    /// never sent again.
    async fn send(
        &self,
        method: Method,
        key: Option<&str>,
        body: Body,
        limit: usize,
    ) -> Result<Response, RemoteError> {
        let timeout = self.config.timeout;
        tokio::time::timeout(timeout, async {
            let (sender, reused) = self.sender().await?;
            let request = self.request(&method, key, &body)?;
            match self.exchange(sender, request, limit).await {
                Err(Exchange::Unsent(why)) if reused => {
                    tracing::debug!(error = %why, "S3 keep-alive connection lost; retrying");
                    let sender = self.connect().await?;
                    let request = self.request(&method, key, &body)?;
                    self.exchange(sender, request, limit)
                        .await
                        .map_err(Exchange::into_error)
                }
                result => result.map_err(Exchange::into_error),
            }
        })
        .await
        .unwrap_or(Err(RemoteError::Timeout(timeout)))
    }

    /// Sends `request` on `sender` and reads the response, keeping the connection if it
    /// stays open.
    async fn exchange(
        &self,
        mut sender: SendRequest<Full<Bytes>>,
        request: Request<Full<Bytes>>,
        limit: usize,
    ) -> Result<Response, Exchange> {
        let op = op_name(request.method());
        if let Err(e) = sender.ready().await {
            return Err(Exchange::Unsent(format!("{op}: connection: {e}")));
        }
        let response = match sender.try_send_request(request).await {
            Ok(response) => response,
            Err(mut e) => {
                let why = format!("{op}: {}", e.error());
                return Err(if e.take_message().is_some() {
                    Exchange::Unsent(why)
                } else {
                    Exchange::Failed(RemoteError::Http(why))
                });
            }
        };
        let status = response.status();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let sha256 = header(SHA256_HEADER);
        let bucket_region = header("x-amz-bucket-region");
        let (body, whole) = if status.is_success() {
            let body = read_body(response.into_body(), limit, op)
                .await
                .map_err(Exchange::Failed)?;
            (body, true)
        } else {
            // An error's body is read for its code only: a long one is cut off.
            read_prefix(response.into_body(), MAX_SMALL_BODY).await
        };
        // A connection with a response left unread is not reused (dropping it closes it).
        if whole {
            self.release(sender);
        }
        Ok(Response {
            status,
            sha256,
            bucket_region,
            body,
        })
    }

    /// The signed request.
    fn request(
        &self,
        method: &Method,
        key: Option<&str>,
        body: &Body,
    ) -> Result<Request<Full<Bytes>>, RemoteError> {
        let host = self.config.host_header();
        let path = self.config.path(key);
        let put = *method == Method::PUT;
        let meta = [(SHA256_HEADER, body.sha256.as_str())];
        let signed = sigv4::sign(
            &sigv4::Request {
                method: method.as_str(),
                host: &host,
                path: &path,
                query: &[],
                headers: if put { &meta } else { &[] },
                payload_sha256: &body.sha256,
            },
            &self.config.credentials,
            &self.config.region,
            &sigv4::amz_date_now(),
        );
        let mut builder = Request::builder()
            .method(method.clone())
            .uri(sigv4::uri_encode(&path, true))
            .header(hyper::header::HOST, host)
            .header("x-amz-date", signed.amz_date)
            .header("x-amz-content-sha256", signed.content_sha256)
            .header(hyper::header::AUTHORIZATION, signed.authorization);
        if let Some(token) = signed.security_token {
            builder = builder.header("x-amz-security-token", token);
        }
        if put {
            builder = builder
                .header(hyper::header::CONTENT_LENGTH, body.bytes.len())
                .header(SHA256_HEADER, body.sha256.as_str());
        }
        builder
            .body(Full::new(body.bytes.clone()))
            .map_err(|e| RemoteError::Http(format!("building the request: {e}")))
    }

    /// An idle keep-alive connection (`true`), or a new one.
    async fn sender(&self) -> Result<(SendRequest<Full<Bytes>>, bool), RemoteError> {
        loop {
            let idle = self.idle.lock().ok().and_then(|mut idle| idle.pop());
            match idle {
                Some((sender, since)) if !sender.is_closed() && since.elapsed() < MAX_IDLE_AGE => {
                    return Ok((sender, true));
                }
                // Closed, or idle too long: dropping it closes it.
                Some(_) => {}
                None => return Ok((self.connect().await?, false)),
            }
        }
    }

    /// Keeps a connection whose exchange completed for the next request.
    fn release(&self, sender: SendRequest<Full<Bytes>>) {
        if sender.is_closed() {
            return;
        }
        if let Ok(mut idle) = self.idle.lock() {
            // The oldest are the likeliest to be dropped by the other end.
            idle.retain(|(_, since)| since.elapsed() < MAX_IDLE_AGE);
            if idle.len() < MAX_IDLE {
                idle.push((sender, Instant::now()));
            }
        }
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, RemoteError> {
        let tcp = TcpStream::connect((self.config.host.as_str(), self.config.port)).await?;
        tcp.set_nodelay(true)?;
        let handshake = |e: hyper::Error| RemoteError::Http(format!("handshake: {e}"));
        match self.tls_connector()? {
            None => {
                let (sender, conn) = http1::handshake(TokioIo::new(tcp))
                    .await
                    .map_err(handshake)?;
                tokio::spawn(drive(conn));
                Ok(sender)
            }
            Some((connector, name)) => {
                let tls = connector
                    .connect(name, tcp)
                    .await
                    .map_err(|e| RemoteError::Tls(format!("handshake: {e}")))?;
                let (sender, conn) = http1::handshake(TokioIo::new(tls))
                    .await
                    .map_err(handshake)?;
                tokio::spawn(drive(conn));
                Ok(sender)
            }
        }
    }
}

/// Runs a connection until it closes.
async fn drive<T>(conn: http1::Connection<T, Full<Bytes>>)
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "S3 connection closed");
    }
}

fn op_name(method: &Method) -> &'static str {
    match *method {
        Method::PUT => "PUT",
        Method::GET => "GET",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        _ => "request",
    }
}

/// An error status with S3's `<Code>` from the body, when it has one, and the bucket's region
/// when S3 says the request went to the wrong one.
fn status_error(op: &'static str, status: StatusCode, r: &Response) -> RemoteError {
    let detail = match &r.bucket_region {
        Some(region) if region.len() <= 64 && !region.chars().any(char::is_control) => {
            format!(" (the bucket is in {region}: set --s3-region {region})")
        }
        _ => String::new(),
    };
    RemoteError::Status {
        op,
        status: status.as_u16(),
        code: error_code(&r.body).unwrap_or_else(|| {
            status
                .canonical_reason()
                .unwrap_or("unknown status")
                .to_owned()
        }),
        detail,
    }
}

/// Whether a 404's body says the key is missing (not the bucket). A 404 without a code (as to
/// a `HEAD`) counts as a missing key.
fn no_such_key(body: &[u8]) -> bool {
    error_code(body).is_none_or(|code| code == "NoSuchKey")
}

/// What went wrong in one exchange.
enum Exchange {
    /// The request was not written (the connection had closed): it may be sent again.
    Unsent(String),
    /// Anything else.
    Failed(RemoteError),
}

impl Exchange {
    fn into_error(self) -> RemoteError {
        match self {
            Self::Unsent(why) => RemoteError::Http(why),
            Self::Failed(e) => e,
        }
    }
}

/// A request body and its SHA-256.
struct Body {
    bytes: Bytes,
    sha256: String,
}

impl Body {
    fn empty() -> Self {
        Self {
            sha256: sigv4::sha256_hex(&[]),
            bytes: Bytes::new(),
        }
    }

    async fn of(bytes: Bytes) -> Result<Self, RemoteError> {
        Ok(Self {
            sha256: hash(bytes.clone()).await?,
            bytes,
        })
    }
}

/// The hex SHA-256 of `bytes`, large ones hashed on the blocking pool (~1.2 ms per 2 MiB).
async fn hash(bytes: Bytes) -> Result<String, RemoteError> {
    if bytes.len() <= HASH_INLINE_MAX {
        return Ok(sigv4::sha256_hex(&bytes));
    }
    tokio::task::spawn_blocking(move || sigv4::sha256_hex(&bytes))
        .await
        .map_err(|e| RemoteError::Http(format!("hashing the body: {e}")))
}

/// A successful response's body, at most `limit` bytes.
async fn read_body(
    body: hyper::body::Incoming,
    limit: usize,
    op: &'static str,
) -> Result<Bytes, RemoteError> {
    Limited::new(body, limit)
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                RemoteError::TooLarge { op, limit }
            } else {
                RemoteError::Http(format!("{op}: reading the body: {e}"))
            }
        })
}

/// The first `limit` bytes of a body (what arrived of it, on an error), and whether that was
/// all of it.
async fn read_prefix(mut body: hyper::body::Incoming, limit: usize) -> (Bytes, bool) {
    let mut out = Vec::new();
    loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    let room = limit.saturating_sub(out.len());
                    out.extend(data.iter().take(room));
                    if data.len() > room {
                        return (Bytes::from(out), false);
                    }
                }
            }
            None => return (Bytes::from(out), true),
            Some(Err(_)) => return (Bytes::from(out), false),
        }
    }
}

/// The text of the first `<Code>…</Code>` element, if short and printable.
fn error_code(body: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let (_, after) = text.split_once("<Code>")?;
    let (code, _) = after.split_once("</Code>")?;
    let ok = !code.is_empty()
        && code.len() <= 64
        && code.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.');
    ok.then(|| code.to_owned())
}

/// Credentials from the standard environment variables (`AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, optional `AWS_SESSION_TOKEN`), as `env` reads them.
pub fn credentials_from(env: impl Fn(&str) -> Option<String>) -> Result<Credentials, RemoteError> {
    let get = |name: &str| env(name).filter(|v| !v.is_empty());
    match (get("AWS_ACCESS_KEY_ID"), get("AWS_SECRET_ACCESS_KEY")) {
        (Some(access_key_id), Some(secret_access_key)) => Ok(Credentials {
            access_key_id,
            secret_access_key,
            session_token: get("AWS_SESSION_TOKEN"),
        }),
        _ => Err(RemoteError::Credentials(
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for \
             temporary credentials) in the daemon's environment"
                .into(),
        )),
    }
}

/// The region from `AWS_REGION`, then `AWS_DEFAULT_REGION`, else `us-east-1`.
pub fn region_from(env: impl Fn(&str) -> Option<String>) -> String {
    env("AWS_REGION")
        .or_else(|| env("AWS_DEFAULT_REGION"))
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "us-east-1".to_owned())
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]
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
        assert!(!aws.path_style);
        assert_eq!(aws.host_header(), "kv-cache.s3.eu-west-1.amazonaws.com");
        assert_eq!(aws.tls_name(), "kv-cache.s3.eu-west-1.amazonaws.com");
        assert_eq!(aws.prefix, "blocks/");
        assert_eq!(aws.path(Some("blocks/a/b")), "/blocks/a/b");
        assert_eq!(aws.path(None), "/");

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
        assert_eq!(minio.host_header(), "minio.kvgate:9000");
        assert_eq!(minio.path(Some("k")), "/kv-cache/k");
        assert_eq!(minio.path(None), "/kv-cache");
        assert_eq!(minio.prefix, "");
        assert_eq!(minio.endpoint(), "http://minio.kvgate:9000");

        let forced = config(
            "s3://kv-cache",
            Some("https://s3.local"),
            Addressing::Virtual,
        );
        assert!(!forced.path_style);
        assert_eq!(forced.port, 443);
        assert_eq!(forced.host_header(), "kv-cache.s3.local");
        let v6 = config("s3://kv-cache", Some("http://[::1]:9000"), Addressing::Auto);
        assert_eq!(v6.host_header(), "[::1]:9000");
        let path = config("s3://kv-cache", None, Addressing::Path);
        assert_eq!(path.host_header(), "s3.eu-west-1.amazonaws.com");
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

    #[test]
    fn error_codes_are_read_from_the_body_when_sane() {
        let body =
            b"<?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code><Message>x</Message></Error>";
        assert_eq!(error_code(body).as_deref(), Some("NoSuchBucket"));
        assert_eq!(error_code(b"<Code><script></Code>"), None);
        assert_eq!(error_code(b"not xml"), None);
        let response = |body: &'static [u8], region: Option<&str>| Response {
            status: StatusCode::FORBIDDEN,
            sha256: None,
            bucket_region: region.map(str::to_owned),
            body: Bytes::from_static(body),
        };
        let e = status_error("GET", StatusCode::FORBIDDEN, &response(b"", None));
        assert_eq!(e.to_string(), "S3 refused GET: HTTP 403 Forbidden");
        assert_eq!(e.metric_label(), "status");
        let moved = status_error(
            "HEAD",
            StatusCode::MOVED_PERMANENTLY,
            &response(b"", Some("eu-west-1")),
        );
        assert_eq!(
            moved.to_string(),
            "S3 refused HEAD: HTTP 301 Moved Permanently (the bucket is in eu-west-1: set \
             --s3-region eu-west-1)"
        );
        assert!(moved.is_config_refusal() && !moved.is_transient());
        // A 404 is a missing key unless S3 says the bucket is missing.
        assert!(no_such_key(b""));
        assert!(no_such_key(b"<Error><Code>NoSuchKey</Code></Error>"));
        assert!(!no_such_key(b"<Error><Code>NoSuchBucket</Code></Error>"));
    }
}
