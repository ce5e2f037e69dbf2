//! gpuledger's test kit: what every crate's integration tests, the benchmarks and
//! `gpuledger-chaos` start and drive.
//!
//! Real `etcd` processes and gpuledger components as separate OS processes on 127.0.0.1, with
//! their logs in one run directory, killed, paused and restarted at will; the fakes that stand
//! in for Kubernetes (a small kube-apiserver, the kube-scheduler emulator, the kubelet
//! emulator, the fake NVML state) and the local cluster that wires them all together. Nothing
//! here is a mock of etcd or of a gpuledger component.

pub mod allocators;
pub mod attacker;
pub mod bins;
pub mod cluster;
pub mod etcd;
pub mod fuzz;
pub mod history;
pub mod http;
pub mod kube;
pub mod kubelet;
pub mod pki;
pub mod process;
pub mod promtext;
pub mod workload;

pub use allocators::Allocators;
pub use bins::bin_path;
pub use cluster::{ClusterOptions, LocalCluster};
pub use etcd::EtcdCluster;
pub use pki::{Identities, Pki};
pub use process::{Proc, free_port};

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
