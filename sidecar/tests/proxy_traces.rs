#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]
//! The sidecar's request traces, exported to an in-process OTLP receiver: a proxied request
//! continues the caller's trace and hands its own span to the engine as the parent; a
//! migration is a span of its own, and the engine that finishes the answer continues from it.

mod support;

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use otel::receiver::{ReceivedSpan, Receiver};
use serde_json::json;
use support::{PREFILLER, Sidecar, Sim, TempDir, prompt};

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn caller() -> String {
    format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01")
}

/// An engine that answers one request with `{}` and reports the request's headers.
fn capturing_engine() -> (u16, mpsc::Receiver<Vec<(String, String)>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut headers = Vec::new();
            let mut line = String::new();
            let mut length = 0usize;
            while reader.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                if let Some((k, v)) = line.trim_end().split_once(':') {
                    let (k, v) = (k.to_ascii_lowercase(), v.trim().to_owned());
                    if k == "content-length" {
                        length = v.parse().unwrap_or(0);
                    }
                    headers.push((k, v));
                }
                line.clear();
            }
            let mut body = vec![0u8; length];
            let _ = std::io::Read::read_exact(&mut reader, &mut body);
            let _ = conn.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            );
            // Health checks and load scrapes are not the request under test.
            if headers.iter().any(|(k, _)| k == "content-type") {
                let _ = tx.send(headers);
            }
        }
    });
    (port, rx)
}

fn tracing_flags(receiver: &Receiver) -> Vec<String> {
    vec![
        "--otlp-endpoint".into(),
        receiver.endpoint(),
        "--trace-sample-ratio".into(),
        "1".into(),
        // Nothing is in flight when the tests stop a sidecar.
        "--drain-grace-seconds".into(),
        "0".into(),
    ]
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {name} in {headers:?}"))
}

/// Stops the sidecar with SIGTERM, which flushes its exporter on the way out.
fn stop(sidecar: &mut Sidecar) {
    sidecar.terminate();
    let deadline = Instant::now() + Duration::from_secs(20);
    while sidecar.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the sidecar did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn named<'a>(spans: &'a [ReceivedSpan], name: &str) -> &'a ReceivedSpan {
    spans
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no {name} span in {spans:#?}"))
}

#[test]
fn a_proxied_request_continues_the_trace_and_hands_its_span_to_the_engine() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let receiver = runtime.block_on(Receiver::start()).unwrap();
    let (engine, seen) = capturing_engine();
    let flags = tracing_flags(&receiver);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut sidecar = Sidecar::start(engine, &flags, false);
    let resp = sidecar.post(
        "/v1/completions",
        &[("traceparent", &caller()), ("x-request-id", "req-7")],
        &json!({"model": "m", "prompt": "hi", "max_tokens": 1}),
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    let to_engine = seen.recv_timeout(Duration::from_secs(10)).unwrap();
    // A caller that did not sample its trace: no span here, its context goes on untouched.
    let unsampled = "00-11111111111111111111111111111111-2222222222222222-00";
    let resp = sidecar.post(
        "/v1/completions",
        &[("traceparent", unsampled)],
        &json!({"model": "m", "prompt": "hi", "max_tokens": 1}),
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    let unsampled_to_engine = seen.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(header(&unsampled_to_engine, "traceparent"), unsampled);
    stop(&mut sidecar);

    let spans = runtime.block_on(receiver.wait_for(Duration::from_secs(10), |s| {
        s.iter().any(|s| s.name == "sidecar.proxy")
    }));
    let proxy = named(&spans, "sidecar.proxy");
    assert_eq!(proxy.service, "kvgate-sidecar");
    assert_eq!(proxy.trace_id, CALLER_TRACE);
    assert_eq!(proxy.parent_span_id, CALLER_SPAN);
    assert_eq!(proxy.attr("request_id"), Some("req-7"));
    assert_eq!(proxy.attr("mode"), Some("passthrough"));
    assert_eq!(proxy.int("http.response.status_code"), Some(200));
    assert_eq!(
        header(&to_engine, "traceparent"),
        format!("00-{CALLER_TRACE}-{}-01", proxy.span_id),
        "the engine's parent is the sidecar's span"
    );
    assert!(
        spans
            .iter()
            .all(|s| s.trace_id != "11111111111111111111111111111111"),
        "an unsampled request leaves no span"
    );
}

#[test]
fn a_migration_is_a_span_and_the_engine_that_finishes_continues_from_it() {
    const TOKENS: usize = 120;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let receiver = runtime.block_on(Receiver::start()).unwrap();
    let flags = tracing_flags(&receiver);
    let mut spare_flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let spare = Sim::start("spare", &[]);
    let mut spare_sidecar = Sidecar::start(spare.port, &spare_flags, true);
    // About 28 ms a token: the kill lands in the middle of the answer.
    let mut engine = Sim::start("dying", &["--preset", "h200-llama70b-fp8"]);
    spare_flags.push("--disable-ssrf-protection");
    let mut sidecar = Sidecar::start(engine.port, &spare_flags, true);
    let body = json!({"model": "m", "prompt": "Tell me a long story", "max_tokens": TOKENS,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", sidecar.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         traceparent: {}\r\nx-kvgate-fallback-endpoints: 127.0.0.1:{}\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        caller(),
        spare_sidecar.port,
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 16384];
    while String::from_utf8_lossy(&raw).matches("data: ").count() < 10 {
        let n = std::io::Read::read(&mut s, &mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        raw.extend_from_slice(&buf[..n]);
    }
    engine.child.kill().unwrap();
    engine.child.wait().unwrap();
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut rest);
    raw.extend_from_slice(&rest);
    assert_eq!(
        String::from_utf8_lossy(&raw)
            .matches("data: [DONE]")
            .count(),
        1,
        "the answer was migrated to its end"
    );
    stop(&mut sidecar);
    stop(&mut spare_sidecar);

    let spans = runtime.block_on(receiver.wait_for(Duration::from_secs(10), |s| {
        s.iter().filter(|s| s.name == "sidecar.proxy").count() >= 2
            && s.iter().any(|s| s.name == "migrate")
    }));
    let migrate = named(&spans, "migrate");
    let first = spans
        .iter()
        .find(|s| s.name == "sidecar.proxy" && s.span_id == migrate.parent_span_id)
        .expect("the migration hangs under the first sidecar's span");
    assert_eq!(first.parent_span_id, CALLER_SPAN);
    assert_eq!(migrate.trace_id, CALLER_TRACE);
    assert_eq!(migrate.attr("outcome"), Some("migrated"));
    assert_eq!(migrate.int("attempt"), Some(1));
    assert!(
        migrate.int("generated_tokens").is_some_and(|t| t >= 9),
        "{migrate:?}"
    );
    let second = spans
        .iter()
        .find(|s| s.name == "sidecar.proxy" && s.parent_span_id == migrate.span_id)
        .expect("the spare sidecar continues the trace from the migration's span");
    assert_eq!(second.trace_id, CALLER_TRACE);
}

#[test]
fn a_prefill_leg_is_a_span_and_the_prefillers_sidecar_continues_from_it() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let receiver = runtime.block_on(Receiver::start()).unwrap();
    let flags = tracing_flags(&receiver);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let prefill = Sim::start("prefill-0", &[]);
    let decode = Sim::start("decode-0", &[]);
    let mut prefiller = Sidecar::start(prefill.port, &flags, true);
    let dir = TempDir::new("pd-trace");
    let list = dir.write(
        "pool.yaml",
        &format!(
            "endpoints:\n  - name: prefill-0\n    address: 127.0.0.1\n    ports: [{}]\n    role: prefill\n",
            prefiller.port
        ),
    );
    let mut decode_flags = flags.clone();
    decode_flags.extend(["--prefiller-allow-list", list.to_str().unwrap()]);
    let mut sidecar = Sidecar::start(decode.port, &decode_flags, true);
    let body = json!({"model": "m", "prompt": prompt(120), "max_tokens": 4, "ignore_eos": true});
    let at = format!("127.0.0.1:{}", prefiller.port);
    let r = sidecar.post(
        "/v1/completions",
        &[(PREFILLER, at.as_str()), ("traceparent", &caller())],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    stop(&mut sidecar);
    stop(&mut prefiller);

    let spans = runtime.block_on(receiver.wait_for(Duration::from_secs(10), |s| {
        s.iter().filter(|s| s.name == "sidecar.proxy").count() >= 2
            && s.iter().any(|s| s.name == "prefill")
    }));
    let decode_span = spans
        .iter()
        .find(|s| s.name == "sidecar.proxy" && s.parent_span_id == CALLER_SPAN)
        .unwrap_or_else(|| panic!("no decode-side span: {spans:#?}"));
    assert_eq!(decode_span.attr("mode"), Some("pd"));
    let leg = named(&spans, "prefill");
    assert_eq!(leg.parent_span_id, decode_span.span_id);
    assert_eq!(leg.attr("prefiller"), Some(at.as_str()));
    let prefill_side = spans
        .iter()
        .find(|s| s.name == "sidecar.proxy" && s.parent_span_id == leg.span_id)
        .expect("the prefiller's sidecar continues from the prefill span");
    assert_eq!(prefill_side.trace_id, CALLER_TRACE);
    assert_eq!(prefill_side.attr("mode"), Some("passthrough"));
}
