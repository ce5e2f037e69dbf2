//! Serving the device plugin socket and registering it with the kubelet, again whenever the
//! kubelet restarts (it deletes plugin sockets and recreates its own).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use gpuledger_proto::deviceplugin::v1beta1 as dp;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::agent::Agent;
use crate::device_plugin::{Plugin, RESOURCE, options};

/// The device-plugin API version the kubelet expects.
pub const VERSION: &str = "v1beta1";

/// How long a registered plugin waits for the kubelet to watch its devices (ListAndWatch)
/// before it registers again. A kubelet that never does advertises none of them (kubelets
/// before 1.26 send the socket path as `:authority`, which this server refuses).
pub const WATCH_WAIT: Duration = Duration::from_secs(10);

/// How often a failed registration is tried again.
const REGISTER_RETRY: Duration = Duration::from_millis(500);

/// A kubelet that cannot be reached is logged as a warning once every this many tries (~30 s).
const REGISTER_WARN_EVERY: u32 = 60;

fn inode(p: &Path) -> Option<u64> {
    std::fs::metadata(p).ok().map(|m| m.ino())
}

/// Why a registration with the kubelet failed (retryable: the kubelet may be starting).
#[derive(Debug, thiserror::Error)]
enum RegisterError {
    /// The kubelet's socket does not answer.
    #[error("connecting to the kubelet: {0}")]
    Connect(#[from] tonic::transport::Error),
    /// The kubelet refused the registration.
    #[error("the kubelet refused the registration: {0}")]
    Refused(#[from] tonic::Status),
}

/// Register with the kubelet once.
async fn register(kubelet_sock: &Path, endpoint: &str) -> Result<(), RegisterError> {
    let ch = crate::uds::channel(kubelet_sock).await?;
    let mut c = dp::registration_client::RegistrationClient::new(ch);
    c.register(dp::RegisterRequest {
        version: VERSION.into(),
        endpoint: endpoint.into(),
        resource_name: RESOURCE.into(),
        options: Some(options()),
    })
    .await?;
    Ok(())
}

/// Serve the plugin and keep it registered until `shutdown`.
pub async fn serve_and_register(agent: Arc<Agent>, shutdown: CancellationToken) {
    let dir = agent.cfg.kubelet_dir.clone();
    let sock: PathBuf = dir.join(&agent.cfg.plugin_socket);
    let kubelet_sock = dir.join("kubelet.sock");
    loop {
        agent.kubelet_registered.store(false, Ordering::Release);
        let _ = std::fs::remove_file(&sock);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            warn!(dir = %dir.display(), "creating the device-plugin directory: {e}");
        }
        let listener = match UnixListener::bind(&sock) {
            Ok(l) => l,
            Err(e) => {
                warn!(socket = %sock.display(), "binding the device-plugin socket: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let my_inode = inode(&sock);
        let svc = dp::device_plugin_server::DevicePluginServer::new(Plugin::new(agent.clone()));
        // Each socket gets its own server, dropped with its connections (ListAndWatch streams
        // never end by themselves) when the socket is replaced or the agent stops.
        let stop_server = shutdown.child_token();
        let server = tokio::spawn(
            stop_server.clone().run_until_cancelled_owned(
                tonic::transport::Server::builder()
                    .add_service(svc)
                    .serve_with_incoming(UnixListenerStream::new(listener)),
            ),
        );
        // Register (retrying until the kubelet is there), then watch both sockets.
        let mut kubelet_inode;
        let mut failures = 0u32;
        loop {
            kubelet_inode = inode(&kubelet_sock);
            if inode(&sock) != my_inode {
                break;
            }
            match register(&kubelet_sock, &agent.cfg.plugin_socket).await {
                Ok(()) => {
                    info!(socket = %sock.display(), resource = RESOURCE, "registered with the kubelet");
                    break;
                }
                Err(e) => {
                    // A kubelet that answers and refuses us is misconfigured: say why at once.
                    // One that is not there yet (starting, restarting) is normal for a moment:
                    // said every REGISTER_WARN_EVERY tries.
                    if let RegisterError::Refused(s) = &e {
                        warn!(
                            kubelet = %kubelet_sock.display(),
                            endpoint = %agent.cfg.plugin_socket,
                            tries = failures + 1,
                            "the kubelet refused the registration: {}; retrying every {REGISTER_RETRY:?} \
                             (the kubelet dials the endpoint in its own device-plugin directory: \
                             --kubelet-dir must be that directory)",
                            s.message()
                        );
                    } else if failures % REGISTER_WARN_EVERY == REGISTER_WARN_EVERY - 1 {
                        warn!(
                            kubelet = %kubelet_sock.display(),
                            tries = failures + 1,
                            "cannot reach the kubelet's registration socket: {e:#}; retrying every {REGISTER_RETRY:?}"
                        );
                    } else {
                        tracing::debug!("registering with the kubelet: {e:#}");
                    }
                    failures = failures.saturating_add(1);
                    tokio::time::sleep(REGISTER_RETRY).await;
                }
            }
        }
        // Ready only while the kubelet watches the devices: registered alone, it may advertise
        // none of them.
        let mut unwatched = Some(std::time::Instant::now());
        let mut watchers = agent.watchers.subscribe();
        loop {
            if *watchers.borrow_and_update() > 0 {
                if unwatched.take().is_some() {
                    info!("the kubelet watches the devices (ListAndWatch)");
                }
                agent.kubelet_registered.store(true, Ordering::Release);
            } else {
                agent.kubelet_registered.store(false, Ordering::Release);
                let since = *unwatched.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() >= WATCH_WAIT {
                    warn!(
                        "the kubelet is not watching the devices (no ListAndWatch for {WATCH_WAIT:?}): it advertises none; \
                         registering again (kubelets before 1.26 cannot reach this plugin: they send the socket path as :authority)"
                    );
                    break;
                }
            }
            let _ = tokio::time::timeout(Duration::from_millis(500), watchers.changed()).await;
            let mine = inode(&sock);
            let kubelet = inode(&kubelet_sock);
            if mine != my_inode {
                info!(
                    "the device-plugin socket was removed (kubelet restart?); serving and registering again"
                );
                break;
            }
            if kubelet.is_some() && kubelet != kubelet_inode {
                info!("the kubelet socket was recreated; registering again");
                break;
            }
            if server.is_finished() {
                warn!("the device-plugin server stopped; restarting it");
                break;
            }
        }
        stop_server.cancel();
        let _ = server.await;
    }
}

/// Remove the plugin socket (on shutdown: the kubelet then sees the plugin gone).
pub fn remove_socket(agent: &Agent) {
    let _ = std::fs::remove_file(agent.cfg.kubelet_dir.join(&agent.cfg.plugin_socket));
}
