#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]
//! The sidecar's SGLang bootstrap connector (`--kv-connector sglang`) between two real
//! `kvgate-sim` engines playing SGLang's prefill and decode roles: the decode engine only
//! decodes once it has found the room the sidecar wrote on the prefill engine's bootstrap port,
//! so a wrong host, port or room fails the request. Streaming, non-streaming and batched
//! requests, prefill failures (final, retried, unreachable) and SSRF refusal.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{PREFILLER, Sidecar, Sim, TempDir, prompt, request, stream_text_and_usage};

/// The seats a simulator saw (`GET /sim/bootstrap`).
fn seen(sim: &Sim) -> Vec<Value> {
    let r = request(sim.port, "GET", "/sim/bootstrap", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    r.json()["seen"].as_array().unwrap().clone()
}

/// A prefill sim serving rooms on its own bootstrap port, a decode sim, and a sidecar in front
/// of the decode sim speaking the SGLang connector with that bootstrap port.
struct Pair {
    prefill: Sim,
    decode: Sim,
    sidecar: Sidecar,
    bootstrap_port: u16,
    _dir: TempDir,
}

fn pair(prefill_extra: &[&str], sidecar_extra: &[&str]) -> Pair {
    let [bootstrap_port] = support::free_ports::<1>();
    let bp = bootstrap_port.to_string();
    let mut args = vec![
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        &bp,
    ];
    args.extend_from_slice(prefill_extra);
    let prefill = Sim::start("prefill-0", &args);
    let decode = Sim::start(
        "decode-0",
        &[
            "--disaggregation-mode",
            "decode",
            "--disaggregation-bootstrap-timeout-ms",
            "2000",
        ],
    );
    let dir = TempDir::new("sglang");
    let list = dir.write("list", &format!("{}\n", prefill.addr()));
    let mut args = vec![
        "--kv-connector",
        "sglang",
        "--sglang-bootstrap-port",
        &bp,
        "--prefiller-allow-list",
        list.to_str().unwrap(),
    ];
    args.extend_from_slice(sidecar_extra);
    let sidecar = Sidecar::start(decode.port, &args, true);
    Pair {
        prefill,
        decode,
        sidecar,
        bootstrap_port,
        _dir: dir,
    }
}

#[test]
fn sglang_pd_between_two_sims_streams_and_answers() {
    let p = pair(&[], &[]);
    let prefill_addr = p.prefill.addr();
    let body = json!({"model": "m", "prompt": prompt(120), "max_tokens": 60, "ignore_eos": true,
                      "stream": true, "stream_options": {"include_usage": true}});
    let r = p
        .sidecar
        .post("/v1/completions", &[(PREFILLER, &prefill_addr)], &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-kvgate-pod"),
        Some("decode-0"),
        "the decode leg answers"
    );
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    let sse = r.sse();
    let (_, usage) = stream_text_and_usage(&sse);
    let usage = usage.expect("usage chunk: stream_options reached the decode engine");
    assert_eq!(usage["completion_tokens"], 60);
    assert_eq!(sse.len(), 62, "60 token chunks, the usage chunk and [DONE]");
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        prompt_tokens / 16 * 16,
        "the decode engine pulled every full block from the room: {usage}"
    );
    // Relayed as the engine wrote it, not buffered.
    let first = r.arrival_of("data: ").unwrap();
    let done = r.arrival_of("[DONE]").unwrap();
    assert!(
        done > first + Duration::from_millis(100),
        "first chunk at {first:?}, [DONE] at {done:?}"
    );

    // Both engines saw the same seat: the prefiller's IP, the bootstrap port, one room.
    let (ps, ds) = (seen(&p.prefill), seen(&p.decode));
    assert_eq!(ps.len(), 1, "{ps:?}");
    assert_eq!(ps, ds);
    assert_eq!(ps[0]["host"], "127.0.0.1");
    assert_eq!(ps[0]["port"], p.bootstrap_port);
    assert!(ps[0]["room"].as_u64().unwrap() < 1 << 63);
    // The prefill engine ran a one-token prefill and served the room; the decode engine joined
    // it and generated the client's tokens.
    assert_eq!(p.prefill.metric("vllm:generation_tokens_total"), 1.0);
    assert_eq!(
        p.prefill.metric("vllm:prompt_tokens_total"),
        prompt_tokens as f64
    );
    assert_eq!(
        p.prefill.metric("kvgate_sim_bootstrap_rooms_ready_total"),
        1.0
    );
    assert_eq!(
        p.decode.metric("kvgate_sim_bootstrap_rooms_joined_total"),
        1.0
    );
    assert_eq!(p.decode.metric("vllm:generation_tokens_total"), 60.0);
    assert_eq!(
        p.sidecar.metric_where(
            "kvgate_sidecar_proxy_connector_info",
            "connector=\"sglang\""
        ),
        1.0
    );
    assert_eq!(
        p.sidecar
            .metric("kvgate_sidecar_proxy_prefill_attempts_total"),
        1.0
    );

    // Chat, non-streaming: one coherent JSON answer, a new room.
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": prompt(100)}],
                      "max_completion_tokens": 5, "ignore_eos": true});
    let r = p
        .sidecar
        .post("/v1/chat/completions", &[(PREFILLER, &prefill_addr)], &chat);
    r.assert_pd_chat(5);
    let (ps, ds) = (seen(&p.prefill), seen(&p.decode));
    assert_eq!(ps.len(), 2);
    assert_eq!(ps, ds);
    assert_ne!(ps[0]["room"], ps[1]["room"], "a fresh room per request");

    // A batch: one room per prompt, each joined.
    let batch = json!({"model": "m", "prompt": [prompt(40), prompt(50)], "max_tokens": 3,
                       "ignore_eos": true});
    let r = p
        .sidecar
        .post("/v1/completions", &[(PREFILLER, &prefill_addr)], &batch);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"].as_array().unwrap().len(), 2);
    let (ps, ds) = (seen(&p.prefill), seen(&p.decode));
    assert_eq!(ps.len(), 4);
    assert_eq!(ps, ds);
    assert_ne!(ps[2]["room"], ps[3]["room"]);
    assert_eq!(
        p.decode.metric("kvgate_sim_bootstrap_rooms_joined_total"),
        4.0
    );
    assert_eq!(
        p.sidecar.metric_where(
            "kvgate_sidecar_proxy_requests_total",
            "mode=\"pd\",outcome=\"2xx\""
        ),
        3.0
    );
}

#[test]
fn sglang_prefill_failure_is_a_502_and_the_decode_leg_is_dropped() {
    // Every prefill answers 500: final, not retried.
    let p = pair(&["--fault-error-rate", "1", "--fault-status", "500"], &[]);
    let body = json!({"model": "m", "prompt": prompt(40), "max_tokens": 5, "stream": true});
    let r = p
        .sidecar
        .post("/v1/completions", &[(PREFILLER, &p.prefill.addr())], &body);
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("x-kvgate-proxy-error"), Some("prefill_failed"));
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        msg.contains(&p.prefill.addr()) && msg.contains("1 attempt") && msg.contains("500"),
        "{msg}"
    );
    assert_eq!(
        p.sidecar.metric_where(
            "kvgate_sidecar_proxy_prefill_failures_total",
            "reason=\"status_other\""
        ),
        1.0
    );
    // Both legs leave at once, but a prefill failing this fast can drop the decode leg before
    // it reaches the engine (seen under parallel test load): the engine saw it at most once,
    // and if it was waiting in the room, dropping the leg ended that wait: it never times out,
    // never generates.
    assert!(seen(&p.decode).len() <= 1);
    std::thread::sleep(Duration::from_millis(2300));
    assert_eq!(
        p.decode.metric("kvgate_sim_bootstrap_room_timeouts_total"),
        0.0
    );
    assert_eq!(p.decode.metric("vllm:generation_tokens_total"), 0.0);
    assert_eq!(
        p.sidecar.metric_where(
            "kvgate_sidecar_proxy_requests_total",
            "mode=\"pd\",outcome=\"5xx\""
        ),
        1.0
    );
}

#[test]
fn sglang_prefill_503s_are_retried_in_the_same_room_and_dead_prefillers_fail() {
    let p = pair(
        &[
            "--fault-error-rate",
            "0.5",
            "--fault-status",
            "503",
            "--seed",
            "7",
        ],
        &[
            "--prefill-max-attempts",
            "12",
            "--prefill-retry-backoff-ms",
            "5",
            "--prefill-max-backoff-ms",
            "20",
        ],
    );
    for i in 0..6 {
        let body =
            json!({"model": "m", "prompt": prompt(40 + i), "max_tokens": 3, "ignore_eos": true});
        let r = p
            .sidecar
            .post("/v1/completions", &[(PREFILLER, &p.prefill.addr())], &body);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    }
    let injected = p.prefill.metric("kvgate_sim_faults_injected_total");
    assert!(injected >= 1.0, "the seed must inject at least one 503");
    assert_eq!(
        p.sidecar
            .metric("kvgate_sidecar_proxy_prefill_attempts_total"),
        6.0 + injected
    );
    // Retries reused the room the decode engine waited in: 6 rooms, each joined once.
    let rooms: std::collections::HashSet<u64> = seen(&p.decode)
        .iter()
        .map(|s| s["room"].as_u64().unwrap())
        .collect();
    assert_eq!(rooms.len(), 6);
    assert_eq!(
        p.decode.metric("kvgate_sim_bootstrap_rooms_joined_total"),
        6.0
    );

    // Nothing listens on the prefiller: connect errors on every attempt, then 502 (before the
    // decode engine, waiting in a room nobody fills, gives up with its own 500).
    let [dead] = support::free_ports::<1>();
    let dir = TempDir::new("sglang-dead");
    let list = dir.write("list", &format!("127.0.0.1:{dead}\n"));
    let bp = p.bootstrap_port.to_string();
    let sidecar = Sidecar::start(
        p.decode.port,
        &[
            "--kv-connector",
            "sglang",
            "--sglang-bootstrap-port",
            &bp,
            "--prefiller-allow-list",
            list.to_str().unwrap(),
            "--prefill-max-attempts",
            "3",
            "--prefill-retry-backoff-ms",
            "5",
        ],
        true,
    );
    let dead_addr = format!("127.0.0.1:{dead}");
    let r = sidecar.post(
        "/v1/completions",
        &[(PREFILLER, &dead_addr)],
        &json!({"model": "m", "prompt": "x", "max_tokens": 3}),
    );
    assert_eq!(r.status, 502, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        msg.contains(&dead_addr) && msg.contains("3 attempt") && msg.contains("onnect"),
        "{msg}"
    );
}

#[test]
fn sglang_ssrf_refusal_contacts_neither_engine() {
    let p = pair(&[], &[]);
    let other = Sim::start(
        "prefill-b",
        &[
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            "0",
        ],
    );
    let body = json!({"model": "m", "prompt": prompt(40), "max_tokens": 2});
    let r = p
        .sidecar
        .post("/v1/completions", &[(PREFILLER, &other.addr())], &body);
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(
        r.header("x-kvgate-proxy-error"),
        Some("prefiller_not_allowed")
    );
    assert!(seen(&other).is_empty(), "never contacted");
    assert!(seen(&p.decode).is_empty(), "no decode either");
    assert_eq!(
        p.sidecar.metric("kvgate_sidecar_proxy_ssrf_refusals_total"),
        1.0
    );
    // Without the header the request passes through untouched (no bootstrap fields).
    let r = p.sidecar.post("/v1/completions", &[], &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(seen(&p.decode).is_empty());
}
