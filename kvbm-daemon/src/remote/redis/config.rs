//! Where and how to reach Redis: `redis[s]://[[user]:password@]host[:port][/db]` parsed and
//! checked at start, and turned into the library's client.

use std::path::PathBuf;
use std::time::Duration;

use ::redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo as _, RedisConnectionInfo};

use super::super::{RemoteError, tls};

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
    /// The largest value read back.
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

    /// The library's client: the address, the credentials and database, no `CLIENT SETINFO`
    /// on connecting; for `rediss://`, the CA bundle read (and checked) now, or the system's
    /// roots checked to be there.
    pub fn client(&self) -> Result<::redis::Client, RemoteError> {
        let settings = RedisConnectionInfo::default()
            .set_db(i64::from(self.db))
            .set_skip_set_lib_name();
        let settings = match &self.username {
            Some(user) => settings.set_username(user),
            None => settings,
        };
        let settings = match &self.password {
            Some(password) => settings.set_password(password),
            None => settings,
        };
        let addr = match &self.tls {
            None => ConnectionAddr::Tcp(self.host.clone(), self.port),
            Some(_) => ConnectionAddr::TcpTls {
                host: self.host.clone(),
                port: self.port,
                insecure: false,
                tls_params: None,
            },
        };
        let info: ConnectionInfo = addr
            .into_connection_info()
            .map_err(|e| RemoteError::Url(e.to_string()))?
            .set_redis_settings(settings)
            .set_tcp_settings(::redis::io::tcp::TcpSettings::default().set_nodelay(true));
        let built = match &self.tls {
            None => ::redis::Client::open(info),
            Some(TlsSettings { ca_file: None, .. }) => {
                tls::check_system_roots()?;
                tls::install_ring();
                ::redis::Client::open(info)
            }
            Some(TlsSettings {
                ca_file: Some(path),
                ..
            }) => {
                let root_cert = Some(tls::ca_bundle(path)?);
                tls::install_ring();
                ::redis::Client::build_with_tls(
                    info,
                    ::redis::TlsCertificates {
                        client_tls: None,
                        root_cert,
                    },
                )
            }
        };
        built.map_err(|e| RemoteError::Tls(format!("setting up the client: {e}")))
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
    }

    #[test]
    fn the_client_gets_the_address_database_and_credentials() {
        let c = RedisConfig::from_url("redis://u:p@[::1]:7000/5", T, 10).unwrap();
        let client = c.client().unwrap();
        let info = client.get_connection_info();
        assert_eq!(*info.addr(), ConnectionAddr::Tcp("::1".into(), 7000));
        let redis = info.redis_settings();
        assert_eq!(
            (redis.db(), redis.username(), redis.password()),
            (5, Some("u"), Some("p"))
        );
        assert!(redis.skip_set_lib_name());
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
            let e = c.client().err().unwrap();
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
}
