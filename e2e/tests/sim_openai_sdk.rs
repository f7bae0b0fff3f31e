//! The official `openai` Python SDK (installed into .venv by scripts/bootstrap.sh) against the
//! simulator: it parses every response and stream chunk with its own models.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use support::Sim;

#[test]
fn openai_python_sdk_accepts_every_response() {
    let python = support::workspace().join(".venv/bin/python");
    assert!(
        python.is_file(),
        "{} missing — run scripts/bootstrap.sh",
        python.display()
    );
    let tokenizer = support::qwen3_dir();
    let sim = Sim::start(&[
        "--model",
        "Qwen/Qwen3-0.6B",
        "--time-scale",
        "50",
        "--tokenizer",
        tokenizer.to_str().unwrap(),
    ]);
    let out = std::process::Command::new(python)
        .arg(support::workspace().join("e2e/tests/openai_sdk.py"))
        .arg(format!("http://127.0.0.1:{}/v1", sim.port))
        .arg("Qwen/Qwen3-0.6B")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openai SDK checks failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
