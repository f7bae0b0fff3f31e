//! One component's process: how it is started (a [`Spec`] kept for restarts), its log file,
//! readiness polling with the log's tail on failure, and a graceful stop (SIGTERM, then SIGKILL
//! after a grace period).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};

use super::config::Component;
use super::error::StackError;

/// Lines of a log shown when a component fails.
pub const TAIL_LINES: usize = 25;
const TAIL_BYTES: u64 = 16 << 10;

/// How to start a component.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The component.
    pub component: Component,
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// Where stdout and stderr go (appended, so restarts keep the history).
    pub log: PathBuf,
}

/// A started component.
#[derive(Debug)]
pub struct Proc {
    spec: Spec,
    child: Child,
}

impl Proc {
    /// Starts `spec` with stdout and stderr appended to its log.
    pub fn spawn(spec: Spec) -> Result<Proc, StackError> {
        let io_err = |source| StackError::Io {
            what: format!("opening {}", spec.log.display()),
            source,
        };
        let out = File::options()
            .create(true)
            .append(true)
            .open(&spec.log)
            .map_err(io_err)?;
        let err = out.try_clone().map_err(io_err)?;
        // Its own process group: a Ctrl-C at the terminal reaches only the stack's owner, which
        // then stops the components in order (the sidecars still have NATS while they drain).
        let child = Command::new(&spec.program)
            .process_group(0)
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|source| StackError::Spawn {
                component: spec.component,
                program: spec.program.clone(),
                source,
            })?;
        tracing::debug!(component = %spec.component, pid = child.id(), "started");
        Ok(Proc { spec, child })
    }

    /// How it was started.
    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The error saying it exited with `status`.
    pub fn exited_error(&self, status: ExitStatus) -> StackError {
        StackError::Exited {
            component: self.spec.component,
            status,
            log: self.spec.log.clone(),
            tail: log_tail(&self.spec.log, TAIL_LINES),
        }
    }

    /// Polls `ready` every 50 ms until it holds, the process exits, or `limit` passes.
    pub fn wait_ready(
        &mut self,
        limit: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), StackError> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.exited() {
                return Err(self.exited_error(status));
            }
            if ready() {
                tracing::debug!(component = %self.spec.component, took = ?start.elapsed(), "ready");
                return Ok(());
            }
            if start.elapsed() >= limit {
                return Err(StackError::NotReady {
                    component: self.spec.component,
                    waited: limit,
                    log: self.spec.log.clone(),
                    tail: log_tail(&self.spec.log, TAIL_LINES),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`; waits for it.
    pub fn stop(self, grace: Duration) -> Option<ExitStatus> {
        self.terminate();
        self.wait_or_kill(Instant::now() + grace)
    }

    /// Sends SIGTERM (a no-op once it has exited).
    pub fn terminate(&self) {
        let _ = kill_process(Pid::from_child(&self.child), Signal::TERM);
    }

    /// Waits until `deadline` for it to exit, then kills it.
    pub fn wait_or_kill(mut self, deadline: Instant) -> Option<ExitStatus> {
        while Instant::now() < deadline {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if self.exited().is_none() {
            tracing::warn!(component = %self.spec.component, "did not stop after SIGTERM; killing");
        }
        self.kill()
    }

    /// SIGKILL (an abrupt death, as a crash would be); waits for it.
    pub fn kill(mut self) -> Option<ExitStatus> {
        let _ = self.child.kill();
        self.child.wait().ok()
    }

    /// Sends SIGKILL without waiting: the process stays tracked, so whoever watches it sees it
    /// die as a crash.
    pub fn signal_kill(&self) {
        let _ = kill_process(Pid::from_child(&self.child), Signal::KILL);
    }

    /// SIGSTOP or SIGCONT: freeze the process without closing its sockets, or thaw it.
    pub fn freeze(&self, frozen: bool) -> std::io::Result<()> {
        let signal = if frozen { Signal::STOP } else { Signal::CONT };
        kill_process(Pid::from_child(&self.child), signal).map_err(std::io::Error::from)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The last `lines` lines of a log file (at most its last 16 KiB), or a note when unreadable.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let read = || -> std::io::Result<String> {
        let mut f = File::open(path)?;
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(TAIL_BYTES)))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    match read() {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            let from = all.len().saturating_sub(lines);
            all.get(from..).unwrap_or_default().join("\n")
        }
        Err(e) => format!("(log unreadable: {e})"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use super::*;

    fn spec(dir: &Path, script: &str) -> Spec {
        Spec {
            component: Component::Nats,
            program: PathBuf::from("/bin/sh"),
            args: vec!["-c".into(), script.into()],
            env: vec![],
            log: dir.join("c.log"),
        }
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvgate-proc-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn an_early_exit_reports_status_and_log_tail() {
        let d = dir("exit");
        let mut p = Proc::spawn(spec(&d, "echo one; echo two; exit 3")).unwrap();
        let err = p.wait_ready(Duration::from_secs(5), || false).unwrap_err();
        match &err {
            StackError::Exited { status, tail, .. } => {
                assert_eq!(status.code(), Some(3));
                assert_eq!(tail, "one\ntwo");
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("nats exited"));
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn not_ready_in_time_and_sigterm_stops() {
        let d = dir("slow");
        let mut p = Proc::spawn(spec(&d, "echo waiting; exec sleep 30")).unwrap();
        let err = p
            .wait_ready(Duration::from_millis(300), || false)
            .unwrap_err();
        assert!(matches!(err, StackError::NotReady { .. }), "{err:?}");
        let start = Instant::now();
        let status = p.stop(Duration::from_secs(5)).unwrap();
        assert!(start.elapsed() < Duration::from_secs(4));
        assert!(!status.success());
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let d = dir("tail");
        let f = d.join("l.log");
        std::fs::write(&f, (0..100).map(|i| format!("{i}\n")).collect::<String>()).unwrap();
        assert_eq!(log_tail(&f, 2), "98\n99");
        assert!(log_tail(&d.join("missing"), 2).starts_with("(log unreadable"));
        std::fs::remove_dir_all(d).unwrap();
    }
}
