//! A Kubernetes client from `--kubeconfig`, or from the in-cluster service account.

use std::path::Path;

use anyhow::Context;

/// True when the process runs in a pod (the in-cluster config is available).
pub fn in_cluster() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
}

/// A client from the kubeconfig file at `path`, or the in-cluster config when `path` is None
/// and the process runs in a pod; None when neither is available.
pub async fn client(path: Option<&Path>) -> anyhow::Result<Option<kube::Client>> {
    let cfg = match path {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p)
                .with_context(|| format!("reading kubeconfig {}", p.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", p.display()))?
        }
        None if in_cluster() => {
            kube::Config::incluster().context("loading the in-cluster Kubernetes config")?
        }
        None => return Ok(None),
    };
    Ok(Some(
        kube::Client::try_from(cfg).context("building the Kubernetes client")?,
    ))
}
