//! The simulator's OpenAI HTTP API, end to end against the real binary.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use serde_json::json;
use support::Sim;

/// Fast settings: byte tokenizer, small preset, model time 50× wall time.
const FAST: &[&str] = &["--model", "m", "--time-scale", "50", "--block-size", "16"];

fn args(extra: &[&'static str]) -> Vec<&'static str> {
    FAST.iter().chain(extra).copied().collect()
}

#[test]
fn models_health_metrics_and_pod_header() {
    let sim = Sim::start(&args(&[
        "--served-model-name",
        "m",
        "alias",
        "--pod-name",
        "pod-7",
    ]));
    let models = sim.get("/v1/models").json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["m", "alias"]);
    assert!(models["data"][0]["max_model_len"].as_u64().unwrap() > 0);
    let r = sim.post(
        "/v1/completions",
        &json!({"model": "alias", "prompt": "hello", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvgate-pod"), Some("pod-7"));
    let text = sim.get("/metrics").text();
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:cache_config_info{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:inter_token_latency_seconds_bucket{",
        "vllm:e2e_request_latency_seconds_bucket{",
        "vllm:request_queue_time_seconds_bucket{",
        "vllm:prompt_tokens_total{",
        "vllm:generation_tokens_total{",
    ] {
        assert!(text.contains(name), "missing {name}");
    }
    assert!(text.contains("block_size=\"16\""));
    assert_eq!(sim.metric("vllm:generation_tokens_total"), 2.0);
    assert_eq!(sim.metric("vllm:request_queue_time_seconds_count"), 1.0);
    assert_eq!(sim.metric("vllm:time_to_first_token_seconds_count"), 1.0);
    assert_eq!(sim.metric("vllm:inter_token_latency_seconds_count"), 1.0);
    assert_eq!(sim.metric("kvgate_sim_step_lag_seconds_count"), 2.0);
}

#[test]
fn completion_usage_counts_cached_prefix_like_vllm() {
    let sim = Sim::start(&args(&[]));
    // 200 bytes → 50 fallback tokens → 3 full blocks of 16.
    let prompt = "abcd".repeat(50);
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 5, "ignore_eos": true});
    let first = sim.post("/v1/completions", &body).json();
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["usage"]["prompt_tokens"], 50);
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["total_tokens"], 55);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(!first["choices"][0]["text"].as_str().unwrap().is_empty());
    let second = sim.post("/v1/completions", &body).json();
    // Three full blocks are cached; the hit is capped at 49 tokens, so 48.
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        48
    );
    assert_eq!(sim.metric("vllm:prefix_cache_hits_total"), 48.0);
    assert_eq!(sim.metric("vllm:prefix_cache_queries_total"), 100.0);
    // After a reset nothing is cached.
    assert_eq!(sim.post("/reset_prefix_cache", &json!({})).status, 200);
    let third = sim.post("/v1/completions", &body).json();
    assert_eq!(third["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[test]
fn token_id_prompts_and_prompt_lists_give_one_choice_each() {
    let sim = Sim::start(&args(&[]));
    let r = sim
        .post("/v1/completions", &json!({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3, "ignore_eos": true, "return_token_ids": true}))
        .json();
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[1]["index"], 1);
    assert_eq!(choices[1]["prompt_token_ids"], json!([4, 5]));
    assert_eq!(choices[0]["token_ids"].as_array().unwrap().len(), 3);
    assert_eq!(r["usage"]["prompt_tokens"], 5);
    assert_eq!(r["usage"]["completion_tokens"], 6);
    let r = sim
        .post(
            "/v1/completions",
            &json!({"prompt": ["ab", "cd"], "max_tokens": 1}),
        )
        .json();
    assert_eq!(r["choices"].as_array().unwrap().len(), 2);
}

#[test]
fn streaming_chat_sends_role_content_usage_and_done() {
    let sim = Sim::start(&args(&[]));
    let r = sim.post(
        "/v1/chat/completions",
        &json!({
            "model": "m", "stream": true, "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "hi there"}],
            "max_completion_tokens": 4, "ignore_eos": true,
        }),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = r.sse();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    let content_chunks = &chunks[..chunks.len() - 1];
    assert_eq!(content_chunks.len(), 4, "one chunk per token");
    assert!(content_chunks.iter().all(|c| c["usage"].is_null()));
    assert_eq!(content_chunks[3]["choices"][0]["finish_reason"], "length");
    assert!(
        content_chunks[..3]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null())
    );
    // Without include_usage there is no usage chunk and no usage key.
    let r = sim.post(
        "/v1/completions",
        &json!({"prompt": "x", "stream": true, "max_tokens": 2, "ignore_eos": true}),
    );
    let events = r.sse();
    assert_eq!(events.len(), 3);
    let c: serde_json::Value = serde_json::from_str(&events[0]).unwrap();
    assert!(c.get("usage").is_none());
}

#[test]
fn without_ignore_eos_output_stops_early_with_stop() {
    let sim = Sim::start(&args(&["--mean-output-tokens", "2", "--seed", "3"]));
    let mut stops = 0;
    for _ in 0..20 {
        let r = sim
            .post(
                "/v1/completions",
                &json!({"prompt": "abc", "max_tokens": 50}),
            )
            .json();
        let n = r["usage"]["completion_tokens"].as_u64().unwrap();
        if r["choices"][0]["finish_reason"] == "stop" {
            stops += 1;
            assert!(n < 50);
        } else {
            assert_eq!(n, 50);
        }
    }
    assert!(
        stops >= 15,
        "mean 2 should stop early almost always ({stops}/20)"
    );
}

#[test]
fn errors_have_openai_shape_and_status() {
    let sim = Sim::start(&args(&[
        "--max-model-len",
        "64",
        "--max-body-bytes",
        "1000",
    ]));
    let r = sim.post_raw("/v1/completions", b"{not json");
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("invalid request body")
    );
    let r = sim.post("/v1/completions", &json!({"model": "nope", "prompt": "a"}));
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "NotFoundError");
    let r = sim.post(
        "/v1/completions",
        &json!({"prompt": "a".repeat(200), "max_tokens": 20}),
    );
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 64")
    );
    let r = sim.post("/v1/completions", &json!({"prompt": "a", "n": 2}));
    assert_eq!(r.status, 400);
    let r = sim.post("/v1/completions", &json!({"prompt": "a".repeat(2000)}));
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["error"]["code"], 413);
    let r = sim.post("/v1/chat/completions", &json!({"messages": []}));
    assert_eq!(r.status, 400);
    let r = sim.post("/v1/completions", &json!({"prompt": []}));
    assert_eq!(r.status, 400);
}

#[test]
fn a_full_queue_answers_429() {
    // One sequence at a time, one waiting slot, slow model time: the third concurrent request
    // finds the queue full.
    let sim = Sim::start(&[
        "--model",
        "m",
        "--time-scale",
        "1",
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "1",
    ]);
    let port = sim.port;
    let handles: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let body = json!({"prompt": "abcd", "max_tokens": 200, "ignore_eos": true});
                support::try_request(
                    port,
                    "POST",
                    "/v1/completions",
                    Some(body.to_string().as_bytes()),
                )
                .unwrap()
            })
        })
        .collect();
    let statuses: Vec<u16> = handles
        .into_iter()
        .map(|h| h.join().unwrap().status)
        .collect();
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(sim.metric("kvgate_sim_rejected_queue_full_total") >= 1.0);
}

#[test]
fn faults_and_readiness_delay() {
    let sim = Sim::start(&args(&["--fault-error-rate", "1", "--fault-status", "503"]));
    let r = sim.post("/v1/completions", &json!({"prompt": "a"}));
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], 503);
    assert_eq!(sim.metric("kvgate_sim_faults_injected_total"), 1.0);
    drop(sim);

    let port = support::free_port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-sim"))
        .args([
            "--port",
            &port.to_string(),
            "--host",
            "127.0.0.1",
            "--ready-delay-ms",
            "1500",
        ])
        .env("RUST_LOG", "warn")
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut saw_503 = false;
    let ready = loop {
        match support::try_request(port, "GET", "/health", None) {
            Ok(r) if r.status == 503 => saw_503 = true,
            Ok(r) if r.status == 200 => break true,
            _ => {}
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        saw_503 && ready,
        "health must be 503 during the delay, then 200"
    );
}

#[test]
fn crash_endpoint_kills_the_process() {
    let mut sim = Sim::start(&args(&["--enable-crash-endpoint"]));
    let _ = support::try_request(sim.port, "POST", "/sim/crash", Some(b""));
    let status = sim.child.wait().unwrap();
    assert!(!status.success());
}

#[test]
fn disaggregated_prefill_then_decode() {
    let prefill = Sim::start(&args(&[]));
    let decode = Sim::start(&args(&[]));
    let prompt = "wxyz".repeat(40); // 40 tokens: 2 full blocks
    let p = prefill
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1, "stream": false,
                    "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}),
        )
        .json();
    let params = p["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(
        params["remote_block_ids"].as_array().unwrap().len(),
        2,
        "{params}"
    );
    assert_eq!(p["usage"]["completion_tokens"], 1);
    let d = decode
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 8, "ignore_eos": true, "kv_transfer_params": params}),
        )
        .json();
    assert_eq!(d["usage"]["completion_tokens"], 8);
    // The transferred 32 tokens are not recomputed.
    assert_eq!(d["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
}

#[test]
fn stalls_pause_a_stream_once_and_slow_start_delays_listening() {
    let sim = Sim::start(&args(&[
        "--fault-stall-rate",
        "1",
        "--fault-stall-ms",
        "600",
    ]));
    let t = std::time::Instant::now();
    let r = sim.post(
        "/v1/completions",
        &json!({"prompt": "a", "stream": true, "max_tokens": 4, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.sse().last().unwrap(), "[DONE]");
    assert!(
        t.elapsed() >= std::time::Duration::from_millis(600),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(sim.metric("kvgate_sim_stalls_injected_total"), 1.0);
    drop(sim);

    let port = support::free_port();
    let started = std::time::Instant::now();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-sim"))
        .args([
            "--port",
            &port.to_string(),
            "--host",
            "127.0.0.1",
            "--startup-delay-ms",
            "800",
        ])
        .env("RUST_LOG", "warn")
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        support::try_request(port, "GET", "/health", None).is_err(),
        "must not listen during the start-up delay"
    );
    let mut up = false;
    while started.elapsed() < std::time::Duration::from_secs(20) {
        if support::try_request(port, "GET", "/health", None).is_ok_and(|r| r.status == 200) {
            up = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(up && started.elapsed() >= std::time::Duration::from_millis(800));
}
