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
//! The live load generator (`kvgate-bench`) sends the prompts to a real OpenAI endpoint and
//! appends the answers the engine returns; the discrete-event replay appends
//! [`synth_answer`]. Both record one [`RequestRecord`] per request.
//!
//! Pure: no I/O apart from the trace reader's `BufRead`, no clock, no threads.

mod content;
mod record;
mod session;

pub use content::{Span, Vocab, synth_answer};
pub use record::{RequestRecord, Status};
pub use session::{Pacing, Session, Turn, Workload};
