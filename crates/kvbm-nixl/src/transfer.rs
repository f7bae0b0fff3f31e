//! One agent: exposing host buffers to peers and reading theirs, through a pool of buffers
//! registered once each.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, MemType, NixlError, RegistrationHandle, ThreadSync, XferDescList, XferOp,
    XferRequest, XferStatus,
};

use crate::BACKEND;
use crate::buffer::HostBuffer;
use crate::load::{self, LoadError};

/// How long a buffer whose transfer failed (or an exposure nobody confirmed) is kept out of the
/// pool, on the assumption that UCX has stopped by then (a failed status does not say so), and
/// how long a read past its deadline is still waited for before its buffer is leaked.
const QUARANTINE: Duration = Duration::from_secs(30);

/// Microseconds the agent's progress thread sleeps between rounds.
const PROGRESS_DELAY_US: u64 = 200;

/// Remote agents kept loaded at most (one per peer node; the oldest is dropped beyond this).
const MAX_REMOTES: usize = 1024;

/// What a puller needs to READ an exposed buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// The holder agent's metadata (`getLocalMD`): its name, backend connection info and the
    /// keys of its registered memory.
    pub metadata: Vec<u8>,
    /// The exposed bytes' address in the holder's process.
    pub addr: u64,
    /// Their length.
    pub len: u64,
}

/// The buffers transfers use: at most `buffers` of `buffer_bytes` each, registered with the
/// agent when first needed and reused (registering memory costs: under RDMA it pins pages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Buffers, each serving one exposure or one read at a time.
    pub buffers: usize,
    /// Bytes of each: the largest exposure or read.
    pub buffer_bytes: usize,
}

/// Why an exposure or a read failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// More bytes than a pool buffer holds (or than this process can address).
    #[error("{0} bytes exceed a NIXL buffer")]
    TooLarge(u64),
    /// No bytes.
    #[error("an empty offer")]
    Empty,
    /// Every pool buffer is in use.
    #[error("all {0} NIXL buffers are in use")]
    Busy(usize),
    /// The offer's metadata names an agent that is not the serving node's.
    #[error("the offer's NIXL agent {agent:?} is not node {node:?}'s")]
    Impostor {
        /// The node that answered the pull.
        node: String,
        /// The agent its metadata named.
        agent: String,
    },
    /// A NIXL call failed.
    #[error("NIXL {step}: {source}")]
    Nixl {
        /// The call.
        step: &'static str,
        /// NIXL's error.
        #[source]
        source: NixlError,
    },
    /// The transfer had not finished by the deadline (its buffer is kept out of the pool until
    /// NIXL is done with it).
    #[error("the NIXL read had not finished by its deadline")]
    Timeout,
}

fn nixl(step: &'static str) -> impl FnOnce(NixlError) -> ReadError {
    move |source| ReadError::Nixl { step, source }
}

/// A registered pool buffer, with the agent's metadata as of its registration (which lists it).
#[derive(Debug)]
struct Slot {
    // Declared before `buffer`: fields drop in order, so the memory is deregistered before it
    // is freed.
    _registration: RegistrationHandle,
    buffer: HostBuffer,
    metadata: Arc<Vec<u8>>,
}

#[derive(Debug)]
struct Pool {
    free: Vec<Slot>,
    /// Buffers registered or being registered (free, in use, quarantined).
    made: usize,
    /// Buffers given up on: a transfer still ran after its quarantine.
    leaked: usize,
}

type Shared = Arc<Mutex<Pool>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A NIXL agent with the UCX backend.
pub struct Nixl {
    agent: Arc<Agent>,
    name: String,
    config: PoolConfig,
    pool: Shared,
    /// Loaded peer agents.
    remotes: Mutex<Remotes>,
}

/// The peer agents loaded: each node's current one, least recently used first, and agents
/// retired (a node's previous incarnation, or evicted) but not yet dropped from NIXL, since a
/// read of this process may still run against them until its quarantine ends.
#[derive(Debug, Default)]
struct Remotes {
    current: Vec<(String, String)>,
    retired: Vec<(Instant, String)>,
}

impl Remotes {
    /// `agent` is `node`'s and was just used: it moves to the back; the node's previous agent
    /// and the least recently used beyond [`MAX_REMOTES`] are retired. Returns the retired
    /// agents old enough to drop from NIXL now.
    fn used(&mut self, node: &str, agent: &str, now: Instant) -> Vec<String> {
        let mut retire = Vec::new();
        self.current.retain(|(n, a)| {
            let keep = n != node && a != agent;
            if n == node && a != agent {
                retire.push(a.clone());
            }
            keep
        });
        self.current.push((node.to_owned(), agent.to_owned()));
        while self.current.len() > MAX_REMOTES {
            retire.push(self.current.remove(0).1);
        }
        // An agent used again is no longer retired.
        self.retired.retain(|(_, a)| a != agent);
        self.retired.extend(retire.into_iter().map(|a| (now, a)));
        let mut drop_now = Vec::new();
        self.retired.retain(|(at, a)| {
            let old = now.saturating_duration_since(*at) > RETIRE_AFTER;
            if old {
                drop_now.push(a.clone());
            }
            !old
        });
        drop_now
    }
}

/// How long a retired agent stays loaded: longer than any read of this process can run
/// against it (its pull's deadline, then its quarantine).
const RETIRE_AFTER: Duration = Duration::from_secs(120);

/// The agent name at the head of NIXL metadata (`nixlSerDes|`, the tag `Agent`, a native
/// `size_t` length, the name, `|`), read without handing the metadata to NIXL.
pub fn metadata_agent(metadata: &[u8]) -> Option<&str> {
    const LEN: usize = std::mem::size_of::<usize>();
    let rest = metadata.strip_prefix(b"nixlSerDes|Agent")?;
    let (len, rest) = rest.split_first_chunk::<LEN>()?;
    let len = usize::from_ne_bytes(*len);
    if len == 0 || len > 512 {
        return None;
    }
    let name = rest.get(..len)?;
    if rest.get(len) != Some(&b'|') {
        return None;
    }
    std::str::from_utf8(name).ok()
}

impl std::fmt::Debug for Nixl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nixl").field("name", &self.name).finish()
    }
}

/// Bytes exposed for peers to read. Dropping it returns the buffer to the pool at once: drop it
/// only when the reader is done, or call [`Exposed::quarantine`].
#[derive(Debug)]
pub struct Exposed {
    offer: Offer,
    slot: Option<Slot>,
    pool: Shared,
}

impl Exposed {
    /// What to send the puller.
    pub fn offer(&self) -> &Offer {
        &self.offer
    }

    /// The reader may still be reading: keep the buffer out of the pool for a while first
    /// (on a thread of its own).
    pub fn quarantine(mut self) {
        if let Some(slot) = self.slot.take() {
            Late::hold(None, slot, Arc::clone(&self.pool));
        }
    }
}

impl Drop for Exposed {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            lock(&self.pool).free.push(slot);
        }
    }
}

/// The agent name of `node`'s daemon in its run `epoch`: `kvbm-<node>-<16 hex digits>` (a
/// reader checks an offer's agent against it before loading it; a restart names a new agent).
pub fn agent_name(node: &str, epoch: u64) -> String {
    format!("kvbm-{node}-{epoch:016x}")
}

/// Whether `agent` is an agent name of `node`'s daemon ([`agent_name`]).
fn agent_name_of(node: &str, agent: &str) -> bool {
    agent
        .strip_prefix("kvbm-")
        .and_then(|rest| rest.strip_prefix(node))
        .and_then(|rest| rest.strip_prefix('-'))
        .is_some_and(|epoch| epoch.len() == 16 && epoch.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl Nixl {
    /// An agent named `name` (`kvbm-<node>-<16 hex digits>`: peers check it), with the UCX
    /// backend and a pool as `pool` says; or why NIXL cannot be used here. NIXL's C API is
    /// opened from `library`, or else found through the library search path (see
    /// [`load::library`]). NIXL finds its plugins in `plugins/` beside `libnixl.so`, or in
    /// `NIXL_PLUGIN_DIR`.
    pub fn load(name: &str, library: Option<&Path>, pool: PoolConfig) -> Result<Self, LoadError> {
        load::library(library)?;
        let config = AgentConfig {
            // NIXL's own locking mode; nixl-sys serialises most calls behind its own lock.
            thread_sync: ThreadSync::Rw,
            // Metadata travels on the authenticated pull connection only.
            enable_listen_thread: false,
            // The progress thread (which serves the holder's side of a READ on transports
            // that need it, such as UCX's TCP) sleeps this long between rounds; NIXL's default
            // of 0 keeps a core busy forever.
            pthr_delay_us: PROGRESS_DELAY_US,
            ..AgentConfig::default()
        };
        let agent_error = |step| move |source| LoadError::Agent { step, source };
        let agent = Agent::new_configured(name, &config).map_err(agent_error("agent"))?;
        let (_, params) = agent.get_plugin_params(BACKEND).map_err(agent_error(
            "UCX plugin parameters (is NIXL_PLUGIN_DIR right?)",
        ))?;
        agent
            .create_backend(BACKEND, &params)
            .map_err(agent_error("UCX backend"))?;
        tracing::info!(
            agent = name,
            backend = BACKEND,
            buffers = pool.buffers,
            buffer_bytes = pool.buffer_bytes,
            "NIXL agent ready"
        );
        Ok(Self {
            agent: Arc::new(agent),
            name: name.to_owned(),
            config: pool,
            pool: Arc::new(Mutex::new(Pool {
                free: Vec::new(),
                made: 0,
                leaked: 0,
            })),
            remotes: Mutex::new(Remotes::default()),
        })
    }

    /// This agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Pool buffers given up on so far (a transfer still ran after its quarantine).
    pub fn leaked_buffers(&self) -> usize {
        lock(&self.pool).leaked
    }

    /// A free pool buffer, or a new one (registered outside the pool's lock) while fewer than
    /// the pool's size exist.
    fn take(&self) -> Result<Slot, ReadError> {
        {
            let mut pool = lock(&self.pool);
            if let Some(slot) = pool.free.pop() {
                return Ok(slot);
            }
            if pool.made >= self.config.buffers {
                return Err(ReadError::Busy(self.config.buffers));
            }
            pool.made += 1;
        }
        let bytes = self.config.buffer_bytes;
        let made = (|| {
            let buffer = HostBuffer::new(vec![0; bytes]);
            let registration = self
                .agent
                .register_memory(&buffer, None)
                .map_err(nixl("register"))?;
            let metadata = self.agent.get_local_md().map_err(nixl("local metadata"))?;
            Ok(Slot {
                _registration: registration,
                buffer,
                metadata: Arc::new(metadata),
            })
        })();
        if made.is_err() {
            lock(&self.pool).made -= 1;
        }
        made
    }

    fn give_back(&self, slot: Slot) {
        lock(&self.pool).free.push(slot);
    }

    fn check_len(&self, len: u64) -> Result<usize, ReadError> {
        let max = self.config.buffer_bytes;
        match usize::try_from(len) {
            Ok(0) => Err(ReadError::Empty),
            Ok(n) if n <= max => Ok(n),
            _ => Err(ReadError::TooLarge(len)),
        }
    }

    /// Exposes `len` bytes, written by `fill`, in a pool buffer. Every registered buffer is
    /// readable by whoever holds this agent's metadata for as long as the agent lives; the
    /// exposure only decides when the buffer is reused.
    pub fn expose(&self, len: u64, fill: impl FnOnce(&mut [u8])) -> Result<Exposed, ReadError> {
        let len = self.check_len(len)?;
        let mut slot = self.take()?;
        let Some(bytes) = slot.buffer.bytes_mut().get_mut(..len) else {
            self.give_back(slot);
            return Err(ReadError::TooLarge(len as u64));
        };
        fill(bytes);
        let offer = Offer {
            metadata: slot.metadata.as_ref().clone(),
            addr: slot.buffer.addr() as u64,
            len: len as u64,
        };
        Ok(Exposed {
            offer,
            slot: Some(slot),
            pool: Arc::clone(&self.pool),
        })
    }

    /// Loads `node`'s agent from `metadata`, refusing (before NIXL sees it) metadata that does
    /// not name that node's agent, and retires the agent the node had before (a restart) and
    /// the least recently used beyond [`MAX_REMOTES`].
    fn remote(&self, node: &str, metadata: &[u8]) -> Result<String, ReadError> {
        let named = metadata_agent(metadata).unwrap_or_default();
        if !agent_name_of(node, named) {
            return Err(ReadError::Impostor {
                node: node.to_owned(),
                agent: named.to_owned(),
            });
        }
        let agent = self
            .agent
            .load_remote_md(metadata)
            .map_err(nixl("load remote metadata"))?;
        if agent != named {
            return Err(ReadError::Impostor {
                node: node.to_owned(),
                agent,
            });
        }
        let stale = lock(&self.remotes).used(node, &agent, Instant::now());
        for old in stale {
            tracing::debug!(agent = %old, "NIXL agent of a restarted or forgotten peer dropped");
            let _ = self.agent.invalidate_remote_md(&old);
        }
        Ok(agent)
    }

    /// Reads what `offer` from the daemon of `node` exposes, by `deadline`, and hands the bytes
    /// to `take` (before the buffer returns to the pool). Blocks; call it where blocking is
    /// allowed.
    pub fn read<R>(
        &self,
        node: &str,
        offer: &Offer,
        deadline: Instant,
        take: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, ReadError> {
        let len = self.check_len(offer.len)?;
        let addr = usize::try_from(offer.addr).map_err(|_| ReadError::TooLarge(offer.addr))?;
        let remote = self.remote(node, &offer.metadata)?;
        let slot = self.take()?;
        // Until the request is posted nothing can write into the buffer: failures give it back.
        let request = (|| {
            let mut local = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
            local.add_desc(slot.buffer.addr(), len, 0);
            let mut theirs = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
            theirs.add_desc(addr, len, 0);
            self.agent
                .create_xfer_req(XferOp::Read, &local, &theirs, &remote, None)
                .map_err(nixl("create transfer"))
        })();
        let request = match request {
            Ok(_) if Instant::now() >= deadline => {
                self.give_back(slot);
                return Err(ReadError::Timeout);
            }
            Ok(r) => r,
            Err(e) => {
                self.give_back(slot);
                return Err(e);
            }
        };
        let done = self
            .agent
            .post_xfer_req(&request, None)
            .and_then(|in_progress| {
                if in_progress {
                    wait(&self.agent, &request, deadline, Poll::Eager)
                } else {
                    Ok(true)
                }
            });
        match done {
            Ok(true) => {
                drop(request);
                let out = slot.buffer.bytes().get(..len).map(take);
                self.give_back(slot);
                out.ok_or(ReadError::TooLarge(len as u64))
            }
            Ok(false) => {
                Late::drain(
                    Arc::clone(&self.agent),
                    request,
                    slot,
                    Arc::clone(&self.pool),
                );
                Err(ReadError::Timeout)
            }
            Err(e) => {
                // A failed status does not prove UCX stopped writing: quarantined.
                Late::hold(Some(request), slot, Arc::clone(&self.pool));
                Err(nixl("transfer")(e))
            }
        }
    }
}

/// How [`wait`] polls.
#[derive(Debug, Clone, Copy)]
enum Poll {
    /// A caller waits: yield, then every 50 µs.
    Eager,
    /// Nobody waits: every millisecond.
    Lazy,
}

/// Polls `request` until it completes (`true`), fails, or `until` passes (`false`).
fn wait(
    agent: &Agent,
    request: &XferRequest,
    until: Instant,
    poll: Poll,
) -> Result<bool, NixlError> {
    let mut polls = 0u32;
    loop {
        if matches!(agent.get_xfer_status(request)?, XferStatus::Success) {
            return Ok(true);
        }
        if Instant::now() >= until {
            return Ok(false);
        }
        polls = polls.saturating_add(1);
        match poll {
            Poll::Eager if polls < 64 => std::thread::yield_now(),
            Poll::Eager => std::thread::sleep(Duration::from_micros(50)),
            Poll::Lazy => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// A buffer NIXL may still write into (or a peer still read), with its request if any. Unless
/// `ended` is set, dropping it leaks the buffer instead of reusing it.
struct Late {
    request: Option<XferRequest>,
    slot: Option<Slot>,
    pool: Shared,
    ended: bool,
}

impl Late {
    /// Waits, on a thread of its own, for `request` to end, at most [`QUARANTINE`]; then the
    /// buffer returns to the pool, or is leaked if the transfer still runs.
    fn drain(agent: Arc<Agent>, request: XferRequest, slot: Slot, pool: Shared) {
        let late = Late::new(Some(request), slot, pool);
        late.spawn(move |late| {
            if let Some(request) = &late.request {
                match wait(&agent, request, Instant::now() + QUARANTINE, Poll::Lazy) {
                    Ok(true) => late.ended = true,
                    Ok(false) => {}
                    // Failed: as for [`Late::hold`], wait out the quarantine.
                    Err(_) => {
                        std::thread::sleep(QUARANTINE);
                        late.ended = true;
                    }
                }
            }
        });
    }

    /// Keeps the buffer out of the pool for [`QUARANTINE`], then returns it.
    fn hold(request: Option<XferRequest>, slot: Slot, pool: Shared) {
        let late = Late::new(request, slot, pool);
        late.spawn(|late| {
            std::thread::sleep(QUARANTINE);
            late.ended = true;
        });
    }

    fn new(request: Option<XferRequest>, slot: Slot, pool: Shared) -> Self {
        Late {
            request,
            slot: Some(slot),
            pool,
            ended: false,
        }
    }

    fn spawn(self, work: impl FnOnce(&mut Late) + Send + 'static) {
        let mut late = self;
        let spawned = std::thread::Builder::new()
            .name("nixl-quarantine".into())
            .spawn(move || work(&mut late));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "no thread to quarantine a NIXL buffer");
        }
    }
}

impl Drop for Late {
    fn drop(&mut self) {
        if self.ended {
            drop(self.request.take());
            if let Some(slot) = self.slot.take() {
                lock(&self.pool).free.push(slot);
            }
        } else {
            tracing::error!(
                "a NIXL transfer may still be running; its buffer is leaked and the pool is one buffer smaller"
            );
            lock(&self.pool).leaked += 1;
            std::mem::forget(self.request.take());
            std::mem::forget(self.slot.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_name_is_read_from_the_head_of_the_metadata() {
        let md = |name: &[u8], len: usize, end: u8| {
            let mut v = b"nixlSerDes|Agent".to_vec();
            v.extend_from_slice(&len.to_ne_bytes());
            v.extend_from_slice(name);
            v.push(end);
            v.extend_from_slice(b"Conns...");
            v
        };
        let good = md(b"kvbm-a-0000000000000001", 23, b'|');
        assert_eq!(metadata_agent(&good), Some("kvbm-a-0000000000000001"));
        assert_eq!(metadata_agent(&md(b"holder", 6, b'|')), Some("holder"));
        for bad in [
            md(b"holder", 7, b'|'),
            md(b"holder", 6, b'x'),
            md(b"holder", 0, b'|'),
            md(b"\xff\xfe", 2, b'|'),
            md(b"holder", usize::MAX, b'|'),
            b"nixlSerDes|Conns".to_vec(),
            b"nixlSerDes|Agent\x06".to_vec(),
            Vec::new(),
        ] {
            assert_eq!(metadata_agent(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn remotes_keep_one_agent_per_node_and_retire_the_rest_late() {
        let t0 = Instant::now();
        let mut r = Remotes::default();
        assert!(r.used("a", "kvbm-a-1", t0).is_empty());
        assert!(r.used("b", "kvbm-b-1", t0).is_empty());
        // a restarts: its old agent is retired, not dropped while a read may run against it.
        assert!(r.used("a", "kvbm-a-2", t0).is_empty());
        assert_eq!(r.current.len(), 2);
        assert_eq!(r.retired.len(), 1);
        // Used again, b moves to the back (least recently used first).
        assert!(r.used("b", "kvbm-b-1", t0).is_empty());
        assert_eq!(r.current.last().unwrap().1, "kvbm-b-1");
        // Long after, the next use drops the retired agent.
        let later = t0 + RETIRE_AFTER + Duration::from_secs(1);
        assert_eq!(r.used("b", "kvbm-b-1", later), vec!["kvbm-a-1".to_owned()]);
        assert!(r.retired.is_empty());
        // Beyond the bound, the least recently used is retired; one used again is un-retired.
        for i in 0..MAX_REMOTES {
            r.used(&format!("n{i}"), &format!("kvbm-n{i}-1"), later);
        }
        assert_eq!(r.current.len(), MAX_REMOTES);
        assert!(r.retired.iter().any(|(_, a)| a == "kvbm-a-2"));
        r.used("a", "kvbm-a-2", later);
        assert!(!r.retired.iter().any(|(_, a)| a == "kvbm-a-2"));
    }

    #[test]
    fn agent_names_belong_to_their_node() {
        assert!(agent_name_of("gpu-1", "kvbm-gpu-1-00ff00ff00ff00ff"));
        for epoch in [0, 1, u64::MAX] {
            assert!(agent_name_of("gpu-1", &agent_name("gpu-1", epoch)));
        }
        for (node, agent) in [
            ("gpu-1", "kvbm-gpu-2-00ff00ff00ff00ff"),
            ("gpu-1", "kvbm-gpu-1-00ff00ff00ff00f"),
            ("gpu-1", "kvbm-gpu-1-00ff00ff00ff00fg"),
            ("gpu-1", "kvbm-gpu-1x00ff00ff00ff00ff"),
            ("gpu", "kvbm-gpu-1-00ff00ff00ff00ff"),
            ("gpu-1", "gpu-1-00ff00ff00ff00ff"),
        ] {
            assert!(!agent_name_of(node, agent), "{agent} is not {node}'s");
        }
    }
}
