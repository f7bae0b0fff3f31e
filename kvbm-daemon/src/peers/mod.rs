//! Pulls from peers: blocks another node's block manager holds, fetched over TCP when this
//! node misses them, instead of the engine recomputing them.
//!
//! - [`directory`] (pure): which peer holds which blocks, from their announces and KV-event
//!   streams (each followed with snapshots on gaps), and where each serves pulls;
//! - [`auth`] (pure): mutual proof of a shared secret; [`wire`] (pure): the messages;
//! - [`pull`] and [`serve`]: the two ends of a TCP exchange ([`conn`]: framing, deadlines);
//! - [`follow`]: the NATS edge feeding the directory, and this node's own announces.
//!
//! docs/kvbm.md § Pulls from peers documents the protocol, flags and failure modes.

pub mod answer;
pub mod auth;
pub mod conn;
pub mod directory;
pub mod fabric;
pub mod follow;
pub mod metrics;
pub mod pull;
pub mod serve;
pub mod wire;

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use kv_events::BlockKey;
use kv_index::Millis;

use crate::store::Layout;
use conn::ConnError;
use directory::{Directory, Holding};
use pull::PullConfig;

/// The directory and the pulling end, shared by the service (lookups, onboards) and the
/// NATS edge (which keeps the directory).
#[derive(Debug)]
pub struct Peers {
    directory: Mutex<Directory>,
    pull: PullConfig,
    started: Instant,
}

impl Peers {
    /// Peers found through `directory`, pulled from as `pull` says.
    pub fn new(directory: Directory, pull: PullConfig) -> Self {
        Self {
            directory: Mutex::new(directory),
            pull,
            started: Instant::now(),
        }
    }

    /// The directory (every critical section leaves it consistent).
    pub fn directory(&self) -> MutexGuard<'_, Directory> {
        self.directory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The directory's clock: milliseconds since start.
    pub fn now(&self) -> Millis {
        Millis(u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX))
    }

    /// The peer holding the longest leading run of `keys` under the layout with fingerprint
    /// `layout` (the index is read after the directory's lock is released).
    pub fn best(&self, keys: &[BlockKey], layout: u64) -> Option<Holding> {
        if keys.is_empty() {
            return None;
        }
        let now = self.now();
        let candidates = self.directory().candidates(layout, now);
        candidates.best(keys)
    }

    /// Fabric buffers given up on so far (0 without a fabric).
    pub fn fabric_leaked_buffers(&self) -> u64 {
        self.pull.fabric.as_ref().map_or(0, |f| f.leaked_buffers())
    }

    /// A pull from `holding`'s peer failed: pass it over for a while.
    pub fn failed(&self, holding: &Holding) {
        let now = self.now();
        self.directory().failed(&holding.node, now);
    }

    /// The leading blocks of `keys` that `holding`'s peer has (at most one answer's worth),
    /// and the key before them in its chain.
    pub async fn pull(
        &self,
        holding: &Holding,
        layout: &Layout,
        keys: &[BlockKey],
    ) -> Result<pull::Pulled, ConnError> {
        pull::pull(&self.pull, &holding.node, holding.addr, layout, keys).await
    }
}
