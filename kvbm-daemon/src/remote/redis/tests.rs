//! The client against scripted servers: what real Redis will not do.

use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::*;

const T: Duration = Duration::from_secs(1);

/// A fake server: on each connection, reads one batch of commands, answers `reply`, then
/// closes.
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

fn client(port: u16, max_value_bytes: usize) -> Redis {
    Redis::new(
        RedisConfig::from_url(&format!("redis://127.0.0.1:{port}"), T, max_value_bytes).unwrap(),
    )
}

#[tokio::test]
async fn server_errors_and_odd_replies_are_typed() {
    let r = client(fake(b"-ERR nope\r\n").await, 8);
    match r.put(b"k", b"v").await {
        Err(e @ RemoteError::Refused { command: "SET", .. }) => assert!(e.is_transient()),
        other => panic!("{other:?}"),
    }
    let r = client(fake(b":1\r\n").await, 8);
    assert!(matches!(
        r.ping().await,
        Err(RemoteError::Unexpected {
            command: "PING",
            ..
        })
    ));
    // A reply the library cannot read is its error, kept as the source.
    let r = client(fake(b"?what\r\n").await, 8);
    let e = r.ping().await.unwrap_err();
    assert!(
        matches!(
            e,
            RemoteError::Redis {
                command: "PING",
                ..
            }
        ),
        "{e}"
    );
    assert!(std::error::Error::source(&e).is_some());
}

#[tokio::test]
async fn a_value_over_the_bound_is_refused() {
    // The range came back longer than the bound: the value is larger.
    let r = client(fake(b"$9\r\n123456789\r\n").await, 8);
    match r.get(b"k").await {
        Err(e @ RemoteError::TooLarge { limit: 8, .. }) => {
            assert_eq!(e.metric_label(), "too_large");
            assert!(!e.is_transient());
        }
        other => panic!("{other:?}"),
    }
    // At the bound it is the value; an empty range is a missing key.
    let r = client(fake(b"$8\r\n12345678\r\n").await, 8);
    assert_eq!(
        r.get(b"k").await.unwrap().as_deref(),
        Some(&b"12345678"[..])
    );
    let r = client(fake(b"$0\r\n\r\n").await, 8);
    assert_eq!(r.get(b"k").await.unwrap(), None);
}

#[tokio::test]
async fn a_silent_server_times_out_and_the_next_command_does_too() {
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
    let started = std::time::Instant::now();
    assert!(matches!(r.ping().await, Err(RemoteError::Timeout(_))));
    assert!(matches!(r.ping().await, Err(RemoteError::Timeout(_))));
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn nothing_listening_fails_fast_as_transient() {
    // Bound but not listening: connections are refused, and no other test can take the port
    // while it is held (a port freed after binding could be, and was, reused by a parallel test).
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let r = client(held.local_addr().unwrap().port(), 8);
    let started = std::time::Instant::now();
    let e = r.get(b"k").await.unwrap_err();
    assert!(e.is_transient(), "{e}");
    assert_eq!(e.metric_label(), "io", "{e}");
    assert!(started.elapsed() < T, "{:?}", started.elapsed());
}
