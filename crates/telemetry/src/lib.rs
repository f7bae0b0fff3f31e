//! Metrics plumbing shared by kvgate's components. Pure: no I/O, no async runtime.
//!
//! - [`Histogram`]: fixed buckets, lock-free `observe` (atomic counters), safe to share across
//!   request tasks.
//! - [`Exposition`]: writes the Prometheus text format (HELP/TYPE once per family, escaped
//!   label values, cumulative buckets).
//! - [`LabelCap`]: bounds the label values a component emits (model names come from requests),
//!   folding everything past the cap into one `other` value so a client cannot grow the
//!   series count.
//!
//! Components keep their counters where the work happens (plain atomics) and render them on
//! scrape; nothing here is a global registry.

mod exposition;
mod histogram;
mod labels;

pub use exposition::{Exposition, Kind, escape_label_value};
pub use histogram::{Histogram, HistogramSnapshot, buckets};
pub use labels::{LabelCap, OVERFLOW_LABEL};
