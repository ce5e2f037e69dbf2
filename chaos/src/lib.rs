//! gpuledger's test kit and local cluster harness.
//!
//! Starts real `etcd` processes and gpuledger components as separate OS processes on
//! 127.0.0.1, with their logs in one run directory, and kills, pauses and restarts them.
//! Integration tests of every crate and the benchmarks use it; nothing here is a mock.

pub mod allocators;
pub mod cluster;
pub mod demo;
pub mod etcd;
pub mod history;
pub mod http;
pub mod kube;
pub mod kubelet;
pub mod process;
pub mod promtext;
pub mod run;
pub mod up;
pub mod workload;

pub use allocators::Allocators;
pub use cluster::{ClusterOptions, LocalCluster};
pub use etcd::EtcdCluster;
pub use process::{Proc, bin_path, free_port};
