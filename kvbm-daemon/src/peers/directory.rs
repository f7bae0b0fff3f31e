//! Which peer node holds which blocks, and where to pull them (pure: no I/O, no clock).
//!
//! Peers are the block managers of other nodes serving the same model and block size. Each
//! announces the address it serves pulls on, its announce interval and the layouts its
//! connectors registered ([`Announce`], on NATS); the directory follows the KV-event stream
//! of every announced peer (`kvgate.kvbm.<namespace>.<node>`) with a [`SourceSync`] each
//! (snapshots on first sight and after a gap), into a [`KvIndex`] where each peer is a node
//! holder. A peer not heard from for three of its intervals is forgotten with its blocks; one
//! whose pull failed (whatever the reason) is passed over for a while. [`Directory::best`] names the peer holding
//! the longest leading run of a chain in host memory or on disk (a peer's remote store is not
//! pulled through it), among those that registered the asked layout.
//!
//! The index is written outside the directory's lock: every method queues its index writes,
//! and the caller applies them ([`Directory::take_writes`], [`IndexWrites::apply`]) after
//! releasing it, so a large snapshot never holds up a lookup. Only one task writes, so the
//! writes land in order. Peer ids are never reused, so a write queued for a forgotten peer
//! cannot land on another.
//!
//! The stream names kvgate keys, not layouts: a peer publishes a key once every shard of one
//! of its layouts holds it, so a pull may still find fewer blocks of the asked layout than the
//! directory promised (a peer holding the key under another of its layouts); the puller then
//! gets what there is.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use kv_events::envelope::EngineKind;
use kv_events::snapshot::Snapshot;
use kv_events::{BlockKey, Envelope, Tier};
use kv_index::{EndpointId, Holder, IndexConfig, KvIndex, Millis, NodeId};
use kv_sync::{Effect, SourceSync, SyncConfig};
use serde::{Deserialize, Serialize};

/// The largest announce accepted.
pub const MAX_ANNOUNCE_BYTES: usize = 4096;

/// A block manager's announcement: who it is and where it serves pulls.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announce {
    /// Its node.
    pub node: String,
    /// The model it serves.
    pub model: String,
    /// Its tokens per block.
    pub block_size: u32,
    /// Where it serves pulls (`ip:port`).
    pub addr: SocketAddr,
    /// How often it announces, milliseconds (0: unknown; the directory's TTL applies).
    #[serde(default)]
    pub interval_ms: u64,
    /// The fingerprints of the layouts its connectors registered (at most 64).
    #[serde(default)]
    pub layouts: Vec<u64>,
}

/// Why an announce was not taken.
#[derive(Debug, thiserror::Error)]
pub enum AnnounceError {
    /// Not a well-formed announce.
    #[error("undecodable announce: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    /// Above [`MAX_ANNOUNCE_BYTES`].
    #[error("announce of {0} bytes (at most {MAX_ANNOUNCE_BYTES})")]
    TooLarge(usize),
}

impl Announce {
    /// Encodes it (a MessagePack map).
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// Decodes one, bounded.
    pub fn decode(bytes: &[u8]) -> Result<Self, AnnounceError> {
        if bytes.len() > MAX_ANNOUNCE_BYTES {
            return Err(AnnounceError::TooLarge(bytes.len()));
        }
        Ok(rmp_serde::from_slice(bytes)?)
    }
}

/// Bounds and timings.
#[derive(Debug, Clone, Copy)]
pub struct DirectoryConfig {
    /// Each peer stream's synchronisation.
    pub sync: SyncConfig,
    /// A peer not announced within this long is forgotten, unless its announce gives its
    /// interval (then three intervals).
    pub ttl: Millis,
    /// How long a peer whose pull failed is passed over.
    pub backoff: Millis,
    /// The most peers followed; announces of more are ignored.
    pub max_peers: usize,
    /// The most (block, peer) residencies kept.
    pub capacity: usize,
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        Self {
            sync: SyncConfig::default(),
            ttl: Millis(30_000),
            backoff: Millis(5_000),
            max_peers: 256,
            capacity: 16 << 20,
        }
    }
}

/// A snapshot to fetch: send its request to `node`'s snapshot subject and pass the reply
/// back ([`Directory::snapshot_done`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetch {
    /// The peer.
    pub node: String,
    /// The peer's incarnation (its id in the directory): a reply for a peer forgotten and
    /// announced again meanwhile is dropped.
    pub peer: u32,
    /// The request's id.
    pub id: u64,
}

/// One queued index write.
#[derive(Debug)]
enum IndexWrite {
    Apply(Holder, Vec<kv_events::KvEvent>),
    Replace(Holder, Snapshot),
    Remove(Holder),
}

/// Index writes to apply, in order, after releasing the directory's lock.
#[derive(Debug)]
#[must_use = "the writes must be applied"]
pub struct IndexWrites {
    index: Arc<KvIndex>,
    writes: Vec<IndexWrite>,
}

impl IndexWrites {
    /// Applies them.
    pub fn apply(self) {
        for write in self.writes {
            match write {
                IndexWrite::Apply(holder, events) => self.index.apply(holder, &events),
                IndexWrite::Replace(holder, snapshot) => {
                    self.index.replace_source(holder, snapshot.entries());
                }
                IndexWrite::Remove(holder) => self.index.remove_source(holder),
            }
        }
    }
}

/// What an announce did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Announced {
    /// A peer seen for the first time (or again after it was forgotten): its snapshot is due.
    New(Fetch),
    /// A known peer, renewed (its address may have changed).
    Renewed,
    /// Not a peer: this node, another model or block size, or over the peer limit.
    Ignored(&'static str),
}

/// A peer holding a run of blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    /// Its node.
    pub node: String,
    /// Where it serves pulls.
    pub addr: SocketAddr,
    /// Leading blocks of the chain it holds.
    pub blocks: u32,
}

/// Counts of what the streams did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectoryStats {
    /// Envelopes of nodes that are not announced peers (or of another model).
    pub envelopes_ignored: u64,
    /// Gaps and epoch changes that made a peer stale.
    pub resyncs: u64,
    /// Snapshot attempts that failed.
    pub snapshot_failures: u64,
    /// Peers forgotten for silence.
    pub expired: u64,
}

#[derive(Debug)]
struct Peer {
    id: u32,
    addr: SocketAddr,
    seen: Millis,
    ttl: Millis,
    layouts: Vec<u64>,
    /// Passed over until then (a pull from it failed).
    down_until: Millis,
    sync: SourceSync,
}

/// The peers and what they hold.
#[derive(Debug)]
pub struct Directory {
    node: String,
    model: String,
    block_size: u32,
    config: DirectoryConfig,
    index: Arc<KvIndex>,
    peers: HashMap<String, Peer>,
    next_id: u32,
    writes: Vec<IndexWrite>,
    stats: DirectoryStats,
}

impl Directory {
    /// The directory of `node`, serving `model` in blocks of `block_size` tokens.
    pub fn new(
        node: &str,
        model: &str,
        block_size: u32,
        config: DirectoryConfig,
    ) -> Result<Self, kv_index::ConfigError> {
        let index = Arc::new(KvIndex::new(IndexConfig {
            shards: 4,
            capacity: config.capacity,
        })?);
        Ok(Self {
            node: node.to_owned(),
            model: model.to_owned(),
            block_size,
            config,
            index,
            peers: HashMap::new(),
            next_id: 0,
            writes: Vec::new(),
            stats: DirectoryStats::default(),
        })
    }

    /// The index writes queued since the last call, to apply once the directory's lock is
    /// released.
    pub fn take_writes(&mut self) -> IndexWrites {
        IndexWrites {
            index: Arc::clone(&self.index),
            writes: std::mem::take(&mut self.writes),
        }
    }

    /// Peers followed now.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Peers whose stream is out of step (a snapshot awaited).
    pub fn stale(&self) -> usize {
        self.peers.values().filter(|p| p.sync.is_stale()).count()
    }

    /// What the streams did since start.
    pub fn stats(&self) -> DirectoryStats {
        self.stats
    }

    /// Takes an announce.
    pub fn announced(&mut self, a: &Announce, now: Millis) -> Announced {
        if a.node == self.node {
            return Announced::Ignored("self");
        }
        if a.model != self.model || a.block_size != self.block_size {
            return Announced::Ignored("other model");
        }
        let ttl = match a.interval_ms {
            0 => self.config.ttl,
            ms => Millis(ms.saturating_mul(3)),
        };
        let mut layouts = a.layouts.clone();
        layouts.truncate(crate::store::MAX_LAYOUTS);
        if let Some(peer) = self.peers.get_mut(&a.node) {
            peer.seen = now;
            peer.ttl = ttl;
            peer.layouts = layouts;
            if peer.addr != a.addr {
                // A new address is a new pod: worth trying at once.
                peer.addr = a.addr;
                peer.down_until = Millis(0);
            }
            return Announced::Renewed;
        }
        if self.peers.len() >= self.config.max_peers || self.next_id > kv_index::MAX_ID {
            return Announced::Ignored("peer limit");
        }
        let id = self.next_id;
        self.next_id += 1;
        // Each peer is a candidate endpoint with no tiers of its own on its own node, so a
        // lookup's reach is the node's.
        if let (Ok(endpoint), Ok(node)) = (EndpointId::new(id), NodeId::new(id)) {
            self.index.set_endpoint_node(endpoint, Some(node));
        }
        let mut out = Vec::new();
        let sync = SourceSync::new(self.config.sync, now, &mut out);
        self.peers.insert(
            a.node.clone(),
            Peer {
                id,
                addr: a.addr,
                seen: now,
                ttl,
                layouts,
                down_until: Millis(0),
                sync,
            },
        );
        let fetches = self.effects(&a.node, out);
        match fetches.into_iter().next() {
            Some(f) => Announced::New(f),
            None => Announced::Renewed,
        }
    }

    /// Takes an envelope from `kvgate.kvbm.<namespace>.*`; those of nodes that are not
    /// announced peers are ignored.
    pub fn envelope(&mut self, e: Envelope, now: Millis) -> Vec<Fetch> {
        let Some(node) = e.source.node.as_deref().filter(|_| {
            e.source.pod.is_none()
                && e.source.engine == EngineKind::Kvbm
                && e.source.model == self.model
                && e.source.block_size == self.block_size
        }) else {
            self.stats.envelopes_ignored += 1;
            return Vec::new();
        };
        let Some(peer) = self.peers.get_mut(node) else {
            self.stats.envelopes_ignored += 1;
            return Vec::new();
        };
        let node = node.to_owned();
        let mut out = Vec::new();
        peer.sync
            .on_envelope(e.epoch, e.seq, e.events, now, &mut out);
        self.effects(&node, out)
    }

    /// Takes the outcome of `fetch` (`None`: it failed).
    pub fn snapshot_done(
        &mut self,
        fetch: &Fetch,
        snapshot: Option<Snapshot>,
        now: Millis,
    ) -> Vec<Fetch> {
        let Some(peer) = self
            .peers
            .get_mut(&fetch.node)
            .filter(|p| p.id == fetch.peer)
        else {
            return Vec::new();
        };
        let mut out = Vec::new();
        match snapshot {
            Some(s) => peer.sync.on_snapshot(fetch.id, s, now, &mut out),
            None => peer.sync.on_snapshot_failed(fetch.id, now, &mut out),
        }
        self.effects(&fetch.node, out)
    }

    /// A pull from `node` failed (it could not be reached, did not answer in time, refused,
    /// failed its proof or sent a damaged block): it is passed over until the backoff has
    /// passed (or it announces a new address), so one bad peer costs one failed pull, not one
    /// per onboard chunk.
    pub fn failed(&mut self, node: &str, now: Millis) {
        if let Some(peer) = self.peers.get_mut(node) {
            peer.down_until = now.after(self.config.backoff);
        }
    }

    /// Advances time: forgets peers silent past the TTL (returned), retries due snapshots.
    pub fn tick(&mut self, now: Millis) -> (Vec<Fetch>, Vec<String>) {
        let expired: Vec<String> = self
            .peers
            .iter()
            .filter(|(_, p)| now.0.saturating_sub(p.seen.0) > p.ttl.0)
            .map(|(n, _)| n.clone())
            .collect();
        for node in &expired {
            self.forget(node);
            self.stats.expired += 1;
        }
        let mut fetches = Vec::new();
        let nodes: Vec<String> = self.peers.keys().cloned().collect();
        for node in nodes {
            let mut out = Vec::new();
            if let Some(peer) = self.peers.get_mut(&node) {
                peer.sync.tick(now, &mut out);
            }
            fetches.extend(self.effects(&node, out));
        }
        (fetches, expired)
    }

    /// Every peer's stream may have missed envelopes (the NATS connection came back): asks
    /// each for a snapshot.
    pub fn resync(&mut self, now: Millis) -> Vec<Fetch> {
        let nodes: Vec<String> = self.peers.keys().cloned().collect();
        let mut fetches = Vec::new();
        for node in nodes {
            let mut out = Vec::new();
            if let Some(peer) = self.peers.get_mut(&node) {
                peer.sync.resync(now, &mut out);
            }
            fetches.extend(self.effects(&node, out));
        }
        fetches
    }

    /// Forgets a peer and its blocks.
    pub fn forget(&mut self, node: &str) {
        if let Some(peer) = self.peers.remove(node) {
            if let Ok(n) = NodeId::new(peer.id) {
                self.writes.push(IndexWrite::Remove(Holder::Node(n)));
            }
            if let Ok(e) = EndpointId::new(peer.id) {
                self.index.set_endpoint_node(e, None);
            }
        }
    }

    /// The candidates [`Directory::best`] would ask the index about: peers that registered
    /// `layout` (or did not say which layouts they have) and are not passed over at `now`.
    pub fn candidates(&self, layout: u64, now: Millis) -> Candidates {
        let peers = self
            .peers
            .iter()
            .filter(|(_, p)| p.down_until <= now)
            .filter(|(_, p)| p.layouts.is_empty() || p.layouts.contains(&layout))
            .filter_map(|(n, p)| Some((EndpointId::new(p.id).ok()?, n.clone(), p.addr)))
            .collect();
        Candidates {
            index: Arc::clone(&self.index),
            peers,
        }
    }

    /// The peer holding the longest leading run of `keys` (under `layout`) in host memory or
    /// on disk (ties: the one with more of it in host memory), or `None` when no peer holds
    /// the first block. Reads the index under the directory's lock: [`Directory::candidates`]
    /// then [`Candidates::best`] does not.
    pub fn best(&self, keys: &[BlockKey], layout: u64, now: Millis) -> Option<Holding> {
        self.candidates(layout, now).best(keys)
    }

    fn effects(&mut self, node: &str, out: Vec<Effect>) -> Vec<Fetch> {
        let Some(holder) = self
            .peers
            .get(node)
            .and_then(|p| NodeId::new(p.id).ok())
            .map(Holder::Node)
        else {
            return Vec::new();
        };
        let mut fetches = Vec::new();
        for effect in out {
            match effect {
                Effect::Apply(events) => self.writes.push(IndexWrite::Apply(holder, events)),
                Effect::Replace(snapshot) => {
                    self.writes.push(IndexWrite::Replace(holder, snapshot))
                }
                Effect::Request { id } => fetches.push(Fetch {
                    node: node.to_owned(),
                    peer: holder_id(holder),
                    id,
                }),
                Effect::Gap | Effect::NewEpoch => self.stats.resyncs += 1,
                Effect::Failed(_) => self.stats.snapshot_failures += 1,
                Effect::LateReply => {}
            }
        }
        fetches
    }
}

fn holder_id(holder: Holder) -> u32 {
    match holder {
        Holder::Node(n) => n.get(),
        Holder::Endpoint(e) => e.get(),
    }
}

/// The peers a lookup may name, and the index to ask, taken under the directory's lock and
/// read after it is released.
#[derive(Debug)]
pub struct Candidates {
    index: Arc<KvIndex>,
    peers: Vec<(EndpointId, String, SocketAddr)>,
}

impl Candidates {
    /// See [`Directory::best`].
    pub fn best(&self, keys: &[BlockKey]) -> Option<Holding> {
        if keys.is_empty() || self.peers.is_empty() {
            return None;
        }
        let ids: Vec<EndpointId> = self.peers.iter().map(|(e, _, _)| *e).collect();
        let best = self
            .index
            .find_matches(keys, &ids)
            .into_iter()
            .filter(|o| o.reach(Tier::Disk) > 0)
            .max_by_key(|o| {
                (
                    o.reach(Tier::Disk),
                    o.reach(Tier::Host),
                    std::cmp::Reverse(o.endpoint.get()),
                )
            })?;
        let (_, node, addr) = self.peers.iter().find(|(e, _, _)| *e == best.endpoint)?;
        Some(Holding {
            node: node.clone(),
            addr: *addr,
            blocks: best.reach(Tier::Disk),
        })
    }
}

#[cfg(test)]
mod tests;
