//! SSRF protection: the live allow-list, re-read from its file on a poll, and the check the
//! P/D flow runs before contacting a prefiller.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use super::allowlist::{self, AllowList};
use super::error::ProxyError;

/// Which prefillers may be contacted.
#[derive(Debug, Clone)]
pub enum SsrfPolicy {
    /// Any address (protection explicitly disabled by flag).
    Disabled,
    /// Only those in the live list.
    AllowList(Arc<LiveAllowList>),
}

impl SsrfPolicy {
    /// Refuses addresses outside the policy.
    pub fn check(&self, addr: &SocketAddr) -> Result<(), ProxyError> {
        match self {
            Self::Disabled => Ok(()),
            Self::AllowList(live) => match live.current() {
                None => Err(ProxyError::NoAllowList),
                Some(list) if list.allows(addr) => Ok(()),
                Some(_) => Err(ProxyError::PrefillerNotAllowed(addr.to_string())),
            },
        }
    }
}

/// The allow-list in force, swapped whole on reload.
#[derive(Debug, Default)]
pub struct LiveAllowList {
    list: RwLock<Option<Arc<AllowList>>>,
    /// Successful (re)loads.
    pub reloads: AtomicU64,
    /// Refused reads or parses (the previous list stayed).
    pub errors: AtomicU64,
}

impl LiveAllowList {
    /// The list in force, if one was ever loaded.
    pub fn current(&self) -> Option<Arc<AllowList>> {
        self.list.read().map(|g| g.clone()).unwrap_or_default()
    }

    /// Replaces the list.
    pub fn set(&self, list: AllowList) {
        if let Ok(mut g) = self.list.write() {
            *g = Some(Arc::new(list));
        }
        self.reloads.fetch_add(1, Ordering::Relaxed);
    }

    /// Addresses in the list in force.
    pub fn len(&self) -> usize {
        self.current().map_or(0, |l| l.len())
    }

    /// Whether no address is allowed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Reads the file once now, then every `every` when its content changed. Runs until dropped.
pub async fn watch(path: PathBuf, live: Arc<LiveAllowList>, every: Duration) {
    let mut last: Option<Vec<u8>> = None;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let p = path.clone();
        let read = tokio::task::spawn_blocking(move || std::fs::read(p)).await;
        let bytes = match read {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(e)) => {
                if last.is_some() || live.errors.load(Ordering::Relaxed) == 0 {
                    tracing::warn!(path = %path.display(), error = %e, "cannot read prefiller allow-list; keeping the previous one");
                }
                live.errors.fetch_add(1, Ordering::Relaxed);
                last = None;
                continue;
            }
            Err(_) => continue,
        };
        if last.as_deref() == Some(bytes.as_slice()) {
            continue;
        }
        match allowlist::parse(&String::from_utf8_lossy(&bytes)) {
            Ok(list) => {
                tracing::info!(path = %path.display(), addresses = list.len(), "prefiller allow-list loaded");
                live.set(list);
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "prefiller allow-list refused; keeping the previous one");
                live.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        last = Some(bytes);
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

    #[test]
    fn policy_refuses_unknown_and_unloaded() {
        let live = Arc::new(LiveAllowList::default());
        let policy = SsrfPolicy::AllowList(live.clone());
        let addr: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        assert!(matches!(policy.check(&addr), Err(ProxyError::NoAllowList)));
        live.set(["10.0.0.2:8000".parse().unwrap()].into_iter().collect());
        assert!(matches!(
            policy.check(&addr),
            Err(ProxyError::PrefillerNotAllowed(_))
        ));
        live.set([addr].into_iter().collect());
        assert!(policy.check(&addr).is_ok());
        assert!(SsrfPolicy::Disabled.check(&addr).is_ok());
    }

    async fn until(f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "timed out");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn watch_reloads_on_change_and_keeps_the_old_list_on_errors() {
        let dir = std::env::temp_dir().join(format!("kvgate-allow-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("list");
        std::fs::write(&path, "10.0.0.1:8000\n").unwrap();
        let live = Arc::new(LiveAllowList::default());
        let task = tokio::spawn(watch(path.clone(), live.clone(), Duration::from_millis(10)));
        let a: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:8000".parse().unwrap();
        until(|| live.current().is_some_and(|l| l.allows(&a))).await;
        std::fs::write(&path, "10.0.0.2:8000\n").unwrap();
        until(|| {
            live.current()
                .is_some_and(|l| l.allows(&b) && !l.allows(&a))
        })
        .await;
        std::fs::write(&path, "not an address\n").unwrap();
        until(|| live.errors.load(Ordering::Relaxed) > 0).await;
        assert!(live.current().unwrap().allows(&b));
        task.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
