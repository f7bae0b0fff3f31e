//! The end-to-end tier: the local stack (NATS, three `kvgate-sim` engines behind
//! `kvgate-sidecar`s, `kvgate-epp` with file discovery, a real Envoy) driven through Envoy with
//! plain HTTP. One stack per test, one test at a time (the machine is small).
//!
//! Needs `kvgate-epp` and `kvgate-sidecar` built into the same target directory
//! (`cargo test --workspace` builds them) and Envoy in `.venv` (scripts/bootstrap.sh).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvgate_e2e::stack::{Component, KvbmConfig, Stack, StackConfig, probe};
use scheduler::Policy;
use support::gateway::{Reply, chat, get, post, post_bytes};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn start(config: StackConfig) -> Stack {
    let config = StackConfig {
        log_level: "info".into(),
        ..config
    };
    match Stack::start(config) {
        Ok(stack) => stack,
        Err(e) => panic!("stack did not start: {e}"),
    }
}

/// Stops the stack and removes its run directory (kept when a test fails, for its logs).
fn finish(stack: Stack) {
    let dir = stack.run_dir().to_path_buf();
    stack.stop();
    std::fs::remove_dir_all(dir).unwrap();
}

fn send(stack: &Stack, body: &serde_json::Value, headers: &[(&str, &str)]) -> Reply {
    post(
        stack.ports().envoy_listen,
        "/v1/chat/completions",
        headers,
        body,
    )
}

fn epp_metric(stack: &Stack, name: &str) -> f64 {
    let page = stack.epp_metrics().unwrap();
    probe::metric_sum(&page, name).unwrap_or_else(|| panic!("EPP has no {name}"))
}

/// Envelopes plus snapshots the EPP applied from NATS.
fn synced(stack: &Stack) -> f64 {
    epp_metric(stack, "kvgate_epp_nats_envelopes_applied_total")
        + epp_metric(stack, "kvgate_epp_nats_snapshots_applied_total")
}

fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A system prompt of about 600 tokens (the simulator's byte tokenizer: 4 bytes a token).
fn long_system(tag: &str) -> String {
    format!("{tag}: ") + &"You are a careful assistant for the shared prefix test. ".repeat(45)
}

fn pod_of(stack: &Stack, upstream: &str) -> Option<String> {
    stack
        .endpoints()
        .iter()
        .position(|e| e == upstream)
        .map(Component::pod_name)
}

#[test]
fn requests_follow_the_epp_and_a_shared_prefix_sticks_with_cached_tokens() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let stack = start(StackConfig::default());
    let listed = stack.endpoints();
    // Distinct prompts spread over the pool, always to a listed endpoint, always the EPP's first
    // choice, and the engine that answered is the one at that address.
    for i in 0..12 {
        let r = send(
            &stack,
            &chat(&format!("distinct {i}"), "hello", 4, false),
            &[],
        );
        assert!(r.ok(), "request {i}: {r:?}");
        let picked = r.picked();
        assert!(!picked.is_empty(), "no pick list: {r:?}");
        assert!(
            picked.iter().all(|p| listed.contains(p)),
            "{picked:?} not in {listed:?}"
        );
        assert_eq!(r.upstream(), picked[0], "Envoy left the EPP's first choice");
        assert_eq!(pod_of(&stack, r.upstream()).as_deref(), Some(r.pod()));
    }
    // A shared prefix sticks to its pod after the first request; the engine reports cache hits.
    let system = long_system("stick");
    let first = send(&stack, &chat(&system, "question 0", 4, false), &[]);
    assert!(first.ok(), "{first:?}");
    std::thread::sleep(Duration::from_millis(300));
    for i in 1..6 {
        let r = send(
            &stack,
            &chat(&system, &format!("question {i}"), 4, false),
            &[],
        );
        assert!(r.ok(), "{r:?}");
        assert_eq!(
            r.pod(),
            first.pod(),
            "request {i} left the pod holding the prefix"
        );
        assert!(
            r.cached_tokens() >= 256,
            "request {i}: {} cached tokens",
            r.cached_tokens()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Past the speculative entries' TTL the prefix still sticks: the engine's own KV events,
    // through its sidecar and NATS, are what the index knows it by.
    std::thread::sleep(Duration::from_millis(2_700));
    let later = send(&stack, &chat(&system, "question 6", 4, false), &[]);
    assert!(later.ok(), "{later:?}");
    assert_eq!(
        later.pod(),
        first.pod(),
        "the prefix left its pod once speculation expired"
    );
    // A malformed body is refused by the EPP with a reason, not forwarded.
    let bad = post_bytes(
        stack.ports().envoy_listen,
        "/v1/chat/completions",
        &[],
        b"{not json",
    );
    assert_eq!(bad.status, 400, "{bad:?}");
    assert!(bad.header("x-kvgate-drop-reason").is_some(), "{bad:?}");
    // The events came through the sidecars over NATS, and every source resolved to an endpoint.
    assert!(synced(&stack) > 0.0);
    assert_eq!(
        epp_metric(&stack, "kvgate_epp_nats_unknown_source_messages_total"),
        0.0
    );
    assert!(epp_metric(&stack, "kvgate_epp_nats_sources") >= 1.0);
    finish(stack);
}

/// An engine killed under six long streams: its sidecar migrates the two it was serving to
/// the EPP's fallback endpoints, so every client gets a whole answer; later requests route
/// around the dead engine, which the EPP takes out of rotation within a second or so.
#[test]
fn killing_an_engine_migrates_its_streams_and_routes_around_it() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut stack = start(StackConfig {
        time_scale: 1.0,
        ..StackConfig::default().with_policy(Policy::RoundRobin)
    });
    let port = stack.ports().envoy_listen;
    // Six long streams, two per engine.
    let streams: Vec<_> = (0..6)
        .map(|i| {
            let body = chat(&format!("long {i}"), "write a lot", 400, true);
            std::thread::spawn(move || post(port, "/v1/chat/completions", &[], &body))
        })
        .collect();
    wait_for("streams running on sim-0", Duration::from_secs(30), || {
        stack
            .engine_metrics(0)
            .ok()
            .and_then(|page| probe::metric_sum(&page, "vllm:num_requests_running"))
            .is_some_and(|running| running >= 1.0)
    });
    stack.kill(Component::Engine(0)).unwrap();
    // How long the EPP takes to notice, from its failed scrapes of the dead engine.
    let noticed = {
        let metrics = stack.ports().epp_metrics;
        let killed = Instant::now();
        std::thread::spawn(move || {
            while killed.elapsed() < Duration::from_secs(10) {
                let down = probe::http_get(metrics, "/metrics", Duration::from_secs(1))
                    .ok()
                    .and_then(|(_, p)| probe::metric_sum(&p, "kvgate_epp_endpoints_unreachable"));
                if down == Some(1.0) {
                    return Some(killed.elapsed());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            None
        })
    };
    let replies: Vec<Reply> = streams.into_iter().map(|t| t.join().unwrap()).collect();
    for r in &replies {
        assert_eq!(r.status, 200, "{r:?}");
        assert!(r.complete, "a stream failed: {r:?}");
        assert!(r.body.contains("[DONE]"), "a stream was cut: {r:?}");
        let tokens = r.body.matches("\"content\"").count();
        assert!(tokens >= 400, "{tokens} pieces: {r:?}");
    }
    let migrated = replies.iter().filter(|r| r.pod() == "sim-0").count();
    assert!(migrated > 0, "nothing was in flight on sim-0");
    let sidecar = stack.ports().engines[0].sidecar_metrics;
    let (_, page) = probe::http_get(sidecar, "/metrics", Duration::from_secs(2)).unwrap();
    let counted = page
        .lines()
        .find(|l| l.starts_with("kvgate_sidecar_proxy_migrations_total{outcome=\"migrated\"}"))
        .and_then(|l| l.rsplit_once(' '))
        .and_then(|(_, v)| v.parse::<f64>().ok());
    assert_eq!(counted, Some(migrated as f64), "{page}");
    // Later requests route around it (Envoy moves on to the EPP's next choice).
    for i in 0..9 {
        let r = send(&stack, &chat(&format!("after {i}"), "hi", 4, false), &[]);
        assert!(r.ok(), "request {i} after the kill: {r:?}");
        assert_ne!(r.pod(), "sim-0");
    }
    // The EPP takes it out of rotation from its failed scrapes, within about a second: round
    // robin then never lists it first.
    let dead = stack.endpoints()[0].clone();
    let noticed = noticed
        .join()
        .unwrap()
        .expect("the dead engine never out of rotation");
    eprintln!(
        "dead engine out of rotation {} ms after the kill",
        noticed.as_millis()
    );
    assert!(noticed < Duration::from_secs(3), "{noticed:?}");
    for i in 0..6 {
        let r = send(&stack, &chat(&format!("out {i}"), "hi", 4, false), &[]);
        assert!(r.ok(), "{r:?}");
        assert_ne!(r.picked()[0], dead, "picked a dead engine first: {r:?}");
    }
    // Back in rotation once it serves again.
    stack.restart(Component::Engine(0)).unwrap();
    wait_for(
        "the engine back in rotation",
        Duration::from_secs(10),
        || epp_metric(&stack, "kvgate_epp_endpoints_unreachable") == 0.0,
    );
    let back = (0..6).any(|i| {
        let r = send(&stack, &chat(&format!("back {i}"), "hi", 4, false), &[]);
        r.ok() && r.pod() == "sim-0"
    });
    assert!(back, "the restarted engine was never picked");
    finish(stack);
}

#[test]
fn a_nats_outage_degrades_to_load_routing_and_the_index_recovers() {
    nats_outage(false);
}

/// After the outage a new prefix sticks again, with follow-ups sent back to back. This also
/// guards the load book's completion discount: without it an engine sample taken while the
/// previous request ran sent about one follow-up in three elsewhere through bounded load
/// (docs/epp.md, "Engine load samples and completions").
#[test]
fn after_a_nats_outage_a_new_prefix_sticks_again() {
    nats_outage(true);
}

fn nats_outage(check_stickiness: bool) {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut stack = start(StackConfig::default());
    // Until the EPP holds a source in sync (a ZMQ subscriber may miss the very first frames,
    // which the sidecar repairs from the engine's replay on the next one).
    let mut n = 0;
    wait_for("a NATS source in sync", Duration::from_secs(20), || {
        n += 1;
        let warm = send(
            &stack,
            &chat(&long_system(&format!("warm {n}")), "q", 4, false),
            &[],
        );
        assert!(warm.ok(), "{warm:?}");
        std::thread::sleep(Duration::from_millis(200));
        synced(&stack) > 0.0 && epp_metric(&stack, "kvgate_epp_nats_stale_sources") == 0.0
    });
    stack.kill(Component::Nats).unwrap();
    wait_for(
        "the EPP to notice NATS is gone",
        Duration::from_secs(10),
        || epp_metric(&stack, "kvgate_epp_nats_connected") == 0.0,
    );
    // No request fails while NATS is away, and they still spread over the engines.
    let mut pods = std::collections::BTreeSet::new();
    for i in 0..12 {
        let r = send(&stack, &chat(&format!("outage {i}"), "hi", 4, false), &[]);
        assert!(r.ok(), "request {i} during the outage: {r:?}");
        pods.insert(r.pod().to_owned());
    }
    assert!(pods.len() >= 2, "all outage requests went to {pods:?}");
    let applied = synced(&stack);
    stack.restart(Component::Nats).unwrap();
    wait_for("the EPP to reconnect", Duration::from_secs(20), || {
        epp_metric(&stack, "kvgate_epp_nats_connected") == 1.0
    });
    // The index recovers: every source resynchronises (snapshots), new events arrive again,
    // and a new shared prefix sticks.
    wait_for(
        "every sidecar to reconnect",
        Duration::from_secs(30),
        || {
            stack.ports().engines.iter().all(|p| {
                probe::http_get(p.sidecar_metrics, "/metrics", Duration::from_secs(1))
                    .ok()
                    .and_then(|(_, page)| probe::metric_sum(&page, "kvgate_sidecar_nats_connected"))
                    == Some(1.0)
            })
        },
    );
    std::thread::sleep(Duration::from_millis(500));
    wait_for("sources to resynchronise", Duration::from_secs(20), || {
        synced(&stack) > applied && epp_metric(&stack, "kvgate_epp_nats_stale_sources") == 0.0
    });
    // Requests keep succeeding after the reconnect.
    let system = long_system("after the outage");
    let before = synced(&stack);
    let first = send(&stack, &chat(&system, "q0", 4, false), &[]);
    assert!(first.ok(), "{first:?}");
    if check_stickiness {
        // New events flow again and the new prefix sticks. A source the EPP first hears of
        // now is synchronised by a snapshot that already holds the prefix (its earlier events
        // are then skipped), so count snapshots as well as envelopes.
        wait_for("the new prefix's events", Duration::from_secs(20), || {
            synced(&stack) > before
        });
    }
    for i in 1..4 {
        let r = send(&stack, &chat(&system, &format!("q{i}"), 4, false), &[]);
        assert!(r.ok(), "{r:?}");
        if check_stickiness {
            assert_eq!(r.pod(), first.pod(), "the recovered index lost the prefix");
            assert!(r.cached_tokens() > 0);
        }
    }
    finish(stack);
}

#[test]
fn with_fail_open_requests_flow_while_the_epp_is_down() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut stack = start(StackConfig {
        fail_open: true,
        ..StackConfig::default()
    });
    // Routed through the EPP while it is up.
    let r = send(&stack, &chat("before", "hi", 4, false), &[]);
    assert!(r.ok() && !r.picked().is_empty(), "{r:?}");
    // Envoy buffers bodies to fail open; it takes what the EPP takes (16 MiB), not its
    // default 1 MiB.
    let big = chat("big", &"many words ".repeat(150_000), 4, false);
    let r = send(&stack, &big, &[]);
    // The engine answers (past its context length, a JSON 400), not Envoy's plain-text 413.
    assert!(
        r.status != 0 && r.status != 413,
        "a 1.6 MB request with fail-open: {} {}",
        r.status,
        r.body
    );
    assert!(
        serde_json::from_str::<serde_json::Value>(&r.body).is_ok(),
        "{} {}",
        r.status,
        r.body
    );
    stack.stop_component(Component::Epp).unwrap();
    let mut pods = std::collections::BTreeSet::new();
    for i in 0..9 {
        let r = send(&stack, &chat(&format!("open {i}"), "hi", 4, false), &[]);
        assert!(r.ok(), "request {i} without the EPP: {r:?}");
        assert!(r.picked().is_empty(), "a pick list without an EPP: {r:?}");
        pods.insert(r.pod().to_owned());
    }
    assert_eq!(pods.len(), 3, "Envoy's fallback did not spread: {pods:?}");
    stack.restart(Component::Epp).unwrap();
    let r = send(&stack, &chat("back", "hi", 4, false), &[]);
    assert!(r.ok() && !r.picked().is_empty(), "{r:?}");
    finish(stack);
}

#[test]
fn without_fail_open_requests_fail_while_the_epp_is_down() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut stack = start(StackConfig {
        engines: 1,
        ..StackConfig::default()
    });
    assert!(!stack.config().fail_open, "GIE's default is fail-closed");
    // A client cannot pin a pool member: a subset header naming no endpoint is not read.
    let r = send(
        &stack,
        &chat("pinned", "hi", 4, false),
        &[("x-gateway-destination-endpoint-subset", "127.0.0.2:1")],
    );
    assert!(r.ok(), "a client-set subset was honoured: {r:?}");
    // Only the OpenAI API is routed: the engines' own pages stay unreachable.
    let r = get(stack.ports().envoy_listen, "/metrics");
    assert_eq!(r.status, 404, "{r:?}");
    assert!(!r.body.contains("vllm:"), "an engine's metrics: {r:?}");
    let err: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(err["error"]["code"], "not_found", "{r:?}");
    stack.stop_component(Component::Epp).unwrap();
    let r = send(&stack, &chat("closed", "hi", 4, false), &[]);
    assert_eq!(r.status, 503, "fail-closed Envoy answered {r:?}");
    assert_eq!(r.header("content-type"), Some("application/json"), "{r:?}");
    let err: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("endpoint picker"), "{r:?}");
    assert_eq!(err["error"]["code"], "endpoint_picker_unreachable", "{r:?}");
    finish(stack);
}

#[test]
fn overload_answers_429() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let stack = start(StackConfig {
        engines: 1,
        time_scale: 1.0,
        engine_args: ["--max-num-seqs", "1", "--max-waiting", "1"]
            .map(String::from)
            .to_vec(),
        ..StackConfig::default()
    });
    let port = stack.ports().envoy_listen;
    let replies: Vec<Reply> = (0..8)
        .map(|i| {
            let body = chat(&format!("busy {i}"), "hi", 64, false);
            std::thread::spawn(move || post(port, "/v1/chat/completions", &[], &body))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert!(
        statuses.contains(&429),
        "no 429 under overload: {statuses:?}"
    );
    assert!(statuses.contains(&200), "nothing served: {statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
    finish(stack);
}

/// GIE's gateway conformance assertions, against the local Envoy: the gateway follows the EPP's
/// list (including its fallbacks when the first choice is unreachable) and honours subset hints.
#[test]
fn conformance_the_gateway_follows_the_list_and_subset_hints() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut stack = start(StackConfig {
        subset_header: true,
        ..StackConfig::default().with_policy(Policy::RoundRobin)
    });
    let listed = stack.endpoints();
    // A one-endpoint subset: every request lands there.
    for i in 0..6 {
        let r = send(
            &stack,
            &chat(&format!("subset {i}"), "hi", 2, false),
            &[("x-gateway-destination-endpoint-subset", listed[1].as_str())],
        );
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.upstream(), listed[1]);
        assert_eq!(r.picked(), vec![listed[1].clone()]);
    }
    // A two-endpoint subset: only those two, both used.
    let pair = format!("{},{}", listed[0], listed[2]);
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..6 {
        let r = send(
            &stack,
            &chat(&format!("pair {i}"), "hi", 2, false),
            &[("x-gateway-destination-endpoint-subset", pair.as_str())],
        );
        assert!(r.ok(), "{r:?}");
        assert!(
            r.upstream() == listed[0] || r.upstream() == listed[2],
            "{r:?}"
        );
        seen.insert(r.upstream().to_owned());
    }
    assert_eq!(seen.len(), 2);
    // A subset that matches no endpoint is refused, not routed elsewhere.
    let r = send(
        &stack,
        &chat("nowhere", "hi", 2, false),
        &[("x-gateway-destination-endpoint-subset", "127.0.0.2:1")],
    );
    assert_eq!(r.status, 503, "{r:?}");
    // The fallback list: with the first choice unreachable, Envoy takes the next one.
    stack.kill(Component::Sidecar(0)).unwrap();
    let mut fell_back = 0;
    for i in 0..9 {
        let r = send(&stack, &chat(&format!("fallback {i}"), "hi", 2, false), &[]);
        assert!(r.ok(), "{r:?}");
        let picked = r.picked();
        assert!(picked.len() >= 2, "no fallbacks in {picked:?}");
        if picked[0] == listed[0] {
            assert_eq!(
                r.upstream(),
                picked[1],
                "Envoy did not follow the list: {r:?}"
            );
            fell_back += 1;
        } else {
            assert_eq!(r.upstream(), picked[0]);
        }
    }
    assert!(
        fell_back > 0,
        "round robin never put the dead endpoint first"
    );
    finish(stack);
}

/// GIE's data-parallel conformance assertion, against the local Envoy: a pod serving two ranks on
/// two target ports is two endpoints; the gateway sends each request to the port the EPP chose,
/// and that port's rank answers. KV events attribute a prefix to its rank, so it sticks to that
/// port, with cached tokens.
#[test]
fn conformance_data_parallel_ports_are_separate_endpoints() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let stack = start(StackConfig {
        engines: 2,
        dp_ranks: 2,
        subset_header: true,
        ..StackConfig::default()
    });
    let listed = stack.endpoints();
    assert_eq!(listed.len(), 4, "{listed:?}");
    // Endpoint k is pod k / 2, rank k % 2: a subset naming it reaches exactly that rank.
    for (k, endpoint) in listed.iter().enumerate() {
        let r = send(
            &stack,
            &chat(&format!("rank pin {k}"), "hi", 2, false),
            &[("x-gateway-destination-endpoint-subset", endpoint.as_str())],
        );
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.upstream(), endpoint);
        assert_eq!(r.pod(), Component::pod_name(k / 2), "{r:?}");
        assert_eq!(r.dp_rank(), (k % 2).to_string(), "{r:?}");
    }
    // Unpinned requests follow the EPP's pick to the rank behind that port, on every port.
    let mut used = std::collections::BTreeSet::new();
    for i in 0..16 {
        let r = send(
            &stack,
            &chat(&format!("spread {i}"), "hello", 2, false),
            &[],
        );
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.upstream(), r.picked()[0], "Envoy left the EPP's choice");
        let k = listed.iter().position(|e| e == r.upstream()).unwrap();
        assert_eq!(
            (r.pod(), r.dp_rank()),
            (
                Component::pod_name(k / 2).as_str(),
                (k % 2).to_string().as_str()
            )
        );
        used.insert(k);
    }
    assert!(used.len() >= 3, "requests used only {used:?}");
    // A prefix first served by rank 1 of a pod sticks to that rank's port: its events name it.
    let system = long_system("dp");
    let first = send(
        &stack,
        &chat(&system, "question 0", 4, false),
        &[("x-gateway-destination-endpoint-subset", listed[3].as_str())],
    );
    assert!(first.ok(), "{first:?}");
    std::thread::sleep(Duration::from_millis(300));
    for i in 1..4 {
        let r = send(
            &stack,
            &chat(&system, &format!("question {i}"), 4, false),
            &[],
        );
        assert!(r.ok(), "{r:?}");
        assert_eq!(
            r.upstream(),
            listed[3],
            "request {i} left the rank holding the prefix"
        );
        assert_eq!(r.dp_rank(), "1");
        assert!(
            r.cached_tokens() >= 256,
            "request {i}: {} cached",
            r.cached_tokens()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        epp_metric(&stack, "kvgate_epp_nats_unknown_source_messages_total"),
        0.0
    );
    finish(stack);
}

/// KV offloading end to end: engines copy their cached blocks to host memory and publish them
/// with the `CPU` medium, the sidecars relay them as host-tier residencies, the EPP's index
/// keeps them after the GPU copies are evicted, and the `kv` policy sends the prefix back to
/// the engine whose host memory holds it, which loads it instead of recomputing it.
#[test]
fn an_offloaded_prefix_is_routed_back_to_the_engine_holding_it_in_host_memory() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // 47 usable GPU blocks of 16 tokens: one ~40-block prompt fits, two do not. 1 GiB of host
    // memory holds 512 of the `small` preset's 2 MiB blocks.
    let stack = start(StackConfig {
        engine_args: [
            "--num-gpu-blocks",
            "48",
            "--max-model-len",
            "752",
            "--kv-offloading-size",
            "1",
        ]
        .map(String::from)
        .to_vec(),
        subset_header: true,
        ..StackConfig::default()
    });
    // Where a prompt nobody holds goes when the pool is idle (the tie-break's choice); the
    // prefix is pinned elsewhere, so only the index's host tier can bring it back there.
    let idle = send(&stack, &chat("a prompt nobody holds", "q", 4, false), &[]);
    assert!(idle.ok(), "{idle:?}");
    let listed = stack.endpoints();
    let engine = listed.iter().position(|e| e != idle.upstream()).unwrap();
    let holder = listed[engine].clone();
    let system = long_system("offload");
    let first = send(
        &stack,
        &chat(&system, "question 0", 4, false),
        &[("x-gateway-destination-endpoint-subset", holder.as_str())],
    );
    assert!(first.ok(), "{first:?}");
    assert_eq!(first.upstream(), holder);
    // Fill that engine's GPU with other prompts (a subset hint pins them there), so every
    // block of the first prompt is evicted from the GPU and stays only in host memory.
    for i in 0..3 {
        let r = send(
            &stack,
            &chat(&long_system(&format!("filler {i}")), "q", 4, false),
            &[("x-gateway-destination-endpoint-subset", holder.as_str())],
        );
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.upstream(), holder);
    }
    let host_hits = |stack: &Stack| {
        let page = stack.engine_metrics(engine).unwrap();
        probe::metric_sum(&page, "kvgate_sim_host_hit_tokens_total").unwrap_or(0.0)
    };
    assert_eq!(host_hits(&stack), 0.0);
    // Past the speculative entries' 2 s TTL (and the 500 ms expiry tick), so what routes the
    // prefix is what the engines' events told the index.
    std::thread::sleep(Duration::from_millis(2_700));
    let again = send(&stack, &chat(&system, "question 1", 4, false), &[]);
    assert!(again.ok(), "{again:?}");
    assert_eq!(
        again.upstream(),
        holder,
        "the prefix left the engine holding it in host memory"
    );
    assert!(
        again.cached_tokens() >= 512,
        "{} cached tokens",
        again.cached_tokens()
    );
    assert!(
        host_hits(&stack) >= 512.0,
        "the blocks should have come from host memory, not the GPU"
    );
    finish(stack);
}

/// The block manager's disk tier in the data path: with host memory too small for a prompt,
/// its blocks go down to the node's disk; evicted from the engine's GPU, the prefix is loaded
/// back from disk, and the EPP counts the node's disk tier as where the chosen endpoint's
/// copy of it is.
#[test]
fn a_prefix_demoted_to_the_block_managers_disk_is_onboarded_from_it() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The `small` preset's blocks are 2 MiB: host memory holds 8 of a prompt's ~39.
    let stack = start(StackConfig {
        engines: 2,
        engine_args: ["--num-gpu-blocks", "48", "--max-model-len", "752"]
            .map(String::from)
            .to_vec(),
        subset_header: true,
        kvbm: Some(KvbmConfig {
            host_bytes: 16 << 20,
            disk_bytes: 1 << 30,
            remote_bytes: 0,
            ..KvbmConfig::default()
        }),
        ..StackConfig::default()
    });
    let listed = stack.endpoints();
    let holder = [("x-gateway-destination-endpoint-subset", listed[0].as_str())];
    let system = long_system("kvbm disk");
    let first = send(&stack, &chat(&system, "question 0", 4, false), &holder);
    assert!(first.ok(), "{first:?}");
    for i in 0..3 {
        let r = send(
            &stack,
            &chat(&long_system(&format!("disk filler {i}")), "q", 4, false),
            &holder,
        );
        assert!(r.ok(), "{r:?}");
    }
    let sim = |i: usize, name: &str| {
        let page = stack.engine_metrics(i).unwrap();
        probe::metric_sum(&page, name).unwrap_or_else(|| panic!("no {name} in {page}"))
    };
    wait_for(
        "the holder to offload every block it cached",
        Duration::from_secs(5),
        || sim(0, "kvgate_sim_kvbm_offloaded_blocks_total") >= 4.0 * 36.0,
    );
    // Past the speculative entries' 2 s TTL: the daemon's events credit the prefix now.
    std::thread::sleep(Duration::from_millis(2_700));
    let series = format!(
        "kvgate_epp_prompt_blocks_hit_by_tier_total{{pool=\"{}\",tier=\"disk\"}}",
        stack.config().pool
    );
    let disk_hits = |stack: &Stack| {
        let page = stack.epp_metrics().unwrap();
        probe::sample(&page, &series).unwrap_or_else(|| panic!("no {series} in {page}"))
    };
    let before = disk_hits(&stack);
    let again = send(&stack, &chat(&system, "question 1", 4, false), &[]);
    assert!(again.ok(), "{again:?}");
    assert!(again.cached_tokens() >= 512, "{again:?}");
    let served = listed.iter().position(|e| e == again.upstream()).unwrap();
    let from_disk = probe::sample(
        &stack.engine_metrics(served).unwrap(),
        "kvgate_sim_kvbm_onboarded_blocks_total{tier=\"disk\"}",
    )
    .unwrap_or(0.0);
    assert!(from_disk >= 24.0, "{from_disk} blocks onboarded from disk");
    let credited = disk_hits(&stack) - before;
    assert!(
        credited >= 24.0,
        "the EPP saw the node's disk tier hold the prefix: {credited} blocks"
    );
    finish(stack);
}

/// The block manager in the data path: every simulator offloads the blocks it caches to the
/// node's `kvgate-kvbm`; a prefix evicted from an engine's GPU is onboarded back from the
/// daemon (cached tokens in the response) by whichever engine of the node gets it, and the EPP
/// credits the node's host tier for it.
#[test]
fn a_prefix_evicted_from_a_gpu_is_onboarded_from_the_block_manager_by_any_engine_of_the_node() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // 47 usable GPU blocks of 16 tokens: one ~40-block prompt fits, two do not. The daemon's
    // 1 GiB of host memory holds 512 of the `small` preset's 2 MiB blocks.
    let mut stack = start(StackConfig {
        engines: 2,
        engine_args: ["--num-gpu-blocks", "48", "--max-model-len", "752"]
            .map(String::from)
            .to_vec(),
        subset_header: true,
        kvbm: Some(KvbmConfig {
            remote_bytes: 256 << 20,
            ..KvbmConfig::default()
        }),
        ..StackConfig::default()
    });
    let listed = stack.endpoints();
    let holder = listed[0].clone();
    let pin = |to: &str| [("x-gateway-destination-endpoint-subset", to.to_owned())];
    let pinned = |stack: &Stack, body: &serde_json::Value, to: &str| {
        let h = pin(to);
        let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        send(stack, body, &h)
    };
    let system = long_system("kvbm");
    let first = pinned(&stack, &chat(&system, "question 0", 4, false), &holder);
    assert!(first.ok(), "{first:?}");
    assert_eq!(first.cached_tokens(), 0);
    // Fill that engine's GPU with other prompts, so every block of the first prompt is
    // evicted from it and stays only in the block manager.
    for i in 0..3 {
        let r = pinned(
            &stack,
            &chat(&long_system(&format!("filler {i}")), "q", 4, false),
            &holder,
        );
        assert!(r.ok(), "{r:?}");
    }
    let sim = |stack: &Stack, i: usize, name: &str| {
        let page = stack.engine_metrics(i).unwrap();
        probe::metric_sum(&page, name).unwrap_or_else(|| panic!("no {name} in {page}"))
    };
    assert_eq!(sim(&stack, 0, "kvgate_sim_kvbm_connected"), 1.0);
    // Four prompts of ~39 full blocks each (offloads run behind the engine: wait for them).
    wait_for(
        "the holder to offload every block it cached",
        Duration::from_secs(5),
        || sim(&stack, 0, "kvgate_sim_kvbm_offloaded_blocks_total") >= 4.0 * 36.0,
    );
    assert_eq!(
        sim(&stack, 0, "kvgate_sim_kvbm_offload_dropped_blocks_total"),
        0.0
    );
    // Past the speculative entries' 2 s TTL (and the 500 ms expiry tick): what credits the
    // prefix now is the daemon's events for the node.
    std::thread::sleep(Duration::from_millis(2_700));
    let hit_before = epp_metric(&stack, "kvgate_epp_prompt_blocks_hit_total");
    let again = send(&stack, &chat(&system, "question 1", 4, false), &[]);
    assert!(again.ok(), "{again:?}");
    assert!(
        again.cached_tokens() >= 512,
        "{} cached tokens",
        again.cached_tokens()
    );
    let credited = epp_metric(&stack, "kvgate_epp_prompt_blocks_hit_total") - hit_before;
    assert!(
        credited >= 32.0,
        "the EPP credits the node's host tier: {credited} blocks"
    );
    let served = listed.iter().position(|e| e == again.upstream()).unwrap();
    let onboarded = |stack: &Stack, i: usize| {
        probe::sample(
            &stack.engine_metrics(i).unwrap(),
            "kvgate_sim_kvbm_onboarded_blocks_total{tier=\"host\"}",
        )
        .unwrap_or(0.0)
    };
    assert!(
        onboarded(&stack, served) >= 32.0,
        "{}",
        onboarded(&stack, served)
    );
    assert!(
        sim(&stack, served, "kvgate_sim_host_hit_tokens_total") >= 512.0,
        "the loaded tokens were not computed"
    );
    // The node's other engine, whose GPU does not hold the prompt, onboards it too.
    let other = 1 - served;
    let before = onboarded(&stack, other);
    let third = pinned(
        &stack,
        &chat(&system, "question 2", 4, false),
        &listed[other],
    );
    assert!(third.ok(), "{third:?}");
    assert!(third.cached_tokens() >= 512, "{third:?}");
    assert!(
        onboarded(&stack, other) >= before + 32.0,
        "{}",
        onboarded(&stack, other)
    );
    assert_eq!(
        sim(&stack, other, "kvgate_sim_kvbm_corrupt_blocks_total"),
        0.0
    );
    // The daemon dies while the engines run: requests still succeed (the engines compute what
    // they cannot load), and the connectors reconnect to its successor.
    stack.kill(Component::Kvbm).unwrap();
    for i in 0..3 {
        let r = pinned(
            &stack,
            &chat(&long_system(&format!("away {i}")), "q", 4, false),
            &holder,
        );
        assert!(r.ok(), "with the daemon away: {r:?}");
    }
    assert!(sim(&stack, 0, "kvgate_sim_kvbm_errors_total") >= 1.0);
    assert_eq!(sim(&stack, 0, "kvgate_sim_kvbm_connected"), 0.0);
    stack.restart(Component::Kvbm).unwrap();
    let mut n = 0;
    wait_for(
        "the connector to reconnect to the restarted daemon",
        Duration::from_secs(10),
        || {
            n += 1;
            let r = pinned(&stack, &chat(&format!("after {n}"), "q", 4, false), &holder);
            assert!(r.ok(), "{r:?}");
            sim(&stack, 0, "kvgate_sim_kvbm_connected") == 1.0
        },
    );
    finish(stack);
}

/// A prompt longer than the connector protocol's 4,096-block limit is looked up in several
/// requests and comes back from the block manager whole, with no failed call.
#[test]
fn a_prompt_over_the_protocols_block_limit_is_onboarded_whole() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // 4,199 usable GPU blocks of 16 tokens: one ~4,150-block prompt fits, two do not. Blocks
    // carry 4 KiB (their real 2 MiB would push 8 GB per prompt through a debug daemon).
    let stack = start(StackConfig {
        engines: 1,
        time_scale: 20.0,
        engine_args: [
            "--num-gpu-blocks",
            "4200",
            "--max-model-len",
            "67184",
            "--kvbm-payload-bytes",
            "4096",
        ]
        .map(String::from)
        .to_vec(),
        kvbm: Some(KvbmConfig {
            host_bytes: 64 << 20,
            remote_bytes: 1 << 20,
            ..KvbmConfig::default()
        }),
        ..StackConfig::default()
    });
    // About 66,400 tokens of the byte tokenizer (4 bytes each).
    let long =
        |tag: &str| format!("{tag}: ") + &"A long prompt for the block limit test. ".repeat(6_630);
    let sim = |name: &str| {
        let page = stack.engine_metrics(0).unwrap();
        probe::metric_sum(&page, name).unwrap_or_else(|| panic!("no {name} in {page}"))
    };
    let first = send(&stack, &chat(&long("a"), "q", 4, false), &[]);
    assert!(first.ok(), "{first:?}");
    let other = send(&stack, &chat(&long("b"), "q", 4, false), &[]);
    assert!(other.ok(), "{other:?}");
    wait_for("both prompts offloaded", Duration::from_secs(20), || {
        sim("kvgate_sim_kvbm_offloaded_blocks_total") >= 2.0 * 4_100.0
    });
    let again = send(&stack, &chat(&long("a"), "q", 4, false), &[]);
    assert!(again.ok(), "{again:?}");
    assert!(
        again.cached_tokens() >= 4_100 * 16,
        "{} cached tokens",
        again.cached_tokens()
    );
    assert_eq!(sim("kvgate_sim_kvbm_errors_total"), 0.0);
    assert_eq!(sim("kvgate_sim_kvbm_lookups_failed_total"), 0.0);
    assert_eq!(sim("kvgate_sim_kvbm_offload_dropped_blocks_total"), 0.0);
    finish(stack);
}

#[test]
fn the_block_manager_runs_in_the_stack_and_its_tiers_reach_the_epp() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut stack = start(StackConfig {
        engines: 2,
        kvbm: Some(KvbmConfig {
            host_bytes: 4 << 20,
            remote_bytes: 64 << 20,
            ..KvbmConfig::default()
        }),
        ..StackConfig::default()
    });
    let socket = stack.kvbm_socket().unwrap();
    let residencies = |stack: &Stack| epp_metric(stack, "kvgate_epp_index_residencies");
    let before = residencies(&stack);
    // A connector offloads 32 blocks of 256 KiB into 4 MiB of host memory: 16 stay there and
    // 16 are demoted to Redis, and the EPP indexes all of them under the node.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    const BLOCK: u64 = 256 << 10;
    let layout = kvgate_kvbm::store::Layout {
        model: stack.config().model.clone(),
        dtype: "bf16".into(),
        layers: 32,
        block_size: stack.config().block_size,
        block_bytes: BLOCK,
        shard: 0,
        shards: 1,
    };
    let onboarded = runtime.block_on(async {
        let mut c = kvgate_kvbm::client::Client::connect(&socket, layout.clone(), 32 * BLOCK)
            .await
            .unwrap();
        let slots: Vec<kvgate_kvbm::protocol::Slot> = (0..32u64)
            .map(|i| {
                c.segment()
                    .write(i * BLOCK, &vec![i as u8; BLOCK as usize])
                    .unwrap();
                kvgate_kvbm::protocol::Slot {
                    key: 0xfeed_0000 + i,
                    offset: i * BLOCK,
                }
            })
            .collect();
        assert_eq!(c.offload(None, slots.clone()).await.unwrap(), (32, 0, 0));
        c.onboard(slots).await.unwrap()
    });
    assert_eq!(
        (onboarded.blocks, onboarded.host, onboarded.remote),
        (32, 16, 16),
        "16 from host memory, 16 back from Redis"
    );
    wait_for(
        "the block manager's residencies in the EPP",
        Duration::from_secs(5),
        || residencies(&stack) >= before + 32.0,
    );
    let page = stack.kvbm_metrics().unwrap();
    let remote_onboards =
        probe::sample(&page, "kvgate_kvbm_onboarded_blocks_total{tier=\"remote\"}");
    assert_eq!(remote_onboards, Some(16.0), "{page}");
    // Requests still flow through Envoy and the EPP with the block manager's node listed.
    let r = send(&stack, &chat("hello", "q", 4, false), &[]);
    assert!(r.ok(), "{r:?}");
    // A graceful stop publishes Cleared for the node: its 32 (block, tier) entries leave the
    // index (the request above only added entries of its own).
    let at_stop = residencies(&stack);
    stack.restart(Component::Kvbm).unwrap();
    wait_for(
        "the node's entries to be cleared",
        Duration::from_secs(5),
        || residencies(&stack) <= at_stop - 32.0,
    );
    // A crash sends no Cleared: the next start's first envelope (a Cleared under a new epoch)
    // clears what the crashed run left in the index.
    let before_crash = residencies(&stack);
    runtime.block_on(async {
        let mut c = kvgate_kvbm::client::Client::connect(&socket, layout, 8 * BLOCK)
            .await
            .unwrap();
        let slots: Vec<kvgate_kvbm::protocol::Slot> = (0..8u64)
            .map(|i| kvgate_kvbm::protocol::Slot {
                key: 0xbeef_0000 + i,
                offset: i * BLOCK,
            })
            .collect();
        assert_eq!(c.offload(None, slots).await.unwrap(), (8, 0, 0));
    });
    wait_for("the new blocks in the EPP", Duration::from_secs(5), || {
        residencies(&stack) >= before_crash + 8.0
    });
    stack.kill(Component::Kvbm).unwrap();
    stack.restart(Component::Kvbm).unwrap();
    wait_for(
        "a restarted block manager to clear its crashed run's entries",
        Duration::from_secs(5),
        || residencies(&stack) <= before_crash + 0.5,
    );
    // Its death is noticed and named, with its log.
    let pid = stack.pid(Component::Kvbm).unwrap();
    std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    wait_for(
        "the stack to notice",
        Duration::from_secs(5),
        || match stack.check() {
            Ok(()) => false,
            Err(e) => {
                assert_eq!(e.component(), Some(Component::Kvbm), "{e}");
                assert!(e.to_string().contains("kvbm.log"), "{e}");
                true
            }
        },
    );
    finish(stack);
}

/// Streams in flight when the EPP dies run to their end, in both failure modes: the routing
/// filter sees only the request and a second, always fail-open ext_proc filter shows the
/// EPP the response while failing open, so losing the EPP cuts nothing. While the EPP lives,
/// it still sees every response (time to first token, tokens, end) through the observer, and
/// a rewritten model's response reaches the client under the name it asked for.
#[test]
fn streams_in_flight_survive_the_epps_death() {
    for fail_open in [false, true] {
        let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let mut stack = start(StackConfig {
            engines: 1,
            fail_open,
            // About 28 ms a token in real time: a 300-token answer streams for ~8 s.
            preset: "h200-llama70b-fp8".into(),
            time_scale: 1.0,
            ..StackConfig::default()
        });
        let port = stack.ports().envoy_listen;
        // The observer reports the response: the request is done, with a first token.
        let r = send(&stack, &chat("observed", "hi", 4, false), &[]);
        assert!(r.ok(), "{r:?}");
        wait_for("the observed response", Duration::from_secs(5), || {
            epp_metric(&stack, "inference_objective_request_ttft_seconds_count") >= 1.0
        });
        let page = stack.epp_metrics().unwrap();
        let claimed =
            probe::metric_sum(&page, "kvgate_epp_response_handoffs_total").unwrap_or_default();
        assert!(claimed >= 1.0, "no ticket handed over:\n{page}");
        assert_eq!(
            epp_metric(&stack, "inference_objective_running_requests"),
            0.0,
            "the finished request is still counted as running"
        );
        // Rewritten to the served model, and back to the client's name by the observer.
        let mut body = chat("rewrite", "hi", 4, false);
        body["model"] = "alias".into();
        let r = send(&stack, &body, &[("x-gateway-model-name-rewrite", "m")]);
        assert!(r.ok(), "{r:?}");
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["model"], "alias", "{r:?}");
        const TOKENS: u32 = 300;
        let streams: Vec<_> = (0..3)
            .map(|i| {
                let body = chat(&format!("in flight {i}"), "hi", TOKENS, true);
                std::thread::spawn(move || {
                    let r = post(port, "/v1/chat/completions", &[], &body);
                    (r, Instant::now())
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(1));
        stack.kill(Component::Epp).unwrap();
        let killed = Instant::now();
        for (i, s) in streams.into_iter().enumerate() {
            let (r, ended) = s.join().unwrap();
            assert!(
                ended > killed,
                "stream {i} ended before the EPP was killed: {r:?}"
            );
            assert!(r.ok(), "fail_open={fail_open}, stream {i}: {r:?}");
            assert!(
                r.body.contains("[DONE]"),
                "fail_open={fail_open}, stream {i} was cut: {}",
                r.body.len()
            );
            let chunks = r.body.matches("\"content\"").count() as u32;
            assert!(
                chunks >= TOKENS,
                "fail_open={fail_open}, stream {i}: {chunks} chunks"
            );
        }
        finish(stack);
    }
}

/// With two EPP replicas behind one Envoy, a request's routing and observer streams often reach
/// different replicas; the observer relays the response's events over NATS to the replica that
/// routed it. Every request is reported where it was routed (time to first token, end), none
/// waits to expire, and a rewritten model's name is swapped back whichever replica observes.
#[test]
fn two_epp_replicas_report_each_response_where_it_was_routed() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let stack = start(StackConfig {
        engines: 2,
        epp_replicas: 2,
        ..StackConfig::default()
    });
    const REQUESTS: usize = 40;
    let port = stack.ports().envoy_listen;
    let senders: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                (0..REQUESTS / 4)
                    .map(|i| {
                        let stream = i % 2 == 0;
                        let mut body = chat(&format!("relay {t}-{i}"), "hi", 4, stream);
                        body["model"] = "alias".into();
                        let r = post(
                            port,
                            "/v1/chat/completions",
                            &[("x-gateway-model-name-rewrite", "m")],
                            &body,
                        );
                        (stream, r)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (stream, r) in senders.into_iter().flat_map(|s| s.join().unwrap()) {
        assert!(r.ok(), "{r:?}");
        if stream {
            assert!(r.body.contains("\"model\":\"alias\""), "{r:?}");
            assert!(!r.body.contains("\"model\":\"m\""), "{r:?}");
        } else {
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(v["model"], "alias", "{r:?}");
        }
    }
    let pages = || -> Vec<String> {
        (0..2)
            .map(|i| {
                let port = stack.ports().epp(i).unwrap().metrics;
                probe::http_get(port, "/metrics", Duration::from_secs(2))
                    .unwrap()
                    .1
            })
            .collect()
    };
    let outcome = support::handoff_outcome;
    let sum = |pages: &[String], name: &str| -> f64 {
        pages
            .iter()
            .map(|p| probe::metric_sum(p, name).unwrap_or_default())
            .sum()
    };
    let mut last = Vec::new();
    let settled = (0..50).any(|_| {
        last = pages();
        let reported = sum(&last, "inference_objective_request_ttft_seconds_count");
        let running = sum(&last, "inference_objective_running_requests");
        if reported >= REQUESTS as f64 && running == 0.0 {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
        false
    });
    assert!(settled, "responses not all reported:\n{}", last.join("\n"));
    let local = outcome(&last, "claimed");
    let relayed_in = outcome(&last, "relayed_in");
    let relayed_out = outcome(&last, "relayed_out");
    eprintln!("observed where routed: {local}; relayed: {relayed_in} in, {relayed_out} out");
    assert_eq!(local + relayed_in, REQUESTS as f64, "{}", last.join("\n"));
    assert_eq!(relayed_in, relayed_out);
    assert!(
        relayed_in > 0.0,
        "no observer stream reached the other replica"
    );
    for gone in ["expired", "unmatched", "relay_lost", "relay_unmatched"] {
        assert_eq!(outcome(&last, gone), 0.0, "{gone}:\n{}", last.join("\n"));
    }
    finish(stack);
}

#[test]
fn a_request_is_one_trace_from_the_caller_through_the_epp_and_the_sidecar() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
    const CALLER: &str = "b7ad6b7169203331";
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let receiver = runtime.block_on(otel::receiver::Receiver::start()).unwrap();
    let stack = start(StackConfig {
        engines: 2,
        otlp_endpoint: Some(receiver.endpoint()),
        ..StackConfig::default()
    });
    let caller = format!("00-{TRACE}-{CALLER}-01");
    let mut body = chat("You are terse.", "Trace me through the gateway", 8, true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let reply = send(
        &stack,
        &body,
        &[("traceparent", &caller), ("x-request-id", "traced-1")],
    );
    assert!(reply.status == 200 && reply.complete, "{reply:?}");
    // Stopping flushes every exporter.
    finish(stack);
    let spans = runtime.block_on(receiver.wait_for(Duration::from_secs(10), |s| {
        s.iter()
            .any(|s| s.name == "sidecar.proxy" && s.trace_id == TRACE)
            && s.iter().any(|s| s.name == "decode" && s.trace_id == TRACE)
    }));
    let request = spans
        .iter()
        .find(|s| s.name == "epp.request" && s.attr("request_id") == Some("traced-1"))
        .unwrap_or_else(|| panic!("no epp.request span: {spans:#?}"));
    assert_eq!(request.service, "kvgate-epp");
    assert_eq!(
        (request.trace_id.as_str(), request.parent_span_id.as_str()),
        (TRACE, CALLER)
    );
    assert_eq!(request.attr("outcome"), Some("completed"));
    assert!(
        request.attr("ttft_ms").is_some() && request.attr("itl_ms").is_some(),
        "{request:?}"
    );
    let proxy = spans
        .iter()
        .find(|s| s.name == "sidecar.proxy" && s.parent_span_id == request.span_id)
        .unwrap_or_else(|| panic!("no sidecar span continues the EPP's: {spans:#?}"));
    assert_eq!(proxy.service, "kvgate-sidecar");
    assert_eq!(proxy.trace_id, TRACE);
    assert_eq!(proxy.attr("request_id"), Some("traced-1"));
    for stage in [
        "parse",
        "tokenize",
        "pick",
        "index_lookup",
        "score",
        "first_token",
        "decode",
    ] {
        assert!(
            spans.iter().any(|s| s.name == stage && s.trace_id == TRACE),
            "no {stage} span in the trace"
        );
    }
}

/// One RESP command to a Redis at `port`; its reply, whole.
fn redis(stream: &mut std::net::TcpStream, args: &[&[u8]]) -> Vec<u8> {
    use std::io::{BufRead as _, BufReader, Read as _, Write as _};
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend(format!("${}\r\n", a.len()).as_bytes());
        out.extend(*a);
        out.extend(b"\r\n");
    }
    stream.write_all(&out).unwrap();
    let mut reader = BufReader::new(stream);
    let mut head = String::new();
    reader.read_line(&mut head).unwrap();
    match head.strip_prefix('$') {
        Some(len) => {
            let mut body = vec![0; len.trim().parse::<usize>().unwrap() + 2];
            reader.read_exact(&mut body).unwrap();
            body.truncate(body.len() - 2);
            body
        }
        None => head.into_bytes(),
    }
}

#[test]
fn the_stacks_redis_holds_the_whole_remote_budget_without_evicting() {
    // The block manager owns the remote budget: the stack's Redis must never drop a block the
    // daemon still indexes (it would count as lost and trip KvgateKVBMLostBlocks). Power-of-two
    // blocks are the worst case for the allocator's size classes.
    let remote: u64 = 64 << 20;
    let port = support::free_port();
    // Killed on drop, so a failed assertion leaves no server behind.
    struct Server(std::process::Child);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _server = Server(
        std::process::Command::new("redis-server")
            .args(kvgate_e2e::stack::render::redis_args(port, remote))
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server is not on the PATH: scripts/bootstrap.sh installs it"),
    );
    let mut stream = None;
    wait_for("redis-server", Duration::from_secs(10), || {
        stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok();
        stream.is_some()
    });
    let mut stream = stream.unwrap();
    for block in [2u64 << 20, 16 << 10] {
        let value = vec![7u8; block as usize];
        for i in 0..remote / block {
            let key = format!("kvgate:kvbm:{block}:{i}");
            let reply = redis(&mut stream, &[b"SET", key.as_bytes(), &value]);
            assert_eq!(reply, b"+OK\r\n", "SET {key}");
        }
        let stats = String::from_utf8(redis(&mut stream, &[b"INFO", b"stats"])).unwrap();
        let memory = String::from_utf8(redis(&mut stream, &[b"INFO", b"memory"])).unwrap();
        let used = memory.lines().find(|l| l.starts_with("used_memory:"));
        assert!(
            stats.lines().any(|l| l == "evicted_keys:0"),
            "{block}-byte blocks: Redis evicted keys within the budget ({used:?})"
        );
        assert_eq!(redis(&mut stream, &[b"FLUSHALL"]), b"+OK\r\n");
    }
}
