//! Decision cost inside the EPP: parse → tokenize → keys → lookup → score → pick, measured on
//! `Picker::route` (the exact code the ext_proc stream calls) on one thread.
//!
//! Setup (seeded): 64 endpoints; an index holding 20,000 random 32-block chains spread over
//! them plus every measured conversation's history on 4 endpoints; the real Qwen3 tokenizer
//! and chat template (`.cache/tokenizers/qwen3/package/models`, or `KVGATE_TOKENIZER_DIR`).
//! Prompts are chats of seeded English-like text.
//!
//! Scenarios, each at ~8,000 and ~100,000 prompt tokens:
//! - `warm`: the EPP routed this conversation's previous request, and the new request adds a
//!   short user question (~40 tokens): every earlier segment comes from the segment cache.
//! - `new turn`: as `warm`, but the request also carries the assistant's previous answer, which
//!   the EPP never saw (~250 tokens), and a long new user turn (~450 tokens): ~700 new tokens.
//! - `cold`: a conversation never seen before: everything is tokenized.
//!
//! Each case reports wall-time percentiles and, on a second line, the same for the thread's CPU
//! time (`CLOCK_THREAD_CPUTIME_ID`), which on a shared machine leaves out waits for a core.
//!
//! Run: `cargo bench -p kvgate-epp --bench decision` (`-- 8k` or `-- 100k` for one size,
//! `-- breakdown` for the stages of a warm 8k decision timed alone, `-- profile` for 1,000 warm
//! 8k decisions to attach a profiler to, `-- added` for what added tokens in a prompt cost its
//! keying, `-- unicode` for what Chinese and multilingual prompts cost it against English).
//!
//! Tracing (`KVGATE_BENCH_TRACE`): unset, no subscriber at all; `off`, the EPP's own subscriber
//! with tracing off (its default: the log only, request spans disabled); `otlp`, the EPP's
//! subscriber exporting every request's spans (`KVGATE_BENCH_TRACE_RATIO`, default 1) to an
//! in-process OTLP receiver. Each decision is timed as the ext_proc stream makes it: the
//! request's span, `Picker::route` inside it, and the `traceparent` for the engine; the
//! response's end (closing the request's spans) is timed apart, as `end`. `ab` alternates the
//! two subscribers request by request in one process (`[off]` and `[on]` lines), so that the
//! machine's drift between runs does not enter the comparison.
//! `e2e/bench/trace_cost.sh` alternates `off` and `otlp` runs and prints the ratio.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss,
    clippy::cast_sign_loss
)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_events::key::SaltStyle;
use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{Holder, IndexConfig, KvIndex};
use kvgate_epp::discovery::Datastore;
use kvgate_epp::extproc::{ResponseEvent, Router, RoutingInput};
use kvgate_epp::routing::keys::{Keyer, ModelTokenizer};
use kvgate_epp::routing::picker::Picker;
use scheduler::{Endpoint, InflightTracker, LoadBook, Scheduler, SchedulerConfig};
use serde_json::json;

/// The allocator the `kvgate-epp` binary uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ENDPOINTS: u16 = 64;
const BLOCK: usize = 16;
const MODEL: &str = "Qwen/Qwen3-0.6B";

const WORDS: &[&str] = &[
    "the",
    "cache",
    "request",
    "model",
    "token",
    "prefix",
    "server",
    "gateway",
    "route",
    "block",
    "memory",
    "latency",
    "cluster",
    "policy",
    "engine",
    "decode",
    "prefill",
    "batch",
    "queue",
    "stream",
    "user",
    "system",
    "answer",
    "question",
    "data",
    "value",
    "index",
    "node",
    "pod",
    "service",
    "deploy",
    "scale",
    "update",
    "config",
    "result",
    "error",
    "retry",
    "timeout",
    "network",
    "storage",
    "compute",
    "weight",
    "layer",
    "attention",
    "context",
    "window",
    "summary",
    "report",
    "document",
    "paragraph",
    "analysis",
    "describe",
    "explain",
    "compare",
    "and",
    "of",
    "to",
    "in",
    "with",
    "for",
    "on",
    "by",
    "from",
    "about",
    "into",
    "over",
    "under",
    "between",
    "through",
    "quickly",
    "carefully",
    "large",
    "small",
    "fast",
    "slow",
    "new",
    "old",
];

/// A tiny seeded generator (xorshift), so inputs are the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn text(&mut self, words: usize) -> String {
        let mut s = String::with_capacity(words * 7);
        for i in 0..words {
            if i > 0 {
                s.push(if i % 17 == 0 { '.' } else { ' ' });
                if i % 17 == 0 {
                    s.push(' ');
                }
            }
            s.push_str(WORDS[(self.next() % WORDS.len() as u64) as usize]);
        }
        s
    }

    /// About `bytes` bytes of Chinese: characters drawn from 498 common ones, a
    /// comma every 6–17 of them and a full stop every few clauses.
    fn chinese(&mut self, bytes: usize) -> String {
        let pool: Vec<char> = ZH.chars().collect();
        let mut s = String::with_capacity(bytes + 8);
        while s.len() < bytes {
            for _ in 0..6 + self.next() % 12 {
                s.push(pool[(self.next() % pool.len() as u64) as usize]);
            }
            s.push(if self.next().is_multiple_of(3) {
                '。'
            } else {
                '，'
            });
        }
        s
    }

    /// About `bytes` bytes alternating English words, Chinese clauses, Russian and accented
    /// words, numbers and emoji: what a multilingual chat holds.
    fn mixed(&mut self, bytes: usize) -> String {
        const OTHER: [&str; 8] = [
            "Привет",
            "мир",
            "résumé",
            "naïve",
            "café",
            "Straße",
            "😀",
            "über",
        ];
        let mut s = String::with_capacity(bytes + 64);
        while s.len() < bytes {
            match self.next() % 4 {
                0 => s.push_str(&self.text(4)),
                1 => s.push_str(&self.chinese(12)),
                2 => s.push_str(OTHER[(self.next() % OTHER.len() as u64) as usize]),
                _ => s.push_str(&format!("{}年", 1900 + self.next() % 130)),
            }
            s.push(' ');
        }
        s
    }
}

/// Common Chinese characters, for [`Rng::chinese`].
const ZH: &str = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处队南给色光门即保治北造百规热领七海口东导器压志世金增争济阶油思术极交受联什认六共权收证改清己美再采转更单风切打白教速花带安场身车例真务具万每目至达走积示议声报斗完类八离华名确才科张信马节话米整空元况今集温传土许步群广石记需段研界拉林律叫且究观越织装影算低持音众书布复容儿须际商非验连断深难近矿千周委素技备半办青省列习响约支般史感劳便团往酸历市克何除消构府称太准精值号率族维划选标写存候毛亲快效斯院查江型眼王按格养易置派层片始却专状育厂京识适属圆包火住调满县局照参红细引听该铁价严";

/// A conversation of `turns` user/assistant pairs and a final user turn of `last` words.
fn conversation(
    rng: &mut Rng,
    words_per_turn: usize,
    turns: usize,
    last: usize,
) -> Vec<serde_json::Value> {
    let mut m = vec![json!({"role": "system", "content": rng.text(60)})];
    for _ in 0..turns {
        m.push(json!({"role": "user", "content": rng.text(words_per_turn)}));
        m.push(json!({"role": "assistant", "content": rng.text(words_per_turn / 2)}));
    }
    m.push(json!({"role": "user", "content": rng.text(last)}));
    m
}

fn body(messages: &[serde_json::Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": MODEL, "messages": messages, "max_tokens": 64})).unwrap()
}

fn tokenizer_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("KVGATE_TOKENIZER_DIR") {
        return Some(PathBuf::from(d));
    }
    let here =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3/package/models");
    here.join("tokenizer.json").exists().then_some(here)
}

/// The picker, with what the bench needs to play the engines' part.
struct Bench {
    picker: Picker,
    index: Arc<KvIndex>,
    endpoints: Arc<Datastore>,
    /// Keys whole prompts (no early stop), as an engine caches them.
    keyer: Keyer,
}

impl Bench {
    /// Routes `body` untimed, then stores its whole prompt on the chosen endpoint, as the
    /// engine's KV events would after serving it (the picker itself speculates only the keys
    /// it computed, which stop at the first block no endpoint held).
    fn serve(&self, body: &[u8]) {
        use kvgate_epp::routing::request::{Api, parse};
        let d = self
            .picker
            .route(chat_input(body, &otel::RequestSpan::none()))
            .expect("routed");
        self.picker.on_response(d.ticket, ResponseEvent::End);
        // The engine takes far longer to serve it than the picker to finish tokenizing it.
        self.picker.keyer().wait_idle();
        let keys = self
            .keyer
            .key(&parse(Api::Chat, body).unwrap())
            .unwrap()
            .keys;
        let addr = &d.endpoints[0];
        let id = self
            .endpoints
            .snapshot()
            .iter()
            .find(|e| e.address.to_string() == *addr)
            .map(|e| e.id)
            .unwrap();
        self.index.apply(
            Holder::Endpoint(id),
            &[KvEvent::Stored {
                keys,
                parent: None,
                tier: Tier::Gpu,
                lora: None,
                token_count: 0,
            }],
        );
    }
}

/// A keyer as the EPP builds one, with the real tokenizer from `dir` (its own segment cache).
fn qwen3_keyer(dir: &Path) -> Keyer {
    let tok = tokenize::TextTokenizer::from_dir(dir).expect("tokenizer");
    Keyer::new(BLOCK, SaltStyle::VllmExtraKey, MODEL)
        .with_model(MODEL, ModelTokenizer::new(tok, 256 << 20))
}

/// The picker over a populated index.
fn setup(dir: &Path) -> Bench {
    let keyer = qwen3_keyer(dir);
    let ds = Arc::new(Datastore::new());
    let eps = (0..ENDPOINTS)
        .map(|i| {
            let key = (format!("pod-{i}"), 8000);
            let id = ds.id_for(&key);
            let addr = format!("10.0.{}.{}:8000", i / 250, i % 250)
                .parse()
                .unwrap();
            (key, Endpoint::new(id, addr))
        })
        .collect();
    ds.replace(eps);
    let index = Arc::new(KvIndex::new(IndexConfig::default()).unwrap());
    let mut rng = Rng(0x5eed);
    let ids: Vec<_> = ds.snapshot().iter().map(|e| e.id).collect();
    for _ in 0..20_000 {
        let holder = Holder::Endpoint(ids[(rng.next() % ids.len() as u64) as usize]);
        let keys: Vec<BlockKey> = (0..32).map(|_| BlockKey(rng.next())).collect();
        index.apply(
            holder,
            &[KvEvent::Stored {
                keys,
                parent: None,
                tier: Tier::Gpu,
                lora: None,
                token_count: 512,
            }],
        );
    }
    let picker = Picker::new(
        keyer,
        Scheduler::new(SchedulerConfig::default(), 7).unwrap(),
        Arc::clone(&index),
        Arc::new(InflightTracker::new()),
        Arc::new(LoadBook::new()),
        Arc::clone(&ds),
    );
    let full = qwen3_keyer(dir);
    Bench {
        picker,
        index,
        endpoints: ds,
        keyer: full,
    }
}

/// CPU time this thread has run (`CLOCK_THREAD_CPUTIME_ID`). The machine is shared, so wall
/// time also counts time the thread waited for a core; CPU time does not.
/// With `KVGATE_BENCH_NO_CPU_CLOCK` set it reads zero: rustix's vDSO set-up crashes under
/// valgrind, which counts instructions instead (docs/benchmarks.md, "what tracing costs").
fn thread_cpu() -> Duration {
    thread_local! {
        static OFF: bool = std::env::var_os("KVGATE_BENCH_NO_CPU_CLOCK").is_some();
    }
    if OFF.with(|off| *off) {
        return Duration::ZERO;
    }
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// Wall and CPU time of one routing decision.
#[derive(Clone, Copy)]
struct Took {
    wall: Duration,
    cpu: Duration,
    /// The response's end, timed apart (closing the request's spans).
    end: Duration,
}

/// A chat completion request with `body`, as the ext_proc stream hands it to the picker.
fn chat_input<'a>(body: &'a [u8], trace: &'a otel::RequestSpan) -> RoutingInput<'a> {
    RoutingInput {
        method: "POST",
        path: "/v1/chat/completions",
        headers: &[],
        body: Some(body),
        subset: None,
        request_id: None,
        trace,
    }
}

/// The headers a request arrives with: a caller's trace context, sampled (every request traced)
/// or not (`KVGATE_BENCH_CALLER=unsampled`), or none (`KVGATE_BENCH_CALLER=none`: the EPP
/// starts the trace and `KVGATE_BENCH_TRACE_RATIO` decides).
fn traced_headers() -> Vec<(String, String)> {
    let flags = match std::env::var("KVGATE_BENCH_CALLER").as_deref() {
        Ok("none") => return Vec::new(),
        Ok("unsampled") => "00",
        _ => "01",
    };
    vec![(
        "traceparent".to_owned(),
        format!("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-{flags}"),
    )]
}

fn route(picker: &Picker, body: &[u8]) -> Took {
    thread_local! {
        static HEADERS: Vec<(String, String)> = traced_headers();
    }
    let c = thread_cpu();
    let t = Instant::now();
    // As the ext_proc stream does: the sampling decision, then a span only for a traced request.
    let (span, unsampled) = HEADERS.with(|h| match otel::head(h) {
        otel::Head::Trace { parent } => (
            kvgate_epp::extproc::request_span(
                "POST",
                "/v1/chat/completions",
                "bench",
                parent.as_ref(),
            ),
            None,
        ),
        otel::Head::Skip { traceparent } => (otel::RequestSpan::none(), traceparent),
    });
    let d = picker.route(chat_input(body, &span)).expect("routed");
    let parent = (span.trace_headers(), unsampled);
    let wall = t.elapsed();
    let cpu = thread_cpu().saturating_sub(c);
    std::hint::black_box(parent);
    let t = Instant::now();
    picker.on_response(d.ticket, ResponseEvent::End);
    drop(span);
    Took {
        wall,
        cpu,
        end: t.elapsed(),
    }
}

/// With `KVGATE_BENCH_TRACE=ab`: the EPP's subscriber with tracing off, then with it on;
/// consecutive requests alternate between them (see [`under`]).
static AB: std::sync::OnceLock<[tracing::Dispatch; 2]> = std::sync::OnceLock::new();

/// Runs sample `i` under its A/B subscriber, if any; says whether it was traced.
fn under<R>(i: usize, f: impl FnOnce() -> R) -> (bool, R) {
    match AB.get() {
        Some(d) => {
            let traced = i % 2 == 1;
            let out = tracing::dispatcher::with_default(&d[usize::from(traced)], f);
            (traced, out)
        }
        None => (false, f()),
    }
}

/// Reports `samples` whole, or, in A/B mode, the untraced and the traced halves apart.
fn report_ab(name: &str, tokens: usize, samples: [Vec<Took>; 2]) {
    let [off, on] = samples;
    if AB.get().is_some() {
        // Neighbouring requests, one untraced and one traced, drift together: the median of
        // their differences is the cost of tracing with the machine's drift taken out.
        let delta = |f: fn(&Took) -> Duration| {
            let mut d: Vec<f64> = off
                .iter()
                .zip(&on)
                .map(|(a, b)| f(b).as_secs_f64() - f(a).as_secs_f64())
                .collect();
            d.sort_by(f64::total_cmp);
            d.get(d.len() / 2).copied().unwrap_or(0.0) * 1e6
        };
        let (cpu, end) = (delta(|t| t.cpu), delta(|t| t.end));
        let base = percentiles(off.iter().map(|t| t.cpu).collect())[0];
        report(&format!("{name} [off]"), tokens, off);
        report(&format!("{name} [on]"), tokens, on);
        println!(
            "{name} paired: tracing adds {cpu:.1} µs of CPU to a decision ({:.1}% of its p50 \
             {base:.1} µs) and {end:.1} µs to the response's end",
            100.0 * cpu / base
        );
    } else {
        report(name, tokens, off);
    }
}

fn percentiles(mut samples: Vec<Duration>) -> [f64; 4] {
    samples.sort_unstable();
    let pct = |p: f64| {
        let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
        samples[i].as_secs_f64() * 1e6
    };
    [pct(0.5), pct(0.9), pct(0.99), pct(1.0)]
}

/// Wall-time percentiles, then the same for the thread's CPU time.
fn report(name: &str, tokens: usize, samples: Vec<Took>) {
    let n = samples.len();
    let wall = percentiles(samples.iter().map(|t| t.wall).collect());
    let cpu = percentiles(samples.iter().map(|t| t.cpu).collect());
    println!(
        "{name:<14} ~{tokens:>6} tokens  n={n:<4} p50 {:>9.1} µs  p90 {:>9.1} µs  p99 {:>9.1} µs  max {:>9.1} µs",
        wall[0], wall[1], wall[2], wall[3]
    );
    println!(
        "{:<14}  {:>6}  cpu     p50 {:>9.1} µs  p90 {:>9.1} µs  p99 {:>9.1} µs  max {:>9.1} µs",
        "", "", cpu[0], cpu[1], cpu[2], cpu[3]
    );
    let ends: Vec<Duration> = samples.iter().map(|t| t.end).collect();
    if !ends.is_empty() {
        let end = percentiles(ends);
        println!(
            "{:<14}  {:>6}  end     p50 {:>9.1} µs  p90 {:>9.1} µs  p99 {:>9.1} µs  max {:>9.1} µs",
            "", "", end[0], end[1], end[2], end[3]
        );
    }
}

/// The subscriber `KVGATE_BENCH_TRACE` asks for (see the module docs); what it returns must
/// live until the end (the runtime carries the receiver and the exporter's channel).
fn tracing_mode() -> Option<Tracing> {
    let mode = std::env::var("KVGATE_BENCH_TRACE").ok()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut args = otel::TracingArgs::default();
    let receiver = match mode.as_str() {
        "off" => None,
        "otlp" | "ab" => {
            let r = runtime.block_on(otel::receiver::Receiver::start()).unwrap();
            // `KVGATE_BENCH_OTLP_ENDPOINT`: export elsewhere (a collector in another process,
            // or a closed port to leave the export's own work out).
            args.otlp_endpoint =
                Some(std::env::var("KVGATE_BENCH_OTLP_ENDPOINT").unwrap_or_else(|_| r.endpoint()));
            args.trace_sample_ratio = std::env::var("KVGATE_BENCH_TRACE_RATIO")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1.0);
            Some(r)
        }
        other => {
            eprintln!("KVGATE_BENCH_TRACE must be `off`, `otlp` or `ab`, not {other:?}");
            std::process::exit(2);
        }
    };
    let telemetry = if mode == "ab" {
        let _rt = runtime.enter();
        let (off, _) = otel::dispatch("kvgate-epp", &otel::TracingArgs::default()).unwrap();
        let (on, telemetry) = otel::dispatch("kvgate-epp", &args).unwrap();
        let _ = AB.set([off, on]);
        telemetry
    } else {
        let _rt = runtime.enter();
        otel::init("kvgate-epp", &args).unwrap()
    };
    println!(
        "tracing: {mode}{}",
        if telemetry.exporting() {
            format!(", sample ratio {}", args.trace_sample_ratio)
        } else {
            String::new()
        }
    );
    Some(Tracing {
        runtime,
        telemetry,
        receiver,
    })
}

/// The bench's tracing set-up, kept alive to the end.
struct Tracing {
    runtime: tokio::runtime::Runtime,
    telemetry: otel::Telemetry,
    receiver: Option<otel::receiver::Receiver>,
}

impl Tracing {
    /// Flushes the exporter and says how many spans the receiver got.
    fn finish(self) {
        self.telemetry.shutdown();
        if let Some(r) = self.receiver {
            let spans = r.spans();
            let requests = spans.iter().filter(|s| s.name == "epp.request").count();
            println!(
                "tracing: the receiver got {} spans, {requests} of them request spans",
                spans.len()
            );
        }
        drop(self.runtime);
    }
}

/// Approximate prompt tokens of a conversation, from the tokenizer.
fn count_tokens(dir: &Path, messages: &[serde_json::Value]) -> usize {
    let tok = tokenize::TextTokenizer::from_dir(dir).unwrap();
    tok.encode_chat(messages, &tokenize::ChatOptions::default())
        .map(|ids| ids.len())
        .unwrap_or(0)
}

fn scenario(dir: &Path, label: &str, words_per_turn: usize, turns: usize, n: usize, n_cold: usize) {
    let bench = setup(dir);
    let picker = &bench.picker;
    let mut rng = Rng(0xc0ffee ^ words_per_turn as u64);
    let sample = conversation(&mut rng, words_per_turn, turns, words_per_turn);
    let tokens = count_tokens(dir, &sample);

    // Warm: the previous request was [.., assistant_k-1, user_k]; this one adds the assistant's
    // answer to it only if `unseen_reply`, then the new user turn.
    let mut run = |short: bool| {
        let mut out = [Vec::with_capacity(n), Vec::with_capacity(n)];
        for i in 0..n {
            let last = if short { 30 } else { words_per_turn };
            let full = conversation(&mut rng, words_per_turn, turns, last);
            let previous: Vec<serde_json::Value> = if short {
                // The answer was seen: it is part of what the EPP tokenized before (a retry, or
                // an answer observed on the response path).
                full[..full.len() - 1].to_vec()
            } else {
                full[..full.len() - 2].to_vec()
            };
            let (traced, took) = under(i, || {
                bench.serve(&body(&previous));
                route(picker, &body(&full))
            });
            out[usize::from(traced)].push(took);
        }
        out
    };
    let warm = run(true);
    report_ab(&format!("{label} warm"), tokens, warm);
    let new_turn = run(false);
    report_ab(&format!("{label} new turn"), tokens, new_turn);

    let mut cold = [Vec::with_capacity(n_cold), Vec::with_capacity(n_cold)];
    for i in 0..n_cold {
        let full = conversation(&mut rng, words_per_turn, turns, words_per_turn);
        let (traced, took) = under(i, || route(picker, &body(&full)));
        cold[usize::from(traced)].push(took);
    }
    report_ab(&format!("{label} cold"), tokens, cold);
    let stats = picker.stats();
    println!(
        "{label}: {} of {} routed requests stopped keying early ({} tokens estimated)",
        stats.early_stops.load(std::sync::atomic::Ordering::Relaxed),
        stats.routed.load(std::sync::atomic::Ordering::Relaxed),
        stats
            .estimated_tokens
            .load(std::sync::atomic::Ordering::Relaxed),
    );
}

/// Where a warm 8k decision spends its time: each stage timed alone on the same inputs, then
/// the whole `Picker::route` on a fully cached prompt.
fn breakdown(dir: &Path) {
    use kvgate_epp::routing::request::{Api, parse};
    let tok = tokenize::TextTokenizer::from_dir(dir).unwrap();
    let cache = tokenize::SegmentCache::new(256 << 20);
    let mut rng = Rng(0xbeef);
    let convs: Vec<_> = (0..50)
        .map(|_| conversation(&mut rng, 400, 12, 400))
        .collect();
    let bodies: Vec<_> = convs.iter().map(|c| body(c)).collect();
    let questions: Vec<String> = (0..50).map(|_| rng.text(30)).collect();
    let opts = tokenize::ChatOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let chunk = tokenize::DEFAULT_CHUNK_BYTES;
    let drain = |c: &[serde_json::Value]| {
        let mut cursor = tok.chat_cursor(c, &opts, Some(&cache), chunk).unwrap();
        let mut ids = Vec::new();
        while let Some(n) = cursor.next_into(&mut ids) {
            n.unwrap();
        }
        ids
    };
    for c in &convs {
        let _ = drain(c);
        let _ = tok.encode_chat_cached(c, &opts, &cache).unwrap();
    }
    let time = |name: &str, f: &dyn Fn(usize)| {
        let (mut wall, mut cpu): (Vec<Duration>, Vec<Duration>) = (0..bodies.len())
            .map(|i| {
                let c = thread_cpu();
                let t = Instant::now();
                f(i);
                (t.elapsed(), thread_cpu().saturating_sub(c))
            })
            .unzip();
        wall.sort_unstable();
        cpu.sort_unstable();
        println!(
            "  {name:<40} p50 {:>8.1} µs  cpu p50 {:>8.1} µs",
            wall[wall.len() / 2].as_secs_f64() * 1e6,
            cpu[cpu.len() / 2].as_secs_f64() * 1e6
        );
    };
    time("parse body", &|i| {
        let _ = parse(Api::Chat, &bodies[i]).unwrap();
    });
    time("render chat template", &|i| {
        let _ = tok.render_chat(&convs[i], &opts).unwrap();
    });
    time("render + cached encode (1 KiB chunks)", &|i| {
        let _ = drain(&convs[i]);
    });
    time("render + cached encode (whole segments)", &|i| {
        let _ = tok.encode_chat_cached(&convs[i], &opts, &cache).unwrap();
    });
    time("encode a new 30-word question (cold)", &|i| {
        let _ = tok.encode_prompt(&questions[i]).unwrap();
    });
    let ids: Vec<Vec<u32>> = convs.iter().map(|c| drain(c)).collect();
    time("block keys", &|i| {
        let _ = kv_events::key::block_keys(kv_events::KeySeed::new(MODEL, None), &ids[i], BLOCK);
    });
    let bench = setup(dir);
    let keyer = qwen3_keyer(dir);
    let parsed: Vec<_> = bodies
        .iter()
        .map(|b| parse(Api::Chat, b).unwrap())
        .collect();
    for p in &parsed {
        let _ = keyer.key(p).unwrap();
    }
    time("Keyer::key (render, encode, keys)", &|i| {
        let _ = keyer.key(&parsed[i]).unwrap();
    });
    for b in &bodies {
        bench.serve(b);
    }
    time("Picker::route, all cached", &|i| {
        let _ = route(&bench.picker, &bodies[i]);
    });
}

/// What added tokens in a prompt cost its keying (`-- added`): 50 completions prompts of ~12 KB
/// with an added token after every 16 words (`<|fim_prefix|>`, as a fill-in-the-middle client
/// sends; a client may send any), each keyed once, cold, through `Keyer::key` (the EPP's
/// chunked path), against the same prompts with the token spelled as plain text of the same
/// length. The ratio is the price of the added tokens.
fn added_tokens(dir: &Path) {
    const TOKEN: &str = "<|fim_prefix|>";
    const PLAIN: &str = "<fim-prefix.>.";
    let mut rng = Rng(0xf1a);
    let with: Vec<String> = (0..50)
        .map(|_| (0..100).map(|_| rng.text(16) + TOKEN).collect())
        .collect();
    let without: Vec<String> = with.iter().map(|p| p.replace(TOKEN, PLAIN)).collect();
    let bytes = with.iter().map(String::len).sum::<usize>() / with.len();
    // Alternate the two, twice, so that drift on a shared machine touches both alike.
    let mut rows = Vec::new();
    for _ in 0..2 {
        rows.push((cold_key_p50(dir, &with), cold_key_p50(dir, &without)));
    }
    for (a, b) in rows {
        println!(
            "added tokens: ~{bytes}-byte prompts, cold Keyer::key cpu p50 {a:.1} µs with \
             {TOKEN} every 16 words, {b:.1} µs without: {:.2}×",
            a / b
        );
    }
}

/// The CPU p50, in µs, of keying each of `prompts` (completions) with a new Qwen3 keyer: cold,
/// as far as the keyer's caches go, for prompts it has not seen.
fn cold_key_p50(dir: &Path, prompts: &[String]) -> f64 {
    use kvgate_epp::routing::request::{Api, parse};
    let keyer = qwen3_keyer(dir);
    let mut took: Vec<Duration> = prompts
        .iter()
        .map(|p| {
            let body = serde_json::to_vec(&json!({"model": MODEL, "prompt": p})).unwrap();
            let parsed = parse(Api::Completions, &body).unwrap();
            let c = thread_cpu();
            let keyed = keyer.key(&parsed).unwrap();
            let cpu = thread_cpu().saturating_sub(c);
            assert!(!keyed.keys.is_empty());
            cpu
        })
        .collect();
    took.sort_unstable();
    took[took.len() / 2].as_secs_f64() * 1e6
}

/// What a prompt's script costs its keying: the cold `Keyer::key` CPU p50 of 50 ~12-KB prompts
/// each of English, Chinese and a multilingual mix (each prompt new to the keyer), and the
/// non-English ones' cost per byte against English's. Two rounds, the three alternating.
fn unicode(dir: &Path) {
    const BYTES: usize = 12_000;
    let mut rng = Rng(0x0123_4567);
    let sets: [(&str, Vec<String>); 3] = [
        ("English", (0..50).map(|_| rng.text(BYTES / 6)).collect()),
        ("Chinese", (0..50).map(|_| rng.chinese(BYTES)).collect()),
        ("mixed", (0..50).map(|_| rng.mixed(BYTES)).collect()),
    ];
    for round in 0..2 {
        let p50: Vec<(f64, f64)> = sets
            .iter()
            .map(|(_, prompts)| {
                let bytes = prompts.iter().map(String::len).sum::<usize>() as f64;
                (cold_key_p50(dir, prompts), bytes / prompts.len() as f64)
            })
            .collect();
        let (en, en_bytes) = p50[0];
        for ((name, _), (us, bytes)) in sets.iter().zip(&p50) {
            println!(
                "unicode round {round}: {name:<7} ~{bytes:.0}-byte prompts, cold Keyer::key cpu \
                 p50 {us:.1} µs, {:.2}× English per byte",
                (us / bytes) / (en / en_bytes)
            );
        }
    }
}

/// The spans of a traced decision without the decision: a request span, the picker's work on an
/// empty pool (parse, tokenize, pick with the scheduler's spans, first token) and the response's
/// end, 2,000 times; the per-request CPU (run it with `KVGATE_BENCH_TRACE=otlp`).
fn spans_alone(dir: &Path) {
    let _ = dir;
    let ds = Arc::new(Datastore::new());
    let key = ("pod-0".to_owned(), 8000);
    let id = ds.id_for(&key);
    ds.replace(vec![(
        key,
        Endpoint::new(id, "10.0.0.1:8000".parse().unwrap()),
    )]);
    let picker = Picker::new(
        Keyer::new(BLOCK, SaltStyle::VllmExtraKey, MODEL),
        Scheduler::new(SchedulerConfig::default(), 7).unwrap(),
        Arc::new(KvIndex::new(IndexConfig::default()).unwrap()),
        Arc::new(InflightTracker::new()),
        Arc::new(LoadBook::new()),
        ds,
    );
    let body = br#"{"model":"Qwen/Qwen3-0.6B","messages":[{"role":"user","content":"hi"}]}"#;
    let mut took = [Vec::new(), Vec::new()];
    for i in 0..2000 {
        let (traced, t) = under(i, || route(&picker, body));
        took[usize::from(traced)].push(t);
    }
    report_ab("one-block chat", 0, took);
}

/// Warm 8k decisions for a profiler: serves `n` conversations' previous requests first, then
/// says `routing` on stderr, waits two seconds (to attach `perf record -p`), and routes each
/// conversation's next request once.
fn profile(dir: &Path, n: usize) {
    let bench = setup(dir);
    let mut rng = Rng(0xfeed);
    let fulls: Vec<_> = (0..n)
        .map(|_| {
            let full = conversation(&mut rng, 400, 12, 30);
            bench.serve(&body(&full[..full.len() - 1]));
            body(&full)
        })
        .collect();
    eprintln!("routing");
    std::thread::sleep(Duration::from_secs(2));
    let took: Vec<Took> = fulls.iter().map(|b| route(&bench.picker, b)).collect();
    report("8k warm (profile)", 0, took);
}

fn main() {
    if !std::env::args().skip(1).any(|a| a == "--bench") {
        return;
    }
    let Some(dir) = tokenizer_dir() else {
        eprintln!(
            "decision bench: no tokenizer (run scripts/bootstrap.sh, or set KVGATE_TOKENIZER_DIR)"
        );
        std::process::exit(2);
    };
    let which = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_default();
    println!("decision cost: Picker::route, {ENDPOINTS} endpoints, block {BLOCK}, one thread");
    let tracing = tracing_mode();
    if which == "profile" {
        profile(&dir, 1000);
        return;
    }
    if which == "breakdown" {
        breakdown(&dir);
        return;
    }
    if which.is_empty() || which == "8k" {
        // ~8k tokens: 12 turns of 400 words (user) + 200 (assistant).
        scenario(&dir, "8k", 400, 12, 300, 100);
    }
    if which == "spans" {
        spans_alone(&dir);
    }
    if which == "added" {
        added_tokens(&dir);
    }
    if which == "unicode" {
        unicode(&dir);
    }
    if which == "tiny" {
        // A one-turn chat of a few words: the decision's fixed costs (and tracing's) alone.
        scenario(&dir, "tiny", 8, 1, 300, 100);
    }
    if which.is_empty() || which == "100k" {
        // ~100k tokens: 40 turns of 1,600 words + 800.
        scenario(&dir, "100k", 1600, 40, 40, 15);
    }
    if let Some(tracing) = tracing {
        tracing.finish();
    }
}
