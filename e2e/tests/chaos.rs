//! The chaos tier, fast version: a steady streaming load through the local stack (Envoy failing
//! open, two EPP replicas that Envoy health-checks, three engines behind their sidecars, NATS,
//! the block manager) while one component at a time is crashed (SIGKILL) and restarted by the
//! stack's supervisor, as `kvgate-bench up --supervise` does: an engine, a sidecar, NATS, one
//! of the two EPP replicas (kept down for 2 s first), the block manager.
//!
//! Asserted per crash: no failed request, except those in flight on a crashed sidecar (its
//! streams die with it); the supervisor has the component back within 10 s; and within a few
//! seconds of that the prefix hit rate is back within 2 points of the baseline (at least one
//! window per crash). Once the load stops, the EPP's index holds for every engine exactly the
//! distinct blocks the engine caches, in each replica: nothing stale, nothing missing; and the
//! block manager's node holds exactly the distinct blocks the daemon holds in any tier
//! (`kvgate_kvbm_blocks`; a block may be in host memory and Redis at once).
//! While the EPP replica is down (2 s), Envoy must take it out of the ext_proc cluster, and at
//! most a fifth of the requests may fail open (route without a pick): the other replica takes
//! the rest. No retry may be refused by the pool's circuit breaker. The figures are printed
//! (`--no-capture`) for docs/benchmarks.md.
//!
//! Longer version: `CHAOS_WINDOW_S=20 cargo test -p kvgate-e2e --test chaos -- --nocapture`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvgate_e2e::stack::{Component, KvbmConfig, Stack, StackConfig, probe};
use support::gateway::{Reply, post};

/// The response header with the EPP's pick (absent when the routing filter failed open).
const PICKED: &str = "x-kvgate-picked";
/// Envoy's count of healthy EPP replicas.
const EXT_PROC_HEALTHY: &str = "cluster.ext_proc.membership_healthy";

/// One of Envoy's stats (a counter or gauge), by its full name.
fn envoy_stat(stack: &Stack, name: &str) -> Option<u64> {
    let (_, body) = probe::http_get(
        stack.ports().envoy_admin,
        &format!("/stats?filter=^{name}$"),
        Duration::from_secs(2),
    )
    .ok()?;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
        .and_then(|v| v.trim().parse().ok())
}

/// Polls an Envoy gauge until it equals `want`; how long that took, or `None` after `limit`.
fn wait_for_gauge(stack: &Stack, name: &str, want: u64, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if envoy_stat(stack, name) == Some(want) {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// The EPP replica crashed: replica 0 of two.
const EPP_REPLICA: Component = Component::Epp;
/// How long it stays down before the supervisor restarts it.
const EPP_DOWN: Duration = Duration::from_secs(2);

/// One request's outcome.
struct Record {
    /// The phase when it was sent and when it ended.
    phases: (usize, usize),
    reply: Reply,
    prompt: u64,
    cached: u64,
}

/// `usage` of a streamed answer (the last event carrying it).
fn usage(body: &str) -> (u64, u64) {
    body.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            let u = v.get("usage")?.as_object()?.clone();
            Some((
                u.get("prompt_tokens")?.as_u64()?,
                u.get("prompt_tokens_details")
                    .and_then(|d| d.get("cached_tokens"))
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0),
            ))
        })
        .next()
        .unwrap_or((0, 0))
}

fn window() -> Duration {
    let s = std::env::var("CHAOS_WINDOW_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    Duration::from_secs(s)
}

/// Hit rate (%) of the requests sent and ended in `phase`.
fn hit_rate(records: &[Record], phase: usize) -> (f64, usize) {
    let done: Vec<&Record> = records
        .iter()
        .filter(|r| r.phases == (phase, phase) && r.reply.ok() && r.prompt > 0)
        .collect();
    let prompt: u64 = done.iter().map(|r| r.prompt).sum();
    let cached: u64 = done.iter().map(|r| r.cached).sum();
    let rate = if prompt == 0 {
        f64::NAN
    } else {
        100.0 * cached as f64 / prompt as f64
    };
    (rate, done.len())
}

#[test]
fn crashing_each_component_under_load_loses_only_what_it_held() {
    let mut stack = Stack::start(StackConfig {
        engines: 3,
        fail_open: true,
        epp_replicas: 2,
        log_level: "info".into(),
        kvbm: Some(KvbmConfig::default()),
        ..StackConfig::default()
    })
    .unwrap_or_else(|e| panic!("stack did not start: {e}"));
    let port = stack.ports().envoy_listen;
    // The pool's endpoint of engine pod 1 (its sidecar's proxy port).
    let sidecar_1 = stack.endpoints()[1].clone();
    assert_eq!(Component::pod_name(1), "sim-1");
    let phase = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..6)
        .map(|t| {
            let (phase, stop) = (Arc::clone(&phase), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut out = Vec::new();
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let group = (t + i) % 4;
                    let system = format!("Group {group}: ")
                        + &"You are a careful assistant for the chaos test. ".repeat(40);
                    let body = serde_json::json!({
                        "model": "m",
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": format!("question {t}-{i}")},
                        ],
                        "max_tokens": 32,
                        "ignore_eos": true,
                        "stream": true,
                        "stream_options": {"include_usage": true},
                    });
                    let sent = phase.load(Ordering::Relaxed);
                    let reply = post(port, "/v1/chat/completions", &[], &body);
                    let (prompt, cached) = usage(&reply.body);
                    out.push(Record {
                        phases: (sent, phase.load(Ordering::Relaxed)),
                        reply,
                        prompt,
                        cached,
                    });
                    i += 1;
                }
                out
            })
        })
        .collect();
    // Phases: 0 warm-up, 1 baseline, then per crash: the crash and restart (odd), then the
    // windows after it (even), until the hit rate is back.
    std::thread::sleep(window());
    phase.store(1, Ordering::Relaxed);
    std::thread::sleep(window());
    let crashes = [
        Component::Engine(1),
        Component::Sidecar(1),
        Component::Nats,
        EPP_REPLICA,
        Component::Kvbm,
    ];
    let mut next = 2;
    let mut plan = Vec::new();
    let mut ejections = Vec::new();
    for component in crashes {
        let crash_phase = next;
        phase.store(crash_phase, Ordering::Relaxed);
        next += 1;
        let crashed = Instant::now();
        stack.crash(component).unwrap();
        if component == EPP_REPLICA {
            // Kept down a while, as a pod restarting takes seconds: long enough for the load
            // to show whether the surviving replica picks what the dead one would have, or
            // the requests fail open (no pick; counted below). Envoy must take the dead
            // replica out of the ext_proc cluster meanwhile.
            let seen = wait_for_gauge(&stack, EXT_PROC_HEALTHY, 1, EPP_DOWN);
            match seen {
                Some(after) => eprintln!(
                    "{component}: Envoy took it out of the ext_proc cluster after {} ms",
                    after.as_millis()
                ),
                None => ejections.push(format!(
                    "{component}: Envoy still counted 2 healthy EPP replicas {EPP_DOWN:?} after \
                     the crash"
                )),
            }
            std::thread::sleep(EPP_DOWN.saturating_sub(crashed.elapsed()));
        }
        let mut restarted = None;
        while restarted.is_none() {
            assert!(
                crashed.elapsed() < Duration::from_secs(30),
                "{component} was not restarted"
            );
            if stack.supervise().unwrap().contains(&component) {
                restarted = Some(crashed.elapsed());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let restarted = restarted.unwrap();
        if component == EPP_REPLICA
            && wait_for_gauge(&stack, EXT_PROC_HEALTHY, 2, window()).is_none()
        {
            ejections.push(format!(
                "{component}: Envoy did not count both EPP replicas healthy within {:?} of the \
                 restart",
                window()
            ));
        }
        let mut windows = Vec::new();
        for _ in 0..3 {
            phase.store(next, Ordering::Relaxed);
            windows.push(next);
            next += 1;
            std::thread::sleep(window());
        }
        plan.push((component, crash_phase, restarted, windows));
    }
    stop.store(true, Ordering::Relaxed);
    let records: Vec<Record> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    let (baseline, n) = hit_rate(&records, 1);
    eprintln!("baseline: hit rate {baseline:.1}% over {n} requests");
    assert!(
        n >= 10 && baseline > 50.0,
        "no usable baseline: {baseline} over {n}"
    );
    let mut problems = Vec::new();
    for (component, crash_phase, restarted, windows) in &plan {
        // Requests that overlapped the crash and restart.
        let during: Vec<&Record> = records
            .iter()
            .filter(|r| r.phases.0 <= *crash_phase && r.phases.1 >= *crash_phase)
            .collect();
        let failed: Vec<&&Record> = during.iter().filter(|r| !r.reply.ok()).collect();
        // In flight on the crashed sidecar: answered by its engine (cut mid-stream), or cut
        // before any answer (Envoy's own 503 names the upstream it lost).
        let allowed = |r: &Record| {
            *component == Component::Sidecar(1)
                && (r.reply.pod() == "sim-1"
                    || r.reply.header("x-kvgate-upstream") == Some(sidecar_1.as_str()))
        };
        let unexpected = failed.iter().filter(|r| !allowed(r)).count();
        let rates: Vec<(f64, usize)> = windows.iter().map(|w| hit_rate(&records, *w)).collect();
        let (at_crash, at_crash_n) = hit_rate(&records, *crash_phase);
        let back = rates
            .iter()
            .position(|(rate, n)| *n > 0 && *rate >= baseline - 2.0);
        eprintln!(
            "{component}: restarted in {} ms; {} requests overlapped, {} failed ({} outside the \
             crashed component); hit rate during the restart {at_crash:.1}% ({at_crash_n}), by \
             {}-s window after: {}",
            restarted.as_millis(),
            during.len(),
            failed.len(),
            unexpected,
            window().as_secs(),
            rates
                .iter()
                .map(|(r, n)| format!("{r:.1}% ({n})"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        if unexpected > 0 {
            let first = failed.iter().find(|r| !allowed(r)).unwrap();
            problems.push(format!(
                "{component}: {unexpected} failed requests, e.g. {:?}",
                first.reply
            ));
        }
        if *restarted > Duration::from_secs(10) {
            problems.push(format!("{component}: restarted after {restarted:?}"));
        }
        if *component == EPP_REPLICA {
            // Requests routed without any EPP's pick (the routing filter failed open: no
            // `x-kvgate-picked`). Only those sent to the dead replica before Envoy's health
            // checks took it out may; without the other replica taking over, about half of
            // the outage's requests would.
            let open = during
                .iter()
                .filter(|r| {
                    r.reply.ok()
                        && r.reply
                            .header(PICKED)
                            .is_none_or(|p| p.is_empty() || p == "-")
                })
                .count();
            eprintln!(
                "{component}: {open} of the {} requests overlapping its outage failed open",
                during.len()
            );
            if during.len() < 20 {
                problems.push(format!(
                    "{component}: only {} requests overlapped its outage; too few to tell",
                    during.len()
                ));
            } else if open * 5 > during.len() {
                problems.push(format!(
                    "{component}: {open} of the {} requests overlapping its outage failed open \
                     (allowed: a fifth): the other replica did not take them",
                    during.len()
                ));
            }
        }
        if back.is_none() {
            problems.push(format!(
                "{component}: hit rate not back within 2 points of {baseline:.1}%: {rates:?}"
            ));
        }
    }
    problems.extend(ejections);
    // No retry was refused by the pool's circuit breaker (a dead engine's requests all retry
    // at once; a refused retry hands the client the engine's 502).
    let overflow = envoy_stat(&stack, "cluster.pool.upstream_rq_retry_overflow");
    eprintln!("Envoy's refused retries (pool): {overflow:?}");
    if overflow != Some(0) {
        problems.push(format!(
            "Envoy refused retries to the pool (upstream_rq_retry_overflow {overflow:?})"
        ));
    }
    problems.extend(stale_index(&stack));
    stack.stop();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Once the load has stopped, each EPP replica's index must hold for each engine exactly the
/// distinct blocks the engine says it caches (its KV events' net effect): after every crash
/// and restart above, nothing stale is left in it and nothing is missing. Polled for a while,
/// as the last events and speculative entries (which expire) settle.
fn stale_index(stack: &Stack) -> Vec<String> {
    let ports = stack.ports();
    let engines = stack.endpoints().len();
    let node = stack
        .config()
        .kvbm
        .as_ref()
        .map(|k| k.node.clone())
        .expect("the chaos stack runs a block manager");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut mismatches = Vec::new();
        let mut matched = Vec::new();
        for replica in 0..stack.config().epp_replicas {
            let metrics = ports.epp(replica).unwrap().metrics;
            let report = probe::http_get(metrics, "/debug/index", Duration::from_secs(2))
                .ok()
                .and_then(|(status, body)| (status == 200).then_some(body))
                .and_then(|body| serde_json::from_str::<serde_json::Value>(&body).ok());
            compare_index(
                ports,
                engines,
                report.as_ref(),
                &format!("replica {replica}"),
                &mut matched,
                &mut mismatches,
            );
            compare_node(
                ports,
                &node,
                report.as_ref(),
                &format!("replica {replica}"),
                &mut matched,
                &mut mismatches,
            );
        }
        if mismatches.is_empty() {
            eprintln!(
                "index: every engine's blocks match each EPP replica's index ({})",
                matched.join(", ")
            );
            return Vec::new();
        }
        if Instant::now() > deadline {
            return mismatches;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `blocks` of the entry of `report[list]` whose `key` is `name`.
fn reported_blocks(
    report: Option<&serde_json::Value>,
    list: &str,
    key: &str,
    name: &str,
) -> Option<u64> {
    report?[list].as_array()?.iter().find(|e| e[key] == name)?["blocks"].as_u64()
}

/// One replica's `/debug/index` report against the engines' own counts.
fn compare_index(
    ports: &kvgate_e2e::stack::ports::Ports,
    engines: usize,
    report: Option<&serde_json::Value>,
    replica: &str,
    matched: &mut Vec<String>,
    mismatches: &mut Vec<String>,
) {
    for i in 0..engines {
        let pod = Component::pod_name(i);
        let indexed = reported_blocks(report, "endpoints", "pod", &pod);
        let page = ports
            .engine_http(i)
            .and_then(|p| probe::http_get(p, "/metrics", Duration::from_secs(2)).ok())
            .map(|(_, body)| body)
            .unwrap_or_default();
        let cached = probe::metric_sum(&page, "kvgate_sim_distinct_cached_blocks");
        let host = probe::metric_sum(&page, "kvgate_sim_host_blocks");
        assert_eq!(
            host,
            Some(0.0),
            "{pod}: the check assumes no engine-side host tier"
        );
        match (indexed, cached) {
            (Some(n), Some(c)) if n as f64 == c => {
                matched.push(format!("{replica}: {pod} {n}"));
            }
            _ => mismatches.push(format!(
                "{replica}, {pod}: the EPP's index holds {indexed:?} blocks, the engine \
                 caches {cached:?}"
            )),
        }
    }
}

/// One replica's count for the block manager's node against the daemon's own count of the
/// distinct blocks it holds (`kvgate_kvbm_blocks`: a block in host memory and in Redis counts
/// once, as in the index). The engines share one layout, so a block is one key. Blocks the
/// daemon dropped (a crash empties host memory) and the index kept, or blocks it holds and the
/// index missed, make them differ.
fn compare_node(
    ports: &kvgate_e2e::stack::ports::Ports,
    node: &str,
    report: Option<&serde_json::Value>,
    replica: &str,
    matched: &mut Vec<String>,
    mismatches: &mut Vec<String>,
) {
    let indexed = reported_blocks(report, "nodes", "node", node);
    let page = probe::http_get(ports.kvbm_metrics, "/metrics", Duration::from_secs(2))
        .map(|(_, body)| body)
        .unwrap_or_default();
    let held = probe::sample(&page, "kvgate_kvbm_blocks");
    let tiers: Vec<f64> = ["host", "disk", "remote"]
        .iter()
        .filter_map(|t| probe::sample(&page, &format!("kvgate_kvbm_tier_blocks{{tier=\"{t}\"}}")))
        .collect();
    match (indexed, held) {
        (Some(n), Some(h)) if n as f64 == h => {
            matched.push(format!("{replica}: node {node} {n} (tiers {tiers:?})"));
        }
        _ => mismatches.push(format!(
            "{replica}, node {node}: the EPP's index holds {indexed:?} blocks, the daemon \
             {held:?} (its tiers {tiers:?}: host, disk, remote)"
        )),
    }
}
