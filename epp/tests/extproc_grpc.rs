#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]
//! The ext_proc service over real gRPC on an in-memory transport (`tokio::io::duplex`), driven
//! the way Envoy drives it, with a fake router.

mod support;

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse, body_mutation::Mutation,
};
use envoy_types::pb::google::protobuf::{ListValue, Value, value::Kind};
use hyper_util::rt::TokioIo;
use kvgate_epp::extproc::{MAX_CHUNK_BYTES, Rejection, ResponseEvent, StreamConfig};
use kvgate_epp::server::ExtProcService;
use support::*;
use tokio::sync::mpsc;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::{Channel, Endpoint, Server, Uri};

const LONG: Duration = Duration::from_secs(10);

/// A client connected to an in-process server over in-memory pipes.
async fn connect(
    router: Arc<FakeRouter>,
    config: StreamConfig,
) -> ExternalProcessorClient<Channel> {
    let (conn_tx, conn_rx) = mpsc::channel::<tokio::io::DuplexStream>(8);
    let service = ExtProcService::new(router, config).into_server();
    tokio::spawn(async move {
        Server::builder()
            .add_service(service)
            .serve_with_incoming(ReceiverStream::new(conn_rx).map(Ok::<_, std::io::Error>))
            .await
    });
    let channel = Endpoint::try_from("http://in-memory.invalid")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let conn_tx = conn_tx.clone();
            async move {
                let (client, server) = tokio::io::duplex(1 << 20);
                conn_tx
                    .send(server)
                    .await
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                Ok::<_, std::io::Error>(TokioIo::new(client))
            }
        }))
        .await
        .unwrap();
    ExternalProcessorClient::new(channel).max_decoding_message_size(64 << 20)
}

/// One `Process` stream, as Envoy holds it.
struct Conversation {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Conversation {
    async fn open(client: &mut ExternalProcessorClient<Channel>) -> Self {
        let (tx, rx) = mpsc::channel(64);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Self { tx, rx }
    }

    async fn send(&self, msg: ProcessingRequest) {
        self.tx.send(msg).await.unwrap();
    }

    async fn recv(&mut self) -> ProcessingResponse {
        tokio::time::timeout(LONG, self.rx.message())
            .await
            .expect("no reply in time")
            .unwrap()
            .expect("stream ended")
    }

    /// Nothing arrives for a while (a deferred reply stays deferred).
    async fn quiet(&mut self) {
        let got = tokio::time::timeout(Duration::from_millis(150), self.rx.message()).await;
        assert!(got.is_err(), "unexpected reply: {got:?}");
    }
}

async fn picking(endpoints: &[&str]) -> (Arc<FakeRouter>, ExternalProcessorClient<Channel>) {
    let router = FakeRouter::picking(endpoints);
    let client = connect(router.clone(), StreamConfig::default()).await;
    (router, client)
}

#[tokio::test]
async fn body_split_across_chunks_is_answered_after_the_last_chunk() {
    let (router, mut client) = picking(&["10.0.0.1:8000", "10.0.0.2:8000"]).await;
    let mut c = Conversation::open(&mut client).await;
    c.send(post(duplex())).await;
    c.send(req_body(
        br#"{"model":"m","messages":[{"role":"user","#,
        false,
    ))
    .await;
    c.quiet().await;
    c.send(req_body(br#""content":"hi"}]}"#, true)).await;
    let headers = c.recv().await;
    assert!(is_request_headers(&headers));
    let set = set_headers(&headers);
    assert_eq!(
        set["x-gateway-destination-endpoint"], "10.0.0.1:8000",
        "the header names the primary; the metadata adds the fallback"
    );
    assert_eq!(
        metadata_endpoint(&headers).as_deref(),
        Some("10.0.0.1:8000,10.0.0.2:8000")
    );
    assert!(common(&headers).clear_route_cache);
    let body = c.recv().await;
    let chunk = streamed_chunk(&body);
    let want = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(chunk.body, want);
    assert!(chunk.end_of_stream);
    assert_eq!(set["content-length"], want.len().to_string());
    assert_eq!(router.seen()[0].body.as_deref(), Some(&want[..]));
    assert_eq!(router.seen()[0].request_id.as_deref(), Some("it-1"));
}

#[tokio::test]
async fn header_only_get_is_answered_on_the_headers() {
    let (router, mut client) = picking(&["10.0.0.3:8000"]).await;
    let mut c = Conversation::open(&mut client).await;
    c.send(req_headers(
        &[(":method", "GET"), (":path", "/v1/models")],
        true,
        duplex(),
    ))
    .await;
    let reply = c.recv().await;
    assert!(is_request_headers(&reply));
    assert_eq!(
        set_headers(&reply)["x-gateway-destination-endpoint"],
        "10.0.0.3:8000"
    );
    assert_eq!(router.seen()[0].body, None);
}

fn list(items: &[&str]) -> Kind {
    Kind::ListValue(ListValue {
        values: items
            .iter()
            .map(|s| Value {
                kind: Some(Kind::StringValue((*s).to_owned())),
            })
            .collect(),
    })
}

#[tokio::test]
async fn subset_hints_in_every_form_and_empty_is_503() {
    let router = FakeRouter::new(|seen| {
        // Pick the first allowed entry, with port 8000 for a bare IP.
        let first = seen.subset.as_ref().and_then(|s| s.first().cloned());
        let ep = match first {
            Some(e) if e.contains(':') => e,
            Some(ip) => format!("{ip}:8000"),
            None => "10.0.0.9:8000".into(),
        };
        Ok(decision(&[ep]))
    });
    let mut client = connect(router.clone(), StreamConfig::default()).await;
    let cases = [
        (
            Some(list(&["10.0.0.5:8001", "10.0.0.6:8001"])),
            Some("10.0.0.5:8001"),
        ),
        (
            Some(Kind::StringValue("10.0.0.7:8002, 10.0.0.8:8002".into())),
            Some("10.0.0.7:8002"),
        ),
        (Some(list(&["10.0.0.4"])), Some("10.0.0.4:8000")),
        (None, Some("10.0.0.9:8000")),
        (Some(list(&[])), None),
        (Some(Kind::StringValue(String::new())), None),
    ];
    for (hint, want) in cases {
        let mut c = Conversation::open(&mut client).await;
        let mut msg = req_headers(&[(":method", "GET")], true, duplex());
        msg.metadata_context = hint.clone().map(|k| {
            metadata(
                "envoy.lb.subset_hint",
                "x-gateway-destination-endpoint-subset",
                k,
            )
        });
        c.send(msg).await;
        let reply = c.recv().await;
        match want {
            Some(ep) => assert_eq!(
                set_headers(&reply)["x-gateway-destination-endpoint"],
                ep,
                "hint {hint:?}"
            ),
            None => {
                let ir = immediate(&reply);
                assert_eq!(ir.status.unwrap().code, 503, "hint {hint:?}");
            }
        }
    }
    assert_eq!(
        router.seen().len(),
        4,
        "empty subsets never reach the router"
    );
}

#[tokio::test]
async fn invalid_request_gets_the_routers_400() {
    let router = FakeRouter::new(|seen| {
        serde_json::from_slice::<serde_json::Value>(seen.body.as_deref().unwrap_or_default())
            .map(|_| decision(&["10.0.0.1:8000".into()]))
            .map_err(|e| Rejection::BadRequest(format!("invalid JSON body: {e}")))
    });
    let mut client = connect(router.clone(), StreamConfig::default()).await;
    let mut c = Conversation::open(&mut client).await;
    c.send(post(duplex())).await;
    c.send(req_body(b"{\"model\": ", true)).await;
    let ir = c.recv().await;
    let ir = immediate(&ir);
    assert_eq!(ir.status.unwrap().code, 400);
    assert_eq!(
        immediate_header(ir, "x-kvgate-drop-reason").as_deref(),
        Some("bad-request")
    );
    assert_eq!(
        immediate_header(ir, "content-type").as_deref(),
        Some("application/json")
    );
    let body: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("invalid JSON body")
    );
    assert_eq!(body["error"]["type"], "invalid_request_error");
}

#[tokio::test]
async fn streaming_sse_response_reports_usage() {
    let (router, mut client) = picking(&["10.0.0.1:8000"]).await;
    let mut c = Conversation::open(&mut client).await;
    c.send(post(duplex())).await;
    c.send(req_body(
        br#"{"stream":true,"stream_options":{"include_usage":true}}"#,
        true,
    ))
    .await;
    c.recv().await;
    c.recv().await;
    c.send(resp_headers(
        "200",
        "text/event-stream",
        Some("10.0.0.1:8000"),
    ))
    .await;
    assert!(matches!(
        c.recv().await.response,
        Some(envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response::ResponseHeaders(_))
    ));
    let chunks = [
        "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n",
    ];
    for (i, chunk) in chunks.iter().enumerate() {
        c.send(resp_body(chunk.as_bytes(), i == 1)).await;
        let echoed = c.recv().await;
        assert_eq!(streamed_chunk(&echoed).body, chunk.as_bytes());
    }
    let events = router.until_terminal(1).await;
    assert_eq!(
        events,
        [
            ResponseEvent::Headers {
                status: 200,
                served: Some("10.0.0.1:8000".into())
            },
            ResponseEvent::FirstByte,
            ResponseEvent::Usage {
                prompt_tokens: 11,
                completion_tokens: 1,
                cached_tokens: Some(0)
            },
            ResponseEvent::End,
        ]
    );
}

#[tokio::test]
async fn large_body_is_rechunked_intact() {
    let (router, mut client) = picking(&["10.0.0.1:8000"]).await;
    let mut c = Conversation::open(&mut client).await;
    let body: Vec<u8> = (0..(1 << 20) + 300_001u32)
        .map(|i| b'a' + (i % 23) as u8)
        .collect();
    c.send(post(duplex())).await;
    let pieces: Vec<&[u8]> = body.chunks(65_536).collect();
    for (i, p) in pieces.iter().enumerate() {
        c.send(req_body(p, i + 1 == pieces.len())).await;
    }
    let headers = c.recv().await;
    assert_eq!(
        set_headers(&headers)["content-length"],
        body.len().to_string()
    );
    let mut joined = Vec::new();
    loop {
        let reply = c.recv().await;
        let chunk = streamed_chunk(&reply);
        assert!(chunk.body.len() <= MAX_CHUNK_BYTES);
        joined.extend_from_slice(&chunk.body);
        if chunk.end_of_stream {
            break;
        }
    }
    assert_eq!(joined.len(), body.len());
    assert!(joined == body, "body changed on the way");
    assert_eq!(
        router.seen()[0].body.as_ref().map(Vec::len),
        Some(body.len())
    );
}

#[tokio::test]
async fn buffered_mode_takes_a_whole_large_body_in_one_message() {
    let router = FakeRouter::new(|seen| {
        let mut d = decision(&["10.0.0.1:8000".into()]);
        d.body = seen.body.as_ref().map(|b| b[..b.len() / 2].to_vec());
        Ok(d)
    });
    let mut client = connect(router.clone(), StreamConfig::default()).await;
    let mut c = Conversation::open(&mut client).await;
    c.send(post(modes(BodySendMode::Buffered, BodySendMode::None)))
        .await;
    let first = c.recv().await;
    assert!(is_request_headers(&first));
    assert!(common(&first).header_mutation.is_none());
    let body = vec![b'z'; 6 << 20];
    c.send(req_body(&body, true)).await;
    let reply = c.recv().await;
    assert_eq!(set_headers(&reply)["content-length"], (3 << 20).to_string());
    assert_eq!(metadata_endpoint(&reply).as_deref(), Some("10.0.0.1:8000"));
    match common(&reply)
        .body_mutation
        .as_ref()
        .and_then(|m| m.mutation.as_ref())
    {
        Some(Mutation::Body(b)) => assert_eq!(b.len(), 3 << 20),
        other => panic!("expected a replaced body, got {:?}", other.map(|_| "other")),
    }
}

#[tokio::test]
async fn client_disconnect_mid_stream_aborts_exactly_once() {
    let (router, mut client) = picking(&["10.0.0.1:8000"]).await;
    let mut c = Conversation::open(&mut client).await;
    c.send(post(duplex())).await;
    c.send(req_body(b"{}", true)).await;
    c.recv().await;
    c.recv().await;
    c.send(resp_headers("200", "text/event-stream", None)).await;
    c.recv().await;
    c.send(resp_body(b"data: {\"choices\":[]}\n\n", false))
        .await;
    c.recv().await;
    drop(c);
    let events = router.until_terminal(1).await;
    assert_eq!(events.last(), Some(&ResponseEvent::Aborted));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let terminal = router
        .events()
        .iter()
        .filter(|(t, e)| *t == 1 && e.is_terminal())
        .count();
    assert_eq!(terminal, 1);
}

#[tokio::test]
async fn body_over_the_limit_is_413() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let config = StreamConfig {
        max_body_bytes: 100_000,
        ..StreamConfig::default()
    };
    let mut client = connect(router.clone(), config).await;
    let mut c = Conversation::open(&mut client).await;
    c.send(post(duplex())).await;
    c.send(req_body(&[b'x'; 60_000], false)).await;
    c.send(req_body(&[b'x'; 60_000], false)).await;
    let reply = c.recv().await;
    assert_eq!(immediate(&reply).status.unwrap().code, 413);
    assert!(router.seen().is_empty());
}

#[tokio::test]
async fn protocol_errors_end_the_stream_with_a_status() {
    let (_router, mut client) = picking(&["10.0.0.1:8000"]).await;
    let mut c = Conversation::open(&mut client).await;
    c.send(req_body(b"{}", true)).await;
    let err = tokio::time::timeout(LONG, c.rx.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
}

#[tokio::test]
async fn concurrent_streams_each_get_their_own_pick_and_end() {
    let router = FakeRouter::new(|seen| {
        let n: u32 = seen.path.trim_start_matches("/r/").parse().unwrap();
        Ok(decision(&[format!(
            "10.0.{}.{}:8000",
            n / 250,
            n % 250 + 1
        )]))
    });
    let client = connect(router.clone(), StreamConfig::default()).await;
    let mut tasks = Vec::new();
    for n in 0..64u32 {
        let mut client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = Conversation::open(&mut client).await;
            let path = format!("/r/{n}");
            c.send(req_headers(
                &[(":method", "POST"), (":path", &path)],
                false,
                duplex(),
            ))
            .await;
            c.send(req_body(format!("{{\"n\":{n}}}").as_bytes(), true))
                .await;
            let h = c.recv().await;
            c.recv().await;
            c.send(resp_headers("200", "application/json", None)).await;
            c.recv().await;
            c.send(resp_body(
                b"{\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}",
                true,
            ))
            .await;
            c.recv().await;
            set_headers(&h)["x-gateway-destination-endpoint"].clone()
        }));
    }
    for (n, t) in tasks.into_iter().enumerate() {
        let n = n as u32;
        assert_eq!(
            t.await.unwrap(),
            format!("10.0.{}.{}:8000", n / 250, n % 250 + 1)
        );
    }
    for ticket in 1..=64 {
        let events = router.until_terminal(ticket).await;
        assert_eq!(events.last(), Some(&ResponseEvent::End));
        assert_eq!(events.iter().filter(|e| e.is_terminal()).count(), 1);
    }
}

/// Collects formatted log lines.
#[derive(Clone, Default)]
struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn request_id_and_endpoint_are_on_the_stream_span() {
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // A current-thread runtime: the stream tasks run on this thread, under this subscriber.
    let _guard = tracing::subscriber::set_default(subscriber);
    let (_router, mut client) = picking(&["10.0.0.1:8000"]).await;
    let mut c = Conversation::open(&mut client).await;
    c.send(req_headers(
        &[(":method", "GET"), ("x-request-id", "trace-me-42")],
        true,
        duplex(),
    ))
    .await;
    c.recv().await;
    let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    let picked = text
        .lines()
        .find(|l| l.contains("picked"))
        .unwrap_or_else(|| panic!("no pick logged:\n{text}"));
    assert!(
        picked.contains("request_id=\"trace-me-42\"") || picked.contains("request_id=trace-me-42"),
        "{picked}"
    );
    assert!(picked.contains("10.0.0.1:8000"), "{picked}");
}
