//! kvgate's development and test tools: `kvgate-sim`, a vLLM-compatible engine simulator, and
//! `kvgate-bench`, the local stack launcher, load generator and benchmark reports:
//! `kvgate-bench up` runs the local stack ([`stack`]), `load` and `report` drive and
//! summarise workloads ([`load`]), `compare` sweeps policies and loads on one stack ([`compare`]),
//! `replay` runs the same workloads in virtual time ([`replay_cmd`]), `profile` measures a
//! replica's profile for the planner ([`profile_cmd`]) and `autoscale` evaluates the planner
//! over a day in virtual time ([`autoscale_cmd`]).

pub mod autoscale_cmd;
pub mod bench;
pub mod compare;
pub mod kube;
pub mod load;
pub mod profile_cmd;
pub mod replay_cmd;
pub mod sim;
pub mod stack;
