#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]
//! The servers on loopback: TLS with the generated certificate, plaintext, health, shutdown.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use kvgate_epp::extproc::{Handoffs, ResponseEvent, Router, StreamConfig};
use kvgate_epp::server::{self, Readiness, ServeError, ServerConfig, TlsMode};
use support::*;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const LONG: Duration = Duration::from_secs(10);

struct Running {
    ext_proc: SocketAddr,
    health: SocketAddr,
    cert: Option<String>,
    readiness: Readiness,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn start(router: Arc<FakeRouter>, tls: TlsMode, drain_timeout: Duration) -> Running {
    let config = ServerConfig {
        ext_proc_addr: loopback(),
        health_addr: loopback(),
        observer_addr: None,
        tls,
        stream: StreamConfig::default(),
        drain_timeout,
        http2_adaptive_window: false,
    };
    let bound = server::bind(config).await.unwrap();
    let ext_proc = bound.ext_proc_addr().unwrap();
    let health = bound.health_addr().unwrap();
    let cert = bound.certificate_pem().map(str::to_owned);
    let readiness = Readiness::new();
    let (stop, stopped) = oneshot::channel::<()>();
    let r: Arc<dyn Router> = router;
    let task = tokio::spawn(bound.serve(r, readiness.clone(), async {
        let _ = stopped.await;
    }));
    Running {
        ext_proc,
        health,
        cert,
        readiness,
        stop: Some(stop),
        task,
    }
}

async fn tls_client(addr: SocketAddr, cert_pem: &str) -> ExternalProcessorClient<Channel> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(cert_pem))
        .domain_name("localhost");
    let channel = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    ExternalProcessorClient::new(channel)
}

async fn plain_client(addr: SocketAddr) -> ExternalProcessorClient<Channel> {
    ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

async fn open(
    client: &mut ExternalProcessorClient<Channel>,
) -> (
    mpsc::Sender<ProcessingRequest>,
    Streaming<ProcessingResponse>,
) {
    let (tx, rx) = mpsc::channel(16);
    let replies = client
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, replies)
}

async fn get_once(client: &mut ExternalProcessorClient<Channel>) -> ProcessingResponse {
    let (tx, mut rx) = open(client).await;
    tx.send(req_headers(
        &[(":method", "GET"), (":path", "/v1/models")],
        true,
        duplex(),
    ))
    .await
    .unwrap();
    tokio::time::timeout(LONG, rx.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
}

async fn health_status(addr: SocketAddr, service: &str) -> ServingStatus {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let reply = client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    ServingStatus::try_from(reply.status).unwrap()
}

#[tokio::test]
async fn tls_handshake_with_the_generated_certificate() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let running = start(
        router.clone(),
        TlsMode::SelfSigned {
            names: vec!["localhost".into()],
        },
        LONG,
    )
    .await;
    let cert = running.cert.clone().expect("TLS is on");
    let mut client = tls_client(running.ext_proc, &cert).await;
    let reply = get_once(&mut client).await;
    assert_eq!(
        set_headers(&reply)["x-gateway-destination-endpoint"],
        "10.0.0.1:8000"
    );

    // A plaintext client cannot talk to the TLS listener.
    let plain = Endpoint::from_shared(format!("http://{}", running.ext_proc))
        .unwrap()
        .connect()
        .await;
    if let Ok(channel) = plain {
        let mut c = ExternalProcessorClient::new(channel);
        let (_tx, rx) = mpsc::channel::<ProcessingRequest>(1);
        let res = tokio::time::timeout(LONG, c.process(ReceiverStream::new(rx))).await;
        assert!(
            !matches!(res, Ok(Ok(_))),
            "plaintext went through a TLS listener"
        );
    }
    running.task.abort();
}

#[tokio::test]
async fn tls_from_certificate_files() {
    let dir = std::env::temp_dir().join(format!("kvgate-server-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pair = rcgen_pair();
    std::fs::write(dir.join("tls.crt"), &pair.0).unwrap();
    std::fs::write(dir.join("tls.key"), &pair.1).unwrap();
    let running = start(
        FakeRouter::picking(&["10.0.0.2:8000"]),
        TlsMode::Files {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        },
        LONG,
    )
    .await;
    assert_eq!(running.cert.as_deref(), Some(pair.0.as_str()));
    let mut client = tls_client(running.ext_proc, &pair.0).await;
    let reply = get_once(&mut client).await;
    assert_eq!(
        set_headers(&reply)["x-gateway-destination-endpoint"],
        "10.0.0.2:8000"
    );
    running.task.abort();

    // A key file that is not a key is refused before any port is bound.
    std::fs::write(dir.join("bad.key"), "not a key").unwrap();
    let err = server::bind(ServerConfig {
        ext_proc_addr: loopback(),
        health_addr: loopback(),
        observer_addr: None,
        tls: TlsMode::Files {
            cert: dir.join("tls.crt"),
            key: dir.join("bad.key"),
        },
        stream: StreamConfig::default(),
        drain_timeout: LONG,
        http2_adaptive_window: false,
    })
    .await
    .unwrap_err();
    assert_eq!(err.metric_label(), "tls");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A certificate and key in PEM, made the way the server makes its own.
fn rcgen_pair() -> (String, String) {
    let c = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    (c.cert.pem(), c.signing_key.serialize_pem())
}

#[tokio::test]
async fn health_follows_readiness_and_liveness_is_always_serving() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let running = start(router, TlsMode::Plaintext, LONG).await;
    let follow = [
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
        "inference-extension",
        "",
    ];
    let wait_for = |service: &'static str, want: ServingStatus| {
        let addr = running.health;
        async move {
            let deadline = tokio::time::Instant::now() + LONG;
            loop {
                let got = health_status(addr, service).await;
                if got == want {
                    return;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{service:?} stuck at {got:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_for("liveness", ServingStatus::Serving).await;
    for s in follow {
        wait_for(s, ServingStatus::NotServing).await;
    }
    running.readiness.set(true);
    for s in follow {
        wait_for(s, ServingStatus::Serving).await;
    }
    running.readiness.set(false);
    wait_for("readiness", ServingStatus::NotServing).await;
    wait_for("liveness", ServingStatus::Serving).await;

    // Plaintext ext_proc works too.
    let mut client = plain_client(running.ext_proc).await;
    let reply = get_once(&mut client).await;
    assert!(is_request_headers(&reply));
    running.task.abort();
}

#[tokio::test]
async fn shutdown_drains_open_streams() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut running = start(router.clone(), TlsMode::Plaintext, LONG).await;
    running.readiness.set(true);
    let mut client = plain_client(running.ext_proc).await;
    let (tx, mut rx) = open(&mut client).await;
    tx.send(req_headers(&[(":method", "GET")], true, duplex()))
        .await
        .unwrap();
    rx.message().await.unwrap().unwrap();

    running.stop.take().unwrap().send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !running.task.is_finished(),
        "an open stream holds the drain"
    );

    // The open stream still works and completes.
    let mut done = resp_headers("200", "application/json", None);
    if let Some(
        envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request::ResponseHeaders(
            h,
        ),
    ) = &mut done.request
    {
        h.end_of_stream = true;
    }
    tx.send(done).await.unwrap();
    rx.message().await.unwrap().unwrap();
    drop(tx);
    drop(rx);
    drop(client);
    let result = tokio::time::timeout(LONG, running.task)
        .await
        .unwrap()
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(
        router.until_terminal(1).await.last(),
        Some(&ResponseEvent::End)
    );
}

#[tokio::test]
async fn drain_timeout_cuts_streams_and_aborts_their_tickets() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut running = start(
        router.clone(),
        TlsMode::Plaintext,
        Duration::from_millis(200),
    )
    .await;
    let mut client = plain_client(running.ext_proc).await;
    let (tx, mut rx) = open(&mut client).await;
    tx.send(req_headers(&[(":method", "GET")], true, duplex()))
        .await
        .unwrap();
    rx.message().await.unwrap().unwrap();

    running.stop.take().unwrap().send(()).unwrap();
    let result = tokio::time::timeout(LONG, running.task)
        .await
        .unwrap()
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(router.until_terminal(1).await, [ResponseEvent::Aborted]);
    let end = tokio::time::timeout(LONG, rx.message()).await.unwrap();
    assert!(!matches!(end, Ok(Some(_))), "the cut stream ended: {end:?}");
    drop(tx);
}

#[tokio::test]
async fn port_in_use_is_reported_before_serving() {
    let taken = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    let err = server::bind(ServerConfig {
        ext_proc_addr: taken.local_addr().unwrap(),
        health_addr: loopback(),
        observer_addr: None,
        tls: TlsMode::Plaintext,
        stream: StreamConfig::default(),
        drain_timeout: LONG,
        http2_adaptive_window: false,
    })
    .await
    .unwrap_err();
    assert_eq!(err.metric_label(), "bind");
    assert!(
        err.to_string()
            .contains(&taken.local_addr().unwrap().to_string())
    );
}

/// The response observer's own port (`--observer-port`): a stream there carries no role
/// metadata, yet it never routes; it claims the ticket the routing stream on the ext_proc port
/// parked and reports the response against it.
#[tokio::test]
async fn the_observer_port_observes_without_role_metadata() {
    let router = FakeRouter::picking(&["10.0.0.2:8000"]);
    let config = ServerConfig {
        ext_proc_addr: loopback(),
        health_addr: loopback(),
        observer_addr: Some(loopback()),
        tls: TlsMode::Plaintext,
        stream: StreamConfig::default(),
        drain_timeout: LONG,
        http2_adaptive_window: false,
    };
    let bound = server::bind(config)
        .await
        .unwrap()
        .with_handoffs(Arc::new(Handoffs::new(16)));
    let (ext_proc, observer) = (
        bound.ext_proc_addr().unwrap(),
        bound.observer_addr().unwrap(),
    );
    assert_ne!(ext_proc, observer);
    let r: Arc<dyn Router> = router.clone();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(bound.serve(r, Readiness::new(), async {
        let _ = stopped.await;
    }));

    let mut routing = plain_client(ext_proc).await;
    let (tx, mut rx) = open(&mut routing).await;
    tx.send(req_headers(
        &[
            (":method", "GET"),
            (":path", "/v1/models"),
            ("x-request-id", "obs-1"),
        ],
        true,
        duplex(),
    ))
    .await
    .unwrap();
    let reply = tokio::time::timeout(LONG, rx.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        set_headers(&reply)["x-gateway-destination-endpoint"],
        "10.0.0.2:8000"
    );
    drop(tx);

    let mut observing = plain_client(observer).await;
    let (tx, mut rx) = open(&mut observing).await;
    tx.send(req_headers(&[("x-request-id", "obs-1")], false, duplex()))
        .await
        .unwrap();
    let reply = tokio::time::timeout(LONG, rx.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(is_request_headers(&reply));
    assert!(
        !set_headers(&reply).contains_key("x-gateway-destination-endpoint"),
        "an observer stream never routes"
    );
    tx.send(resp_headers("200", "application/json", None))
        .await
        .unwrap();
    tx.send(resp_body(b"{}", true)).await.unwrap();
    let events = router.until_terminal(1).await;
    assert_eq!(events.last(), Some(&ResponseEvent::End), "{events:?}");
    assert_eq!(
        router.tickets_issued(),
        1,
        "routed once, on the ext_proc port"
    );
    drop(tx);
    let _ = stop.send(());
    tokio::time::timeout(LONG, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
