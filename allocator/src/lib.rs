//! The gpuledger allocator: a leader-elected replica of the GPU ledger on etcd.
//!
//! Every replica folds the committed log into the same state and serves reads; the elected
//! leader decides writes, batches their events and appends them to etcd in one fenced
//! transaction per batch. The write protocol: `docs/ledger.md`.

pub mod archive;
pub mod authz;
pub mod budget_watch;
pub mod claim_templates;
pub mod claim_watch;
pub mod config;
pub mod election;
pub mod expiry;
pub mod grpc;
pub mod http;
pub mod kube_watch;
pub mod leader;
pub mod log;
pub mod log_scans;
pub mod metrics;
pub mod preemption;
pub mod read_limits;
pub mod replica;
pub mod requeue;
mod retry;
pub mod runtime;
pub mod service;
pub mod shared;
pub mod span;
mod status;
pub mod tail;
pub mod workload;
pub mod write_limits;
pub mod writer;

pub use config::Config;
pub use replica::run;
