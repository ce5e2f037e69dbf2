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

/// Poll `f` every 100 ms until it says true; fail with `what` after `timeout`.
pub async fn eventually<F, Fut>(
    what: &str,
    timeout: std::time::Duration,
    mut f: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
        if f().await? {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    anyhow::bail!("{what}: not within {timeout:?}")
}
