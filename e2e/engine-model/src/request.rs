//! Requests: what the caller submits, the admission checks, and the engine's per-request state.

use crate::config::EngineConfig;
use crate::hash::BlockHashChain;
use crate::{BlockId, Nanos, RequestId};

/// A request submitted to the engine.
#[derive(Debug)]
pub struct NewRequest {
    /// Caller-chosen identity, unique among unfinished requests.
    pub id: RequestId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// The exact tokens to generate (the caller decides length and EOS); at least one.
    pub output: Vec<u32>,
    /// Hashes the request's full blocks; it carries the request's cache namespace.
    pub hasher: Box<dyn BlockHashChain>,
    /// When the request arrives: it is not scheduled before. Requests are served first come,
    /// first served in the order they are added, so add them in arrival order.
    pub arrival: Nanos,
    /// Prefill/decode disaggregation role, if any.
    pub kv_transfer: Option<KvTransfer>,
}

/// vLLM NIXL connector roles for prefill/decode disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvTransfer {
    /// `do_remote_decode: true`: run the prefill only, emit exactly one token, finish, and
    /// report the blocks a decode engine would pull.
    PrefillOnly,
    /// `do_remote_prefill: true`: the first `num_tokens` prompt tokens (at most prompt − 1,
    /// rounded down to whole blocks, less any local prefix-cache hit) are pulled from a remote
    /// engine: the request waits `bytes / kv_transfer_bandwidth` without holding up the batch,
    /// then those blocks count as computed (and are cached and reported like computed ones).
    RemotePrefill {
        /// Prompt tokens the remote engine computed.
        num_tokens: u32,
    },
}

/// Why a request was not admitted (nothing changed in the engine).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The prompt has no tokens.
    #[error("request {0}: empty prompt")]
    EmptyPrompt(RequestId),
    /// The output has no tokens.
    #[error("request {0}: empty output")]
    EmptyOutput(RequestId),
    /// Prompt plus output exceed `max_model_len`.
    #[error(
        "request {id}: {prompt} prompt + {output} output tokens exceed max_model_len {max_model_len}"
    )]
    TooLong {
        /// The request.
        id: RequestId,
        /// Prompt tokens.
        prompt: usize,
        /// Output tokens it would generate.
        output: usize,
        /// The limit.
        max_model_len: u32,
    },
    /// An unfinished request already has this id.
    #[error("request {0} already exists")]
    Duplicate(RequestId),
}

impl AdmitError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::EmptyPrompt(_) => "empty_prompt",
            Self::EmptyOutput(_) => "empty_output",
            Self::TooLong { .. } => "too_long",
            Self::Duplicate(_) => "duplicate",
        }
    }
}

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// In the waiting queue, holding no blocks (new or preempted) or holding blocks whose KV
    /// arrived from a remote engine.
    Waiting,
    /// In the waiting queue, holding blocks that a remote engine is filling (vLLM
    /// `WAITING_FOR_REMOTE_KVS`); at `ready_at` its first `target` tokens count as computed.
    Transferring { ready_at: Nanos, target: usize },
    /// In the running list.
    Running,
}

/// The engine's state for one unfinished request.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) id: RequestId,
    pub(crate) prompt_len: usize,
    /// Prompt followed by the tokens generated so far.
    pub(crate) tokens: Vec<u32>,
    output: Vec<u32>,
    /// Tokens it generates before finishing (1 for a prefill-only request).
    max_output: usize,
    hasher: Box<dyn BlockHashChain>,
    /// Hashes of its full blocks (empty when prefix caching is off).
    pub(crate) hashes: Vec<u64>,
    hash_blocks: bool,
    block_size: usize,
    /// Its block table.
    pub(crate) blocks: Vec<BlockId>,
    /// Leading blocks of `blocks` already cached under their hashes.
    pub(crate) num_cached_blocks: usize,
    /// Tokens whose KV is computed (or scheduled to be, within a step).
    pub(crate) num_computed: usize,
    /// Prompt tokens served from the cache when first scheduled (vLLM `num_cached_tokens`).
    pub(crate) num_cached_tokens: Option<u32>,
    pub(crate) num_preemptions: u32,
    pub(crate) phase: Phase,
    /// A remote prefill not yet started.
    pub(crate) remote_prefill: Option<u32>,
    pub(crate) prefill_only: bool,
    pub(crate) arrival: Nanos,
    /// When a step first scheduled it (vLLM's `scheduled_ts`, for queue time).
    pub(crate) first_scheduled: Option<Nanos>,
}

impl Request {
    /// Admission checks (all but the duplicate id) and the initial state: prompt blocks are
    /// hashed on arrival, as vLLM does.
    pub(crate) fn admit(new: NewRequest, config: &EngineConfig) -> Result<Self, AdmitError> {
        let id = new.id;
        if new.prompt.is_empty() {
            return Err(AdmitError::EmptyPrompt(id));
        }
        if new.output.is_empty() {
            return Err(AdmitError::EmptyOutput(id));
        }
        let prefill_only = new.kv_transfer == Some(KvTransfer::PrefillOnly);
        let max_output = if prefill_only { 1 } else { new.output.len() };
        if new.prompt.len() + max_output > config.max_model_len as usize {
            return Err(AdmitError::TooLong {
                id,
                prompt: new.prompt.len(),
                output: max_output,
                max_model_len: config.max_model_len,
            });
        }
        let remote_prefill = match new.kv_transfer {
            Some(KvTransfer::RemotePrefill { num_tokens }) => Some(num_tokens),
            _ => None,
        };
        let mut req = Self {
            id,
            prompt_len: new.prompt.len(),
            tokens: new.prompt,
            output: new.output,
            max_output,
            hasher: new.hasher,
            hashes: Vec::new(),
            hash_blocks: config.enable_prefix_caching,
            block_size: config.block_size as usize,
            blocks: Vec::new(),
            num_cached_blocks: 0,
            num_computed: 0,
            num_cached_tokens: None,
            num_preemptions: 0,
            phase: Phase::Waiting,
            remote_prefill,
            prefill_only,
            arrival: new.arrival,
            first_scheduled: None,
        };
        req.extend_hashes();
        Ok(req)
    }

    /// Prompt plus generated tokens.
    pub(crate) fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Tokens generated so far.
    pub(crate) fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Whether it has generated all it will.
    pub(crate) fn is_done(&self) -> bool {
        self.num_generated() >= self.max_output
    }

    /// Generates the next output token: appends it and hashes a block it completes.
    pub(crate) fn append_next_token(&mut self) -> Option<u32> {
        let token = self.output.get(self.num_generated()).copied()?;
        self.tokens.push(token);
        self.extend_hashes();
        Some(token)
    }

    /// Hashes every full block not hashed yet.
    fn extend_hashes(&mut self) {
        if !self.hash_blocks || self.block_size == 0 {
            return;
        }
        let full = self.tokens.len() / self.block_size;
        while self.hashes.len() < full {
            let start = self.hashes.len() * self.block_size;
            let Some(block) = self.tokens.get(start..start + self.block_size) else {
                return;
            };
            self.hashes.push(self.hasher.next_block(block));
        }
    }
}
