//! The fake kube-apiserver: the REST routes kube-rs and kubectl use, over an in-memory
//! [`Store`], on HTTPS on 127.0.0.1 (a CA of the run's own), reached through an ordinary
//! kubeconfig file.
//!
//! Where it differs from a real kube-apiserver (each difference is one no gpuledger component
//! meets; the real-Kubernetes tier (`make test-e2e`) runs the same components against a real
//! one):
//! - **Patches:** JSON merge patch (RFC 7386) only. A strategic-merge patch is applied as a
//!   merge patch, so a list in it replaces the whole list instead of merging by its patch
//!   merge key (containers by `name`, conditions by `type`…); its directives (`$patch`,
//!   `$retainKeys`, `$deleteFromPrimitiveList`, `$setElementOrder`) are refused with 415
//!   rather than misapplied. JSON patch (RFC 6902) and server-side apply are refused with 415.
//! - **Subresources:** `pods/binding`, `status` and `portforward` only. A PUT or PATCH to
//!   `status` changes only the status. A `metadata.resourceVersion` in a PUT or a merge patch
//!   is a precondition (409 when the object has another), as on a real server.
//! - **Faults:** a test may make every write to one resource fail with 503
//!   ([`Store::fail_writes`]), as a server that lost its etcd answers.
//! - **Validation and defaults:** bodies must be JSON objects, and only a pod's
//!   `spec.schedulerName`, `status.phase`, `metadata.uid`, `creationTimestamp` and
//!   `resourceVersion` are defaulted; nothing is validated against a schema, no admission
//!   webhook is called, a client-set `metadata.uid` is kept (so recorded requests replay).
//! - **Selectors:** field selectors compare any field path for (in)equality, where a real
//!   server allows only a few fields per resource; set-based label selectors (`in`, `notin`)
//!   are not understood.
//! - **Watches:** one global resourceVersion and a history of the last 200,000 changes;
//!   no bookmarks, no `sendInitialEvents`, no `resourceVersionMatch`.
//! - **Authentication for TokenReview only:** ServiceAccount tokens are issued (TokenRequest,
//!   [`Store::issue_token`]) and reviewed (TokenReview) as a real server does, but the server's
//!   own requests are not authenticated or authorized: a bearer token is only recorded, as the
//!   user of the request in RBAC terms ([`Store::requests`]), for the RBAC check of `deploy/`.
//! - **No garbage collection, finalizers or graceful deletion:** a delete removes at once.

mod rest;
mod watch;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, Method, Uri};
use serde_json::{Value, json};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::pki::Pki;

pub use super::store::{ApiError, ApiRequest, Store};

/// A running fake API server on 127.0.0.1 with a kubeconfig file that points at it.
pub struct FakeApiServer {
    /// The object store (tests may read and change it directly).
    pub store: Arc<Store>,
    /// The run's CA (in `<dir>/pki`): the API server's certificate, and everything else of a
    /// run that starts with it.
    pub pki: Arc<Pki>,
    url: String,
    kubeconfig: PathBuf,
    dir: PathBuf,
    /// Stops serving when the server is dropped.
    _stop: DropGuard,
}

impl FakeApiServer {
    /// Start on a free loopback port, with a new CA in `<dir>/pki`; write `<dir>/kubeconfig`.
    pub async fn start(dir: &Path) -> Result<FakeApiServer> {
        let store = Arc::new(Store::default());
        let pki = Pki::new(dir)?;
        let (cert, key) = pki.server("apiserver")?;
        let tls = gpuledger_auth::tls::server_config(
            &cert,
            &key,
            gpuledger_auth::tls::ClientCerts::None,
            &[b"http/1.1"],
        )?;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the fake API server")?;
        let url = format!("https://{}", l.local_addr()?);
        let s = store.clone();
        let app = Router::new()
            .merge(super::portforward::routes(store.clone()))
            .fallback(
                move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
                    let s = s.clone();
                    async move { rest::handle(s, method, uri, headers, body).await }
                },
            );
        let stop = CancellationToken::new();
        let serving = stop.clone();
        // Every component of a test cluster watches it from 127.0.0.1: no connection bounds.
        let limits = gpuledger_auth::https::Limits {
            body_bytes: 8 << 20,
            max_connections: 0,
            max_connections_per_peer: 0,
            ..Default::default()
        };
        tokio::spawn(gpuledger_auth::https::serve(
            "fake-apiserver",
            l,
            tls,
            limits,
            gpuledger_auth::limit::Bites::new(),
            app,
            serving,
        ));
        let ca = pki.ca_file().display().to_string();
        std::fs::create_dir_all(dir)?;
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\n    certificate-authority: {ca}\n\
                 contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
                 current-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
            ),
        )?;
        Ok(FakeApiServer {
            store,
            pki,
            url,
            kubeconfig,
            dir: dir.to_path_buf(),
            _stop: stop.drop_guard(),
        })
    }

    /// The server URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Path of the kubeconfig file that reaches this server.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Write a kubeconfig whose requests carry `user` as their bearer token, so that
    /// [`Store::requests`] tells this client's requests apart (one per component, e.g.
    /// `system:serviceaccount:gpuledger-system:gpuledger-extender`).
    pub fn kubeconfig_as(&self, user: &str) -> Result<PathBuf> {
        let file: String = user
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let path = self.dir.join(format!("kubeconfig-{file}"));
        let token = serde_json::to_string(user)?;
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n    certificate-authority: {}\n\
                 contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: u\n    namespace: default\n\
                 current-context: fake\nusers:\n- name: u\n  user:\n    token: {token}\n",
                self.url,
                self.pki.ca_file().display()
            ),
        )?;
        Ok(path)
    }

    /// A kube-rs client through the kubeconfig, as a component would build it.
    pub async fn client(&self) -> Result<kube::Client> {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig)?;
        let cfg =
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await?;
        Ok(kube::Client::try_from(cfg)?)
    }

    /// Add a ready node advertising `gpuledger.io/gpu` slots.
    pub fn add_node(&self, name: &str, gpu_slots: u32) -> Result<Value> {
        self.store
            .create("v1", "nodes", "", json!({
                "metadata": {"name": name, "labels": {"gpuledger.io/enabled": "true"}},
                "status": {
                    "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110", "gpuledger.io/gpu": gpu_slots.to_string()},
                    "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", "gpuledger.io/gpu": gpu_slots.to_string()},
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }))
            .map_err(|e| anyhow::anyhow!("{}", e.message()))
    }

    /// Create a pod from its JSON (server fields such as uid are set here).
    pub fn add_pod(&self, pod: Value) -> Result<Value> {
        let ns = pod
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        self.store
            .create("v1", "pods", &ns, pod)
            .map_err(|e| anyhow::anyhow!("{}", e.message()))
    }

    /// Get a pod.
    pub fn pod(&self, ns: &str, name: &str) -> Option<Value> {
        self.store.get("v1", "pods", ns, name).ok()
    }

    /// Delete a pod.
    pub fn delete_pod(&self, ns: &str, name: &str) -> Result<()> {
        self.store
            .delete("v1", "pods", ns, name)
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("{}", e.message()))
    }

    /// Delete a node.
    pub fn delete_node(&self, name: &str) -> Result<()> {
        self.store
            .delete("v1", "nodes", "", name)
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("{}", e.message()))
    }

    /// Set a pod's phase (as the kubelet would).
    pub fn set_pod_phase(&self, ns: &str, name: &str, phase: &str) -> Result<()> {
        self.store
            .update("v1", "pods", ns, name, |p| {
                p["status"]["phase"] = json!(phase);
                Ok(())
            })
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("{}", e.message()))
    }
}
