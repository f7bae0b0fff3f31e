//! The remote tier's Redis client: one connection, one command at a time, every command under
//! a deadline. A broken connection is dropped and the next command opens a new one, so a
//! Redis restart costs the commands that were in flight, never the daemon.
//!
//! `rediss://` URLs speak TLS (rustls on ring; TLS 1.2 and 1.3), verifying the server's
//! certificate against a CA bundle ([`TlsSettings::ca_file`]) or the system's roots, for the
//! URL's host name.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::Mutex;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::resp::{self, Parsed, Reply, RespError};

/// TLS to Redis (`rediss://`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// The name the server's certificate must carry (the URL's host).
    pub server_name: String,
    /// PEM bundle of the CAs to trust; the system's roots when absent.
    pub ca_file: Option<PathBuf>,
}

/// Where and how to reach Redis, parsed from `redis[s]://[[user]:password@]host[:port][/db]`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// Host name or IP.
    pub host: String,
    /// Port (default 6379).
    pub port: u16,
    /// Database number (default 0).
    pub db: u32,
    /// ACL user, if any.
    pub username: Option<String>,
    /// Password, if any.
    pub password: Option<String>,
    /// Deadline of one command, connecting included.
    pub timeout: Duration,
    /// The largest value accepted in a reply.
    pub max_value_bytes: usize,
    /// TLS, for `rediss://`.
    pub tls: Option<TlsSettings>,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("db", &self.db)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("timeout", &self.timeout)
            .field("max_value_bytes", &self.max_value_bytes)
            .field("tls", &self.tls)
            .finish()
    }
}

pub use super::RemoteError;

impl RedisConfig {
    /// Parses a `redis://` or `rediss://` (TLS, trusting the system's roots until
    /// [`TlsSettings::ca_file`] is set) URL.
    pub fn from_url(
        url: &str,
        timeout: Duration,
        max_value_bytes: usize,
    ) -> Result<Self, RemoteError> {
        let bad = |why: &str| RemoteError::Url(format!("{why}: {}", redact(url)));
        let (rest, tls) = match url.strip_prefix("rediss://") {
            Some(rest) => (rest, true),
            None => (
                url.strip_prefix("redis://")
                    .ok_or_else(|| bad("must start with redis:// or rediss://"))?,
                false,
            ),
        };
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (username, password) = match userinfo {
            None => (None, None),
            Some(u) => match u.split_once(':') {
                Some((user, pass)) => (
                    (!user.is_empty()).then(|| user.to_owned()),
                    Some(pass.to_owned()),
                ),
                None => (None, Some(u.to_owned())),
            },
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || hostport.starts_with('[') => (
                h,
                p.parse::<u16>()
                    .map_err(|_| bad("the port is not a number"))?,
            ),
            _ => (hostport, 6379),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let db = if path.is_empty() {
            0
        } else {
            path.parse::<u32>()
                .map_err(|_| bad("the path must be a database number"))?
        };
        let tls = tls.then(|| TlsSettings {
            server_name: host.to_owned(),
            ca_file: None,
        });
        Ok(Self {
            host: host.to_owned(),
            port,
            db,
            username,
            password,
            timeout,
            max_value_bytes,
            tls,
        })
    }

    /// The TLS connector for `rediss://` (none for `redis://`): loads the CA bundle or the
    /// system's roots. [`Redis`] builds it once and keeps it.
    pub fn tls_connector(
        &self,
    ) -> Result<Option<(TlsConnector, ServerName<'static>)>, RemoteError> {
        let Some(tls) = &self.tls else {
            return Ok(None);
        };
        let config = super::tls::client_config(tls.ca_file.as_deref())?;
        let name = ServerName::try_from(tls.server_name.clone())
            .map_err(|e| RemoteError::Tls(format!("server name {}: {e}", tls.server_name)))?;
        Ok(Some((TlsConnector::from(config), name)))
    }
}

/// `url` with any password replaced, for messages and logs.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            format!("{}<credentials>@{}", &url[..s + 3], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// A connection's byte stream: plain TCP, or TLS over it.
#[derive(Debug)]
enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Self::Plain(s) => s.write_all(bytes).await,
            Self::Tls(s) => {
                s.write_all(bytes).await?;
                s.flush().await
            }
        }
    }

    async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Plain(s) => s.read(buf).await,
            Self::Tls(s) => s.read(buf).await,
        }
    }
}

#[derive(Debug)]
struct Conn {
    stream: Stream,
    buf: Vec<u8>,
}

/// A Redis client for the remote tier.
pub struct Redis {
    config: RedisConfig,
    conn: Mutex<Option<Conn>>,
    /// The TLS connector, built once (by [`Redis::prepare_tls`] or the first connect).
    tls: std::sync::OnceLock<(TlsConnector, ServerName<'static>)>,
}

impl std::fmt::Debug for Redis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redis")
            .field("config", &self.config)
            .field("tls_ready", &self.tls.get().is_some())
            .finish_non_exhaustive()
    }
}

impl Redis {
    /// A client; nothing is connected until the first command.
    pub fn new(config: RedisConfig) -> Self {
        Self {
            config,
            conn: Mutex::new(None),
            tls: std::sync::OnceLock::new(),
        }
    }

    /// Builds the TLS connector now (for `rediss://`), so a CA bundle that cannot be read
    /// fails at start rather than at the first command; later connects reuse it.
    pub fn prepare_tls(&self) -> Result<(), RemoteError> {
        self.tls_connector().map(|_| ())
    }

    fn tls_connector(&self) -> Result<Option<(TlsConnector, ServerName<'static>)>, RemoteError> {
        if let Some(tls) = self.tls.get() {
            return Ok(Some(tls.clone()));
        }
        let Some(built) = self.config.tls_connector()? else {
            return Ok(None);
        };
        Ok(Some(self.tls.get_or_init(|| built).clone()))
    }

    /// Where it connects (for logs).
    pub fn address(&self) -> String {
        format!(
            "{}:{}/{}",
            self.config.host, self.config.port, self.config.db
        )
    }

    /// `PING`.
    pub async fn ping(&self) -> Result<(), RemoteError> {
        match self.command("PING", &[b"PING"]).await? {
            Reply::Status(s) if s == "PONG" => Ok(()),
            reply => Err(RemoteError::Unexpected {
                command: "PING",
                reply,
            }),
        }
    }

    /// `SET key value`.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), RemoteError> {
        match self.command("SET", &[b"SET", key, value]).await? {
            Reply::Status(s) if s == "OK" => Ok(()),
            reply => Err(RemoteError::Unexpected {
                command: "SET",
                reply,
            }),
        }
    }

    /// `GET key`: `None` when Redis does not have it.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Bytes>, RemoteError> {
        match self.command("GET", &[b"GET", key]).await? {
            Reply::Bulk(v) => Ok(v),
            reply => Err(RemoteError::Unexpected {
                command: "GET",
                reply,
            }),
        }
    }

    /// `DEL key`.
    pub async fn delete(&self, key: &[u8]) -> Result<(), RemoteError> {
        match self.command("DEL", &[b"DEL", key]).await? {
            Reply::Integer(_) => Ok(()),
            reply => Err(RemoteError::Unexpected {
                command: "DEL",
                reply,
            }),
        }
    }

    async fn command(&self, name: &'static str, args: &[&[u8]]) -> Result<Reply, RemoteError> {
        let timeout = self.config.timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        // The deadline covers waiting for the connection too.
        let Ok(mut slot) = tokio::time::timeout_at(deadline, self.conn.lock()).await else {
            return Err(RemoteError::Timeout(timeout));
        };
        let result = tokio::time::timeout_at(deadline, async {
            if slot.is_none() {
                *slot = Some(self.connect().await?);
            }
            let conn = slot.as_mut().ok_or(RemoteError::Timeout(timeout))?;
            conn.call(args, self.config.max_value_bytes).await
        })
        .await
        .unwrap_or(Err(RemoteError::Timeout(timeout)));
        match result {
            Ok(Reply::Error(message)) => Err(RemoteError::Refused {
                command: name,
                message,
            }),
            Ok(reply) => Ok(reply),
            Err(e) => {
                // The connection's state is unknown after a failure: start afresh.
                *slot = None;
                Err(e)
            }
        }
    }

    async fn connect(&self) -> Result<Conn, RemoteError> {
        let tcp = TcpStream::connect((self.config.host.as_str(), self.config.port)).await?;
        tcp.set_nodelay(true)?;
        let stream = match self.tls_connector()? {
            None => Stream::Plain(tcp),
            Some((connector, name)) => Stream::Tls(Box::new(
                connector
                    .connect(name, tcp)
                    .await
                    .map_err(|e| RemoteError::Tls(format!("handshake: {e}")))?,
            )),
        };
        let mut conn = Conn {
            stream,
            buf: Vec::new(),
        };
        let limit = self.config.max_value_bytes;
        if let Some(password) = &self.config.password {
            let reply = match &self.config.username {
                Some(user) => {
                    conn.call(&[b"AUTH", user.as_bytes(), password.as_bytes()], limit)
                        .await?
                }
                None => conn.call(&[b"AUTH", password.as_bytes()], limit).await?,
            };
            expect_ok("AUTH", reply)?;
        }
        if self.config.db != 0 {
            let db = self.config.db.to_string();
            expect_ok(
                "SELECT",
                conn.call(&[b"SELECT", db.as_bytes()], limit).await?,
            )?;
        }
        Ok(conn)
    }
}

fn expect_ok(command: &'static str, reply: Reply) -> Result<(), RemoteError> {
    match reply {
        Reply::Status(s) if s == "OK" => Ok(()),
        Reply::Error(message) => Err(RemoteError::Refused { command, message }),
        reply => Err(RemoteError::Unexpected { command, reply }),
    }
}

impl Conn {
    async fn call(&mut self, args: &[&[u8]], max_bulk: usize) -> Result<Reply, RemoteError> {
        let mut out = Vec::with_capacity(64 + args.iter().map(|a| a.len()).sum::<usize>());
        resp::encode(args, &mut out);
        self.stream.write_all(&out).await?;
        loop {
            if let Parsed::Done(reply, used) = resp::parse(&self.buf, max_bulk)? {
                self.buf.drain(..used);
                return Ok(reply);
            }
            // One reply is at most one value and its framing (the commands used here never
            // return large arrays): refuse to buffer more.
            let limit = max_bulk.saturating_add(4 * resp::MAX_LINE);
            if self.buf.len() > limit {
                return Err(RespError::TooLarge {
                    what: "reply",
                    got: self.buf.len(),
                    limit,
                }
                .into());
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            self.buf
                .extend_from_slice(chunk.get(..n).unwrap_or_default());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(1);

    #[test]
    fn urls_parse_with_defaults_and_credentials() {
        let c = RedisConfig::from_url("redis://127.0.0.1", T, 10).unwrap();
        assert_eq!((c.host.as_str(), c.port, c.db), ("127.0.0.1", 6379, 0));
        let c = RedisConfig::from_url("redis://u:p@cache.ns.svc:6380/2", T, 10).unwrap();
        assert_eq!(
            (
                c.host.as_str(),
                c.port,
                c.db,
                c.username.as_deref(),
                c.password.as_deref()
            ),
            ("cache.ns.svc", 6380, 2, Some("u"), Some("p"))
        );
        let c = RedisConfig::from_url("redis://:secret@[::1]:7000", T, 10).unwrap();
        assert_eq!(
            (
                c.host.as_str(),
                c.port,
                c.username.as_deref(),
                c.password.as_deref()
            ),
            ("::1", 7000, None, Some("secret"))
        );
        assert!(!format!("{c:?}").contains("secret"));
        assert_eq!(c.tls, None);
        let c = RedisConfig::from_url("rediss://:pw@cache.example:6380/1", T, 10).unwrap();
        assert_eq!(
            c.tls,
            Some(TlsSettings {
                server_name: "cache.example".into(),
                ca_file: None
            })
        );
        assert_eq!((c.port, c.db), (6380, 1));
        // An IP literal is verified against the certificate's IP entries.
        let dir = std::env::temp_dir().join(format!("kvgate-redis-ip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = dir.join("ca.pem");
        let cert = rcgen::generate_simple_self_signed(vec!["::1".to_owned()]).unwrap();
        std::fs::write(&ca, cert.cert.pem()).unwrap();
        let mut c = RedisConfig::from_url("rediss://[::1]:6380", T, 10).unwrap();
        if let Some(tls) = &mut c.tls {
            tls.ca_file = Some(ca);
        }
        let (_, name) = c.tls_connector().unwrap().unwrap();
        assert!(matches!(name, ServerName::IpAddress(_)), "{name:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_bad_ca_bundle_is_a_tls_error_at_setup() {
        let dir = std::env::temp_dir().join(format!("kvgate-redis-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, b"not a certificate\n").unwrap();
        for ca in [empty, dir.join("missing.pem")] {
            let mut c = RedisConfig::from_url("rediss://h", T, 10).unwrap();
            if let Some(tls) = &mut c.tls {
                tls.ca_file = Some(ca.clone());
            }
            let e = c.tls_connector().err().unwrap();
            assert!(matches!(e, RemoteError::Tls(_)), "{ca:?}: {e}");
            assert_eq!(e.metric_label(), "tls");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_urls_are_refused_without_leaking_the_password() {
        for url in [
            "rediss://",
            "http://h",
            "redis://",
            "redis://h:port",
            "redis://h/db",
        ] {
            assert!(RedisConfig::from_url(url, T, 10).is_err(), "{url}");
        }
        let e = RedisConfig::from_url("redis://u:hunter2@h:x", T, 10).unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    /// A one-shot fake server: reads one command, answers `reply`, then closes.
    async fn fake(reply: &'static [u8]) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(reply).await;
            }
        });
        port
    }

    fn client(port: u16) -> Redis {
        Redis::new(RedisConfig::from_url(&format!("redis://127.0.0.1:{port}"), T, 8).unwrap())
    }

    #[tokio::test]
    async fn server_errors_and_oversized_values_are_typed() {
        let r = client(fake(b"-ERR nope\r\n").await);
        assert!(matches!(
            r.put(b"k", b"v").await,
            Err(RemoteError::Refused { command: "SET", .. })
        ));
        let r = client(fake(b"$100\r\n").await);
        assert!(matches!(r.get(b"k").await, Err(RemoteError::Protocol(_))));
        let r = client(fake(b":1\r\n").await);
        assert!(matches!(
            r.ping().await,
            Err(RemoteError::Unexpected {
                command: "PING",
                ..
            })
        ));
    }

    #[tokio::test]
    async fn a_silent_server_times_out_and_the_next_command_reconnects() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s); // accept, never answer
            }
        });
        let r = Redis::new(
            RedisConfig::from_url(
                &format!("redis://127.0.0.1:{port}"),
                Duration::from_millis(100),
                8,
            )
            .unwrap(),
        );
        assert!(matches!(r.ping().await, Err(RemoteError::Timeout(_))));
        assert!(r.conn.lock().await.is_none());
        assert!(matches!(r.ping().await, Err(RemoteError::Timeout(_))));
    }
}
