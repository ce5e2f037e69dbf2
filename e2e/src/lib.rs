//! gpuledger's real-Kubernetes test tier (`make test-e2e`).
//!
//! A real kube-apiserver, kube-controller-manager, kube-scheduler and kubelet of a current
//! Kubernetes, containerd 2 and etcd 3.6 (built from the Go module proxy by
//! `e2e/kube/build.sh` and cached), the machine's runc, and gpuledger's own processes, all on
//! 127.0.0.1 in one run directory. The scheduler runs the shipped
//! `deploy/scheduler/default-scheduler-config.yaml`; the shipped
//! `deploy/kustomize/overlays/default-scheduler` is applied server-side and the shipped
//! `deploy/scripts/gpuledger-certs.sh` makes and installs the certificates.
//! Nodes are either kubelet-less (created through the API with GPU capacity, registered with the
//! allocator as a node agent would) or one real kubelet with a node agent and the fake NVML.
//! The peers (HAMi, dra-example-driver; `e2e/peers/build.sh`) can run beside gpuledger on the
//! same control plane: [`hami`] starts HAMi's scheduler and registers HAMi's fake GPU nodes;
//! [`draex`] starts dra-example-driver's controller and publishes its nodes' ResourceSlices.
//!
//! The scenario tests in `tests/` are `#[ignore]`d: `cargo test --workspace` never needs the
//! Kubernetes binaries or root; `make test-e2e` runs them with `--ignored`.

pub mod bins;
pub mod certs;
pub mod cluster;
pub mod control_plane;
pub mod draex;
pub mod gpuledger;
pub mod hami;
pub mod images;
pub mod kubectl;
pub mod lone_agent;
pub mod manifests;
pub mod nodes;
pub mod peers;
pub mod pki;
pub mod pods;
pub mod real_node;

pub use cluster::{E2e, Options};

/// The repository root (the tier reads `deploy/` from it, never anything outside it).
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| std::path::PathBuf::from(".."))
}

/// Poll `f` every 250 ms until it returns `Some`; fail with `what` (and the last `None`'s
/// reason) after `timeout`.
pub async fn until<T, F, Fut>(
    what: &str,
    timeout: std::time::Duration,
    mut f: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(t) = f().await? {
            return Ok(t);
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("{what}: not within {timeout:?}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}
