//! `kvgate-bench load` against real `kvgate-sim` processes: multi-turn caching, open-loop
//! ordering, HTTP errors and a dying engine all become records, never a crash.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use support::Sim;
use workload::{RequestRecord, SharedPrefixOptions, Status};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-load-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn bench(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-bench"));
    cmd.args(args);
    if args.first() == Some(&"load") {
        cmd.arg("--quiet");
    }
    cmd.env("RUST_LOG", "warn").stdin(Stdio::null());
    cmd
}

fn run_ok(mut cmd: Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "kvgate-bench failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn records(path: &Path) -> Vec<RequestRecord> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn url(sim: &Sim) -> String {
    format!("http://127.0.0.1:{}", sim.port)
}

#[test]
fn closed_loop_conversations_hit_the_cache_on_later_turns() {
    let sim = Sim::start(&[
        "--time-scale",
        "50",
        "--pod-name",
        "sim-a",
        "--max-model-len",
        "32768",
    ]);
    let dir = scratch("closed");
    let out = dir.join("records.jsonl");
    let output = run_ok(bench(&[
        "load",
        "--url",
        &url(&sim),
        "--workload",
        "doks",
        "--concurrency",
        "2",
        "--sessions",
        "3",
        "--run",
        "direct",
        "--out",
        out.to_str().unwrap(),
    ]));
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        stdout.starts_with("run ") && stdout.contains("direct"),
        "{stdout}"
    );
    let records = records(&out);
    let w = workload::doks(&workload::DoksOptions {
        sessions: 3,
        concurrency: 2,
        ..workload::DoksOptions::default()
    });
    assert_eq!(records.len(), w.requests(), "every turn of every session");
    let mut by_session: BTreeMap<u64, Vec<&RequestRecord>> = BTreeMap::new();
    for r in &records {
        assert_eq!(r.status, Status::Ok, "{r:?}");
        assert_eq!((r.run.as_str(), r.load), ("direct", Some(2.0)));
        assert_eq!(r.endpoint.as_deref(), Some("sim-a"));
        assert_eq!(r.http_status, Some(200));
        let ttft = r.ttft_ms.unwrap();
        assert!(ttft > 0.0 && ttft <= r.e2e_ms);
        assert!(r.tpot_ms.unwrap() > 0.0);
        by_session.entry(r.session).or_default().push(r);
    }
    for (id, mut turns) in by_session {
        turns.sort_by_key(|r| r.turn);
        let session = &w.sessions[id as usize];
        assert_eq!(turns.len(), session.turns.len());
        for (r, turn) in turns.iter().zip(&session.turns) {
            assert_eq!(
                r.output_tokens, turn.max_tokens,
                "ignore_eos gives exactly max_tokens"
            );
            assert_eq!(r.group, session.group);
        }
        for pair in turns.windows(2) {
            let (prev, next) = (pair[0], pair[1]);
            assert!(
                next.start_ms >= prev.start_ms + prev.e2e_ms - 1.0,
                "turns are sequential"
            );
            // The history (previous prompt and the engine's own answer) is cached, up to the
            // last partial block (16 tokens) and the last generated token.
            let history = prev.prompt_tokens + prev.output_tokens;
            let cached = next.cached_tokens.unwrap();
            assert!(
                cached + 17 >= history,
                "session {id} turn {}: cached {cached} of history {history}",
                next.turn
            );
            assert!(next.prompt_tokens > history);
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn open_loop_sends_in_arrival_order_never_early() {
    let sim = Sim::start(&["--time-scale", "50"]);
    let dir = scratch("open");
    let out = dir.join("records.jsonl");
    run_ok(bench(&[
        "load",
        "--url",
        &url(&sim),
        "--workload",
        "shared-prefix",
        "--groups",
        "2",
        "--users-per-group",
        "3",
        "--questions-per-user",
        "4",
        "--system-prompt-tokens",
        "256",
        "--question-tokens",
        "20",
        "--output-tokens",
        "8",
        "--qps",
        "40",
        "--seed",
        "9",
        "--out",
        out.to_str().unwrap(),
    ]));
    let w = workload::shared_prefix(&SharedPrefixOptions {
        groups: 2,
        users_per_group: 3,
        questions_per_user: 4,
        system_prompt_tokens: 256,
        question_tokens: 20,
        output_tokens: 8,
        qps: 40.0,
        seed: 9,
        ..SharedPrefixOptions::default()
    })
    .unwrap();
    let mut records = records(&out);
    assert_eq!(records.len(), 24);
    assert!(
        records
            .iter()
            .all(|r| r.status == Status::Ok && r.load == Some(40.0))
    );
    records.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    let due = |id: u64| {
        w.sessions
            .iter()
            .find(|s| s.id == id)
            .unwrap()
            .start
            .as_secs_f64()
            * 1_000.0
    };
    // Sessions are started in the order they are due. Two due within 50 ms of each other may
    // record their starts in either order (task scheduling on a loaded machine); further apart,
    // the earlier one must have been sent first.
    for a in &records {
        for b in &records {
            if due(b.session) - due(a.session) >= 50.0 {
                assert!(
                    a.start_ms < b.start_ms,
                    "{a:?} due before {b:?} but sent after"
                );
            }
        }
    }
    for r in &records {
        let due = w.sessions.iter().find(|s| s.id == r.session).unwrap().start;
        assert!(
            r.start_ms + 1.0 >= due.as_secs_f64() * 1_000.0,
            "sent before its time: {r:?}"
        );
    }
    // The second request of a group finds the system prompt cached.
    let mut seen = std::collections::HashSet::new();
    for r in &records {
        if !seen.insert(r.group) {
            assert!(r.cached_tokens.unwrap() >= 256, "{r:?}");
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn http_errors_are_records_not_a_crash() {
    let sim = Sim::start(&[
        "--time-scale",
        "50",
        "--fault-error-rate",
        "1",
        "--fault-status",
        "503",
    ]);
    let dir = scratch("errors");
    let out = dir.join("records.jsonl");
    let output = run_ok(bench(&[
        "load",
        "--url",
        &url(&sim),
        "--workload",
        "doks",
        "--concurrency",
        "3",
        "--sessions",
        "5",
        "--out",
        out.to_str().unwrap(),
    ]));
    let records = records(&out);
    assert_eq!(records.len(), 5, "a failed first turn ends its session");
    for r in &records {
        assert_eq!(
            (r.status, r.http_status, r.turn),
            (Status::HttpError, Some(503), 0),
            "{r:?}"
        );
        assert!(r.error.as_deref().unwrap().contains("503"));
    }
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(stdout.lines().nth(1).unwrap().contains("  5  "), "{stdout}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_killed_engine_gives_transport_records() {
    let mut sim = Sim::start(&["--time-scale", "1"]);
    let dir = scratch("killed");
    let out = dir.join("records.jsonl");
    let mut child = bench(&[
        "load",
        "--url",
        &url(&sim),
        "--workload",
        "shared-prefix",
        "--groups",
        "1",
        "--users-per-group",
        "4",
        "--questions-per-user",
        "10",
        "--system-prompt-tokens",
        "64",
        "--question-tokens",
        "8",
        "--output-tokens",
        "4000",
        "--qps",
        "20",
        "--out",
        out.to_str().unwrap(),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(1_500));
    sim.child.kill().unwrap();
    sim.child.wait().unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    let records = records(&out);
    assert_eq!(records.len(), 40);
    let transport = records
        .iter()
        .filter(|r| r.status == Status::Transport)
        .count();
    assert_eq!(
        transport, 40,
        "every request was cut off or refused: {records:?}"
    );
    assert!(
        records.iter().any(|r| r.http_status == Some(200)),
        "some were cut off mid-stream"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn report_renders_a_table_and_plots() {
    let dir = scratch("report");
    let mut lines = String::new();
    for (run, base) in [("kv", 200.0), ("round-robin", 300.0)] {
        for load in [60.0, 120.0, 180.0] {
            for i in 0..20 {
                let r = RequestRecord {
                    run: run.into(),
                    load: Some(load),
                    session: i,
                    turn: 0,
                    group: 0,
                    start_ms: f64::from(i as u32) * 100.0,
                    ttft_ms: Some(base + load + f64::from(i as u32)),
                    tpot_ms: Some(30.0),
                    e2e_ms: 3_000.0,
                    prompt_tokens: 1_000,
                    output_tokens: 100,
                    cached_tokens: Some(800),
                    status: Status::Ok,
                    http_status: Some(200),
                    endpoint: None,
                    error: None,
                };
                lines.push_str(&serde_json::to_string(&r).unwrap());
                lines.push('\n');
            }
        }
    }
    let input = dir.join("runs.jsonl");
    std::fs::write(&input, lines).unwrap();
    let plots = dir.join("plots");
    let output = run_ok(bench(&[
        "report",
        "--in",
        input.to_str().unwrap(),
        "--out",
        plots.to_str().unwrap(),
    ]));
    let table = String::from_utf8(output.stdout).unwrap();
    assert_eq!(table.lines().count(), 7, "{table}");
    assert!(table.lines().nth(1).unwrap().starts_with("kv "), "{table}");
    for png in ["ttft.png", "throughput.png"] {
        let bytes = std::fs::read(plots.join(png)).unwrap();
        assert!(
            bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000,
            "{png}"
        );
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plots.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary.as_array().unwrap().len(), 6);
    if std::env::var_os("KVGATE_KEEP_PLOTS").is_none() {
        std::fs::remove_dir_all(dir).unwrap();
    } else {
        eprintln!("plots kept in {}", plots.display());
    }
}
