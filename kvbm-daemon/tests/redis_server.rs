//! The remote tier's client against a real `redis-server` (Debian's, installed by
//! `scripts/bootstrap.sh`; `KVGATE_REDIS_SERVER` points elsewhere).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use kvgate_kvbm::remote::redis::{Redis, RedisConfig, RemoteError};
use support::{free_port, redis_server};

/// A `redis-server` and its port.
struct Server {
    _proc: support::Proc,
    port: u16,
}

impl Server {
    fn start(port: u16, password: Option<&str>) -> Self {
        Self {
            _proc: redis_server(port, password),
            port,
        }
    }
}

fn client(url: &str) -> Redis {
    Redis::new(RedisConfig::from_url(url, Duration::from_secs(2), 4 << 20).unwrap())
}

#[tokio::test]
async fn blocks_round_trip_and_missing_ones_are_none() {
    let server = Server::start(free_port(), None);
    let r = client(&format!("redis://127.0.0.1:{}/3", server.port));
    r.ping().await.unwrap();
    let block: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    r.put(b"kvgate:kvbm:a:1", &block).await.unwrap();
    assert_eq!(
        r.get(b"kvgate:kvbm:a:1").await.unwrap().as_deref(),
        Some(&block[..])
    );
    assert_eq!(r.get(b"kvgate:kvbm:a:2").await.unwrap(), None);
    r.delete(b"kvgate:kvbm:a:1").await.unwrap();
    assert_eq!(r.get(b"kvgate:kvbm:a:1").await.unwrap(), None);
    // A value over the client's bound is refused, not allocated.
    let small = Redis::new(
        RedisConfig::from_url(
            &format!("redis://127.0.0.1:{}/3", server.port),
            Duration::from_secs(2),
            1024,
        )
        .unwrap(),
    );
    small.put(b"big", &block).await.unwrap();
    match small.get(b"big").await {
        Err(e @ RemoteError::TooLarge { limit: 1024, .. }) => assert!(!e.is_transient()),
        other => panic!("{other:?}"),
    }
    // A value of exactly the bound is read.
    small.put(b"full", &block[..1024]).await.unwrap();
    assert_eq!(
        small.get(b"full").await.unwrap().as_deref(),
        Some(&block[..1024])
    );
    // ...and the connection recovers for the next command.
    assert_eq!(small.get(b"absent").await.unwrap(), None);
}

#[tokio::test]
async fn passwords_are_sent_and_wrong_ones_refused() {
    let server = Server::start(free_port(), Some("s3cret"));
    let ok = client(&format!("redis://:s3cret@127.0.0.1:{}", server.port));
    ok.put(b"k", b"v").await.unwrap();
    let wrong = client(&format!("redis://:nope@127.0.0.1:{}", server.port));
    let err = wrong.get(b"k").await.unwrap_err();
    assert!(
        matches!(
            err,
            RemoteError::Refused {
                command: "AUTH",
                ..
            }
        ),
        "{err}"
    );
    let none = client(&format!("redis://127.0.0.1:{}", server.port));
    assert!(matches!(
        none.get(b"k").await,
        Err(RemoteError::Refused { command: "GET", .. })
    ));
}

#[tokio::test]
async fn a_restarted_server_costs_one_command() {
    let port = free_port();
    let server = Server::start(port, None);
    let r = client(&format!("redis://127.0.0.1:{port}"));
    r.put(b"k", b"v").await.unwrap();
    drop(server);
    assert!(r.get(b"k").await.is_err());
    let _server = Server::start(port, None);
    // A fresh connection; the data is gone (no persistence), which the store handles as lost.
    assert_eq!(r.get(b"k").await.unwrap(), None);
}

/// A CA, and a certificate for `localhost` it signed: (CA PEM, server cert PEM, server key PEM).
fn tls_material() -> (String, String, String) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
    let server_key = rcgen::KeyPair::generate().unwrap();
    let server = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    (ca.pem(), server.pem(), server_key.serialize_pem())
}

#[tokio::test]
async fn rediss_speaks_tls_and_verifies_the_server() {
    /// Removes the test's files however it ends.
    struct Dir(std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let guard = Dir(std::env::temp_dir().join(format!("kvgate-rediss-{}", std::process::id())));
    let dir = guard.0.clone();
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, cert, key) = tls_material();
    let (ca_file, cert_file, key_file) = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&ca_file, ca).unwrap();
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, key).unwrap();
    let port = free_port();
    let _server = support::redis_tls_server(port, &cert_file, &key_file);
    let tls_client = |url: &str, ca: Option<&std::path::Path>| {
        let mut c = RedisConfig::from_url(url, Duration::from_secs(2), 1 << 20).unwrap();
        if let Some(tls) = &mut c.tls {
            tls.ca_file = ca.map(std::path::Path::to_path_buf);
        }
        Redis::new(c)
    };
    // Trusting the CA, by the certificate's name: a working remote tier.
    let r = tls_client(&format!("rediss://localhost:{port}/2"), Some(&ca_file));
    r.ping().await.unwrap();
    r.prepare_tls().unwrap();
    // A block of many TLS records each way.
    let block: Vec<u8> = (0..(1 << 20) - 64).map(|i| (i % 253) as u8).collect();
    r.put(b"kvgate:kvbm:t:1", &block).await.unwrap();
    assert_eq!(
        r.get(b"kvgate:kvbm:t:1").await.unwrap().as_deref(),
        Some(&block[..])
    );
    // A name the certificate does not carry is refused.
    let wrong_name = tls_client(&format!("rediss://127.0.0.1:{port}"), Some(&ca_file));
    let e = wrong_name.ping().await.unwrap_err();
    assert_eq!(e.metric_label(), "tls", "{e}");
    assert!(e.to_string().contains("handshake"), "{e}");
    // So is a server signed by a CA we do not trust.
    let (other_ca, _, _) = tls_material();
    let other = dir.join("other.pem");
    std::fs::write(&other, other_ca).unwrap();
    let untrusted = tls_client(&format!("rediss://localhost:{port}"), Some(&other));
    let e = untrusted.ping().await.unwrap_err();
    assert_eq!(e.metric_label(), "tls", "{e}");
    assert!(e.to_string().contains("handshake"), "{e}");
    // And plain TCP to the TLS port gets nowhere.
    let plain = client(&format!("redis://localhost:{port}"));
    assert!(plain.ping().await.is_err());
}
