//! One agent: exposing host buffers to peers and reading theirs, through a pool of buffers
//! registered once each.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, MemType, NixlError, RegistrationHandle, ThreadSync, XferDescList, XferOp,
    XferRequest, XferStatus,
};

use crate::BACKEND;
use crate::buffer::HostBuffer;
use crate::load::{self, LoadError};

/// How long a transfer that outlived its caller's deadline is still waited for before its
/// buffer is leaked (NIXL may still write into it; reusing or freeing it would be unsound).
const DRAIN_GRACE: Duration = Duration::from_secs(30);

/// Microseconds the agent's progress thread sleeps between rounds.
const PROGRESS_DELAY_US: u64 = 200;

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

/// A registered pool buffer.
#[derive(Debug)]
struct Slot {
    // Declared before `buffer`: fields drop in order, so the memory is deregistered before it
    // is freed.
    _registration: RegistrationHandle,
    buffer: HostBuffer,
}

#[derive(Debug)]
struct Pool {
    config: PoolConfig,
    free: Vec<Slot>,
    /// Slots registered so far (free, in use, or draining).
    made: usize,
    /// The agent's metadata as of the last registration (it lists every registered slot).
    metadata: Arc<Vec<u8>>,
}

/// A NIXL agent with the UCX backend.
pub struct Nixl {
    agent: Arc<Agent>,
    name: String,
    pool: Arc<Mutex<Pool>>,
}

impl std::fmt::Debug for Nixl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nixl").field("name", &self.name).finish()
    }
}

/// Bytes exposed for peers to read; the buffer goes back to the pool when this is dropped.
#[derive(Debug)]
pub struct Exposed {
    offer: Offer,
    slot: Option<Slot>,
    pool: Arc<Mutex<Pool>>,
}

impl Exposed {
    /// What to send the puller.
    pub fn offer(&self) -> &Offer {
        &self.offer
    }
}

impl Drop for Exposed {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            lock(&self.pool).free.push(slot);
        }
    }
}

fn lock(pool: &Mutex<Pool>) -> std::sync::MutexGuard<'_, Pool> {
    pool.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Nixl {
    /// An agent named `name` (unique in the mesh: peers key their loaded metadata by it), with
    /// the UCX backend and a pool as `pool` says; or why NIXL cannot be used here. NIXL's C API
    /// is opened from `library`, or else found through the library search path (see
    /// [`load::library`]). NIXL finds its plugins in `plugins/` beside `libnixl.so`, or in
    /// `NIXL_PLUGIN_DIR`.
    pub fn load(name: &str, library: Option<&Path>, pool: PoolConfig) -> Result<Self, LoadError> {
        load::library(library)?;
        let config = AgentConfig {
            // Transfers from many connections at once; registrations exclusive.
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
            pool: Arc::new(Mutex::new(Pool {
                config: pool,
                free: Vec::new(),
                made: 0,
                metadata: Arc::new(Vec::new()),
            })),
        })
    }

    /// This agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A free pool buffer (registering a new one while fewer than the pool's size exist),
    /// and the agent's metadata that lists it.
    fn take(&self) -> Result<(Slot, Arc<Vec<u8>>), ReadError> {
        let mut pool = lock(&self.pool);
        if let Some(slot) = pool.free.pop() {
            return Ok((slot, Arc::clone(&pool.metadata)));
        }
        if pool.made >= pool.config.buffers {
            return Err(ReadError::Busy(pool.config.buffers));
        }
        // Registered under the lock: the metadata read after it lists every slot made so far.
        let buffer = HostBuffer::new(vec![0; pool.config.buffer_bytes]);
        let registration = self
            .agent
            .register_memory(&buffer, None)
            .map_err(nixl("register"))?;
        let metadata = self.agent.get_local_md().map_err(nixl("local metadata"))?;
        pool.metadata = Arc::new(metadata);
        pool.made += 1;
        let slot = Slot {
            _registration: registration,
            buffer,
        };
        Ok((slot, Arc::clone(&pool.metadata)))
    }

    fn check_len(&self, len: u64) -> Result<usize, ReadError> {
        let max = lock(&self.pool).config.buffer_bytes;
        match usize::try_from(len) {
            Ok(0) => Err(ReadError::Empty),
            Ok(n) if n <= max => Ok(n),
            _ => Err(ReadError::TooLarge(len)),
        }
    }

    /// Exposes `len` bytes, written by `fill`, for peers to read until the returned value is
    /// dropped.
    pub fn expose(&self, len: u64, fill: impl FnOnce(&mut [u8])) -> Result<Exposed, ReadError> {
        let len = self.check_len(len)?;
        let (mut slot, metadata) = self.take()?;
        let bytes = slot
            .buffer
            .bytes_mut()
            .get_mut(..len)
            .ok_or(ReadError::TooLarge(len as u64))?;
        fill(bytes);
        let offer = Offer {
            metadata: metadata.as_ref().clone(),
            addr: slot.buffer.addr() as u64,
            len: len as u64,
        };
        Ok(Exposed {
            offer,
            slot: Some(slot),
            pool: Arc::clone(&self.pool),
        })
    }

    /// Reads what `offer` exposes, by `deadline`, and hands the bytes to `take` (before the
    /// buffer returns to the pool). Blocks; call it where blocking is allowed.
    pub fn read<R>(
        &self,
        offer: &Offer,
        deadline: Instant,
        take: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, ReadError> {
        let len = self.check_len(offer.len)?;
        let addr = usize::try_from(offer.addr).map_err(|_| ReadError::TooLarge(offer.addr))?;
        let remote = self
            .agent
            .load_remote_md(&offer.metadata)
            .map_err(nixl("load remote metadata"))?;
        let (slot, _) = self.take()?;
        let mut local = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
        local.add_desc(slot.buffer.addr(), len, 0);
        let mut theirs = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
        theirs.add_desc(addr, len, 0);
        let request = match self
            .agent
            .create_xfer_req(XferOp::Read, &local, &theirs, &remote, None)
        {
            Ok(r) => r,
            Err(e) => {
                lock(&self.pool).free.push(slot);
                return Err(nixl("create transfer")(e));
            }
        };
        let done = self
            .agent
            .post_xfer_req(&request, None)
            .and_then(|in_progress| {
                if in_progress {
                    wait(&self.agent, &request, deadline)
                } else {
                    Ok(true)
                }
            });
        match done {
            Ok(true) => {
                drop(request);
                let out = slot.buffer.bytes().get(..len).map(take);
                lock(&self.pool).free.push(slot);
                out.ok_or(ReadError::TooLarge(len as u64))
            }
            Ok(false) => {
                drain(
                    Arc::clone(&self.agent),
                    request,
                    slot,
                    Arc::clone(&self.pool),
                );
                Err(ReadError::Timeout)
            }
            Err(e) => {
                // Failed: NIXL no longer writes into the buffer.
                drop(request);
                lock(&self.pool).free.push(slot);
                Err(nixl("transfer")(e))
            }
        }
    }
}

/// Polls `request` until it completes (`true`), fails, or `until` passes (`false`).
fn wait(agent: &Agent, request: &XferRequest, until: Instant) -> Result<bool, NixlError> {
    let mut polls = 0u32;
    loop {
        if matches!(agent.get_xfer_status(request)?, XferStatus::Success) {
            return Ok(true);
        }
        if Instant::now() >= until {
            return Ok(false);
        }
        polls = polls.saturating_add(1);
        if polls < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// A transfer that outlived its caller's deadline, with the pool buffer NIXL may still write
/// into. Unless `ended` is set, dropping it leaks the buffer instead of reusing it.
struct Late {
    request: Option<XferRequest>,
    slot: Option<Slot>,
    pool: Arc<Mutex<Pool>>,
    ended: bool,
}

impl Late {
    /// NIXL is done with the buffer: it may be reused.
    fn end(&mut self) {
        self.ended = true;
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
            tracing::error!("a NIXL read may still be running; its buffer is leaked");
            std::mem::forget(self.request.take());
            std::mem::forget(self.slot.take());
        }
    }
}

/// Keeps a late transfer's buffer out of the pool until NIXL is done with it, on a thread of
/// its own (at most [`DRAIN_GRACE`]; after that, or without a thread, the buffer is leaked and
/// the pool is one buffer smaller).
fn drain(agent: Arc<Agent>, request: XferRequest, slot: Slot, pool: Arc<Mutex<Pool>>) {
    let mut late = Late {
        request: Some(request),
        slot: Some(slot),
        pool,
        ended: false,
    };
    let spawned = std::thread::Builder::new()
        .name("nixl-drain".into())
        .spawn(move || {
            let until = Instant::now() + DRAIN_GRACE;
            if let Some(request) = &late.request
                // Finished, or failed: either way NIXL no longer writes into the buffer.
                && !matches!(wait(&agent, request, until), Ok(false))
            {
                late.end();
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "no thread to drain a late NIXL read");
    }
}
