//! kvgate's benchmark workloads, as data.
//!
//! A [`Workload`] is a list of [`Session`]s (a conversation; a single request is a session of
//! one turn) and a [`Pacing`]: open loop (each session starts at its own arrival time) or closed
//! loop (a fixed number of sessions in flight, the next one starting when one ends). Each
//! [`Turn`] adds the user's tokens to the conversation and asks for a number of output tokens;
//! the prompt of turn *k* is the whole history: every earlier turn's user tokens and answer,
//! then turn *k*'s user tokens ([`Session::prompt`]).
//!
//! Token content is not stored. It is a list of [`Span`]s, each a seed and a length, expanded
//! on demand by [`Vocab::tokens`]: equal seeds give equal tokens, hence equal KV blocks at any
//! block size. A one-hour production trace with 12,000-token prompts stays a few megabytes.
//!
//! The generators: [`read_mooncake`] (the Mooncake conversation trace), [`doks`] (seed 001's
//! multi-turn demo), [`shared_prefix`] (llm-d's groups of users behind shared system
//! prompts) and [`day`] (a day-shaped load from a trace's arrival pattern), all seeded and
//! deterministic.
//!
//! The live load generator (`kvgate-bench`) sends the prompts to a real OpenAI endpoint and
//! appends the answers the engine returns; the discrete-event replay appends
//! [`synth_answer`]. Both record one [`RequestRecord`] per request; [`summarize`] turns a run's
//! records into its figures and [`render_table`] sets several runs side by side.
//!
//! Pure: no I/O apart from the trace reader's `BufRead`, no clock, no threads.

mod content;
mod day;
mod doks;
mod mooncake;
pub mod percentile;
mod record;
mod rng;
mod session;
mod shared_prefix;
mod summary;
mod table;

pub use content::{Span, Vocab, synth_answer};
pub use day::{Burst, DayError, DayOptions, day};
pub use doks::{DoksOptions, Tokens, doks};
pub use mooncake::{
    BLOCK_TOKENS, MAX_LINE_BYTES, MooncakeError, MooncakeOptions, block_seed, read_mooncake,
};
pub use percentile::{Sorted, Stats};
pub use record::{RequestRecord, Status};
pub use session::{Pacing, Session, Turn, Workload};
pub use shared_prefix::{MAX_REQUESTS, SharedPrefixError, SharedPrefixOptions, shared_prefix};
pub use summary::{Slo, Summary, Window, summarize, summarize_runs};
pub use table::render_table;
