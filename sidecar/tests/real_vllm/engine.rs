//! A real vLLM 0.32 CPU server (`../shared/scripts/real-vllm/serve.sh`) on free ports: started
//! in its own process group, waited for on `/v1/models`, stopped by SIGTERM to its PID (then
//! SIGKILL to the group) on drop. Its log goes to a temporary directory removed with it; the log's
//! tail is shown when start-up fails or a check fails.
#![allow(unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::http_support::{TempDir, free_ports, request};

/// The setup directory: `$KVGATE_REAL_VLLM_DIR`, else `~/.cache/kvgate-real-vllm`.
pub fn setup_dir() -> PathBuf {
    std::env::var_os("KVGATE_REAL_VLLM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/kvgate-real-vllm")
        })
}

/// A running vLLM server.
pub struct Vllm {
    child: Child,
    pub http: u16,
    pub events: u16,
    pub replay: u16,
    pub startup: Duration,
    tmp: TempDir,
}

impl Vllm {
    /// Starts `serve.sh` from `scripts` against the setup in `dir` and waits until it serves.
    pub fn start(scripts: &Path, dir: &Path, extra: &[&str]) -> Vllm {
        let [http, events, replay] = free_ports::<3>();
        let tmp = TempDir::new("real-vllm");
        let ipc = tmp.0.join("tmp");
        std::fs::create_dir_all(&ipc).unwrap();
        let log = std::fs::File::create(tmp.0.join("server.log")).unwrap();
        let t0 = Instant::now();
        // setsid: the server leads its own process group (its PID is the group's id), so the
        // engine-core and worker processes it spawns can be ended with it.
        let child = Command::new("setsid")
            .arg(scripts.join("serve.sh"))
            .arg("--dir")
            .arg(dir)
            .args(["--port", &http.to_string()])
            .args(["--events-port", &events.to_string()])
            .args(["--replay-port", &replay.to_string()])
            .arg("--extra")
            .args(extra)
            .env("TMPDIR", &ipc) // vLLM leaves IPC socket files there
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn serve.sh");
        let mut v = Vllm {
            child,
            http,
            events,
            replay,
            startup: Duration::ZERO,
            tmp,
        };
        v.wait_ready(Duration::from_secs(600)); // 60-100 s alone; minutes under build load
        v.startup = t0.elapsed();
        v
    }

    fn wait_ready(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "vLLM exited during start-up ({status}); log:\n{}",
                    self.log_tail(40)
                );
            }
            if request(self.http, "GET", "/v1/models", &[], b"").is_ok_and(|r| r.status == 200) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "vLLM not ready after {limit:?}; log:\n{}",
                self.log_tail(40)
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The last `n` lines of the server log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(self.tmp.0.join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Resident memory of the server's process group, in GiB.
    pub fn rss_gib(&self) -> f64 {
        let out = Command::new("ps")
            .args(["-eo", "pgid=,rss="])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let pgid = self.child.id().to_string();
        let kib: f64 = out
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                (it.next()? == pgid).then(|| it.next()?.parse::<f64>().ok())?
            })
            .sum();
        kib / 1_048_576.0
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(200));
        }
        // Whatever is left of the group (or the server itself, after 30 s).
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{pid}")])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.wait();
    }
}
