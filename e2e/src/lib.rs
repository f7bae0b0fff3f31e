//! kvgate's development and test tools: `kvgate-sim`, a vLLM-compatible engine simulator
//! (issue #4), and `kvgate-bench`, the local stack launcher, load generator and benchmark
//! reports (issue #7). This build parses and validates their configuration only.

pub mod bench;
pub mod replay_cmd;
pub mod sim;
