//! The remote tier's S3 client against a real S3 server: moto (`moto[server]` in `.venv`,
//! installed by `scripts/bootstrap.sh`; `KVGATE_MOTO_SERVER` points elsewhere) with request
//! authentication on, so every request's SigV4 signature is checked by an independent
//! implementation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use kv_events::BlockKey;
use kvgate_kvbm::remote::RemoteError;
use kvgate_kvbm::remote::s3::{Addressing, S3, S3Config, S3Options};
use kvgate_kvbm::remote::sigv4::Credentials;
use support::{S3Server, free_port, s3_server};

fn client(server: &S3Server, url: &str, secret: &str, max_value: usize) -> S3 {
    let options = S3Options {
        endpoint: Some(format!("http://127.0.0.1:{}", server.port)),
        region: "us-east-1".into(),
        addressing: Addressing::Auto,
    };
    let credentials = Credentials {
        access_key_id: server.access_key.clone(),
        secret_access_key: secret.to_owned(),
        session_token: None,
    };
    S3::new(
        S3Config::from_url(
            url,
            &options,
            credentials,
            Duration::from_secs(5),
            max_value,
        )
        .unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_round_trip_under_checked_signatures() {
    let server = s3_server(free_port(), "kvgate");
    let s3 = client(&server, "s3://kvgate/node-a", &server.secret_key, 4 << 20);
    s3.ping().await.unwrap();

    let name = s3.block_name(0xab, BlockKey(7));
    assert_eq!(name, "node-a/00000000000000ab/0000000000000007");
    let block: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    s3.put(&name, &block).await.unwrap();
    assert_eq!(s3.get(&name).await.unwrap().as_deref(), Some(&block[..]));
    // Overwriting is a put like any other (two nodes write identical bytes under one name).
    s3.put(&name, &block).await.unwrap();
    let other = s3.block_name(0xab, BlockKey(8));
    assert_eq!(s3.get(&other).await.unwrap(), None);
    s3.delete(&name).await.unwrap();
    assert_eq!(s3.get(&name).await.unwrap(), None);
    // Deleting what is not there is fine.
    s3.delete(&other).await.unwrap();
    // An empty object, and one whose key needs encoding, round-trip too.
    s3.put("node-a/odd key:+&=", b"").await.unwrap();
    assert_eq!(
        s3.get("node-a/odd key:+&=").await.unwrap().as_deref(),
        Some(&b""[..])
    );

    // Many requests in parallel share the keep-alive connections.
    let s3 = std::sync::Arc::new(s3);
    let tasks: Vec<_> = (0..16u64)
        .map(|i| {
            let s3 = std::sync::Arc::clone(&s3);
            tokio::spawn(async move {
                let name = s3.block_name(1, BlockKey(i));
                let value = vec![i as u8; 4096 + i as usize];
                s3.put(&name, &value).await.unwrap();
                assert_eq!(s3.get(&name).await.unwrap().as_deref(), Some(&value[..]));
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
    // A wrong secret: moto recomputes the signature and refuses it.
    let forged = client(&server, "s3://kvgate", "not-the-secret", 1 << 20);
    match forged.put("k", b"v").await {
        Err(RemoteError::Status {
            status: 403, code, ..
        }) => {
            assert_eq!(code, "SignatureDoesNotMatch");
        }
        other => panic!("{other:?}"),
    }
    let e = forged.ping().await.unwrap_err();
    assert_eq!(e.metric_label(), "status");
    // A bucket that does not exist.
    let missing = client(&server, "s3://no-such-bucket", &server.secret_key, 1 << 20);
    match missing.put("k", b"v").await {
        Err(RemoteError::Status {
            status: 404, code, ..
        }) => assert_eq!(code, "NoSuchBucket"),
        other => panic!("{other:?}"),
    }
    assert!(missing.ping().await.is_err());
    // An object larger than the client reads back is refused, not allocated, and the client
    // keeps working.
    let small = client(&server, "s3://kvgate", &server.secret_key, 1024);
    small.put("big", &[7; 4096]).await.unwrap();
    assert!(matches!(
        small.get("big").await,
        Err(RemoteError::TooLarge {
            op: "GET",
            limit: 1024
        })
    ));
    assert_eq!(small.get("absent").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_goes_away_costs_requests_not_the_client() {
    let port = free_port();
    let mut server = s3_server(port, "kvgate");
    let s3 = client(&server, "s3://kvgate", &server.secret_key, 1 << 20);
    s3.put("k", b"v").await.unwrap();
    server.proc.0.kill().unwrap();
    server.proc.0.wait().unwrap();
    let e = s3.get("k").await.unwrap_err();
    assert!(
        matches!(e.metric_label(), "io" | "http"),
        "a closed endpoint: {e}"
    );
    // Back on the same port (moto keeps nothing): the client reconnects by itself.
    let again = s3_server(port, "kvgate");
    let s3 = client(&again, "s3://kvgate", &again.secret_key, 1 << 20);
    assert_eq!(s3.get("k").await.unwrap(), None);
    s3.put("k", b"v2").await.unwrap();
    assert_eq!(s3.get("k").await.unwrap().as_deref(), Some(&b"v2"[..]));
}
