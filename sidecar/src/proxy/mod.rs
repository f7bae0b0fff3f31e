//! The P/D proxy on :8000 in front of the engine on :8200.
//!
//! Without `x-prefiller-host-port` a request passes straight through: headers minus hop-by-hop
//! ones, the body streamed up and the answer (SSE included) streamed back frame by frame. With
//! it, and only on `/v1/completions` and `/v1/chat/completions`, the proxy runs the P/D flow of
//! the configured [`connector`]:
//!
//! - `nixlv2` (default): vLLM's NIXL connector flow as llm-d's routing sidecar does it: a
//!   one-token, non-streaming prefill on the named prefiller (retried, see [`retry`]), then the
//!   client's own request on the local engine carrying the `kv_transfer_params` the prefiller
//!   returned;
//! - `sglang`: SGLang's bootstrap flow ([`sglang`]): the client's request with
//!   `bootstrap_host`/`bootstrap_port`/`bootstrap_room` ([`bootstrap`]) sent to the prefiller and
//!   the local engine at once.
//!
//! Prefillers outside the allow-list are never contacted ([`ssrf`]).
//!
//! A streamed answer whose engine fails mid-way is finished by one of the EPP's fallback
//! endpoints and spliced into the same response ([`migrate`], [`migration`]).
//!
//! Pure parts: [`rewrite`], [`bootstrap`], [`dual`], [`headers`], [`allowlist`], [`retry`],
//! [`migrate`]; I/O: [`handler`], [`prefill`], [`sglang`], [`migration`], [`server`],
//! [`ssrf::watch`].

pub mod allowlist;
mod args;
pub mod body;
pub mod bootstrap;
pub mod connector;
pub mod dual;
pub mod error;
pub mod handler;
pub mod headers;
pub mod metrics;
pub mod migrate;
pub mod migration;
pub mod prefill;
pub mod retry;
pub mod rewrite;
pub mod server;
pub mod sglang;
pub mod ssrf;
pub mod upstream;

pub use args::{DEFAULT_MAX_BODY, ProxyArgs, engine_authority, rank_authorities};
pub use connector::Connector;
pub use error::ProxyError;
pub use handler::ProxyState;
pub use metrics::{Mode, ProxyMetrics};
pub use server::{BoundProxy, bind};
