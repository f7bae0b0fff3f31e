//! The routing brain behind the ext_proc layer: request parsing, keying, endpoints and the pick.

pub mod budget;
pub mod finish;
pub mod keys;
pub mod picker;
pub mod request;
pub mod rewrite;
pub mod stats;
mod trace;

#[cfg(test)]
mod early_stop_props;
