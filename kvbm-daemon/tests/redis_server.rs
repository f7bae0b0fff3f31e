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
    assert!(matches!(
        small.get(b"big").await,
        Err(RemoteError::Protocol(_))
    ));
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
