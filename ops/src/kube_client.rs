//! A Kubernetes client from `--kubeconfig`, or from the in-cluster service account.

use std::path::{Path, PathBuf};

/// Why no Kubernetes client could be made. None is retryable but [`KubeClientError::Build`]
/// (the configuration is read again only when the file or the pod changes).
#[derive(Debug, thiserror::Error)]
pub enum KubeClientError {
    /// The kubeconfig file could not be read or parsed.
    #[error("reading kubeconfig {}: {error}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What kube said.
        error: kube::config::KubeconfigError,
    },
    /// The kubeconfig names no usable cluster, user or context.
    #[error("loading kubeconfig {}: {error}", path.display())]
    Load {
        /// The file.
        path: PathBuf,
        /// What kube said.
        error: kube::config::KubeconfigError,
    },
    /// The pod's service account is not readable.
    #[error("loading the in-cluster Kubernetes config: {0}")]
    InCluster(kube::config::InClusterError),
    /// The client could not be built from the configuration (TLS setup; retryable).
    #[error("building the Kubernetes client: {0}")]
    Build(kube::Error),
}

/// True when the process runs in a pod (the in-cluster config is available).
pub fn in_cluster() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
}

/// A client from the kubeconfig file at `path`, or the in-cluster config when `path` is None
/// and the process runs in a pod; None when neither is available.
pub async fn client(path: Option<&Path>) -> Result<Option<kube::Client>, KubeClientError> {
    let cfg = match path {
        Some(p) => {
            let kc =
                kube::config::Kubeconfig::read_from(p).map_err(|error| KubeClientError::Read {
                    path: p.to_path_buf(),
                    error,
                })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|error| KubeClientError::Load {
                    path: p.to_path_buf(),
                    error,
                })?
        }
        None if in_cluster() => kube::Config::incluster().map_err(KubeClientError::InCluster)?,
        None => return Ok(None),
    };
    Ok(Some(
        kube::Client::try_from(cfg).map_err(KubeClientError::Build)?,
    ))
}
