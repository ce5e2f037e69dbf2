//! DRA kubelet emulator: the kubelet's plugin watcher and DRA manager as far as a DRA driver
//! meets them, over the real gRPC protocols on unix sockets. It watches `<dir>/plugins_registry`
//! for sockets (polling every 50 ms where the kubelet uses fsnotify), asks each new one
//! `GetInfo` with the kubelet's 1 s timeout, accepts a `DRAPlugin` that offers `v1.DRAPlugin`
//! on an absolute endpoint, answers `NotifyRegistrationStatus` (5 s), and then calls
//! `NodePrepareResources` / `NodeUnprepareResources` on that endpoint with the kubelet's 45 s,
//! and opens the health stream (`NodeWatchResources`) there.

use std::collections::HashSet;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use gpuledger_proto::dra::v1 as dra;
use gpuledger_proto::drahealth::v1alpha1 as drahealth;
use gpuledger_proto::pluginregistration::v1 as reg;
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::uds_channel;

/// The kubelet's timeout on `GetInfo`.
pub const GET_INFO_TIMEOUT: Duration = Duration::from_secs(1);
/// The kubelet's timeout on `NotifyRegistrationStatus`.
pub const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);
/// The kubelet's timeout on each DRA call.
pub const DRA_CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// A plugin the emulator registered.
#[derive(Debug, Clone)]
pub struct Registered {
    /// The registration socket it appeared as.
    pub socket: PathBuf,
    /// What `GetInfo` answered.
    pub info: reg::PluginInfo,
}

/// A running DRA kubelet emulator.
pub struct DraKubelet {
    registry: PathBuf,
    plugins: PathBuf,
    registered: watch::Receiver<Vec<Registered>>,
    _stop: DropGuard,
}

impl DraKubelet {
    /// Create `<dir>/plugins_registry` and `<dir>/plugins` and watch the registry.
    pub async fn start(dir: &Path) -> Result<DraKubelet> {
        let registry = dir.join("plugins_registry");
        let plugins = dir.join("plugins");
        std::fs::create_dir_all(&registry)?;
        std::fs::create_dir_all(&plugins)?;
        let (tx, rx) = watch::channel(Vec::new());
        let stop = CancellationToken::new();
        tokio::spawn(
            stop.clone()
                .run_until_cancelled_owned(watch_registry(registry.clone(), tx)),
        );
        Ok(DraKubelet {
            registry,
            plugins,
            registered: rx,
            _stop: stop.drop_guard(),
        })
    }

    /// The plugin registry directory (the agent's `--dra-registry-dir`).
    pub fn registry_dir(&self) -> &Path {
        &self.registry
    }

    /// The plugins directory (the agent's `--dra-plugin-dir`).
    pub fn plugins_dir(&self) -> &Path {
        &self.plugins
    }

    /// Every registration so far, in order.
    pub fn registrations(&self) -> Vec<Registered> {
        self.registered.borrow().clone()
    }

    /// Wait for the `n`th registration.
    pub async fn wait_registered(&self, n: usize, timeout: Duration) -> Result<Registered> {
        let mut rx = self.registered.clone();
        tokio::time::timeout(timeout, rx.wait_for(|r| r.len() >= n))
            .await
            .with_context(|| format!("no DRA plugin registration #{n} within {timeout:?}"))?
            .context("the emulator stopped")?;
        Ok(self.registered.borrow()[n - 1].clone())
    }

    async fn client(
        &self,
    ) -> Result<dra::dra_plugin_client::DraPluginClient<tonic::transport::Channel>> {
        let Some(r) = self.registered.borrow().last().cloned() else {
            bail!("no DRA plugin is registered");
        };
        let ch = uds_channel(Path::new(&r.info.endpoint))
            .await
            .with_context(|| format!("dialing the DRA plugin at {}", r.info.endpoint))?;
        Ok(dra::dra_plugin_client::DraPluginClient::new(ch))
    }

    /// `NodePrepareResources` for `claims`, as the kubelet calls it.
    pub async fn prepare(
        &self,
        claims: &[dra::Claim],
    ) -> Result<dra::NodePrepareResourcesResponse> {
        let mut c = self.client().await?;
        let mut req = tonic::Request::new(dra::NodePrepareResourcesRequest {
            claims: claims.to_vec(),
        });
        req.set_timeout(DRA_CALL_TIMEOUT);
        Ok(c.node_prepare_resources(req).await?.into_inner())
    }

    /// A new connection to the registered plugin's endpoint, for a client of any of its
    /// services and versions.
    pub async fn plugin_channel(&self) -> Result<tonic::transport::Channel> {
        let Some(r) = self.registered.borrow().last().cloned() else {
            bail!("no DRA plugin is registered");
        };
        uds_channel(Path::new(&r.info.endpoint))
            .await
            .with_context(|| format!("dialing the DRA plugin at {}", r.info.endpoint))
    }

    /// `NodeWatchResources` of the health service (`v1alpha1.DRAResourceHealth`) on the
    /// plugin's endpoint, as the kubelet opens it once the plugin is registered.
    pub async fn watch_health(
        &self,
    ) -> Result<tonic::Streaming<drahealth::NodeWatchResourcesResponse>> {
        let ch = self.plugin_channel().await?;
        let mut c = drahealth::dra_resource_health_client::DraResourceHealthClient::new(ch);
        Ok(
            c.node_watch_resources(drahealth::NodeWatchResourcesRequest {})
                .await?
                .into_inner(),
        )
    }

    /// `NodeUnprepareResources` for `claims`, as the kubelet calls it.
    pub async fn unprepare(
        &self,
        claims: &[dra::Claim],
    ) -> Result<dra::NodeUnprepareResourcesResponse> {
        let mut c = self.client().await?;
        let mut req = tonic::Request::new(dra::NodeUnprepareResourcesRequest {
            claims: claims.to_vec(),
        });
        req.set_timeout(DRA_CALL_TIMEOUT);
        Ok(c.node_unprepare_resources(req).await?.into_inner())
    }
}

/// Register every new socket in `dir` (a socket replaced by another inode is new again).
async fn watch_registry(dir: PathBuf, tx: watch::Sender<Vec<Registered>>) {
    let mut seen: HashSet<(PathBuf, u64)> = HashSet::new();
    loop {
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                let Ok(meta) = e.metadata() else { continue };
                if !meta.file_type().is_socket() {
                    continue;
                }
                let key = (e.path(), meta.ino());
                if seen.contains(&key) {
                    continue;
                }
                // One that does not answer yet (being started) is tried on the next pass.
                if let Ok(info) = register(&e.path()).await {
                    seen.insert(key);
                    tx.send_modify(|r| {
                        r.push(Registered {
                            socket: e.path(),
                            info,
                        })
                    });
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the plugin watcher and the DRA handler do with one socket. Its `:authority` is
/// `localhost`, as the kubelet's since 1.26 (`grpc.WithAuthority("localhost")` on every unix
/// socket client; before, grpc-go sent the socket path, which h2 refuses).
async fn register(sock: &Path) -> Result<reg::PluginInfo> {
    let ch = uds_channel(sock).await?;
    let mut c = reg::registration_client::RegistrationClient::new(ch);
    let mut req = tonic::Request::new(reg::InfoRequest {});
    req.set_timeout(GET_INFO_TIMEOUT);
    let info = tokio::time::timeout(GET_INFO_TIMEOUT, c.get_info(req))
        .await
        .context("GetInfo timed out")??
        .into_inner();
    let refusal = if info.r#type != "DRAPlugin" {
        Some(format!("plugin type {:?} is not DRAPlugin", info.r#type))
    } else if !info.supported_versions.iter().any(|v| v == "v1.DRAPlugin") {
        Some(format!(
            "none of the versions {:?} is supported",
            info.supported_versions
        ))
    } else if !Path::new(&info.endpoint).is_absolute() {
        Some(format!(
            "endpoint {:?} is not an absolute path",
            info.endpoint
        ))
    } else {
        None
    };
    let mut req = tonic::Request::new(reg::RegistrationStatus {
        plugin_registered: refusal.is_none(),
        error: refusal.clone().unwrap_or_default(),
    });
    req.set_timeout(NOTIFY_TIMEOUT);
    c.notify_registration_status(req).await?;
    if let Some(why) = refusal {
        bail!("registration refused: {why}");
    }
    Ok(info)
}
