//! The real-engine tier: a real vLLM 0.32 on CPU (tiny random-weight Qwen3, the real Qwen3
//! tokenizer; `../shared/scripts/real-vllm/`) with the real sidecar, `nats-server`, EPP and
//! Envoy. Opt-in: the test is ignored in ordinary runs; `scripts/test-real-engine.sh` runs it
//! with `--ignored` and `KVGATE_REAL_VLLM=1` after the setup (without the variable it fails).
//!
//! One vLLM serves three checks, each reported PASS/FAIL with its time:
//! - **a. events**: vLLM's ZMQ KV events → sidecar → NATS carry the kvgate keys the router
//!   computes for the prompt with the real tokenizer; seq is contiguous in one epoch; a snapshot
//!   holds the resident set; a restarted sidecar has a new epoch and catches up by replay.
//! - **b. routing**: Envoy → EPP (NATS, real tokenizer) → {vLLM, kvgate-sim}, each behind its
//!   sidecar: a prompt cached on an engine by a request that bypassed the router is routed to
//!   that engine, and a shared prefix sticks to where it first went; the engines' own
//!   `cached_tokens` confirm the hits.
//! - **c. proxy SSE**: a streamed chat completion through the sidecar's pass-through proxy
//!   arrives incrementally and equal to the engine's direct stream.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "support/mod.rs"]
mod http_support;
#[path = "nats_support/mod.rs"]
mod support;

#[path = "real_vllm/engine.rs"]
mod engine;
#[path = "real_vllm/gateway.rs"]
mod gateway;

use std::collections::HashSet;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::Vllm;
use gateway::{Endpoint, Gateway};
use kv_events::key::{SaltStyle, request_block_keys};
use kv_events::{BlockKey, Tier};
use serde_json::{Value, json};
use support::{Nats, Receiver, Sidecar, snapshot, wait_for};
use tokenize::{ChatOptions, TextTokenizer};

const BLOCK: usize = 32;

/// What every check shares: the running vLLM and the real tokenizer.
struct Ctx {
    vllm: Vllm,
    tokenizer_dir: PathBuf,
    tokenizer: TextTokenizer,
}

/// Writes past the test harness's output capture, so the line is seen without `--nocapture`.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "[real-vllm] {line}");
}

fn ep(port: u16) -> String {
    format!("tcp://127.0.0.1:{port}")
}

/// A chat conversation with a long system prompt (`tag` makes it distinct) and a question.
fn messages(tag: &str, question: &str) -> Vec<Value> {
    let system: String = (0..40)
        .map(|i| format!("Rule {i} of the {tag} handbook: answer briefly and cite section {i}. "))
        .collect();
    vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": question}),
    ]
}

fn chat_body(msgs: &[Value], max_tokens: u32, stream: bool) -> Value {
    let mut b = json!({"model": "tiny", "messages": msgs, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": true});
    if stream {
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

impl Ctx {
    fn ids(&self, msgs: &[Value]) -> Vec<u32> {
        self.tokenizer
            .encode_chat(msgs, &ChatOptions::default())
            .unwrap()
    }

    /// The keys the router computes for a chat prompt: real tokenizer, then kvgate keys.
    fn keys(&self, msgs: &[Value]) -> Vec<BlockKey> {
        request_block_keys(
            "tiny",
            None,
            SaltStyle::VllmExtraKey,
            &self.ids(msgs),
            BLOCK,
        )
    }
}

/// POSTs a chat completion straight to an engine port; returns the JSON answer.
fn chat_direct(port: u16, msgs: &[Value], max_tokens: u32) -> Value {
    let r = http_support::request(
        port,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body(msgs, max_tokens, false).to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn cached_tokens(resp: &Value) -> u64 {
    resp.pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("no usage.prompt_tokens_details.cached_tokens in {resp}"))
}

fn contains_all(have: &[BlockKey], want: &[BlockKey]) -> bool {
    let have: HashSet<_> = have.iter().collect();
    want.iter().all(|k| have.contains(k))
}

fn resident(snap: &kv_events::snapshot::Snapshot) -> HashSet<BlockKey> {
    snap.entries()
        .filter(|(_, t)| *t == Tier::Gpu)
        .map(|(k, _)| k)
        .collect()
}

/// a. vLLM's KV events through the sidecar onto NATS.
async fn check_events(ctx: Arc<Ctx>) {
    let nats = Nats::start();
    let pod = "vllm-a";
    let mut rx = Receiver::connect(&nats.url(), &format!("kvgate.kv.ns.pool.{pod}")).await;
    let vllm_flags = ["--engine", "vllm", "--block-size", "32"];
    let v = &ctx.vllm;
    let sidecar = Sidecar::start(
        &nats.url(),
        v.http,
        &ep(v.events),
        &ep(v.replay),
        pod,
        &vllm_flags,
    );
    wait_for("NATS connected", Duration::from_secs(10), || {
        sidecar.metric("kvgate_sidecar_nats_connected") == 1.0
    });
    tokio::time::sleep(Duration::from_millis(500)).await; // the SUB socket joins

    let msgs = messages("events", "What does rule 3 say?");
    let ids = ctx.ids(&msgs);
    let want = ctx.keys(&msgs);
    assert!(want.len() >= 8, "prompt too short: {} tokens", ids.len());
    let t = Instant::now();
    let resp = chat_direct(v.http, &msgs, 4);
    assert_eq!(
        resp["usage"]["prompt_tokens"].as_u64(),
        Some(ids.len() as u64),
        "vLLM's prompt token count differs from crates/tokenize's"
    );
    rx.until("the prompt's keys", Duration::from_secs(10), |e| {
        contains_all(&support::stored_keys(e), &want)
    })
    .await;
    say(&format!(
        "a: {} prompt tokens → {} keys on NATS {:?} after the request was sent; {} envelope(s)",
        ids.len(),
        want.len(),
        t.elapsed(),
        rx.envelopes.len()
    ));
    let epoch1 = rx.envelopes[0].epoch;
    for (i, env) in rx.envelopes.iter().enumerate() {
        assert_eq!(env.epoch, epoch1, "one epoch");
        assert_eq!(env.seq, i as u64, "contiguous seq from 0");
        assert_eq!(env.source.pod.as_deref(), Some(pod));
        assert_eq!(env.source.block_size, 32);
        assert_eq!(env.source.engine, kv_events::envelope::EngineKind::Vllm);
    }
    let snap = snapshot(&rx.client, pod).await;
    assert_eq!(snap.epoch, epoch1);
    let have = resident(&snap);
    assert!(want.iter().all(|k| have.contains(k)), "snapshot lacks keys");
    assert_eq!(sidecar.metric("kvgate_sidecar_gaps_total"), 0.0);
    assert_eq!(sidecar.metric("kvgate_sidecar_malformed_total"), 0.0);
    assert_eq!(sidecar.metric("kvgate_sidecar_rejected_events_total"), 0.0);

    // A new sidecar: new epoch; the engine's replay buffer restores the resident set.
    drop(sidecar);
    let sidecar = Sidecar::start(
        &nats.url(),
        v.http,
        &ep(v.events),
        &ep(v.replay),
        pod,
        &vllm_flags,
    );
    wait_for("NATS connected", Duration::from_secs(10), || {
        sidecar.metric("kvgate_sidecar_nats_connected") == 1.0
    });
    wait_for("replayed frames", Duration::from_secs(10), || {
        sidecar.metric("kvgate_sidecar_frames_in_total") >= 1.0
    });
    let snap = snapshot(&rx.client, pod).await;
    assert_ne!(snap.epoch, epoch1, "a restarted sidecar has a new epoch");
    let have = resident(&snap);
    assert!(
        want.iter().all(|k| have.contains(k)),
        "snapshot after restart lacks keys"
    );
    say(&format!(
        "a: restart → epoch {:#x} ≠ {epoch1:#x}; snapshot holds {} keys (replay)",
        snap.epoch,
        have.len()
    ));
}

/// Starts `kvgate-sim` (`$KVGATE_SIM_BIN`, else the target directory's) as a second engine:
/// model `tiny`, the real tokenizer, block size 32.
fn start_sim(tokenizer_dir: &std::path::Path) -> (http_support::Sim, u16, u16) {
    let [http, publisher, replay] = http_support::free_ports::<3>();
    let config = format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{publisher}","replay_endpoint":"tcp://*:{replay}"}}"#
    );
    let bin =
        std::env::var_os("KVGATE_SIM_BIN").map_or_else(http_support::sim_binary, PathBuf::from);
    let child = Command::new(bin)
        .args(["--host", "127.0.0.1", "--port", &http.to_string()])
        .args([
            "--model",
            "tiny",
            "--block-size",
            "32",
            "--max-model-len",
            "2048",
        ])
        .args(["--time-scale", "50", "--pod-name", "sim-0", "--tokenizer"])
        .arg(tokenizer_dir)
        .args(["--kv-events-config", &config])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvgate-sim");
    let mut sim = http_support::Sim { child, port: http };
    wait_for("kvgate-sim /health", Duration::from_secs(60), || {
        if let Ok(Some(status)) = sim.child.try_wait() {
            panic!("kvgate-sim exited during start-up: {status}");
        }
        http_support::request(http, "GET", "/health", &[], b"").is_ok_and(|r| r.status == 200)
    });
    (sim, publisher, replay)
}

/// Tokens of the full blocks two prompts share: what the engine can serve from its cache
/// (it always computes at least the prompt's last token).
fn shared_block_tokens(a: &[u32], b: &[u32]) -> u64 {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let usable = common.min(b.len().saturating_sub(1));
    (usable / BLOCK * BLOCK) as u64
}

/// b. precise routing through Envoy and the EPP, confirmed by the engines' cached tokens.
async fn check_routing(ctx: Arc<Ctx>) {
    let nats = Nats::start();
    let v = &ctx.vllm;
    let (sim, sim_pub, sim_replay) = start_sim(&ctx.tokenizer_dir);
    let sc_v = Sidecar::start(
        &nats.url(),
        v.http,
        &ep(v.events),
        &ep(v.replay),
        "vllm-0",
        &["--engine", "vllm", "--block-size", "32"],
    );
    let sc_s = Sidecar::start(
        &nats.url(),
        sim.port,
        &ep(sim_pub),
        &ep(sim_replay),
        "sim-0",
        &["--block-size", "32"],
    );
    let gw = Gateway::start(
        &nats.url(),
        &ctx.tokenizer_dir,
        &[
            Endpoint {
                pod: "vllm-0",
                port: sc_v.proxy_port,
            },
            Endpoint {
                pod: "sim-0",
                port: sc_s.proxy_port,
            },
        ],
    );
    let mut rx_v = Receiver::connect(&nats.url(), "kvgate.kv.ns.pool.vllm-0").await;
    let mut rx_s = Receiver::connect(&nats.url(), "kvgate.kv.ns.pool.sim-0").await;
    tokio::time::sleep(Duration::from_millis(500)).await; // SUB sockets join
    let name = |resp: &http_support::Response| -> &'static str {
        let host = resp.header("x-upstream-host").unwrap_or("?").to_owned();
        if host.ends_with(&format!(":{}", sc_v.proxy_port)) {
            "vllm-0"
        } else if host.ends_with(&format!(":{}", sc_s.proxy_port)) {
            "sim-0"
        } else {
            panic!("request went to {host}, not an endpoint the EPP listed")
        }
    };
    let routed = |msgs: &[Value]| -> (http_support::Response, Value) {
        let r = gw.post("/v1/chat/completions", &chat_body(msgs, 4, false));
        assert_eq!(
            r.status,
            200,
            "{}\nEPP log:\n{}",
            r.text(),
            gw.epp_log_tail(20)
        );
        let j = r.json();
        (r, j)
    };

    // 1. Warm an engine behind the router's back; only its KV events can tell the EPP.
    let targets = [
        ("vllm-0", v.http),
        ("sim-0", sim.port),
        ("vllm-0", v.http),
        ("sim-0", sim.port),
    ];
    for (i, (target, port)) in targets.into_iter().enumerate() {
        let tag = format!("routing-{i}");
        let warm = messages(&tag, "First question?");
        let epp_seen = || {
            http_support::metric(gw.epp_metrics, "kvgate_epp_nats_envelopes_applied_total")
                + http_support::metric(gw.epp_metrics, "kvgate_epp_nats_snapshots_applied_total")
        };
        let before = epp_seen();
        chat_direct(port, &warm, 4);
        let want = ctx.keys(&warm);
        let rx = if target == "vllm-0" {
            &mut rx_v
        } else {
            &mut rx_s
        };
        rx.until("the warm-up's keys on NATS", Duration::from_secs(10), |e| {
            contains_all(&support::stored_keys(e), &want)
        })
        .await;
        wait_for("the EPP applies it", Duration::from_secs(10), || {
            epp_seen() > before
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let follow = messages(&tag, "And a different second question?");
        let (r, j) = routed(&follow);
        let got = name(&r);
        let expect = shared_block_tokens(&ctx.ids(&warm), &ctx.ids(&follow));
        let cached = cached_tokens(&j);
        say(&format!(
            "b: prefix {i} warmed on {target} directly ({} keys) → EPP routed the follow-up to {got}; cached_tokens {cached} (shared full blocks: {expect} tokens)",
            want.len()
        ));
        assert_eq!(got, target, "the EPP did not follow the engine's KV events");
        assert!(
            cached >= expect.saturating_sub(BLOCK as u64) && cached > 0,
            "{target} reported {cached} cached tokens, expected about {expect}"
        );
    }

    // 2. A shared prefix sticks to the engine that served it first.
    for i in 0..2 {
        let tag = format!("sticky-{i}");
        let first = messages(&tag, "Opening question?");
        let (r1, _) = routed(&first);
        let pod = name(&r1);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let second = messages(&tag, "Second question on the same handbook?");
        let (r2, j2) = routed(&second);
        let expect = shared_block_tokens(&ctx.ids(&first), &ctx.ids(&second));
        let cached = cached_tokens(&j2);
        say(&format!(
            "b: sticky prefix {i}: first → {pod}, second → {}; cached_tokens {cached} (expected ≈ {expect})",
            name(&r2)
        ));
        assert_eq!(name(&r2), pod, "the shared prefix left its engine");
        assert!(cached >= expect.saturating_sub(BLOCK as u64) && cached > 0);
    }
    let m = |n: &str| http_support::metric(gw.epp_metrics, n);
    say(&format!(
        "b: EPP routed {} requests, prefix hit ratio {:.2}, NATS envelopes {}",
        m("kvgate_epp_requests_routed_total"),
        m("kvgate_epp_prefix_hit_ratio"),
        m("kvgate_epp_nats_envelopes_applied_total"),
    ));
}

/// What a client makes of an SSE chat stream: the concatenated text, the finish reason, the
/// usage, and each event's field names. vLLM coalesces tokens produced while a chunk is being
/// written, so chunk boundaries (and the event count) depend on timing, not on the proxy.
fn stream_summary(
    r: &http_support::Response,
) -> (String, Vec<Value>, Vec<Value>, Vec<Vec<String>>) {
    let events = r.sse();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let (mut text, mut finish, mut usage, mut shapes) = (String::new(), vec![], vec![], vec![]);
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}"));
        if let Some(t) = v
            .pointer("/choices/0/delta/content")
            .and_then(Value::as_str)
        {
            text.push_str(t);
        }
        if let Some(f) = v
            .pointer("/choices/0/finish_reason")
            .filter(|f| !f.is_null())
        {
            finish.push(f.clone());
        }
        if !v["usage"].is_null() {
            usage.push(v["usage"].clone());
        }
        let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        shapes.push(keys);
    }
    shapes.dedup();
    (text, finish, usage, shapes)
}

/// c. the sidecar's pass-through proxy in front of vLLM streams SSE unchanged.
async fn check_proxy_sse(ctx: Arc<Ctx>) {
    let v = &ctx.vllm;
    let sidecar = http_support::Sidecar::start(v.http, &["--engine", "vllm"], true);
    let msgs = messages("proxy", "Stream a long answer, please.");
    let body = chat_body(&msgs, 48, true);
    // Warm once so both compared streams see the same cached prefix (same usage).
    chat_direct(v.http, &msgs, 1);
    let post = |port: u16| {
        http_support::request(
            port,
            "POST",
            "/v1/chat/completions",
            &[],
            body.to_string().as_bytes(),
        )
        .unwrap()
    };
    let direct = post(v.http);
    let proxied = post(sidecar.port);
    assert_eq!(proxied.status, 200, "{}", proxied.text());
    assert!(
        proxied
            .header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream")),
        "{:?}",
        proxied.headers
    );
    let (d, p) = (stream_summary(&direct), stream_summary(&proxied));
    assert_eq!(p.1, vec![json!("length")], "one finish_reason");
    assert_eq!(p.2.len(), 1, "one usage chunk");
    assert_eq!(p.2[0]["completion_tokens"].as_u64(), Some(48), "{:?}", p.2);
    assert_eq!(d, p, "the proxied stream differs from the direct one");
    let data_reads = |r: &http_support::Response| {
        r.reads
            .iter()
            .filter(|(_, b)| b.windows(5).any(|w| w == b"data:"))
            .count()
    };
    let first = proxied.arrival_of("data: ").unwrap();
    let done = proxied.arrival_of("[DONE]").unwrap();
    say(&format!(
        "c: {} SSE events (direct {}): text, finish reason, usage and event shapes equal to the direct stream's; data reads direct {} / proxied {}; proxied first chunk {first:?}, [DONE] {done:?}",
        proxied.sse().len(),
        direct.sse().len(),
        data_reads(&direct),
        data_reads(&proxied)
    ));
    assert!(
        data_reads(&proxied) >= 8,
        "the proxied stream came in {} reads: buffered?",
        data_reads(&proxied)
    );
    assert!(done > first, "first chunk and [DONE] arrived together");
    assert_eq!(
        sidecar.metric_where("kvgate_sidecar_proxy_requests_total", "passthrough"),
        1.0
    );
}

fn panic_text(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(p) => p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "panic".into()),
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "opt-in real-vLLM tier: scripts/test-real-engine.sh"]
async fn real_vllm_tier() {
    assert_eq!(
        std::env::var("KVGATE_REAL_VLLM").as_deref(),
        Ok("1"),
        "the real-vLLM tier runs through scripts/test-real-engine.sh (or with KVGATE_REAL_VLLM=1 \
         after ../shared/scripts/real-vllm/setup.sh)"
    );
    let dir = engine::setup_dir();
    let scripts = support::shared().join("scripts/real-vllm");
    assert!(
        scripts.join("serve.sh").is_file(),
        "{} is missing (../shared checkout, or set KVGATE_SHARED)",
        scripts.display()
    );
    let tokenizer_dir = dir.join("tokenizer");
    let tokenizer = TextTokenizer::from_dir(&tokenizer_dir)
        .unwrap_or_else(|e| panic!("{e} (run ../shared/scripts/real-vllm/setup.sh)"));
    let vllm = Vllm::start(
        &scripts,
        &dir,
        &["--enable-prompt-tokens-details", "--max-num-seqs", "4"],
    );
    say(&format!(
        "vLLM ready in {:.1} s (http {}, events {}, replay {}), RSS {:.1} GiB",
        vllm.startup.as_secs_f64(),
        vllm.http,
        vllm.events,
        vllm.replay,
        vllm.rss_gib()
    ));
    let ctx = Arc::new(Ctx {
        vllm,
        tokenizer_dir,
        tokenizer,
    });
    let mut results = Vec::new();
    for (name, check) in [
        ("a. events → sidecar → NATS", 0),
        ("b. precise routing (Envoy → EPP)", 1),
        ("c. proxy streams SSE unchanged", 2),
    ] {
        let t = Instant::now();
        let c = Arc::clone(&ctx);
        let outcome = match check {
            0 => tokio::spawn(check_events(c)).await,
            1 => tokio::spawn(check_routing(c)).await,
            _ => tokio::spawn(check_proxy_sse(c)).await,
        };
        let secs = t.elapsed().as_secs_f64();
        let verdict = outcome.map_err(panic_text);
        match &verdict {
            Ok(()) => say(&format!("{name}: PASS in {secs:.1} s")),
            Err(e) => say(&format!("{name}: FAIL in {secs:.1} s: {e}")),
        }
        results.push((name, verdict));
    }
    let failed: Vec<_> = results.iter().filter(|(_, r)| r.is_err()).collect();
    if !failed.is_empty() {
        say(&format!("vLLM log tail:\n{}", ctx.vllm.log_tail(20)));
    }
    assert!(failed.is_empty(), "failed checks: {failed:?}");
}
