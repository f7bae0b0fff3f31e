#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]
//! The sidecar binary between real `kvgate-sim` engines: pass-through streaming, the P/D flow
//! end to end, prefill retries, SSRF refusal and hot reload, body limits, readiness and the
//! canary, and drain on SIGTERM.

mod support;

use std::io::Write as _;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{PREFILLER, Sidecar, Sim, TempDir, prompt, request, stream_text_and_usage};

#[test]
fn passthrough_streams_chunk_by_chunk() {
    let engine = Sim::start("engine", &[]);
    let sidecar = Sidecar::start(engine.port, &[], true);
    let body = json!({"model": "m", "prompt": "hello there", "max_tokens": 60,
                      "ignore_eos": true, "stream": true});
    let r = sidecar.post("/v1/completions", &[], &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert_eq!(r.header("x-kvgate-pod"), Some("engine"));
    let sse = r.sse();
    let (_, _) = stream_text_and_usage(&sse);
    assert_eq!(sse.len(), 61, "60 token chunks and [DONE]");
    let first = r.arrival_of("data: ").unwrap();
    let done = r.arrival_of("[DONE]").unwrap();
    // 60 decode steps of the `small` preset take well over 100 ms; a buffering proxy would
    // deliver the first chunk with the last.
    assert!(
        done > first + Duration::from_millis(100),
        "first chunk at {first:?}, [DONE] at {done:?}"
    );
    let data_reads = r
        .reads
        .iter()
        .filter(|(_, b)| String::from_utf8_lossy(b).contains("data: "))
        .count();
    assert!(data_reads >= 10, "only {data_reads} reads carried data");

    // Non-streaming, other methods and paths, and the engine's own errors pass through.
    let r = request(sidecar.port, "GET", "/v1/models", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["id"], "m");
    let r = request(sidecar.port, "POST", "/v1/completions", &[], b"{nope").unwrap();
    assert_eq!(r.status, 400, "the engine's 400, relayed");
    assert!(r.header("x-kvgate-proxy-error").is_none());
    assert_eq!(
        sidecar.metric_where(
            "kvgate_sidecar_proxy_requests_total",
            "mode=\"passthrough\",outcome=\"2xx\""
        ),
        2.0
    );
    assert_eq!(
        sidecar.metric("kvgate_sidecar_proxy_added_latency_seconds_count"),
        3.0
    );
}

#[test]
fn pd_flow_end_to_end_between_two_sims() {
    let prefill = Sim::start("prefill-0", &[]);
    let decode = Sim::start("decode-0", &[]);
    let dir = TempDir::new("pd");
    let list = dir.write(
        "pool.yaml",
        &format!(
            "endpoints:\n  - name: prefill-0\n    address: 127.0.0.1\n    ports: [{}]\n    role: prefill\n",
            prefill.port
        ),
    );
    let sidecar = Sidecar::start(
        decode.port,
        &[
            "--prefiller-allow-list",
            list.to_str().unwrap(),
            "--allow-list-poll-ms",
            "50",
        ],
        true,
    );
    let text = prompt(120);
    let body = json!({"model": "m", "prompt": text, "max_tokens": 20, "ignore_eos": true,
                      "stream": true, "stream_options": {"include_usage": true}});
    let r = sidecar.post("/v1/completions", &[(PREFILLER, &prefill.addr())], &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-kvgate-pod"),
        Some("decode-0"),
        "the decode leg answers"
    );
    let (_, usage) = stream_text_and_usage(&r.sse());
    let usage = usage.expect("usage chunk (include_usage kept for the decode leg)");
    assert_eq!(usage["completion_tokens"], 20);
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(prompt_tokens >= 100, "{usage}");
    assert_eq!(
        cached,
        prompt_tokens / 16 * 16,
        "the decode engine pulled every full block: {usage}"
    );

    // The prefill engine ran a one-token, prefill-only request.
    assert_eq!(prefill.metric("vllm:generation_tokens_total"), 1.0);
    assert_eq!(
        prefill.metric("vllm:prompt_tokens_total"),
        prompt_tokens as f64
    );
    // The decode engine generated the client's tokens without recomputing the pulled blocks.
    assert_eq!(decode.metric("vllm:generation_tokens_total"), 20.0);
    assert_eq!(
        sidecar.metric("kvgate_sidecar_proxy_prefill_attempts_total"),
        1.0
    );

    // Chat, non-streaming: one coherent JSON answer.
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": prompt(100)}],
                      "max_completion_tokens": 5, "ignore_eos": true});
    let r = sidecar.post(
        "/v1/chat/completions",
        &[(PREFILLER, &prefill.addr())],
        &chat,
    );
    r.assert_pd_chat(5);
    assert_eq!(prefill.metric("vllm:generation_tokens_total"), 2.0);
    assert_eq!(
        sidecar.metric_where(
            "kvgate_sidecar_proxy_requests_total",
            "mode=\"pd\",outcome=\"2xx\""
        ),
        2.0
    );

    // A body that is not JSON never reaches either engine.
    let before = prefill.metric("vllm:prompt_tokens_total");
    let r = request(
        sidecar.port,
        "POST",
        "/v1/completions",
        &[(PREFILLER, &prefill.addr())],
        b"{x",
    )
    .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "BadRequestError");
    assert_eq!(prefill.metric("vllm:prompt_tokens_total"), before);
    // Nor does a malformed prefiller header.
    let r = sidecar.post(
        "/v1/completions",
        &[(PREFILLER, "prefill.example:8000")],
        &body,
    );
    assert_eq!(r.status, 400);
}

#[test]
fn prefill_retries_on_503_then_succeeds_and_gives_up_with_502() {
    let prefill = Sim::start(
        "prefill-0",
        &[
            "--fault-error-rate",
            "0.5",
            "--fault-status",
            "503",
            "--seed",
            "7",
        ],
    );
    let decode = Sim::start("decode-0", &[]);
    let [dead] = support::free_ports::<1>();
    let dir = TempDir::new("retry");
    let list = dir.write("list", &format!("{}\n127.0.0.1:{dead}\n", prefill.addr()));
    let sidecar = Sidecar::start(
        decode.port,
        &[
            "--prefiller-allow-list",
            list.to_str().unwrap(),
            "--prefill-max-attempts",
            "12",
            "--prefill-retry-backoff-ms",
            "5",
            "--prefill-max-backoff-ms",
            "20",
        ],
        true,
    );
    for i in 0..6 {
        let body =
            json!({"model": "m", "prompt": prompt(40 + i), "max_tokens": 3, "ignore_eos": true});
        let r = sidecar.post("/v1/completions", &[(PREFILLER, &prefill.addr())], &body);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    }
    let injected = prefill.metric("kvgate_sim_faults_injected_total");
    assert!(injected >= 1.0, "the seed must inject at least one 503");
    assert_eq!(
        sidecar.metric_where("kvgate_sidecar_proxy_prefill_failures_total", "status_503"),
        injected
    );
    assert_eq!(
        sidecar.metric("kvgate_sidecar_proxy_prefill_attempts_total"),
        6.0 + injected
    );

    // Nothing listens on `dead`: connect errors on every attempt, then a 502 naming the reason.
    let body = json!({"model": "m", "prompt": "x", "max_tokens": 3});
    let dead_addr = format!("127.0.0.1:{dead}");
    let r = sidecar.post("/v1/completions", &[(PREFILLER, &dead_addr)], &body);
    assert_eq!(r.status, 502, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        msg.contains(&dead_addr) && msg.contains("12 attempt") && msg.contains("onnect"),
        "{msg}"
    );
    assert_eq!(
        sidecar.metric_where(
            "kvgate_sidecar_proxy_prefill_failures_total",
            "reason=\"connect\""
        ),
        12.0
    );
}

#[test]
fn ssrf_refuses_unlisted_prefillers_and_follows_the_file() {
    let allowed = Sim::start("prefill-a", &[]);
    let other = Sim::start("prefill-b", &[]);
    let decode = Sim::start("decode-0", &[]);
    let dir = TempDir::new("ssrf");
    let list = dir.write("list", &format!("# pool\n{}\n", allowed.addr()));
    let sidecar = Sidecar::start(
        decode.port,
        &[
            "--prefiller-allow-list",
            list.to_str().unwrap(),
            "--allow-list-poll-ms",
            "50",
        ],
        true,
    );
    let body = json!({"model": "m", "prompt": prompt(40), "max_tokens": 2});
    let r = sidecar.post("/v1/completions", &[(PREFILLER, &other.addr())], &body);
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "PermissionDeniedError");
    assert_eq!(
        other.metric("vllm:prompt_tokens_total"),
        0.0,
        "never contacted"
    );
    assert_eq!(
        decode.metric("vllm:prompt_tokens_total"),
        0.0,
        "no decode either"
    );
    assert_eq!(
        sidecar.metric("kvgate_sidecar_proxy_ssrf_refusals_total"),
        1.0
    );
    let r = sidecar.post("/v1/completions", &[(PREFILLER, &allowed.addr())], &body);
    assert_eq!(r.status, 200, "{}", r.text());

    // Hot reload: the file now lists the other prefiller only.
    std::fs::write(&list, format!("{}\n", other.addr())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = sidecar.post("/v1/completions", &[(PREFILLER, &other.addr())], &body);
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 403);
        assert!(Instant::now() < deadline, "the new list was never loaded");
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = sidecar.post("/v1/completions", &[(PREFILLER, &allowed.addr())], &body);
    assert_eq!(r.status, 403);
    assert!(other.metric("vllm:prompt_tokens_total") > 0.0);
}

#[test]
fn body_limit_is_413_and_no_list_refuses_pd() {
    let engine = Sim::start("engine", &[]);
    let sidecar = Sidecar::start(engine.port, &["--proxy-max-body-bytes", "1000"], true);
    let big = json!({"model": "m", "prompt": "y".repeat(2000), "max_tokens": 1});
    let r = sidecar.post("/v1/completions", &[], &big);
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["error"]["code"], 413);
    assert_eq!(engine.metric("vllm:prompt_tokens_total"), 0.0);
    // A chunked body (no content-length) is cut off at the limit while it streams.
    let mut s = TcpStream::connect(("127.0.0.1", sidecar.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let payload = big.to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
         content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    .unwrap();
    for part in payload.as_bytes().chunks(500) {
        write!(s, "{:x}\r\n", part.len()).unwrap();
        s.write_all(part).unwrap();
        s.write_all(b"\r\n").unwrap();
    }
    s.write_all(b"0\r\n\r\n").unwrap();
    let r = support::read_response(&mut s, Instant::now()).unwrap();
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(engine.metric("vllm:prompt_tokens_total"), 0.0);
    // P/D without an allow-list (and without --disable-ssrf-protection) is refused.
    let small = json!({"model": "m", "prompt": "y", "max_tokens": 1});
    let r = sidecar.post("/v1/completions", &[(PREFILLER, &engine.addr())], &small);
    assert_eq!(r.status, 403);
    assert!(r.text().contains("allow-list"), "{}", r.text());
}

fn ready(sidecar: &Sidecar) -> (u16, Value) {
    let r = request(sidecar.health_port, "GET", "/ready", &[], b"").unwrap();
    (r.status, r.json())
}

#[test]
fn readiness_follows_engine_health_and_the_canary() {
    let [nothing] = support::free_ports::<1>();
    let orphan = Sidecar::start(nothing, &[], false);
    std::thread::sleep(Duration::from_millis(300));
    let (status, body) = ready(&orphan);
    assert_eq!(status, 503);
    assert_eq!(body["not_ready"], json!(["engine_unhealthy"]));
    let r = request(orphan.health_port, "GET", "/health", &[], b"").unwrap();
    assert_eq!(r.status, 200, "liveness does not depend on the engine");

    let broken = Sim::start(
        "broken",
        &["--fault-error-rate", "1", "--fault-status", "500"],
    );
    let sidecar = Sidecar::start(
        broken.port,
        &[
            "--canary",
            "--canary-interval-ms",
            "100",
            "--canary-failures",
            "3",
            "--require-kv-events",
        ],
        false,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = ready(&sidecar);
        assert_eq!(status, 503);
        if body["not_ready"] == json!(["canary_failing", "kv_events_down"]) {
            break;
        }
        assert!(Instant::now() < deadline, "canary never failed: {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(broken.metric("kvgate_sim_faults_injected_total") >= 3.0);
}

#[test]
fn sigterm_drains_in_flight_streams_then_exits_0() {
    let engine = Sim::start("engine", &[]);
    let mut sidecar = Sidecar::start(engine.port, &["--drain-grace-seconds", "20"], true);
    let body = json!({"model": "m", "prompt": "long one", "max_tokens": 150,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", sidecar.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Wait for the stream to start before the signal.
    let mut first = [0u8; 256];
    let n = std::io::Read::read(&mut s, &mut first).unwrap();
    assert!(n > 0);
    sidecar.terminate();
    std::thread::sleep(Duration::from_millis(300));
    let (status, body_json) = ready(&sidecar);
    assert_eq!(status, 503, "unready while draining");
    assert!(
        body_json["not_ready"]
            .as_array()
            .unwrap()
            .contains(&json!("draining"))
    );
    assert_eq!(sidecar.metric("kvgate_sidecar_proxy_in_flight"), 1.0);
    assert!(sidecar.metric("kvgate_sidecar_proxy_drain_duration_seconds") > 0.0);
    assert!(
        TcpStream::connect(("127.0.0.1", sidecar.port)).is_err(),
        "new connections are refused while draining"
    );
    assert!(
        sidecar.child.try_wait().unwrap().is_none(),
        "still draining the stream"
    );
    let rest = read_response_tail(&mut s, &first[..n]);
    assert!(rest.contains("[DONE]"), "the stream completed: {rest}");
    let events = rest.matches("\"text\"").count();
    assert_eq!(events, 150, "every token arrived");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = sidecar.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "sidecar did not exit after draining"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
}

/// Reads the rest of a raw chunked SSE response whose first bytes were already read.
fn read_response_tail(s: &mut TcpStream, first: &[u8]) -> String {
    let mut raw = first.to_vec();
    let mut buf = [0u8; 16384];
    loop {
        match std::io::Read::read(s, &mut buf) {
            Ok(0) => break,
            Ok(n) => {
                raw.extend_from_slice(&buf[..n]);
                if raw.ends_with(b"0\r\n\r\n") {
                    break;
                }
            }
            Err(e) => panic!("stream broke: {e}"),
        }
    }
    String::from_utf8_lossy(&raw).into_owned()
}

/// The `data:` payloads of an SSE response read raw (chunked framing left in: each chunk is
/// one whole event here, so payloads are never split).
fn sse_payloads(raw: &str) -> Vec<Value> {
    raw.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// An engine killed in the middle of a streamed answer: the sidecar has the rest generated by
/// the fallback endpoint the EPP named and splices it into the same response, so the client
/// gets one whole answer: every token, one id, one role delta (chat), one `[DONE]`.
#[test]
fn an_engine_dying_mid_stream_is_migrated_into_the_same_answer() {
    const TOKENS: usize = 200;
    let spare = Sim::start("spare", &[]);
    let spare_sidecar = Sidecar::start(spare.port, &[], true);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": "m", "prompt": "Tell me a long story", "max_tokens": TOKENS,
                   "ignore_eos": true, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": "Tell me more"}],
                   "max_tokens": TOKENS, "ignore_eos": true, "stream": true}),
        ),
    ] {
        // About 28 ms a token: the answer takes ~6 s, so the kill lands in the middle.
        let mut engine = Sim::start("dying", &["--preset", "h200-llama70b-fp8"]);
        let sidecar = Sidecar::start(engine.port, &["--disable-ssrf-protection"], true);
        let spare_prompts = spare.metric("vllm:prompt_tokens_total");
        let body = body.to_string();
        let mut s = TcpStream::connect(("127.0.0.1", sidecar.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             x-kvgate-fallback-endpoints: 127.0.0.1:{}\r\ncontent-length: {}\r\n\r\n{body}",
            spare_sidecar.port,
            body.len()
        )
        .unwrap();
        let mut raw = Vec::new();
        let mut buf = [0u8; 16384];
        while String::from_utf8_lossy(&raw).matches("data: ").count() < 20 {
            let n = std::io::Read::read(&mut s, &mut buf).unwrap();
            assert!(n > 0, "{path}: the stream ended early");
            raw.extend_from_slice(&buf[..n]);
        }
        engine.child.kill().unwrap();
        engine.child.wait().unwrap();
        let text = read_response_tail(&mut s, &raw);
        assert!(text.starts_with("HTTP/1.1 200"), "{path}: {text}");
        assert_eq!(text.matches("data: [DONE]").count(), 1, "{path}: {text}");
        let events = sse_payloads(&text);
        let pieces: usize = events
            .iter()
            .filter(|e| {
                let c = &e["choices"][0];
                c["text"]
                    .as_str()
                    .or(c["delta"]["content"].as_str())
                    .is_some_and(|t| !t.is_empty())
            })
            .count();
        assert_eq!(pieces, TOKENS, "{path}: every token, once");
        let first = &events[0];
        assert!(
            events
                .iter()
                .all(|e| e["id"] == first["id"] && e["created"] == first["created"]),
            "{path}: one answer's id"
        );
        let roles = events
            .iter()
            .filter(|e| e["choices"][0]["delta"]["role"].is_string())
            .count();
        assert_eq!(roles, usize::from(path.contains("chat")), "{path}");
        assert!(
            spare.metric("vllm:prompt_tokens_total") > spare_prompts,
            "{path}: the spare engine generated the rest"
        );
        assert_eq!(
            sidecar.metric_where(
                "kvgate_sidecar_proxy_migrations_total",
                "outcome=\"migrated\""
            ),
            1.0,
            "{path}"
        );
    }
    // Without a fallback endpoint, the cut stays a cut (and is counted).
    let mut engine = Sim::start("dying", &["--preset", "h200-llama70b-fp8"]);
    let sidecar = Sidecar::start(engine.port, &["--disable-ssrf-protection"], true);
    let body = json!({"model": "m", "prompt": "x", "max_tokens": TOKENS, "ignore_eos": true,
                      "stream": true})
    .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", sidecar.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         x-kvgate-fallback-endpoints: 127.0.0.1:1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 4096];
    let n = std::io::Read::read(&mut s, &mut first).unwrap();
    assert!(n > 0);
    engine.child.kill().unwrap();
    engine.child.wait().unwrap();
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut rest);
    let all = String::from_utf8_lossy(&rest);
    assert!(
        !all.contains("[DONE]"),
        "a dead engine's answer cannot end well"
    );
    wait_until(|| {
        sidecar.metric_where(
            "kvgate_sidecar_proxy_migrations_total",
            "outcome=\"failed\"",
        ) == 1.0
    });
}

fn wait_until(mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out");
        std::thread::sleep(Duration::from_millis(50));
    }
}
